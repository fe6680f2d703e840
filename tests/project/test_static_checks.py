"""Lint and format (ruff) and type check (mypy) as tests, so the README's test command runs them in CI.

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
from pathlib import Path

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


@pytest.mark.timeout(120)
def test_ruff_format_changes_nothing() -> None:
    proc = _run("ruff", "format", "--check", "--no-cache", ".", timeout=100)
    assert proc.returncode == 0, (
        f"ruff format --check . would reformat files (run `ruff format <files>`):\n{proc.stdout}{proc.stderr}"
    )


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


# Each hook sources scripts/venv.sh and starts ruff in a fresh shell: seconds idle, but a CI run
# under full load once took over 100 s for one of them; the bound is for a hang, not for speed.
@pytest.mark.timeout(900)
def test_pre_commit_runs_the_same_checks(tmp_path: Path) -> None:
    """.pre-commit-config.yaml: ruff, ruff format and mypy, each as a command that works here."""
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((Path(REPO) / ".pre-commit-config.yaml").read_text(encoding="utf-8"))
    hooks = {hook["id"]: hook for repo in config["repos"] for hook in repo["hooks"]}
    assert set(hooks) == {"ruff", "ruff-format", "mypy", "commit-msg"}  # the last: tests/project/test_commit_msg.py
    assert all(hook["language"] == "system" for hook in hooks.values())
    assert hooks["mypy"]["pass_filenames"] is False
    # The two ruff hooks, run as pre-commit would (entry + the staged file), on a clean file and a bad one.
    clean = Path(REPO) / "tests" / "project" / "test_static_checks.py"
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nx=1\n", encoding="utf-8")
    for hook_id in ("ruff", "ruff-format"):
        entry = hooks[hook_id]["entry"]
        ok = subprocess.run(
            f"{entry} {clean}", shell=True, cwd=REPO, capture_output=True, text=True, timeout=300, check=False
        )
        assert ok.returncode == 0, f"{hook_id} hook failed on a clean file:\n{ok.stdout}{ok.stderr}"
    lint = subprocess.run(
        f"{hooks['ruff']['entry']} --no-cache {bad}",
        shell=True,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert lint.returncode != 0 and "F401" in lint.stdout, lint.stdout + lint.stderr
