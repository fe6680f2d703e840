"""scripts/venv.sh as a user sources it (issue 13): the README's `ckptsdk` command exists, the
user's shell keeps its options and directory, two clones share one venv, a failed set-up says so."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)
needs_venv = pytest.mark.skipif(
    not (VENV / ".complete").exists(), reason="not running inside a venv made by scripts/venv.sh"
)


def bash(script: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", script],
        cwd=cwd,
        text=True,
        capture_output=True,
        timeout=120,
        env={**os.environ, **env},
    )


@needs_venv
def test_sourcing_keeps_the_shell_and_brings_the_ckptsdk_command(tmp_path):
    proc = bash(
        f"""
        set +euo pipefail
        source {REPO}/scripts/venv.sh
        echo "rc=$? pwd=$(pwd)"
        set -o | grep -E '^(errexit|nounset|pipefail)' | tr -s ' \\t' ' '
        command -v ckptsdk
        ckptsdk ls {tmp_path}/missing; echo "exit=$?"
        false; echo "still here"
    """,
        cwd=tmp_path,
        CKPTSDK_VENV=str(VENV),
    )
    lines = proc.stdout.splitlines()
    assert lines[:4] == [f"rc=0 pwd={tmp_path}", "errexit off", "nounset off", "pipefail off"]
    assert lines[4] == str(VENV / "bin" / "ckptsdk")
    assert lines[5:] == ["exit=4", "still here"]
    assert f"no checkpoint root at {tmp_path}/missing" in proc.stderr


@needs_venv
def test_two_clones_share_one_venv_and_each_runs_its_own_ckptsdk(tmp_path):
    clone = tmp_path / "clone2"
    (clone / "scripts").mkdir(parents=True)
    (clone / "ckptsdk").mkdir()
    shutil.copy(REPO / "scripts" / "venv.sh", clone / "scripts" / "venv.sh")
    shutil.copy(REPO / "pyproject.toml", clone / "pyproject.toml")
    (clone / "ckptsdk" / "__init__.py").write_text("")
    (clone / "ckptsdk" / "__main__.py").write_text("print('the ckptsdk of clone2')\n")
    proc = bash(
        f"""
        (source {clone}/scripts/venv.sh && ckptsdk)
        (source {REPO}/scripts/venv.sh && ckptsdk --help | head -1)
    """,
        cwd=tmp_path,
        CKPTSDK_VENV=str(VENV),
    )
    assert proc.stdout.splitlines() == ["the ckptsdk of clone2", "usage: ckptsdk [-h] [-v] COMMAND ..."]


def test_a_failed_set_up_returns_an_error_and_leaves_the_shell_alone(tmp_path):
    venv = tmp_path / "venv"
    proc = bash(
        f"""
        source {REPO}/scripts/venv.sh
        echo "rc=$? pwd=$(pwd)"
        case "$-" in *e*) echo errexit on;; *) echo errexit off;; esac
    """,
        cwd=tmp_path,
        CKPTSDK_VENV=str(venv),
        PYTHON="false",
    )
    assert proc.stdout.splitlines() == [f"rc=1 pwd={tmp_path}", "errexit off"]
    assert "setting up" in proc.stderr and "failed" in proc.stderr
    assert not (venv / ".complete").exists()
