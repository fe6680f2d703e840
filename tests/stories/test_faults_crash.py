"""Fault suite, part 1: a save interrupted at every backend call, then a restore in a fresh process.

For each N, a save (sync and async) of step 4 onto a local root holding steps 1-3 (keep_last=3)
is stopped at its N-th backend call: the call fails (``BackendError``), the process "dies" there
(``SimulatedCrash``, a BaseException nothing catches), the call lands but reports a failure
(``fail_after``), or the process is really SIGKILLed at that call (a forked child). Then one fresh
Python process restores every root read-only and reports what it got. Each must restore the
newest committed step *exactly* (model, optimizer, every RNG), and lose nothing committed before:
steps 1-3 stay valid unless step 4 committed, and then 2-4 do. N runs past the last call, so the
uninterrupted save is checked too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckptsdk import CheckpointManager, LeaseOptions
from ckptsdk.backends.local import LocalBackend
from ckptsdk.errors import BackendError, CkptError
from ckptsdk.manager import Simulation
from ckptsdk.testing import OPS, FaultyBackend, SimulatedCrash
from tests.support._fault_state import expected, make_state

REPO = Path(__file__).resolve().parents[2]
KEEP = 3
MODES = ("fail", "crash", "fail_after")


def _open(root: str) -> tuple[CheckpointManager, FaultyBackend]:
    faulty = FaultyBackend(LocalBackend(root))
    # A short ttl: the verifier reads without the lease, and no test waits on a dead holder.
    return CheckpointManager(
        faulty, keep_last=KEEP, _simulation=Simulation(heartbeat=False), lease_options=LeaseOptions(ttl=1.0)
    ), faulty


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """A root with steps 1-3 committed and the lease released."""
    root = str(tmp_path_factory.mktemp("faults") / "base")
    with CheckpointManager(root, keep_last=KEEP, _simulation=Simulation(heartbeat=False)) as mgr:
        assert mgr.restore(make_state(0)) is None
        for step in (1, 2, 3):
            mgr.save(make_state(step), step=step)
    return root


def _at_call(n: int, action):  # noqa: ANN001, ANN202
    """A fail_on/fail_after hook that acts at the n-th backend call of any kind (1-based)."""
    seen = [0]

    def hook(op: str, key: str, _count: int):  # noqa: ANN202
        seen[0] += 1
        return action(op, key) if seen[0] == n else None

    return hook


def _calls_of_one_save(base: str, tmp: Path, blocking: bool) -> int:
    root = str(tmp / f"count-{blocking}")
    shutil.copytree(base, root)
    mgr, faulty = _open(root)
    mgr.restore(make_state(0))
    faulty.calls.clear()
    mgr.save(make_state(4), step=4, blocking=blocking)
    mgr.wait()
    total = sum(faulty.calls[op] for op in OPS)
    mgr.close()
    return total


def _verify(roots: list[str]) -> dict[str, dict]:
    """Restore each root in ONE fresh interpreter; its JSON report per root."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.support._fault_state", "verify", *roots],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {d["root"]: d for d in map(json.loads, out.stdout.splitlines())}


def _check(report: dict, committed4: bool | None, where: str) -> None:
    """Exact restore of the newest committed step, and nothing committed before is lost."""
    valid = {int(s): d for s, d in report["valid"].items()}
    for step, got in valid.items():
        assert got == expected(step), f"{where}: step {step} loads a different state (silently wrong)"
    if committed4 is None:  # unknown (a SIGKILL): whatever was committed decides
        committed4 = 4 in valid
    must = {2, 3, 4} if committed4 else {1, 2, 3}
    assert must <= set(valid), f"{where}: committed checkpoints lost: valid {sorted(valid)}, expected {sorted(must)}"
    newest = max(valid)
    assert report["step"] == newest, f"{where}: restored {report['step']}, the newest committed is {newest}"
    assert report["digest"] == expected(newest), f"{where}: restore of step {newest} is not exact"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
def test_fail_or_crash_at_every_backend_call_of_a_save(base, tmp_path, blocking):
    total = _calls_of_one_save(base, tmp_path, blocking)
    assert total >= 6, f"a save made only {total} backend calls?"
    trials: list[tuple[str, str, int, bool | None]] = []
    for mode in MODES:
        for n in range(1, total + 2):  # total + 1: the save runs to its end
            root = str(tmp_path / f"{mode}-{n}")
            shutil.copytree(base, root)
            mgr, faulty = _open(root)
            mgr.restore(make_state(0))
            if mode == "fail":
                faulty.fail_on = _at_call(n, lambda op, key: BackendError(f"injected: {op} {key}", key=key))
            elif mode == "crash":
                faulty.fail_on = _at_call(n, lambda op, key: SimulatedCrash(f"died at {op} {key}"))
            else:
                faulty.fail_after = _at_call(n, lambda op, key: BackendError(f"reply lost: {op} {key}", key=key))
            raised: BaseException | None = None
            try:
                mgr.save(make_state(4), step=4, blocking=blocking)
                mgr.wait()
            except (CkptError, SimulatedCrash) as exc:  # BackendError, or LeaseLostError after one
                raised = exc
            assert raised is None or n <= total, (mode, n, raised)
            faulty.fail_on = faulty.fail_after = None  # the save is over: close() is not under test
            if mode == "crash" and raised is not None:
                mgr._shutdown._closed = True  # the process is "dead": no close(), no release, no atexit work
            else:
                try:
                    mgr.close()
                except CkptError:
                    pass  # a storage that keeps failing may fail the release too; that is allowed
            trials.append((mode, root, n, None))
    reports = _verify([root for _, root, _, _ in trials])
    for mode, root, n, committed in trials:
        _check(reports[root], committed, f"{mode} at call {n}/{total} ({'sync' if blocking else 'async'})")
    print(f"{len(trials)} trials ({total} calls per save, modes {MODES}): 0 torn, lost or wrong restores")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
def test_sigkill_at_every_backend_call_of_a_save(base, tmp_path, blocking):
    """A real SIGKILL, delivered by the process to itself exactly at its N-th backend call.

    Each trial is a child forked from this (already warm) interpreter, so the kill lands inside
    the real save code path, on whatever thread makes the call (the background one when async).
    """
    total = _calls_of_one_save(base, tmp_path, blocking)
    roots, killed = [], 0
    for n in range(1, total + 2):
        root = str(tmp_path / f"kill-{n}")
        shutil.copytree(base, root)
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 3
            try:
                mgr, faulty = _open(root)
                mgr.restore(make_state(0))
                faulty.fail_on = _at_call(n, lambda op, key: os.kill(os.getpid(), signal.SIGKILL))
                mgr.save(make_state(4), step=4, blocking=blocking)
                mgr.wait()
                faulty.fail_on = None  # the save is over: close() is not under test
                mgr.close()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if n <= total:
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (n, status)
            killed += 1
        else:
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (n, status)
        roots.append(root)
    reports = _verify(roots)
    for n, root in enumerate(roots, start=1):
        _check(reports[root], None, f"SIGKILL at call {n}/{total} ({'sync' if blocking else 'async'})")
    assert killed == total
    print(f"{killed} SIGKILLs + 1 clean save: 0 torn, lost or wrong restores")
