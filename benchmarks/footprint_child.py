"""Writers for the storage-footprint kill tests (run as ``python -m benchmarks.footprint_child``).

``zygote URL KEEP_LAST GRACE [MODE [SIZE]]``: import torch and ckptsdk once, then for each
``go N`` line on stdin fork a writer that takes the lease (``force=True``: the previous one may
have been SIGKILLed), restores, and saves steps back to back until the parent SIGKILLs it (or N
saves, if N > 0); ``final N`` forks one that restores, saves N times (at least once) and closes.
The zygote reaps each and reports. MODE is the retention mode (default: the manager's), SIZE the
side of the square weight matrix (default 724: about 2 MB). A writer's byte counts come from a
counting wrapper around its backend (benchmarks/footprint.py reuses this).

Protocol lines (stdout): ``zygote-ready``; per writer: ``ready PID``, ``saved STEP``...,
``restored STEP WRITTEN`` (bytes written by the restore: the anchor), ``closed WRITTEN``,
``reaped PID STATUS``; ``read_line`` reads them (the parent's side, shared by the tests).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import torch

from ckptsdk import CheckpointManager, LeaseOptions, Retention, TrainState
from ckptsdk.backends import open_backend
from ckptsdk.testing.counting import CountingBackend

MAX_SAVES = 400  # bounded even if the parent forgets to kill a writer


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())  # not print: a forked child must not share the buffer


def read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The zygote's next protocol line, read from ``proc``'s stdout (the parent's side).

    Byte by byte with ``select``, so a line never waits in a buffer the parent cannot see.

    Raises:
        AssertionError: no whole line within ``timeout`` seconds, or the zygote closed its stdout
            (the tests and benchmarks that call this treat it as a failed check).
    """
    if proc.stdout is None:
        raise AssertionError("the zygote was started without stdout=subprocess.PIPE")
    deadline = time.monotonic() + timeout
    buf = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        ch = os.read(proc.stdout.fileno(), 1)
        if not ch:
            break
        if ch == b"\n":
            return buf.decode()
        buf += ch
    raise AssertionError(f"no line from the zygote within {timeout} s (got {buf!r})")


def state(size: int = 724) -> TrainState:
    """About 2 MB of parameters by default: a save takes long enough for kills to land inside it."""
    torch.manual_seed(0)
    return TrainState(model=torch.nn.Linear(size, size))


def writer(url: str, keep_last: int, grace: float, *, saves: int, mode: str | None, size: int) -> None:
    counting = CountingBackend(open_backend(url))
    mgr = CheckpointManager(
        counting,
        retention=Retention(keep_last=keep_last, leftover_grace=grace, mode=mode),
        lease_options=LeaseOptions(ttl=5, settle=0, force=True),
    )
    s = state(size)
    pos = mgr.restore(s)
    _say(f"restored {pos.step if pos else 0} {counting.bytes_written}")
    first = (pos.step if pos else 0) + 1
    for step in range(first, first + saves):
        with torch.no_grad():
            s.objects["model"].weight.add_(0.001)
        mgr.save(s, step=step)
        _say(f"saved {step}")
    mgr.close()
    _say(f"closed {counting.bytes_written}")


def zygote(url: str, keep_last: int, grace: float, mode: str | None = None, size: int = 724) -> None:
    _say("zygote-ready")
    for line in sys.stdin:
        cmd, n = line.split()
        saves = max(1, int(n)) if cmd == "final" else (int(n) if int(n) > 0 else MAX_SAVES)
        pid = os.fork()
        if pid == 0:  # the writer
            code = 0
            try:
                _say(f"ready {os.getpid()}")
                writer(url, keep_last, grace, saves=saves, mode=mode, size=size)
            except BaseException as exc:  # reported, then the child ends without cleanup
                _say(f"error {type(exc).__name__}: {exc}".replace("\n", " "))
                code = 1
            os._exit(code)
        _pid, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        _say(f"reaped {pid} {code}")


if __name__ == "__main__":
    if sys.argv[1] == "zygote":
        mode = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "default" else None
        size = int(sys.argv[6]) if len(sys.argv) > 6 else 724
        zygote(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), mode, size)
    else:
        raise SystemExit(f"unknown command {sys.argv[1:]}")
