"""The suite's scheduling (scripts/test.sh: ``-n auto --dist loadgroup``) does what its tests rely
on: the tests of one ``xdist_group`` run on one worker, so a module-scoped reference they share is
trained once. pytest 9.2 broke that silently under pytest-xdist 3.8 (see pyproject's pin)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

GROUPED = """
import os
import pytest

pytestmark = pytest.mark.xdist_group("together")


@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    with open(os.environ["WORKERS_LOG"], "a") as log:
        log.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")


@pytest.mark.parametrize("i", range(6))
@pytest.mark.xdist_group("param-group")
def test_marked_one_by_one(i):
    with open(os.environ["PARAMS_LOG"], "a") as log:
        log.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


@pytest.mark.timeout(300)
def test_an_xdist_group_runs_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's addopts
    env = {**os.environ, "WORKERS_LOG": str(tmp_path / "workers"), "PARAMS_LOG": str(tmp_path / "params")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "3", "--dist", "loadgroup"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for log in ("workers", "params"):
        workers = (tmp_path / log).read_text().split()
        assert len(workers) == 6 and len(set(workers)) == 1, (log, workers)
