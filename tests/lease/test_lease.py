"""The writer lease: acquire, renew, takeover, force, fencing, release; races and dead holders.

Unit tests drive time with a fake clock (no sleeping); the race and dead-holder tests (marked
slow) use real processes (tests/support/_story_writer.py) on local disk, the Drive folder and the GCS
emulator. The Drive simulation (ckptsdk/testing/drive_sim.py) is checked here too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ckptsdk.backends.base import ObjectInfo
from ckptsdk.errors import (
    BackendError,
    ConfigError,
    LeaseError,
    LeaseHeldError,
    LeaseLostError,
    PreconditionFailed,
)
from ckptsdk.format.layout import writer_tag
from ckptsdk.lease.acquire import LEASE_KEY, Lease, LeaseRecord, parse_lease, read_lease
from ckptsdk.lease.identity import Liveness, judge_holder, this_process
from ckptsdk.lease.record import LeaseHolder
from ckptsdk.testing.drive_sim import DriveSim
from tests.support.story_child import can_unshare, inner_pid, read_events, spawn, wait_event
from tests.support.waiting import wait_for


class FakeTime:
    """A clock that moves only when a Lease sleeps; hooks run after every move."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.hooks: list[Any] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds
        for hook in list(self.hooks):
            hook(self.now)


def fake_lease(backend: Any, ft: FakeTime, **kw: Any) -> Lease:
    return Lease(backend, clock=ft.clock, sleep=ft.sleep, **kw)


def renew_every(lease: Lease, ft: FakeTime, period: float) -> None:
    """Make ``lease`` renew every ``period`` seconds of fake time (a live holder)."""
    state = {"next": ft.now + period}

    def hook(now: float) -> None:
        while now >= state["next"]:
            lease.renew()
            state["next"] += period

    ft.hooks.append(hook)


class Proxy:
    """Wraps a backend; attributes given here replace the wrapped ones."""

    def __init__(self, inner: Any, **overrides: Any) -> None:
        self._inner = inner
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Trace:
    """What one Lease did, in order: its clock readings, its sleeps, and what it read and wrote
    of LEASE.json. Tests assert the order of these events (the protocol's own rules, on the
    lease's own clock), never how long a loaded machine took.

    Others may add their own events (``trace.events.append(("kill", ...))``) to order them too.
    """

    def __init__(self, backend: Any, clock: Any = time.monotonic, sleep: Any = time.sleep) -> None:
        self.events: list[tuple[str, Any]] = []
        self._clock, self._sleep, self._inner = clock, sleep, backend
        self.backend = Proxy(backend, read=self._read, replace=self._replace, create=self._create)

    def clock(self) -> float:
        now = self._clock()
        self.events.append(("clock", now))
        return now

    def sleep(self, seconds: float) -> None:
        self.events.append(("sleep", seconds))
        self._sleep(seconds)

    def _read(self, key: str) -> bytes:
        data = self._inner.read(key)
        if key == LEASE_KEY:
            self.events.append(("read", data))
        return data

    def _replace(self, key: str, data: bytes, version: str) -> ObjectInfo:
        try:
            info = self._inner.replace(key, data, version=version)
        except PreconditionFailed:
            self.events.append(("replace-refused", data))  # the record moved: observed afresh
            raise
        self.events.append(("replace", data))
        return info

    def _create(self, key: str, data: bytes) -> ObjectInfo:
        info = self._inner.create(key, data)
        self.events.append(("create", data))
        return info

    def lease(self, **kw: Any) -> Lease:
        return Lease(self.backend, clock=self.clock, sleep=self.sleep, **kw)


def assert_took_over_by_the_rule(events: list[tuple[str, Any]], *, ttl: float, record: LeaseRecord) -> int:
    """The newcomer replaced the record at the first observation round where it had seen it
    unchanged for a whole ttl on its own clock (not earlier: the holder may be alive; not a round
    later: it did not dawdle), then used it at once: no settle is slept, even without
    compare-and-swap (the read-back runs later, in the background). Returns the index of the
    takeover write in ``events``.
    """
    rounds: list[tuple[bytes | None, float]] = []  # (record read, the lease's clock right after)
    read: bytes | None = None
    take = None
    for i, (kind, value) in enumerate(events):
        if kind == "read":
            read = value
        elif kind == "clock" and read is not None:
            rounds.append((read, value))
            read = None
        elif kind == "replace-refused":
            rounds.append((None, math.nan))  # a takeover that lost to a change: watch afresh
        elif kind == "replace":
            take = i
            break
    assert take is not None and rounds and rounds[-1][0] is not None, events
    since = [rounds[0][1]]  # when each round's record was first seen
    for (prev, _), (data, now) in zip(rounds, rounds[1:], strict=False):
        since.append(since[-1] if data == prev else now)
    data, now = rounds[-1]
    assert data is not None and parse_lease(data).epoch + 1 == record.epoch  # it replaced the record it watched
    assert now - since[-1] >= ttl, (now, since[-1])
    if len(rounds) > 1 and rounds[-2][0] == data:
        assert rounds[-2][1] - since[-1] < ttl, (rounds[-2][1], since[-1])
    after = events[take + 1 :]
    assert not [e for e in after if e[0] == "sleep"], after  # acquire returned without waiting
    return take


