"""A fork while a thread holds a local root's flock must not leave the child holding it.

Found by the data-loader SIGKILL tests: a DataLoader forks its workers at every epoch while the
run log's flusher thread may be inside a write; the workers inherited the lock's descriptor and
every later save waited 120 s, then failed.
"""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from ckptsdk.backends import local
from ckptsdk.backends.local import LocalBackend
from ckptsdk.errors import BackendError


def _wait_forever(conn) -> None:
    conn.recv()  # until the parent says so (or dies)


def test_a_fork_during_a_locked_write_waits_and_the_child_holds_no_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "LOCK_TIMEOUT_S", 10.0)
    backend = LocalBackend(str(tmp_path / "root"))
    inside, go = threading.Event(), threading.Event()

    def hold() -> None:
        with backend._locked("create", "k"):
            inside.set()
            go.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(60)
    parent_end, child_end = multiprocessing.Pipe()
    child = multiprocessing.get_context("fork").Process(target=_wait_forever, args=(child_end,))
    forked = threading.Event()

    def fork() -> None:
        child.start()  # waits in the at-fork hook until the holder leaves its locked section
        forked.set()

    forker = threading.Thread(target=fork)
    forker.start()
    assert not forked.wait(0.5)  # held off while the lock is held (the order, not a duration)
    go.set()
    holder.join(60)
    assert forked.wait(60)
    try:
        # The child is alive; had it inherited the lock, this would wait 10 s and fail.
        backend.write("after-fork", b"ok")
        assert backend.read("after-fork") == b"ok"
    finally:
        parent_end.send("stop")
        child.join(60)
        forker.join(60)


def test_the_sabotaged_guard_leaks_the_lock_into_the_child(tmp_path, monkeypatch):
    """Without the guard the same sequence leaves the child holding the root's lock."""
    monkeypatch.setattr(local, "LOCK_TIMEOUT_S", 1.0)
    monkeypatch.setattr(local, "no_fork", _no_guard)
    backend = LocalBackend(str(tmp_path / "root"))
    parent_end, child_end = multiprocessing.Pipe()
    child = multiprocessing.get_context("fork").Process(target=_wait_forever, args=(child_end,))
    with backend._locked("create", "k"):
        child.start()
    try:
        with pytest.raises(BackendError, match="stayed held"):
            backend.write("after-fork", b"ok")
    finally:
        parent_end.send("stop")
        child.join(60)


class _no_guard:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
