"""Writers for the storage-footprint kill tests (run as ``python -m tests._footprint_child``).

``zygote URL KEEP_LAST GRACE``: import torch and ckptsdk once, then for each ``go N`` line on
stdin fork a writer that takes the lease (``force=True``: the previous one was SIGKILLed),
restores, and saves steps back to back until the parent SIGKILLs it; ``final N`` forks one that
restores, saves once and closes. The zygote reaps each and reports. A writer's byte counts come
from a counting wrapper around its backend.

Protocol lines (stdout): ``zygote-ready``; per writer: ``ready PID``, ``saved STEP``...,
``restored STEP WRITTEN`` (bytes written by the restore: the anchor), ``closed WRITTEN``,
``reaped PID STATUS``.
"""

from __future__ import annotations

import os
import sys

import torch

from ckptsdk import CheckpointManager, TrainState
from ckptsdk.backends import open_backend
from tests.counting import CountingBackend

MAX_SAVES = 400  # bounded even if the parent forgets to kill a writer


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())  # not print: a forked child must not share the buffer


def state() -> TrainState:
    """About 2 MB of parameters: a save takes long enough for kills to land inside it."""
    torch.manual_seed(0)
    return TrainState(model=torch.nn.Linear(724, 724))


def writer(url: str, keep_last: int, grace: float, *, final: bool) -> None:
    counting = CountingBackend(open_backend(url))
    mgr = CheckpointManager(counting, keep_last=keep_last, lease_ttl=5, lease_settle=0, force=True,
                            leftover_grace=grace)
    s = state()
    pos = mgr.restore(s)
    _say(f"restored {pos.step if pos else 0} {counting.bytes_written}")
    step = (pos.step if pos else 0) + 1
    for step in range(step, step + (1 if final else MAX_SAVES)):
        with torch.no_grad():
            s.objects["model"].weight.add_(0.001)
        mgr.save(s, step=step)
        _say(f"saved {step}")
    mgr.close()
    _say(f"closed {counting.bytes_written}")


def zygote(url: str, keep_last: int, grace: float) -> None:
    _say("zygote-ready")
    for line in sys.stdin:
        cmd, _n = line.split()
        pid = os.fork()
        if pid == 0:  # the writer
            code = 0
            try:
                _say(f"ready {os.getpid()}")
                writer(url, keep_last, grace, final=cmd == "final")
            except BaseException as exc:  # reported, then the child ends without cleanup
                _say(f"error {type(exc).__name__}: {exc}".replace("\n", " "))
                code = 1
            os._exit(code)
        _pid, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        _say(f"reaped {pid} {code}")


if __name__ == "__main__":
    if sys.argv[1] == "zygote":
        zygote(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    else:
        raise SystemExit(f"unknown command {sys.argv[1:]}")
