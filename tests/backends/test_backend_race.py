"""Two processes race to ``create`` the same key, 50 rounds: exactly one wins each round.

Local disk (``os.link`` refuses an existing name) and the Drive backend on one VM (check and rename
under the root flock; docs/DRIVE.md: nothing excludes a second VM, which capabilities say).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptsdk.backends.local import TMP_PREFIX

REPO = Path(__file__).resolve().parents[2]
ROUNDS = 50


def _read_json(proc: subprocess.Popen, timeout: float = 30.0) -> dict:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"racer {proc.pid} answered nothing for {timeout} s"
    line = proc.stdout.readline().decode()
    assert line, f"racer {proc.pid} exited early"
    return json.loads(line) if line.startswith("{") else {"line": line.strip()}


@pytest.mark.parametrize("kind", ["local", "drive"])
def test_two_processes_race_to_create(kind, make_backend_target):
    target = make_backend_target(kind)
    backend = target.open()
    env = {**os.environ, "PYTHONPATH": str(REPO), **target.env}
    racers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support._crash_child", "race", target.url],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        for _ in range(2)
    ]
    overlapping = 0
    try:
        for proc in racers:
            assert _read_json(proc) == {"line": "ready"}
        for round_no in range(ROUNDS):
            start = time.time() + 0.03  # both start at the same wall-clock moment
            for proc in racers:
                proc.stdin.write(f"{round_no} {start}\n".encode())
                proc.stdin.flush()
            results = [_read_json(proc) for proc in racers]
            assert [r["round"] for r in results] == [round_no, round_no]
            winners = [r["who"] for r in results if r["outcome"] == "won"]
            assert len(winners) == 1, f"round {round_no}: {results}"
            assert backend.read(f"race/{round_no:03d}") == winners[0].encode() * 16384
            if max(r["began"] for r in results) < min(r["ended"] for r in results):
                overlapping += 1
    finally:
        for proc in racers:
            proc.stdin.close()
        for proc in racers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
            proc.stdout.close()
    assert all(proc.returncode == 0 for proc in racers)
    assert [info.key for info in backend.list()] == [f"race/{i:03d}" for i in range(ROUNDS)]
    # The losers left no temp files, and the calls really ran at the same time.
    assert not [name for name in os.listdir(os.path.join(backend.root, "race")) if name.startswith(TMP_PREFIX)]
    assert overlapping >= ROUNDS // 5, f"only {overlapping} of {ROUNDS} rounds overlapped"
