"""Freezing a child process (SIGSTOP) as a deleted runtime freezes, outside the local root's flock.

A zombie in the lease stories is frozen, not dead. Frozen *while holding* a local root's flock it
tells another story: every writer on that root then fails loudly after ``LOCK_TIMEOUT_S``
(tests/backends/test_lock_and_fork.py), so a newcomer in the zombie story would wait that long.
The lock is held for a rename and a folder fsync, so thawing and stopping again (bounded) lands
outside it. Linux only (``/proc``), as the stories.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.support.waiting import poll_until


def holds_flock(pid: int, lock_file: Path) -> bool:
    """Whether ``pid`` holds a flock on ``lock_file`` now (``/proc/locks``; the ``->`` lines are
    waiters, which hold nothing)."""
    try:
        st = lock_file.stat()
    except FileNotFoundError:
        return False
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
            continue
        if int(fields[4]) == pid and fields[5] == inode:
            return True
    return False


def stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped now (state T or t in ``/proc/PID/stat``)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def freeze(pid: int, lock_file: Path | None, *, tries: int = 200) -> None:
    """SIGSTOP ``pid`` and return once it is stopped and holds no flock on ``lock_file``
    (None: any moment will do). Fails after ``tries`` freezes that each caught it in the lock."""
    for _ in range(tries):
        os.kill(pid, signal.SIGSTOP)
        if poll_until(lambda: stopped(pid), 10) is None:
            raise AssertionError(f"pid {pid} did not stop within 10 s of SIGSTOP")
        if lock_file is None or not holds_flock(pid, lock_file):
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.005)
    raise AssertionError(f"pid {pid} held {lock_file} at each of {tries} freezes")
