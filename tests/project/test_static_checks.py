"""Lint (ruff) and type check (mypy) as tests, so the README's test command runs them in CI.

Both read their configuration from pyproject.toml ([tool.ruff], [tool.mypy]); the versions are
pinned in the ``dev`` extra so a finding here is the same on every machine.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tool: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(tool) is None:
        pytest.fail(f"{tool} is not installed; install the dev extra: pip install -e '.[dev]'")
    return subprocess.run(
        [sys.executable, "-m", tool, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.timeout(120)
def test_ruff_finds_nothing() -> None:
    proc = _run("ruff", "check", "--no-cache", "--output-format", "concise", ".", timeout=100)
    assert proc.returncode == 0, f"ruff check . found problems:\n{proc.stdout}{proc.stderr}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mypy_finds_nothing() -> None:
    proc = _run("mypy", timeout=280)
    assert proc.returncode == 0, f"mypy (files, options: pyproject.toml) found problems:\n{proc.stdout}{proc.stderr}"
