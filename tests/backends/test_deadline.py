"""The deadline of one save (ckptsdk/backends/deadline.py): nesting, threads, the retry schedule,
and what the save pipeline does with it. The frozen-server stories are tests/stories/test_faults_frozen.py."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch

from ckptsdk import CheckpointManager, SaveOptions
from ckptsdk.backends import open_backend
from ckptsdk.backends.cloud.gcs import GCSBackend
from ckptsdk.backends.deadline import Retries, bounded, carried, current, socket_timeout
from ckptsdk.errors import DeadlineExceeded
from ckptsdk.manager import Simulation
from ckptsdk.testing import FaultyBackend


def test_the_earlier_deadline_wins_and_each_ends_with_its_block() -> None:
    with bounded(100.0, "outer work", option="signal_deadline") as outer:
        with bounded(5.0, "inner work", option="save_deadline") as inner:
            assert current() is inner and inner.what == "inner work"
        with bounded(1000.0, "a longer one", option="save_deadline") as longer:
            assert longer is outer  # a save inside the stop after a signal keeps the signal's
        assert current() is outer
    assert current() is None


def test_bytes_extend_a_deadline_at_the_slowest_rate_allowed() -> None:
    with bounded(2.0, "a save", option="save_deadline", nbytes=3 << 20) as d:
        assert d.seconds == 5.0


def test_a_thread_sees_the_deadline_only_when_carried() -> None:
    seen: dict[str, object] = {}
    with bounded(30.0, "work", option="save_deadline") as d:
        plain = threading.Thread(target=lambda: seen.update(plain=current()))
        carrying = threading.Thread(target=carried(lambda: seen.update(carried=current())))
        plain.start(), carrying.start()
        plain.join(10), carrying.join(10)
    assert seen == {"plain": None, "carried": d}


def test_retries_stop_at_the_deadline_and_say_so() -> None:
    with bounded(0.3, "work", option="save_deadline"):
        tries = Retries(50, backoff=0.1, spread=0.0, allowance=60.0, jitter=random.Random(0))
        lefts = list(tries)
        time.sleep(max(0.0, tries.end - time.monotonic()) + 0.01)
        assert tries.expired() and tries.cut_short() and 1 <= tries.tried < 50
    assert all(0 < left <= 0.3 for left in lefts)
    outside = Retries(2, backoff=0.0, spread=0.0, allowance=60.0, jitter=random.Random(0))
    assert len(list(outside)) == 2 and not outside.expired()


def test_socket_timeouts_come_in_a_few_sizes() -> None:
    assert [socket_timeout(60.0, left) for left in (120.0, 60.0, 59.0, 31.9, 2.5, 0.01)] == [60, 60, 32, 16, 2, 1]


@pytest.mark.gcs
def test_a_gcs_request_past_the_deadline_is_not_sent(gcs_emulator) -> None:
    gcs_emulator.make_bucket("deadline-unit")
    backend = GCSBackend("deadline-unit/run", **gcs_emulator.storage_options)
    backend.write("a", b"1")
    with bounded(0.0, "the save of step 7 under gs://deadline-unit/run", option="save_deadline"):
        with pytest.raises(DeadlineExceeded) as caught:
            backend.write("b", b"2")
    assert caught.value.key == "b" and caught.value.url == "gs://deadline-unit/run"
    assert str(caught.value).startswith("the save of step 7 under gs://deadline-unit/run did not finish within")
    assert f"GCS at {gcs_emulator.endpoint} to answer POST" in caught.value.waited_for
    assert "attempts: 0," in caught.value.waited_for
    assert not backend.exists("b") and backend.read("a") == b"1"


def test_running_out_of_time_after_the_commit_only_leaves_rotation(caplog) -> None:
    """The commit stands: the save returns it, and the next save rotates."""
    out_of_time: list[bool] = [False]

    def late(op: str, key: str, n: int) -> BaseException | None:
        if op == "delete" and out_of_time[0]:
            return DeadlineExceeded("ran out of time (injected)", url="memory://late", key=key)
        return None

    inner = open_backend("memory://deadline-after-commit")
    mgr = CheckpointManager(
        inner, keep_last=1, save_options=SaveOptions(on_signal=False), _simulation=Simulation(heartbeat=False)
    )
    mgr.backend = FaultyBackend(inner, fail_on=late)
    mgr.save({"w": torch.ones(2)}, step=1)
    out_of_time[0] = True
    with caplog.at_level(logging.WARNING, logger="ckptsdk.checkpoint.writing"):
        info = mgr.save({"w": torch.full((2,), 2.0)}, step=2)
        mgr.wait()  # a sync save's rotation runs on the worker, after the commit
    assert info.committed and info.step == 2
    assert "step 2 is committed under memory://deadline-after-commit; rotation waits" in caplog.text
    assert [c.step for c in mgr.list() if c.committed] == [1, 2]  # step 1 not rotated out yet
    out_of_time[0] = False
    mgr.save({"w": torch.full((2,), 3.0)}, step=3)
    mgr.close()
    assert [c.step for c in CheckpointManager(inner, read_only=True).list() if c.committed] == [3]


@pytest.mark.timeout(60)
def test_a_stuck_lock_holder_fails_a_local_save_within_its_deadline(tmp_path) -> None:
    """The root's flock (held here by another open file, as a process stuck in a write would) is
    waited for until the save's deadline, not for the lock's own 120 s."""
    import fcntl
    import os

    from ckptsdk.backends.posix import LOCK_NAME

    root = tmp_path / "run"
    mgr = CheckpointManager(
        str(root),
        save_options=SaveOptions(save_deadline=60.0, on_signal=False),
        _simulation=Simulation(heartbeat=False),
    )
    mgr.save({"w": torch.ones(2)}, step=1)
    mgr._saving.save_deadline = 1.0  # only the save behind the held lock is short (a loaded disk may be slow)
    fd = os.open(root / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(DeadlineExceeded) as caught:
            mgr.save({"w": torch.full((2,), 2.0)}, step=2)
    finally:
        os.close(fd)
    assert str(caught.value).startswith(f"the save of step 2 under {root} did not finish within its 1.0 s")
    assert caught.value.waited_for.startswith(f"the lock {LOCK_NAME} in {root}, held by another process")
    mgr._saving.save_deadline = 60.0
    mgr.save({"w": torch.full((2,), 3.0)}, step=3)  # the lock is free again: the writer carries on
    mgr.close()
    reader = CheckpointManager(str(root), read_only=True)
    assert [c.step for c in reader.list() if c.committed][-1] == 3
    assert torch.equal(reader.load(step=1)["w"], torch.ones(2))  # nothing lost
