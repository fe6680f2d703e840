"""Lint (ruff) and type check (mypy) as tests, so the README's test command runs them in CI.

Both read their configuration from pyproject.toml ([tool.ruff], [tool.mypy]); the versions are
pinned in the ``dev`` extra so a finding here is the same on every machine. The mypy configuration
itself is held to ``strict`` over the whole package, so a later edit cannot quietly loosen it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib

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


def test_mypy_config_is_strict_over_the_whole_package() -> None:
    # test_mypy_finds_nothing runs plain `mypy`, which reads exactly this table: loosening it here
    # (strict off, a module's errors ignored, a check disabled) would pass that test silently.
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        mypy = tomllib.load(f)["tool"]["mypy"]
    assert mypy.get("strict") is True
    assert {"ckptsdk", "adapters"} <= set(mypy["files"])
    loosening = {"ignore_errors", "disallow_untyped_defs", "disallow_incomplete_defs", "check_untyped_defs"}
    for override in mypy.get("overrides", []):
        modules = override["module"] if isinstance(override["module"], list) else [override["module"]]
        ours = [m for m in modules if m.split(".")[0] in ("ckptsdk", "adapters")]
        assert not (ours and loosening & set(override)), f"override {override} loosens the check for {ours}"
        assert override.get("ignore_errors") is not True, f"override {override} ignores errors"