def assert_took_over_at_once(events: list[tuple[str, Any]], *, ttl: float, record: LeaseRecord) -> int:
    """The newcomer replaced the record before it had seen it unchanged for a whole ttl: it knew
    the holder dead without watching. Returns the index of the takeover write."""
    take = next(i for i, (kind, _) in enumerate(events) if kind == "replace")
    reads = [i for i, (kind, _) in enumerate(events[:take]) if kind == "read"]
    clocks = [v for kind, v in events[:take] if kind == "clock"]
    assert reads and clocks, events
    assert parse_lease(events[reads[-1]][1]).epoch + 1 == record.epoch
    assert clocks[-1] - clocks[0] < ttl, (clocks[0], clocks[-1])
    assert not [e for e in events[take + 1 :] if e[0] == "sleep"]
    return take


# ---------------------------------------------------------------- acquire, renew, release


def test_first_acquire_then_renewals(backend: Any) -> None:
    ft = FakeTime()
    lease = fake_lease(backend, ft, ttl=10)
    assert read_lease(backend) is None
    record = lease.acquire()
    assert (record.epoch, record.attempt, record.renewals) == (1, 1, 0)
    assert record.holder.pid == os.getpid() and record.holder.nonce
    assert len(record.run_id) == 32 and record.ttl == 10 and not record.released
    assert read_lease(backend) == record
    assert (lease.epoch, lease.attempt, lease.run_id) == (1, 1, record.run_id)
    v0 = backend.stat(LEASE_KEY).version
    for n in (1, 2, 3):
        assert lease.renew().renewals == n
    stored = read_lease(backend)
    assert stored is not None and stored.renewals == 3 and stored.holder == record.holder
    assert backend.stat(LEASE_KEY).version != v0
    lease.check()  # still ours: does not raise
    assert not lease.fenced


def test_reacquire_after_release_continues_epoch_attempt_and_run(backend: Any) -> None:
    ft = FakeTime()
    seen = []
    for _ in range(3):
        lease = fake_lease(backend, ft, ttl=10)
        seen.append(lease.acquire())
        lease.release()
        lease.release()  # idempotent
        with pytest.raises(LeaseLostError, match="released"):
            lease.check()
    assert [r.epoch for r in seen] == [1, 2, 3]
    assert [r.attempt for r in seen] == [1, 2, 3]
    assert len({r.run_id for r in seen}) == 1
    assert len({r.holder.nonce for r in seen}) == 3  # a nonce per acquisition
    final = read_lease(backend)
    assert final is not None and final.released and final.holder == seen[-1].holder
    given = fake_lease(backend, ft, ttl=10, run_id="my-run").acquire()
    assert (given.run_id, given.epoch, given.attempt) == ("my-run", 4, 4)


def test_takeover_after_a_whole_unchanged_ttl(backend: Any) -> None:
    ft = FakeTime()
    old = fake_lease(backend, ft, ttl=10)
    first = old.acquire()  # and never renews again: a dead holder
    newcomer = fake_lease(backend, ft, ttl=10)
    t0 = ft.now
    record = newcomer.acquire()
    waited = ft.now - t0
    assert 10 <= waited <= 10 + 1.0 + newcomer.settle
    assert (record.epoch, record.attempt, record.run_id) == (2, 2, first.run_id)
    assert read_lease(backend) == record
    with pytest.raises(LeaseLostError) as info:
        old.renew()
    assert info.value.epoch == 1
    assert info.value.newer_epoch == 2  # Drive: the holder read the newer record, then fenced
    assert "epoch 2" in str(info.value) and "nothing was deleted" in str(info.value)
    assert old.fenced and read_lease(backend) == record  # the fenced one wrote nothing


