"""Lineage regressions: the faults the lineage machine found, each as its smallest story.

All were fixed in de3dc83; each test says what went wrong before. Single-threaded stories on
tests/support/drive_deterministic_sim.py (or the memory backend) with a fake clock, using the machine's
``Weights``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ckptsdk import LeaseOptions, SaveOptions
from ckptsdk.backends.memory import MemoryBackend
from ckptsdk.errors import LeaseLostError
from ckptsdk.manager import CheckpointManager, Simulation
from tests.support.drive_deterministic_sim import FakeClock, FrozenBackend, SimDrive
from tests.support.lineage_machine import Rank, Weights, folder_name


def _sim_manager(
    sim: SimDrive, vm: str, *, beating: tuple[CheckpointManager, ...] = (), force: bool = False, **kw: Any
) -> CheckpointManager:
    """A writer on ``vm`` whose lease sleeps by letting simulated time pass (single-threaded);
    while it sleeps, the writers in ``beating`` renew their leases every 50 s (their heartbeats)."""
    if vm not in sim.views:
        sim.add_vm(vm)
    return CheckpointManager(
        sim.backend(vm),
        keep_last=1,
        lease_options=LeaseOptions(ttl=300.0, force=force),
        _simulation=Simulation(heartbeat=False, clock=sim.clock, sleep=lambda dt: _beat(sim, beating, dt)),
        run_id="run",
        **kw,
    )


def _beat(sim: SimDrive, writers: tuple[CheckpointManager, ...], seconds: float, every: float = 50.0) -> None:
    """``seconds`` pass on ``sim``; every ``every`` s each unfenced writer renews its lease (a
    renewal that finds a higher writer fences that writer: what its heartbeat would do)."""
    end = sim.now + seconds
    while sim.now < end:
        sim.advance_to(min(end, sim.now + every))
        for m in writers:
            assert m.lease is not None
            if not m.lease.fenced:
                try:
                    m.lease.renew()
                except LeaseLostError:
                    pass


def _rank(mgr: CheckpointManager) -> Rank:
    """The rank a Drive writer must carry in its names: (lease epoch, nonce[:8])."""
    assert mgr.lease is not None and mgr.lease.record is not None
    return mgr.lease.epoch, mgr.lease.record.holder.nonce[:8]


def _nonces(monkeypatch: pytest.MonkeyPatch, *prefixes: str) -> None:
    """The lease nonces of the next acquisitions, in order (so a story fixes which writer of a
    shared epoch ranks higher; real nonces are random uuids)."""
    from ckptsdk.lease import acquire as lease_module

    it = iter(prefixes)
    monkeypatch.setattr(
        lease_module, "uuid", SimpleNamespace(uuid4=lambda: SimpleNamespace(hex=(next(it) * 8)[:8] + "0" * 24))
    )


def _the_higher_rank_wins(
    sim: SimDrive,
    first: CheckpointManager,
    second: CheckpointManager,
    step: int,
    gap: float,
    *,
    low_fenced_early: bool = False,
) -> None:
    """Two writers that took the same epoch on Drive: both save ``step`` under distinct names
    (unless the lower one has already seen the higher one: ``low_fenced_early``, then that save
    raises LeaseLostError); once each has seen the other's writes (``gap`` seconds of
    heartbeats), the lower-ranked one's next save raises LeaseLostError, none of the higher
    one's checkpoints is gone, and a reader on a fresh VM restores the higher one's newest."""
    assert first.lease is not None and second.lease is not None
    # The story still produces a shared epoch (else this test no longer tests rank ordering).
    assert first.lease.epoch == second.lease.epoch and _rank(first) != _rank(second)
    (high_uid, high), (low_uid, low) = sorted(((1, first), (2, second)), key=lambda p: _rank(p[1]), reverse=True)
    keys = {}
    for uid, m in ((1, first), (2, second)):
        if m is low and low_fenced_early:
            with pytest.raises(LeaseLostError):
                m.save(Weights(uid, step), step=step)
            continue
        keys[uid] = m.save(Weights(uid, step), step=step).key
        assert keys[uid] == folder_name(step, _rank(m)), f"{keys[uid]} does not carry the rank {_rank(m)}"
    assert len(set(keys.values())) == len(keys)  # the folder names differ
    high_keys = {c.key for c in high.list() if c.rank == _rank(high) and c.valid}
    assert keys[high_uid] in high_keys
    _beat(sim, (first, second), gap)
    for uid, key in keys.items():  # each VM has seen the other writer's checkpoint
        other = second if uid == 1 else first
        assert sim.backend(other.backend.vm).exists(f"{key}/manifest.json")  # type: ignore[attr-defined]
    assert high.lease is not None and not high.lease.fenced, high.lease.record
    with pytest.raises(LeaseLostError):
        low.save(Weights(low_uid, step + 10), step=step + 10)
    _beat(sim, (high,), gap)
    converged = CheckpointManager(FrozenBackend(sim.converged_cloud()), read_only=True).list()
    valid = {c.key for c in converged if c.valid}
    assert high_keys <= valid, f"the higher writer lost {sorted(high_keys - valid)}"
    assert not any(c.key == folder_name(step + 10, _rank(low)) for c in converged), "the fenced writer committed"
    assert high.save(Weights(high_uid, step + 10), step=step + 10).committed
    _beat(sim, (high,), gap)
    sim.add_vm("reader")
    state = Weights(0, 0)
    rp = CheckpointManager(sim.backend("reader"), read_only=True).restore(state)
    assert rp is not None and rp.key == folder_name(step + 10, _rank(high)) and state.payload == (high_uid, step + 10)


@pytest.mark.parametrize("higher", ["first", "second"])
def test_two_newcomers_sharing_an_epoch_on_late_drive_are_ordered_by_rank(
    monkeypatch: pytest.MonkeyPatch, higher: str
) -> None:
    """Changes 400 s late (> settle 60 s): two newcomers that take over a dead writer one after
    the other on two VMs both become epoch 2. Before de3dc83 their folders (step-N.e2) collided
    and either one's rotation deleted the other's checkpoints; now names carry the nonce and the
    lower rank steps back."""
    _nonces(monkeypatch, "1", "9" if higher == "first" else "5", "5" if higher == "first" else "9")
    sim = SimDrive(delay=lambda hop, key: 400.0)
    w1 = _sim_manager(sim, "vm1")
    managers = [w1]
    try:
        assert w1.restore(Weights(1, 0)) is None
        w1.save(Weights(1, 10), step=10)
        sim.advance_to(sim.now + 1000)  # everything propagated; then W1's VM vanishes
        w2 = _sim_manager(sim, "vm2")  # watches W1's silent lease for a ttl, takes over
        managers.append(w2)
        assert w2.restore(Weights(2, 0)) is not None  # step 10, anchored under W2's rank
        w2.wait()
        w3 = _sim_manager(sim, "vm3", beating=(w2,))  # W2's records are still in flight to vm3
        managers.append(w3)
        assert w3.restore(Weights(3, 0)) is not None
        w3.wait()
        _the_higher_rank_wins(sim, w2, w3, step=20, gap=1000.0)
    finally:
        for m in managers:  # a dead VM closes nothing (and runs no exit handler)
            m._shutdown._closed = True


def test_restore_after_being_taken_over_commits_nothing() -> None:
    """A writer taken over between opening and restoring: restore() renews the lease and looks
    for newer writers before it records lineage or anchors (before de3dc83 it committed
    step-N.e<old> after the takeover)."""
    clock = FakeClock()
    name = f"lineage-restore-{id(clock)}"
    backend = MemoryBackend(name)
    managers: list[CheckpointManager] = []
    try:

        def open_writer(force: bool = False) -> CheckpointManager:
            m = CheckpointManager(
                backend,
                keep_last=2,
                lease_options=LeaseOptions(ttl=60.0, force=force),
                _simulation=Simulation(
                    heartbeat=False, clock=clock, sleep=lambda dt: setattr(clock, "now", clock.now + dt)
                ),
                run_id="run",
            )
            managers.append(m)
            return m

        w1 = open_writer()
        w1.restore(Weights(1, 0))
        w1.save(Weights(1, 10), step=10)
        w1._shutdown._closed = True  # dies
        clock.now += 61.0
        w2 = open_writer()  # epoch 2 (takes over after a ttl of silence), does not restore yet
        w3 = open_writer(force=True)  # epoch 3 takes over from W2
        assert w3.restore(Weights(3, 0)) is not None
        w3.wait()
        with pytest.raises(LeaseLostError):
            w2.restore(Weights(2, 0))  # W2 is stale: epoch 3 holds the lease and wrote lineage
        w2.wait()
        assert not backend.exists("step-0000000010.e2/manifest.json"), "the stale writer committed an anchor"
        assert not backend.exists("lineage/epoch-000002.json"), "the stale writer recorded a lineage"
        state = Weights(0, 0)
        rp = CheckpointManager(backend, read_only=True).restore(state)
        assert rp is not None and rp.key == "step-0000000010.e3" and state.payload == (1, 10)
    finally:
        for m in managers:
            m._shutdown._closed = True
        MemoryBackend.discard_store(name)


def test_gc_on_another_vm_spares_a_checkpoint_still_uploading() -> None:
    """On Drive a checkpoint whose manifest arrived before its tensor file looks torn on other
    VMs; gc there must keep it (before de3dc83 it deleted the live writer's newest)."""
    sim = SimDrive(delay=lambda hop, key: 400.0 if key.endswith("tensors.safetensors") else 0.0)
    w1 = _sim_manager(sim, "vm1")
    try:
        w1.restore(Weights(1, 0))
        key = w1.save(Weights(1, 10), step=10).key
        assert key == folder_name(10, _rank(w1))
        sim.add_vm("vm2")
        sim.advance_to(sim.now + 1)  # the manifest is everywhere, the tensor file still uploading
        other = CheckpointManager(sim.backend("vm2"), read_only=True)
        assert [c.valid for c in other.list()] == [False]  # torn, as vm2 sees it
        report = other.gc()
        assert key not in report.deleted, report.reasons
        sim.advance_to(sim.now + 1000)
        state = Weights(0, 0)
        rp = CheckpointManager(sim.backend("vm2"), read_only=True).restore(state)
        assert rp is not None and rp.key == key and state.payload == (1, 10)
    finally:
        w1._shutdown._closed = True


def test_rotation_on_drive_keeps_a_checkpoint_when_the_vm_vanishes_mid_upload() -> None:
    """Rotation deletes are tiny and reach Drive long before a checkpoint's tensor file; if the
    VM then vanishes, the predecessor must still be there (before de3dc83 nothing was left)."""
    sim = SimDrive(delay=lambda hop, key: 200.0 if key.endswith("tensors.safetensors") else 1.0)
    w1 = _sim_manager(sim, "vm1")  # keep_last=1
    try:
        w1.restore(Weights(1, 0))
        key10 = w1.save(Weights(1, 10), step=10).key
        sim.advance_to(sim.now + 250)  # step 10 is on Drive, complete (and W1's lease is < ttl old)
        w1.save(Weights(1, 20), step=20)  # Drive rotates one save late: step 10 stays
        sim.advance_to(sim.now + 10)  # small changes reached Drive; step 20's tensors still uploading
        assert sim.lose_vm("vm1") > 0
    finally:
        w1._shutdown._closed = True
    sim.add_vm("vm2")
    sim.advance_to(sim.now + 1000)
    state = Weights(0, 0)
    rp = CheckpointManager(sim.backend("vm2"), read_only=True).restore(state)
    assert rp is not None and rp.key == key10 and state.payload == (1, 10)


@pytest.mark.parametrize("higher", ["first", "second"])
def test_a_renewal_during_the_settle_cannot_make_two_writers_collide(
    monkeypatch: pytest.MonkeyPatch, higher: str
) -> None:
    """Every change 20 s per hop (40 s < settle 60 s): a stale holder's heartbeat renewal made
    during a newcomer's settle lands after the newcomer's read-back and hides its epoch-2 record
    on the holder's VM; a third writer there takes epoch 2 again. They share an epoch, not a
    rank: names stay apart and the lower rank steps back (before de3dc83 they collided)."""
    _nonces(monkeypatch, "1", "9" if higher == "first" else "5", "5" if higher == "first" else "9")
    sim = SimDrive(delay=lambda hop, key: 20.0)
    w3 = _sim_manager(sim, "vm2")  # the holder, epoch 1, heartbeating
    managers = [w3]
    try:
        w3.restore(Weights(3, 0))
        sim.advance_to(sim.now + 100)
        assert w3.lease is not None

        def settle_with_a_renewal(dt: float) -> None:
            sim.advance_to(sim.now + 30)
            w3.lease.renew()  # type: ignore[union-attr]  # vm2 does not see epoch 2 yet (at +40)
            sim.advance_to(sim.now + dt - 30)

        sim.add_vm("vm3")
        w4 = CheckpointManager(
            sim.backend("vm3"),
            keep_last=1,
            lease_options=LeaseOptions(ttl=300.0, force=True),
            run_id="run",
            _simulation=Simulation(heartbeat=False, clock=sim.clock, sleep=settle_with_a_renewal),
        )
        managers.append(w4)
        sim.advance_to(sim.now + 1)
        w5 = _sim_manager(sim, "vm2", force=True)  # on the holder's VM, which still shows epoch 1
        managers.append(w5)
        if higher == "second":
            # W5's record, newer and of a higher nonce, reaches vm3 (two 20 s hops; nobody waits
            # for a settle now): W4 sees it when restore() renews, and stops before recording any
            # lineage.
            sim.advance_to(sim.now + 41)
            with pytest.raises(LeaseLostError):
                w4.restore(Weights(0, 0))
            assert not sim.backend("vm3").exists(f"lineage/epoch-000002.{_rank(w4)[1]}.json")
        else:
            assert w4.restore(Weights(0, 0)) is None  # nothing saved yet: a fresh start
        assert w5.restore(Weights(0, 0)) is None
        _the_higher_rank_wins(sim, w4, w5, step=10, gap=200.0, low_fenced_early=higher == "second")
    finally:
        for m in managers:
            m._shutdown._closed = True


@pytest.mark.parametrize("kind", ["local", "drive"])
def test_a_fresh_start_after_a_longer_run_keeps_its_own_first_checkpoint(kind, tmp_path, monkeypatch) -> None:
    """Found by the deep lineage profile (2026-12-02): a writer that starts fresh (no restore) on a
    root whose last run reached step 50 saves step 10. Its catalog, listed at that first save
    before its lineage record existed, still showed steps 40 and 50 as part of its lineage, so its
    rotation (keep_last=2) let its own step 10 go; the record then made 40 and 50 orphans, and a
    reader restored nothing at all. Now only what the record keeps in the lineage is judged."""
    import torch

    from ckptsdk import TrainState

    if kind == "drive":
        monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path))
        url = "drive://run"
    else:
        url = str(tmp_path / "run")

    def state(seed: int) -> TrainState:
        torch.manual_seed(seed)
        return TrainState(model=torch.nn.Linear(4, 4))

    kw: dict[str, Any] = dict(
        keep_last=2, lease_options=LeaseOptions(ttl=5, settle=0), save_options=SaveOptions(on_signal=False)
    )
    with CheckpointManager(url, **kw) as first:
        s = state(0)
        assert first.restore(s) is None
        for step in (10, 20, 30, 40, 50):
            first.save(s, step=step, blocking=True)
    with CheckpointManager(url, **kw) as resumed:
        assert resumed.restore(state(1)).step == 50
    fresh = state(2)
    expected = {k: v.clone() for k, v in fresh.objects["model"].state_dict().items()}
    with CheckpointManager(url, **kw) as again:  # no restore: a new lineage from scratch
        again.save(fresh, step=10, blocking=True)
        epoch = again.lease.epoch
    back = state(3)
    got = CheckpointManager(url, read_only=True).restore(back)
    assert got is not None and got.step == 10
    for name, value in back.objects["model"].state_dict().items():
        assert torch.equal(value, expected[name]), name
    from ckptsdk import open_backend
    from ckptsdk.checkpoint.reading.catalog import scan

    cat = scan(open_backend(url))
    assert [(c.step, c.epoch) for c in cat.restorable()] == [(10, epoch)]
    assert {c.step for c in cat.checkpoints if c.orphan} >= {40, 50}  # orphans, left to gc: nothing deleted


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_a_writer_fenced_before_its_first_save_records_no_fresh_start(kind, tmp_path) -> None:
    """Found by the deep lineage profile (2026-12-06): W1 commits step 10 and closes; W2 opens and
    does not restore; W3 opens with force (epoch 3); W2 saves. Its first save recorded W2's lineage
    ("epoch 2 started fresh") after a check that does no I/O, and only the commit's renewal found
    epoch 3: a record of a writer already superseded, saying the run started over, beside a
    takeover that resumed step 10. Now the record is written only after the lease is confirmed."""
    clock = FakeClock()
    name = f"lineage-fenced-fresh-{id(clock)}"
    backend: Any = MemoryBackend(name) if kind == "memory" else str(tmp_path / "run")
    managers: list[CheckpointManager] = []
    try:

        def open_writer(force: bool = False) -> CheckpointManager:
            m = CheckpointManager(
                backend,
                keep_last=1,
                lease_options=LeaseOptions(ttl=60.0, force=force),
                _simulation=Simulation(
                    heartbeat=False, clock=clock, sleep=lambda dt: setattr(clock, "now", clock.now + dt)
                ),
                run_id="run",
            )
            managers.append(m)
            return m

        w1 = open_writer()
        assert w1.restore(Weights(1, 0)) is None
        w1.save(Weights(1, 10), step=10, blocking=True)
        w1.close()
        w2 = open_writer()  # takes the released lease (epoch 2), restores nothing
        w3 = open_writer(force=True)  # epoch 3
        with pytest.raises(LeaseLostError):
            w2.save(Weights(2, 10), step=10, blocking=True)
        store = w3._writer.backend
        assert not store.exists("lineage/epoch-000002.json"), "the superseded writer recorded a fresh start"
        assert not store.exists("step-0000000010.e2/manifest.json")
        state = Weights(0, 0)
        rp = w3.restore(state)
        assert rp is not None and rp.step == 10 and state.payload == (1, 10)
        w3.close()
        state = Weights(0, 0)
        rp = CheckpointManager(backend, read_only=True).restore(state)
        assert rp is not None and rp.step == 10 and state.payload == (1, 10)  # nothing lost
    finally:
        for m in managers:
            m._shutdown._closed = True
        if kind == "memory":
            MemoryBackend.discard_store(name)
