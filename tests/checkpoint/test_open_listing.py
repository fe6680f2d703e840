"""Opening a writer and its first restore share one listing of the root (stores with compare-and-swap).

The listing is taken once the lease is held, so it shows what a restore's own listing would; it
is used by the first restore only, never after a save or a scan; and a root whose LEASE.json and
lineage records were lost still never sees an epoch used twice (the lease moves up first).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, TrainState
from ckptsdk.checkpoint.reading.catalog import scan
from ckptsdk.errors import LeaseError, LeaseLostError
from ckptsdk.format.layout import LINEAGE_PREFIX, checkpoint_dir
from ckptsdk.lease.acquire import Lease
from ckptsdk.lease.record import LEASE_KEY, parse_lease
from ckptsdk.manager import Simulation
from ckptsdk.testing.counting import CountingBackend

NO_HEARTBEAT = Simulation(heartbeat=False)


def _state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _weights(state: TrainState) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.objects["model"].state_dict().items()}


def _open(backend: Any) -> CheckpointManager:
    return CheckpointManager(
        backend, keep_last=10, lease_options=LeaseOptions(ttl=60, settle=0.05), _simulation=NO_HEARTBEAT
    )


@pytest.mark.parametrize("kind", ["memory", "local", "drive", pytest.param("gcs", marks=pytest.mark.gcs)])
def test_opening_and_restoring_a_writer_lists_the_root_once(kind: str, make_backend_target: Callable[..., Any]) -> None:
    target = make_backend_target(kind)
    saved = _state(0)
    with _open(target.open()) as mgr:
        assert mgr.restore(saved) is None
        for step in (1, 2, 3):
            mgr.save(saved, step=step)
    backend = CountingBackend(target.open())
    live = _state(1)
    with _open(backend) as mgr:
        point = mgr.restore(live)
    assert point is not None and point.step == 3
    assert all(torch.equal(a, b) for a, b in zip(_weights(live).values(), _weights(saved).values(), strict=True))
    # The root's listing of checkpoint folders: all their files, or (where the store names its
    # folders) their names, each folder's files listed when the restore reaches it.
    listings = [i for i, (op, key) in enumerate(backend.ops) if op in ("list", "list_folders") and key == "step-"]
    taken = next(i for i, (op, key) in enumerate(backend.ops) if key == LEASE_KEY and op in ("create", "replace"))
    if backend.capabilities.compare_and_swap:
        # One listing, after the lease is ours: a previous holder commits nothing past it but
        # what the lineage orphans.
        assert len(listings) == 1 and listings[0] > taken, backend.ops
    else:
        # Drive: listed before the lease (its epoch floor), again by the restore, which sees
        # more of the other machines' late writes, and by its fences (the listing is one there).
        assert listings[0] < taken < listings[1], backend.ops


@pytest.mark.parametrize("blocking", [True, False])
def test_a_restore_after_a_save_reads_a_new_listing(blocking: bool, make_backend_target: Callable[..., Any]) -> None:
    target = make_backend_target("memory")
    with _open(target.open()) as mgr:
        mgr.save(_state(0), step=1)
    newer = _state(2)
    with _open(target.open()) as mgr:
        mgr.save(newer, step=7, blocking=blocking)  # the open's listing knows only step 1
        live = _state(3)
        point = mgr.restore(live)
    assert point is not None and point.step == 7
    assert all(torch.equal(a, b) for a, b in zip(_weights(live).values(), _weights(newer).values(), strict=True))


def test_a_restore_after_gc_reads_a_new_listing(make_backend_target: Callable[..., Any]) -> None:
    target = make_backend_target("memory")
    with _open(target.open()) as mgr:
        for step in (1, 2, 3):
            mgr.save(_state(step), step=step)
    with _open(target.open()) as mgr:
        report = mgr.gc(keep_last=1)  # the open's listing still shows steps 1 and 2
        assert report.deleted, report
        point = mgr.restore(_state(9))
    assert point is not None and point.step == 3


def _three_writers(root: Path) -> None:
    """Steps 1, 2, 3 by writers of epochs 1, 2, 3 (each closes: the next takes over at once)."""
    for step in (1, 2, 3):
        with _open(str(root)) as mgr:
            state = _state(step)
            mgr.restore(state)
            mgr.save(state, step=step)


def test_a_root_that_lost_its_lease_takes_its_epoch_from_the_lineage_records(tmp_path: Path, caplog: Any) -> None:
    root = tmp_path / "root"
    _three_writers(root)
    (root / LEASE_KEY).unlink()
    caplog.set_level(logging.INFO, logger="ckptsdk")
    with _open(str(root)) as mgr:
        assert mgr.lease.epoch == 4
        assert mgr.restore(_state(9)).step == 3
        mgr.save(_state(9), step=4)
    assert (root / checkpoint_dir(4, 4) / "manifest.json").is_file()
    assert "takes epoch" not in caplog.text  # no second write of the lease was needed


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_a_root_that_lost_its_lease_and_lineage_never_reuses_an_epoch(
    kind: str, make_backend_target: Callable[..., Any], caplog: Any
) -> None:
    target = make_backend_target(kind)
    for step in (1, 2, 3):
        with _open(target.open()) as mgr:
            state = _state(step)
            mgr.restore(state)
            mgr.save(state, step=step)
    store = target.open()
    store.delete(LEASE_KEY)
    for obj in store.list(LINEAGE_PREFIX):
        store.delete(obj.key)
    caplog.set_level(logging.WARNING, logger="ckptsdk")
    with _open(target.open()) as mgr:
        # The names show epoch 3: the lease, taken at epoch 1, moved up before any write.
        assert mgr.lease.epoch == 4
        assert parse_lease(store.read(LEASE_KEY)).epoch == 4
        state = _state(9)
        point = mgr.restore(state)
        assert point is not None and point.step == 3
        mgr.save(state, step=4)
    assert "this writer takes epoch 4" in caplog.text
    # Nothing lost (step 3 lives on as this writer's anchor, its original dropped at the save)
    # and the new name is epoch 4's.
    restorable = scan(store).restorable()
    assert sorted(c.step for c in restorable) == [1, 2, 3, 4]
    assert next(c for c in restorable if c.step == 4).key == checkpoint_dir(4, 4)


def test_raise_epoch_after_a_takeover_fences_and_writes_nothing(make_backend_target: Callable[..., Any]) -> None:
    store = make_backend_target("memory").open()
    ours = Lease(store, ttl=60)
    ours.acquire()
    rival = Lease(store, ttl=60, force=True)
    rival.acquire()
    theirs = store.read(LEASE_KEY)
    with pytest.raises(LeaseLostError):
        ours.raise_epoch(ours.epoch + 5)
    assert store.read(LEASE_KEY) == theirs  # the rival's record stands
    assert ours.fenced
    rival.release()


def test_raise_epoch_is_refused_without_compare_and_swap(make_backend_target: Callable[..., Any]) -> None:
    store = make_backend_target("drive").open()
    lease = Lease(store, ttl=60, settle=0.0)
    lease.acquire()
    record = store.read(LEASE_KEY)
    with pytest.raises(LeaseError, match="compare-and-swap"):
        lease.raise_epoch(lease.epoch + 1)
    assert store.read(LEASE_KEY) == record
    lease.release()
