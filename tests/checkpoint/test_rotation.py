"""Rotation on its own: what retention lets go, deleting it manifest first, gc, and the fence.

Roots are written by a real :class:`~ckptsdk.CheckpointManager` (heartbeat off) on ``memory://``
or a Drive folder under ``tmp_path``; a crash inside a delete is a :class:`SimulatedCrash` from
the shipped fault injector. Each failure-path test checks what is left, not only what is raised.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, TrainState
from ckptsdk.backends import open_backend
from ckptsdk.backends.base import Backend
from ckptsdk.backends.memory import MemoryBackend
from ckptsdk.checkpoint.pruning.rotation import Rotation
from ckptsdk.checkpoint.reading.catalog import CheckpointInfo, scan
from ckptsdk.checkpoint.reading.reader import CheckpointReader
from ckptsdk.errors import LeaseLostError
from ckptsdk.manager import Simulation
from ckptsdk.testing import FaultyBackend, SimulatedCrash, fail_nth


def _state() -> TrainState:
    torch.manual_seed(0)
    return TrainState(model=torch.nn.Linear(4, 3))


def _writer(url: str, **kw: object) -> CheckpointManager:
    return CheckpointManager(url, keep_last=10, _simulation=Simulation(heartbeat=False), **kw)  # type: ignore[arg-type]


@pytest.fixture
def url() -> Iterator[str]:
    store = f"rotation-{uuid.uuid4().hex}"
    yield f"memory://{store}"
    MemoryBackend.discard_store(store)


def _saved(url: str, steps: list[int], **kw: object) -> Backend:
    mgr = _writer(url, **kw)
    state = _state()
    for step in steps:
        mgr.save(state, step=step)
    mgr.close()
    return open_backend(url)


def _keys(backend: Backend) -> list[str]:
    return sorted(o.key for o in backend.list("step-"))


def test_an_unknown_mode_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="'bogus'"):
        Rotation(open_backend(url), keep_last=1, keep_every=None, mode="bogus")


def test_beyond_retention_keeps_last_milestones_and_the_protected(url: str) -> None:
    backend = _saved(url, [100, 200, 300, 400, 500, 600])
    mine = scan(backend).checkpoints
    by_last = Rotation(backend, keep_last=2, keep_every=None).beyond_retention(mine, 2)
    assert [c.step for c in by_last] == [100, 200, 300, 400]
    with_every = Rotation(backend, keep_last=2, keep_every=300).beyond_retention(mine, 2, protected=[100])
    assert [c.step for c in with_every] == [200, 400]
    assert Rotation(backend, keep_last=2, keep_every=None).beyond_retention([], 2) == []


def test_every_folder_of_a_step_shares_its_fate(url: str) -> None:
    backend = _saved(url, [100, 200, 300])
    mine = scan(backend).checkpoints
    copy = CheckpointInfo(step=100, epoch=2, key="step-0000000100.e2", size=1, committed=True, valid=True)
    doomed = Rotation(backend, keep_last=2, keep_every=None).beyond_retention([*mine, copy], 2)
    assert sorted(c.key for c in doomed) == ["step-0000000100.e1", "step-0000000100.e2"]


def test_delete_goes_manifest_first_so_a_crash_leaves_no_torn_checkpoint(url: str) -> None:
    backend = _saved(url, [10, 20])
    before = _keys(backend)
    faulty = FaultyBackend(backend, fail_on=fail_nth("delete", 2, SimulatedCrash))
    rotation = Rotation(faulty, keep_last=1, keep_every=None)  # type: ignore[arg-type]
    (oldest,) = scan(backend).find(10)
    with pytest.raises(SimulatedCrash):
        rotation.delete(oldest)
    assert [key for op, key in faulty.log if op == "delete"] == [
        "step-0000000010.e1/manifest.json",
        "step-0000000010.e1/tensors.safetensors",
    ]
    # The checkpoint stopped existing at once (no manifest): what is left is an uncommitted
    # folder, never restorable and never a corrupt checkpoint; step 20 is untouched.
    assert _keys(backend) == [k for k in before if k != "step-0000000010.e1/manifest.json"]
    (left,) = scan(backend).find(10)
    assert not left.committed and not left.valid
    assert CheckpointReader(backend).verify(20).step == 20
    # Deleting again finishes the job; deletion is idempotent.
    Rotation(backend, keep_last=1, keep_every=None).delete(left)
    Rotation(backend, keep_last=1, keep_every=None).delete(left)
    assert _keys(backend) == [k for k in before if k.startswith("step-0000000020.e1/")]


def _damaged_root(url: str, **kw: object) -> Backend:
    """Steps 10..50 of epoch 1; step 30 torn; an uncommitted folder of step 60."""
    backend = _saved(url, [10, 20, 30, 40, 50], **kw)
    torn = scan(backend).find(30)[0].key
    backend.delete(f"{torn}/tensors.safetensors")
    backend.write(f"{torn.replace('0000000030', '0000000060')}/tensors.safetensors", b"a crashed save")
    return backend


def test_gc_dry_run_reports_and_removes_nothing(url: str) -> None:
    backend = _damaged_root(url)
    before = _keys(backend)
    report = Rotation(backend, keep_last=2, keep_every=None).gc(scan(backend), dry_run=True, grace=0.0)
    assert report.dry_run
    assert report.deleted == [
        "step-0000000010.e1",
        "step-0000000020.e1",
        "step-0000000030.e1",
        "step-0000000060.e1",
    ]
    assert report.reasons["step-0000000030.e1"] == "torn: tensors.safetensors is missing"
    assert report.reasons["step-0000000010.e1"] == "beyond keep_last=2"
    assert report.reasons["step-0000000060.e1"].startswith("uncommitted")
    assert report.sizes["step-0000000060.e1"] == len(b"a crashed save")
    assert report.trash_bytes is None  # memory has no trash
    assert _keys(backend) == before


def test_gc_removes_what_it_reported_and_keeps_the_newest_readable(url: str) -> None:
    backend = _damaged_root(url)
    dry = Rotation(backend, keep_last=2, keep_every=None).gc(scan(backend), dry_run=True, grace=0.0)
    report = Rotation(backend, keep_last=2, keep_every=None).gc(scan(backend), grace=0.0)
    assert report.deleted == dry.deleted and not report.dry_run
    assert [c.key for c in scan(backend).checkpoints] == ["step-0000000040.e1", "step-0000000050.e1"]
    reader = CheckpointReader(backend)
    assert reader.verify(50).step == 50 and reader.verify(40).step == 40


def test_gc_keeps_uncommitted_folders_inside_the_grace(url: str) -> None:
    backend = _damaged_root(url)
    report = Rotation(backend, keep_last=2, keep_every=None).gc(scan(backend), grace=3600.0)
    assert "step-0000000060.e1" not in report.deleted
    assert backend.exists("step-0000000060.e1/tensors.safetensors")


def test_gc_on_drive_keeps_torn_checkpoints_and_counts_the_trash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path))
    # settle=0: one writer, nothing to wait for (the settle guards against another VM).
    backend = _damaged_root("drive://run", lease_options=LeaseOptions(settle=0.0))
    assert not backend.capabilities.immediately_consistent and backend.capabilities.trash_on_delete
    cat = scan(backend)
    folder = {step: cat.find(step)[0].key for step in (10, 20, 30, 40, 50)}
    assert folder[30].startswith("step-0000000030.e1.")  # Drive names carry the writer's tag
    report = Rotation(backend, keep_last=1, keep_every=None).gc(cat, dry_run=True, grace=0.0)
    # A torn-looking checkpoint may still be uploading from another VM: gc leaves it.
    assert folder[30] not in report.deleted
    # One save late on Drive: keep_last=1 keeps two steps (40 and 50).
    assert report.reasons[folder[20]] == "beyond keep_last=1 (+1: on this store rotation runs one save late)"
    assert folder[40] not in report.deleted and folder[50] not in report.deleted
    assert report.trash_bytes == sum(report.sizes.values()) > 0


def test_recycle_acts_only_where_the_store_rewrites_in_place(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not Rotation(open_backend(url), keep_last=1, keep_every=None, mode="recycle").recycles
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path))
    assert Rotation(open_backend("drive://run"), keep_last=1, keep_every=None, mode="recycle").recycles
    assert not Rotation(open_backend("drive://run"), keep_last=1, keep_every=None, mode="delete").recycles


def test_rotate_deletes_only_beyond_retention_of_its_own_lineage(url: str) -> None:
    mgr = _writer(url)
    state = _state()
    for step in (10, 20, 30, 40):
        mgr.save(state, step=step)
    backend = open_backend(url)
    assert mgr._writer is not None and mgr._writer.rank == (1, "")
    Rotation(backend, keep_last=2, keep_every=None).rotate(mgr._writer, scan(backend))
    assert [c.step for c in scan(backend).checkpoints] == [30, 40]
    mgr.close()


def test_a_fenced_writer_rotates_nothing(url: str) -> None:
    zombie = _writer(url)
    state = _state()
    for step in (10, 20, 30):
        zombie.save(state, step=step)
    taker = _writer(url, lease_options=LeaseOptions(force=True))  # breaks the live lease: the zombie is now superseded
    assert zombie.lease is not None
    with pytest.raises(LeaseLostError):
        zombie.lease.renew()
    backend = open_backend(url)
    before = _keys(backend)
    assert zombie._writer is not None and zombie._writer.rank == (1, "")
    Rotation(backend, keep_last=1, keep_every=None).rotate(zombie._writer, scan(backend))
    assert _keys(backend) == before
    taker.close()


def test_a_writer_that_sees_a_newer_one_fences_itself_and_rotates_nothing(url: str) -> None:
    zombie = _writer(url)
    state = _state()
    for step in (10, 20, 30):
        zombie.save(state, step=step)
    assert zombie.wait(timeout=60)  # its last rotation (on its worker) is over before the takeover
    taker = _writer(url, lease_options=LeaseOptions(force=True))
    assert taker.restore(_state()) is not None
    taker.save(_state(), step=40)  # a folder of epoch 2 in the listing
    assert taker.wait(timeout=60)  # its own rotation, on its worker after the commit
    backend = open_backend(url)
    before = _keys(backend)
    assert zombie.lease is not None and not zombie.lease.fenced  # its heartbeat is off: it has not noticed
    assert zombie._writer is not None and zombie._writer.rank == (1, "")
    Rotation(backend, keep_last=1, keep_every=None).rotate(zombie._writer, scan(backend))
    assert _keys(backend) == before
    assert zombie.lease.fenced
    with pytest.raises(LeaseLostError):
        zombie.lease.check()
    taker.close()