def test_live_holder_is_never_taken_over(backend: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ckptsdk.lease")
    ft = FakeTime()
    holder = fake_lease(backend, ft, ttl=10, run_id="run-h")
    mine = holder.acquire()
    renew_every(holder, ft, 10 / 3)
    newcomer = fake_lease(backend, ft, ttl=10, wait_timeout=60)
    t0 = ft.now
    with pytest.raises(LeaseHeldError) as info:
        newcomer.acquire()
    assert 60 <= ft.now - t0 <= 61
    seen = info.value.holder
    assert seen["holder"]["nonce"] == mine.holder.nonce and seen["epoch"] == 1
    assert seen["run_id"] == "run-h" and "force=True" in str(info.value)
    assert not holder.fenced and read_lease(backend).holder == mine.holder  # type: ignore[union-attr]
    holder.renew()
    waits = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert waits and "run-h" in waits[0] and f"pid {os.getpid()}" in waits[0]
    assert "takeover possible in" in waits[0] and "acquired" in waits[0]


def test_holders_longer_ttl_is_respected(backend: Any) -> None:
    ft = FakeTime()
    holder = fake_lease(backend, ft, ttl=30)
    holder.acquire()
    renew_every(holder, ft, 10)  # alive by its own ttl, silent for 10 s at a time
    newcomer = fake_lease(backend, ft, ttl=2, wait_timeout=100)
    with pytest.raises(LeaseHeldError):
        newcomer.acquire()
    assert not holder.fenced


def test_wait_timeout_zero_fails_at_once(backend: Any) -> None:
    ft = FakeTime()
    fake_lease(backend, ft, ttl=10).acquire()
    t0 = ft.now
    with pytest.raises(LeaseHeldError):
        fake_lease(backend, ft, ttl=10, wait_timeout=0).acquire()
    assert ft.now == t0


def test_force_takes_over_at_once(backend: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ckptsdk.lease")
    ft = FakeTime()
    holder = fake_lease(backend, ft, ttl=10)
    holder.acquire()
    forcer = fake_lease(backend, ft, ttl=10, force=True)
    t0 = ft.now
    record = forcer.acquire()
    assert ft.now == t0  # no observation window, and no settle (read back in the background)
    assert (record.epoch, record.attempt) == (2, 2)
    assert any(r.levelno == logging.WARNING and "force=True" in r.getMessage() for r in caplog.records)
    with pytest.raises(LeaseLostError) as info:
        holder.renew()
    assert (info.value.epoch, info.value.newer_epoch) == (1, 2)
    assert info.value.holder["holder"]["nonce"] == record.holder.nonce


def test_release_only_if_ours(backend: Any) -> None:
    ft = FakeTime()
    old = fake_lease(backend, ft, ttl=10)
    old.acquire()
    new = fake_lease(backend, ft, ttl=10, force=True)
    theirs = new.acquire()
    old.release()  # not ours any more: leaves it alone
    assert read_lease(backend) == theirs
    new.release()
    after = read_lease(backend)
    assert after is not None and after.released and after.holder == theirs.holder
    data = backend.read(LEASE_KEY)
    new.release()
    assert backend.read(LEASE_KEY) == data
    with pytest.raises(LeaseLostError):
        new.renew()


def test_fence_by_the_manager_and_check(backend: Any) -> None:
    lease = fake_lease(backend, FakeTime(), ttl=10)
    lease.acquire()
    lease.fence("saw a manifest of epoch 7", 7)
    assert lease.fenced and lease.newer_epoch == 7
    with pytest.raises(LeaseLostError) as info:
        lease.check()
    msg = str(info.value)
    assert "epoch 7" in msg and "must stop" in msg and "nothing was deleted" in msg
    assert (info.value.epoch, info.value.newer_epoch) == (1, 7)
    with pytest.raises(LeaseLostError):
        lease.renew()
    lease.release()  # a fenced writer leaves LEASE.json alone
    stored = read_lease(backend)
    assert stored is not None and not stored.released and stored.renewals == 0


def test_zombies_delayed_record_is_overwritten_not_obeyed(backend: Any) -> None:
    """Drive delivers an old epoch's write after ours: the newer holder rewrites, stays in."""
    ft = FakeTime()
    zombie = fake_lease(backend, ft, ttl=10)
    zombie.acquire()
    zombie_bytes = zombie.renew().to_json()
    holder = fake_lease(backend, ft, ttl=10, force=True)
    mine = holder.acquire()
    backend.write(LEASE_KEY, zombie_bytes)  # what a late sync does
    assert holder.renew().holder == mine.holder
    assert not holder.fenced and read_lease(backend).holder == mine.holder  # type: ignore[union-attr]


def test_two_newcomers_exactly_one_wins_the_swap(backend: Any) -> None:
    """Both judged the same record dead; the second compare-and-swap loses to the first."""
    ft = FakeTime()
    fake_lease(backend, ft, ttl=10).acquire()  # dead holder
    first = fake_lease(backend, ft, ttl=10)
    won: list[LeaseRecord] = []

    def replace_after_rival(key: str, data: Any, version: str) -> ObjectInfo:
        if not won:
            won.append(first.acquire())  # the rival completes its takeover just before us
        return backend.replace(key, data, version=version)

    second = fake_lease(Proxy(backend, replace=replace_after_rival), ft, ttl=10)
    with pytest.raises(LeaseHeldError) as info:
        second.acquire()
    assert "same moment" in str(info.value)
    assert info.value.holder["holder"]["nonce"] == won[0].holder.nonce
    assert read_lease(backend) == won[0] and won[0].epoch == 2


def test_lost_reply_is_recognised_as_our_own_write(backend: Any) -> None:
    """GCS retries a create/replace whose reply was lost into a 412 although it won."""

    lost: list[str] = []

    def lost_reply(op: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            info = op(*args, **kw)
            if op.__name__ in lost:
                return info
            lost.append(op.__name__)  # the first reply of each kind is lost
            raise PreconditionFailed("412 after a retried request", url=backend.url, key=LEASE_KEY)

        return call

    ft = FakeTime()
    flaky = Proxy(backend, create=lost_reply(backend.create), replace=lost_reply(backend.replace))
    lease = fake_lease(flaky, ft, ttl=10)
    record = lease.acquire()
    assert record.epoch == 1 and read_lease(backend).holder == record.holder  # type: ignore[union-attr]
    assert lease.renew().renewals == 1
    assert read_lease(backend).renewals == 1 and not lease.fenced  # type: ignore[union-attr]
    assert sorted(lost) == ["create", "replace"]


def test_unreadable_lease_needs_force(backend: Any) -> None:
    ft = FakeTime()
    backend.write(LEASE_KEY, b"\x00garbage")
    with pytest.raises(LeaseError) as info:
        fake_lease(backend, ft, ttl=10).acquire()
    assert type(info.value) is LeaseError and "force=True" in str(info.value)
    assert fake_lease(backend, ft, ttl=10, force=True).acquire().epoch == 1
    backend.write(LEASE_KEY, json.dumps({"format": "ckptsdk.lease/9", "epoch": 4}).encode())
    with pytest.raises(LeaseError, match="ckptsdk.lease/9"):
        read_lease(backend)
    assert fake_lease(backend, ft, ttl=10, force=True).acquire().epoch == 5


# LEASE.json as the previous ckptsdk wrote it (indented, times in ms with "+00:00"), held by a
# writer that stopped renewing.
_OLD_LEASE = b"""{
 "format": "ckptsdk.lease/1",
 "run_id": "0f3c2a9e8b7d4c1a9e8b7d4c1a9e8b7d",
 "attempt": 3,
 "epoch": 7,
 "holder": {
  "host": "colab-vm-1",
  "pid": 4242,
  "nonce": "5d41402abc4b2a76b9719d911017c592"
 },
 "renewals": 12,
 "ttl": 60.0,
 "settle": 0.0,
 "acquired_at": "2026-11-30T06:10:00.123+00:00",
 "renewed_at": "2026-11-30T06:14:00.456+00:00",
 "released": false
}"""


def test_a_lease_written_by_the_previous_version_is_read_and_taken_over(backend: Any) -> None:
    backend.write(LEASE_KEY, _OLD_LEASE)
    old = read_lease(backend)
    assert old is not None and (old.epoch, old.attempt, old.renewals, old.holder.host) == (7, 3, 12, "colab-vm-1")
    assert old.renewed_at == "2026-11-30T06:14:00.456+00:00"
    ft = FakeTime()
    record = fake_lease(backend, ft, ttl=10).acquire()  # silent for a whole ttl: taken over
    assert (record.epoch, record.attempt, record.run_id) == (8, 4, old.run_id)
    written = json.loads(backend.read(LEASE_KEY))
    # Now 1.1, which readers of 1.0 read by the version rule; times in the one UTC form.
    assert written["format"] == "ckptsdk.lease/1.1" and written["renewed_at"].endswith("Z")
    assert written["holder"]["boot_id"] and written["holder"]["start_time"] > 0
    assert parse_lease(backend.read(LEASE_KEY)) == record


def test_a_newer_major_lease_says_upgrade(backend: Any) -> None:
    backend.write(LEASE_KEY, _OLD_LEASE.replace(b"ckptsdk.lease/1", b"ckptsdk.lease/2"))
    with pytest.raises(LeaseError, match="newer ckptsdk.*upgrade ckptsdk") as info:
        fake_lease(backend, FakeTime(), ttl=10).acquire()
    assert "--break" in str(info.value) and LEASE_KEY in str(info.value)
    # A newer minor version's record is read (its extra fields ignored) and can be taken over.
    newer_minor = json.loads(_OLD_LEASE.replace(b"ckptsdk.lease/1", b"ckptsdk.lease/1.3"))
    backend.write(LEASE_KEY, json.dumps({**newer_minor, "priority": 5}).encode())
    assert read_lease(backend).epoch == 7  # type: ignore[union-attr]


def test_bad_options_are_refused(backend: Any) -> None:
    with pytest.raises(ConfigError):
        Lease(backend, ttl=0)
    with pytest.raises(ConfigError):
        Lease(backend, settle=-1)
    with pytest.raises(LeaseError, match="acquire"):
        Lease(backend).epoch  # noqa: B018


def test_defaults_follow_the_backend(make_backend_target: Any) -> None:
    local = Lease(make_backend_target("local").open())
    drive = Lease(make_backend_target("drive").open())
    assert (local.ttl, local.settle) == (15.0, 0.0)
    assert (drive.ttl, drive.settle) == (45.0, 60.0)
    record = fake_lease(make_backend_target("memory").open(), FakeTime()).acquire()
    assert parse_lease(record.to_json()) == record


# ---------------------------------------------------------------- no compare-and-swap (Drive)


def test_drive_read_back_fences_us_when_a_rival_took_the_lease(make_backend_target: Any) -> None:
    """Without compare-and-swap the lease is used at once; a rival's record that reaches us
    later is found by the read-back (any renewal), and we are fenced: nothing more is written."""
    backend = make_backend_target("drive").open()
    ft = FakeTime()
    fake_lease(backend, ft, ttl=10).acquire()  # dead (alive by pid, so judged by the ttl rule)
    lease = fake_lease(backend, ft, ttl=10, settle=5)
    record = lease.acquire()
    t_open = ft.now
    assert record.epoch == 2 and not lease.settled
    rival = fake_lease(make_backend_target("drive").open(), FakeTime(), ttl=10, force=True)
    theirs = rival.acquire()  # another VM's record arrives over ours
    ft.sleep(5)
    with pytest.raises(LeaseLostError) as info:
        lease.renew()  # the read-back after the settle
    assert (info.value.epoch, info.value.newer_epoch) == (2, theirs.epoch)
    assert lease.fenced and read_lease(backend).holder == theirs.holder  # type: ignore[union-attr]
    assert ft.now - t_open == 5  # nobody waited for the settle but the test


def test_drive_an_old_holders_late_write_is_written_over_and_it_is_fenced(make_backend_target: Any) -> None:
    """An older epoch's renewal landing after our takeover (Drive's late writes): the read-back
    writes ours again, and the old holder fences itself at its next renewal."""
    backend = make_backend_target("drive").open()
    ft = FakeTime()
    old = fake_lease(backend, ft, ttl=10)
    old.acquire()
    old_bytes = old.renew().to_json()
    lease = fake_lease(backend, ft, ttl=10, settle=3, wait_timeout=100)
    record = lease.acquire()
    assert record.epoch == 2
    backend.write(LEASE_KEY, old_bytes.replace(b'"renewals": 1', b'"renewals": 2'))  # lands late
    ft.sleep(3)
    again = lease.renew()
    assert lease.settled and again.holder == record.holder and read_lease(backend).epoch == 2  # type: ignore[union-attr]
    with pytest.raises(LeaseLostError):
        old.renew()
    assert old.fenced and read_lease(backend).holder == record.holder  # type: ignore[union-attr]


def test_a_record_deleted_under_us_does_not_reset_epochs(backend: Any) -> None:
    """A delayed delete (a zombie's release reaching us late) while we watch or settle."""
    ft = FakeTime()
    dead = fake_lease(backend, ft, ttl=10)
    first = dead.acquire()
    deleted = []

    def delete_once(now: float) -> None:
        if not deleted and backend.exists(LEASE_KEY):
            deleted.append(now)
            backend.delete(LEASE_KEY)

    ft.hooks.append(delete_once)
    record = fake_lease(backend, ft, ttl=10).acquire()
    assert deleted
    assert (record.epoch, record.attempt, record.run_id) == (2, 2, first.run_id)
    assert read_lease(backend) == record


def test_drive_holder_fences_itself_after_a_ttl_without_renewal(make_backend_target: Any) -> None:
    backend = make_backend_target("drive").open()
    ft = FakeTime()
    lease = fake_lease(backend, ft, ttl=10)
    lease.acquire()
    ft.now += 11  # frozen (SIGSTOP) for longer than ttl: a newcomer may hold it unseen
    with pytest.raises(LeaseLostError, match="may have taken over"):
        lease.renew()
    assert lease.fenced and read_lease(backend).renewals == 0  # type: ignore[union-attr]
    other = fake_lease(backend, ft, ttl=10, force=True)
    other.acquire()
    ft.now += 11
    with pytest.raises(LeaseLostError, match="may have taken over"):
        other.check()  # no I/O: a save in flight during the freeze must not commit


# ---------------------------------------------------------------- heartbeat (real time)


def test_heartbeat_renews_and_stops_when_fenced(make_backend_target: Any) -> None:
    backend = make_backend_target("local").open()
    lease = Lease(backend, ttl=0.3)
    lease.acquire()
    lease.start_heartbeat()
    wait_for(lambda: read_lease(backend).renewals >= 2, 30, "two heartbeat renewals")  # type: ignore[union-attr]
    taker = Lease(backend, ttl=0.3, force=True)
    taker.acquire()
    wait_for(lambda: lease.fenced, 30, "the heartbeat to see the takeover")
    assert lease.newer_epoch == 2
    thread = lease.heartbeat.thread
    assert thread is not None
    thread.join(2)
    assert not thread.is_alive()
    lease.release()
    assert read_lease(backend).holder == taker.record.holder  # type: ignore[union-attr]
    taker.release()


def test_heartbeat_fences_after_a_ttl_of_storage_failures(make_backend_target: Any) -> None:
    backend = make_backend_target("memory").open()
    broken = {"on": False}

    def replace(key: str, data: Any, version: str) -> ObjectInfo:
        if broken["on"]:
            raise BackendError("connection reset", url=backend.url, key=key)
        return backend.replace(key, data, version=version)

    lease = Lease(Proxy(backend, replace=replace), ttl=0.3)
    lease.acquire()
    lease.start_heartbeat()
    broken["on"] = True
    wait_for(lambda: lease.fenced, 30, "a ttl of failed renewals to fence the writer")
    with pytest.raises(LeaseLostError, match="could not renew"):
        lease.check()
    lease.release()


# ---------------------------------------------------------------- the Drive simulation


def test_drive_sim_propagates_with_delay_and_last_writer_wins(tmp_path: Path) -> None:
    with DriveSim(tmp_path / "sim", delay=0.5, poll=0.02) as sim:
        a, b = sim.backend("vm1", "run"), sim.backend("vm2", "run")
        a.write("x/one", b"1")
        assert not b.exists("x/one")  # not yet: the delay
        sim.wait_synced(5)
        assert b.read("x/one") == b"1"
        b.write("x/one", b"2")
        sim.wait_synced(5)
        assert a.read("x/one") == b"2"
        a.delete("x/one")
        sim.wait_synced(5)
        assert not b.exists("x/one") and b.list() == []
        a.write("y", b"from-a")
        time.sleep(0.1)  # the scenario: B writes a tenth of a second after A (scans every 0.02 s)
        b.write("y", b"from-b")  # seen later: wins everywhere
        sim.wait_synced(5)
        assert a.read("y") == b.read("y") == b"from-b"
        (sim.root("vm1") / "run" / ".ckptsdk-tmp.z").write_bytes(b"temp")
        a.write("after-temp", b"x")  # once this arrived, the syncer has scanned vm1 with the temp file there
        sim.wait_synced(5)
        assert b.read("after-temp") == b"x"
        assert not (sim.root("vm2") / "run" / ".ckptsdk-tmp.z").exists()
        assert sim.applied >= 4


def test_lease_across_two_simulated_vms(tmp_path: Path) -> None:
    with DriveSim(tmp_path / "sim", delay=0.5, poll=0.02) as sim:
        a_back, b_back = sim.backend("vm1", "run"), sim.backend("vm2", "run")
        a = Lease(a_back, ttl=1.5, settle=1.2)
        a.acquire()
        a.start_heartbeat()
        # Not wait_synced: a renewal every 0.5 s against a 0.5 s delay leaves no quiet moment.
        wait_for(lambda: getattr(read_lease(b_back), "holder", None) == a.record.holder, 10, "A's record on B's VM")  # type: ignore[union-attr]
        with pytest.raises(LeaseHeldError):  # alive, seen through the delay
            Lease(b_back, ttl=1.5, settle=1.2, wait_timeout=3).acquire()
        a.heartbeat.stop_soon()  # A freezes (no release): its last renewal is still syncing
        trace = Trace(b_back)
        trace.events.append(("frozen", None))
        b = trace.lease(ttl=1.5, settle=1.2, wait_timeout=20)
        record = b.acquire()
        events = list(trace.events)
        b.start_heartbeat()
        assert record.epoch == 2
        assert_took_over_by_the_rule(events[1:], ttl=1.5, record=record)
        with pytest.raises(LeaseLostError):  # A thaws after > ttl: it stops, whatever it sees
            time.sleep(0.2)  # the scenario: A stays frozen a while longer, then thaws
            a.renew()
        wait_for(lambda: getattr(read_lease(a_back), "holder", None) == record.holder, 10, "B's record on A's VM")
        assert read_lease(b_back).holder == record.holder  # type: ignore[union-attr]
        assert not b.fenced
        b.release()
        a.release()
        sim.wait_synced(5)  # no heartbeat any more: the copies settle
        assert read_lease(a_back).released  # type: ignore[union-attr]


def test_two_vms_on_an_empty_root_the_read_back_picks_one(tmp_path: Path) -> None:
    """Both VMs see no lease and create epoch 1 at once; the read-backs decide by writer rank.

    Deterministic: the syncer starts only once both VMs hold their record; then each renews in
    turn (what the background read-back does), waiting for the copies to agree in between.
    """
    sim = DriveSim(tmp_path / "sim", delay=0.3, poll=0.02)  # not started: nothing syncs yet
    leases = {vm: Lease(sim.backend(vm, "run"), ttl=30.0, settle=1.0, wait_timeout=0) for vm in ("vm1", "vm2")}
    try:
        records = {vm: lease.acquire() for vm, lease in leases.items()}  # neither waits
        assert {r.epoch for r in records.values()} == {1}
        assert not any(lease.settled for lease in leases.values())
        sim.start()
        sim.wait_synced(20)
        lost = []
        for _ in range(3):
            for vm, lease in leases.items():
                if lease.fenced:
                    continue
                try:
                    lease.renew()
                except LeaseLostError:
                    lost.append(vm)
                sim.wait_synced(20)
        assert len(lost) == 1, lost
        (winner,) = set(leases) - set(lost)
        tags = {vm: writer_tag(r.holder.nonce, compare_and_swap=False) for vm, r in records.items()}
        assert tags[winner] > tags[lost[0]]  # the rank that orders their folders orders them here
        for vm in ("vm1", "vm2"):
            assert read_lease(sim.backend(vm, "run")).holder == records[winner].holder  # type: ignore[union-attr]
    finally:
        sim.stop()


# ---------------------------------------------------------------- real processes


def _child(mode: str, target: Any, events: Path, *args: str, host: str | None = None) -> subprocess.Popen[bytes]:
    return spawn(mode, target.url, events, *args, options=target.options, env=target.env, host=host)


needs_unshare = pytest.mark.skipif(
    not can_unshare(), reason="needs root and namespaces (unshare) to play another machine"
)


def _reap(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@pytest.mark.slow
@pytest.mark.parametrize("holder", ["stale", "dead"])
@pytest.mark.parametrize(
    "kind", ["local", "drive", pytest.param("gcs", marks=pytest.mark.gcs), pytest.param("s3", marks=pytest.mark.s3)]
)
def test_two_processes_race_for_a_stale_lease(kind: str, holder: str, make_backend_target: Any, tmp_path: Path) -> None:
    """Two newcomers on one host: the store's compare-and-swap (on Drive, the root's lock on this
    VM) lets exactly one take the lease, whether the holder went silent or its process died."""
    target = make_backend_target(kind)
    if holder == "stale":
        Lease(target.open(), ttl=1.0).acquire()  # a live holder that never renews: stale after 1 s
    else:  # a holder process SIGKILLed on this host: taken at once, by both racers' judgement
        events = tmp_path / "holder.jsonl"
        dead = _child("hold", target, events, "--ttl", "30", "--max-seconds", "120")
        try:
            wait_event(events, dead, "acquired", 60)
        finally:
            _reap(dead)
    go = tmp_path / "go"
    files = [tmp_path / f"racer{i}.jsonl" for i in (1, 2)]
    procs = [_child("race", target, f, "--ttl", "1", "--wait", "3", "--hold", "4", "--go", str(go)) for f in files]
    try:
        for f, p in zip(files, procs, strict=True):
            wait_event(f, p, "ready", 60)
        go.touch()
        for p in procs:
            p.wait(60)
        outcomes = {e["event"]: e for f in files for e in read_events(f) if e["event"] in ("won", "held")}
        results = sorted(e["event"] for f in files for e in read_events(f) if e["event"] in ("won", "held"))
    finally:
        _reap(*procs)
    assert results == ["held", "won"], results
    winner, loser = outcomes["won"], outcomes["held"]
    assert winner["epoch"] == 2 and loser["holder"]["holder"]["nonce"] == winner["nonce"]
    final = read_lease(target.open())
    assert final is not None and final.holder.nonce == winner["nonce"] and final.epoch == 2


TAKEOVER: dict[str, float] = {}


def _watch_then_kill(
    target: Any, tmp_path: Path, *, ttl: float, host: str | None, stop: bool = False
) -> tuple[dict[str, Any], list[tuple[str, Any]], dict[str, Any], Path, subprocess.Popen[bytes]]:
    """A holder child (on another machine if ``host``) renewing while an in-process newcomer
    watches; then SIGKILLed (or SIGSTOPped with ``stop``). Returns (result, trace events, the
    holder's "acquired" event, its events file, its process); the caller reaps it."""
    events = tmp_path / "holder.jsonl"
    proc = _child("hold", target, events, "--ttl", str(ttl), "--max-seconds", "120", host=host)
    result: dict[str, Any] = {}
    trace = Trace(target.open())

    def newcomer() -> None:
        try:
            lease = trace.lease(ttl=ttl, wait_timeout=60)
            result["record"] = lease.acquire()
            result["t"] = time.monotonic()
            trace.events.append(("acquired", None))
            result["lease"] = lease
        except BaseException as exc:  # reported by the assertions below
            result["error"] = exc

    held = wait_event(events, proc, "acquired", 60)
    renewed = wait_event(events, proc, "renewed", 60)  # alive, and renewing
    assert renewed
    thread = threading.Thread(target=newcomer, daemon=True)
    thread.start()
    # The newcomer watches a live holder renewing: let it see at least one renewal.
    wait_for(lambda: sum(1 for k, _ in trace.events if k == "read") >= 2, 30, "the newcomer watching")
    trace.events.append(("kill", None))
    victim = inner_pid(proc) if host is not None else proc.pid
    os.kill(victim, signal.SIGSTOP if stop else signal.SIGKILL)
    result["t_dead"] = time.monotonic()
    thread.join(60)
    return result, list(trace.events), held, events, proc


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    ["local", "drive", pytest.param("gcs", marks=pytest.mark.gcs), pytest.param("s3", marks=pytest.mark.s3)],
)
def test_a_dead_holder_on_this_host_is_taken_over_at_once(kind: str, make_backend_target: Any, tmp_path: Path) -> None:
    """SIGKILL, as a crash or a kernel restart: same host, boot and pid namespace, process gone."""
    ttl = 30.0
    target = make_backend_target(kind)
    result, recorded, held, _, proc = _watch_then_kill(target, tmp_path, ttl=ttl, host=None)
    _reap(proc)
    assert "record" in result, result
    took = result["t"] - result["t_dead"]
    print(f"\nSAME-HOST TAKEOVER {kind}: holder SIGKILLed -> newcomer holds after {took:.2f} s (ttl {ttl:g} s)")
    assert (result["record"].epoch, result["record"].attempt) == (held["epoch"] + 1, 2)
    kill = recorded.index(("kill", None))
    assert not any(k == "replace" for k, _ in recorded[:kill])  # alive, it was not taken
    take = assert_took_over_at_once(recorded, ttl=ttl, record=result["record"])
    assert take > kill
    result["lease"].release()


@pytest.mark.slow
@needs_unshare
@pytest.mark.parametrize(
    "kind",
    ["local", "drive", pytest.param("gcs", marks=pytest.mark.gcs), pytest.param("s3", marks=pytest.mark.s3)],
)
def test_a_dead_holder_on_another_host_is_taken_over_after_about_one_ttl(
    kind: str, make_backend_target: Any, tmp_path: Path
) -> None:
    """What this host cannot check (another hostname and pid namespace) waits for the ttl rule."""
    ttl = 2.0
    target = make_backend_target(kind)
    result, recorded, held, _, proc = _watch_then_kill(target, tmp_path, ttl=ttl, host="other-vm")
    _reap(proc)
    assert "record" in result, result
    took = result["t"] - result["t_dead"]
    TAKEOVER[kind] = took  # reported, not asserted: a loaded machine is slower, not wrong
    print(f"\nTAKEOVER {kind}: holder on another host SIGKILLed -> newcomer holds after {took:.2f} s (ttl {ttl} s)")
    assert (result["record"].epoch, result["record"].attempt) == (held["epoch"] + 1, 2)
    kill = recorded.index(("kill", None))
    assert any(k == "read" for k, _ in recorded[:kill]) and not any(k == "replace" for k, _ in recorded[:kill])
    take = assert_took_over_by_the_rule(recorded, ttl=ttl, record=result["record"])
    assert take > kill
    result["lease"].release()


@pytest.mark.slow
@needs_unshare
def test_a_stopped_holder_in_another_namespace_is_not_broken_at_once_and_is_fenced_when_it_wakes(
    make_backend_target: Any, tmp_path: Path
) -> None:
    ttl = 2.0
    target = make_backend_target("local")
    result, recorded, held, events, proc = _watch_then_kill(target, tmp_path, ttl=ttl, host="other-vm", stop=True)
    try:
        assert "record" in result, result
        take = assert_took_over_by_the_rule(recorded, ttl=ttl, record=result["record"])  # a whole ttl watched
        assert take > recorded.index(("kill", None))
        os.kill(inner_pid(proc), signal.SIGCONT)
        wait_event(events, proc, "fenced", 60)  # its next renewal sees the newer epoch
        assert proc.wait(60) == 0
    finally:
        _reap(proc)
    final = read_lease(target.open())
    assert final is not None and final.holder == result["record"].holder and final.epoch == held["epoch"] + 1
    result["lease"].release()


@pytest.mark.slow
def test_a_live_holder_on_this_host_is_kept(make_backend_target: Any, tmp_path: Path) -> None:
    target = make_backend_target("local")
    events = tmp_path / "holder.jsonl"
    proc = _child("hold", target, events, "--ttl", "30", "--max-seconds", "120")
    try:
        wait_event(events, proc, "acquired", 60)
        with pytest.raises(LeaseHeldError) as info:
            Lease(target.open(), ttl=30, wait_timeout=1.0).acquire()
        assert "is alive" in str(info.value) and info.value.holder["holder"]["pid"] == proc.pid
        os.kill(proc.pid, signal.SIGSTOP)  # stopped is not dead
        with pytest.raises(LeaseHeldError):
            Lease(target.open(), ttl=30, wait_timeout=1.0).acquire()
        os.kill(proc.pid, signal.SIGCONT)
        assert not [e for e in read_events(events) if e["event"] == "fenced"]
    finally:
        _reap(proc)


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"])


def test_identity_judges_pid_reuse_a_stopped_process_and_a_zombie() -> None:
    me = this_process()
    assert me.boot_id and me.pid_ns and me.start_time
    assert judge_holder(me.host, me.pid, me.boot_id, me.pid_ns, me.start_time)[0] is Liveness.ALIVE
    # pid reuse: a live pid whose start time is not the recorded one is another process
    verdict, why = judge_holder(me.host, me.pid, me.boot_id, me.pid_ns, me.start_time - 1)
    assert verdict is Liveness.DEAD and "another process" in why
    # what this host cannot check: another host, another boot, another pid namespace, an old record
    assert judge_holder("other-vm", me.pid, me.boot_id, me.pid_ns, 1)[0] is Liveness.UNKNOWN
    assert judge_holder(me.host, me.pid, "another-boot", me.pid_ns, 1)[0] is Liveness.UNKNOWN
    assert judge_holder(me.host, me.pid, me.boot_id, "pid:[1]", 1)[0] is Liveness.UNKNOWN
    assert judge_holder(me.host, me.pid, None, None, None)[0] is Liveness.UNKNOWN
    child = _sleeper()
    try:
        started = _start_time(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        assert judge_holder(me.host, child.pid, me.boot_id, me.pid_ns, started)[0] is Liveness.ALIVE
        os.kill(child.pid, signal.SIGKILL)
        wait_for(lambda: Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1][0] == "Z", 30, "a zombie")
        verdict, why = judge_holder(me.host, child.pid, me.boot_id, me.pid_ns, started)  # not reaped yet
        assert verdict is Liveness.DEAD and "zombie" in why
        child.wait(10)
        verdict, why = judge_holder(me.host, child.pid, me.boot_id, me.pid_ns, started)
        assert verdict is Liveness.DEAD and "no longer exists" in why
    finally:
        _reap(child)


def _start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])


def _record_for(backend: Any, *, pid: int, start_time: int | None, host: str | None = None) -> LeaseRecord:
    me = this_process()
    record = LeaseRecord(
        run_id="r",
        attempt=1,
        epoch=3,
        renewals=0,
        ttl=30.0,
        settle=0.0,
        holder=LeaseHolder(
            host=host or me.host,
            pid=pid,
            nonce="0123456789abcdef",
            boot_id=me.boot_id if start_time is not None else None,
            pid_ns=me.pid_ns if start_time is not None else None,
            start_time=start_time,
        ),
        acquired_at="2026-12-05T10:00:00.000000Z",
        renewed_at="2026-12-05T10:00:00.000000Z",
    )
    backend.write(LEASE_KEY, record.to_json())
    return record


def test_a_record_naming_a_reused_pid_is_taken_at_once_a_live_one_is_not(backend: Any) -> None:
    child = _sleeper()
    try:
        started = _start_time(child.pid)
        ft = FakeTime()
        _record_for(backend, pid=child.pid, start_time=started)  # that very process: alive
        with pytest.raises(LeaseHeldError):
            fake_lease(backend, ft, ttl=30, wait_timeout=0).acquire()
        _record_for(backend, pid=child.pid, start_time=started - 7)  # the pid now belongs to another process
        t0 = ft.now
        record = fake_lease(backend, ft, ttl=30, wait_timeout=0).acquire()
        assert ft.now == t0 and record.epoch == 4  # no wait, no settle
    finally:
        _reap(child)


def test_an_old_record_without_the_new_fields_waits_for_the_ttl(backend: Any) -> None:
    child = _sleeper()
    child.kill()
    child.wait(10)  # a pid that no longer exists, but the record cannot prove it was that process
    ft = FakeTime()
    _record_for(backend, pid=child.pid, start_time=None)
    t0 = ft.now
    record = fake_lease(backend, ft, ttl=5).acquire()
    assert ft.now - t0 >= 30 and record.epoch == 4  # the holder's recorded ttl, watched whole
