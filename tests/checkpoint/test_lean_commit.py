"""The lean commit: storage calls per save on every backend, saves that never queue, the single-renewal fence.

Calls are counted at the backend API (``ckptsdk.testing.counting``): a multi-part upload is one
``write``. A slow store is a gate (an event) a tensor write waits on, never a sleep.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, Retention, SaveOptions, TrainState
from ckptsdk.backends.posix import TMP_PREFIX
from ckptsdk.checkpoint.reading.catalog import scan
from ckptsdk.checkpoint.writing.saving import RELIST_S
from ckptsdk.errors import LeaseLostError
from ckptsdk.format.layout import MANIFEST, TENSORS, checkpoint_dir
from ckptsdk.lease.record import LEASE_KEY
from ckptsdk.manager import Simulation
from ckptsdk.testing import FaultyBackend
from ckptsdk.testing.counting import CountingBackend

NO_HEARTBEAT = Simulation(heartbeat=False)  # only saves touch the lease: every call is the save's


def _state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _train(state: TrainState) -> None:
    model = state.objects["model"]
    opt = state.objects["optimizer"]
    opt.zero_grad()
    model(torch.ones(2, 8)).sum().backward()
    opt.step()


def _critical_path(ops: list[tuple[str, str]], folder: str) -> list[tuple[str, str]]:
    """The calls of one save (``ops`` from its start) up to its manifest write, step log aside."""
    last = ops.index(("write", f"{folder}/{MANIFEST}"))
    return [(op, key) for op, key in ops[: last + 1] if not key.startswith("runlog/")]


@pytest.mark.parametrize(
    "kind", ["memory", "local", "drive", "drive-delete", pytest.param("gcs", marks=pytest.mark.gcs)]
)
def test_calls_per_steady_state_save(kind: str, make_backend_target: Callable[..., Any]) -> None:
    """CAS stores: tensor upload, one renewal (the fence), manifest: 3 calls in sequence; rotation
    and the step log come after the commit. Drive: the listing is the fence as well."""
    target = make_backend_target(kind.partition("-")[0])
    # Where the two listings run at once (Drive), each waits at a barrier for the other: run one
    # after the other, the first would wait in vain and the save fail.
    # In recycle mode the retired checkpoint's manifest delete runs beside them too: in the
    # measured save, the lineage listing also waits for that delete to start.
    both, beside = threading.Barrier(2, timeout=30), threading.Barrier(2, timeout=30)
    concurrent = not target.open().capabilities.immediately_consistent
    # the manifest whose delete the measured save runs beside the listing; whether the listing
    # has yet to wait for it
    retiring: dict[str, Any] = {"manifest": None, "listing_due": False}

    def meet(op: str, key: str, _n: int) -> None:
        if concurrent and op == "list" and key in ("step-", "lineage/"):
            both.wait()
            if key == "lineage/" and retiring["listing_due"]:
                retiring["listing_due"] = False
                beside.wait()
        if op == "delete" and key == retiring["manifest"]:
            beside.wait()

    backend = CountingBackend(FaultyBackend(target.open(), fail_on=meet))
    mode = "delete" if kind == "drive-delete" else None
    mgr = CheckpointManager(
        backend,
        retention=Retention(keep_last=2, mode=mode),
        lease_options=LeaseOptions(ttl=60, settle=0.05),
        _simulation=NO_HEARTBEAT,
    )
    state = _state()
    assert mgr.restore(state) is None
    epoch = mgr.lease.epoch
    tag = mgr._saving.tag
    # Drive rotates one save late: with keep_last=2 the save of step 5 lets step 2 go.
    old = checkpoint_dir(2, epoch, tag)
    for step in range(1, 6):
        _train(state)
        mgr.log_step(step, loss=float(step))
        start = len(backend.ops)
        if step == 5 and concurrent and mode is None:
            retiring.update(manifest=f"{old}/{MANIFEST}", listing_due=True)
        mgr.save(state, step=step, blocking=False)
        assert mgr.wait(timeout=120)
    folder = checkpoint_dir(5, epoch, tag)
    path = _critical_path(backend.ops[start:], folder)
    if backend.capabilities.compare_and_swap:
        assert path == [("write", f"{folder}/{TENSORS}"), ("replace", LEASE_KEY), ("write", f"{folder}/{MANIFEST}")]
    elif mode == "delete":
        # Drive, deleting: the listing of checkpoints and lineage records (the two at once, met at
        # the barrier: one round trip) fences a newer writer before the upload; the renewal is one
        # versioned replace while LEASE.json is still the record this writer wrote last. Four
        # calls in sequence (the five at most).
        assert set(path[:2]) == {("list", "step-"), ("list", "lineage/")}, path
        assert path[2:] == [
            ("write", f"{folder}/{TENSORS}"),
            ("replace", LEASE_KEY),
            ("write", f"{folder}/{MANIFEST}"),
        ], path
    else:
        # Drive, recycling (its default): the oldest rotated-out checkpoint loses its manifest
        # beside the same listing (all three met at the barriers: one round trip), then gives its
        # file (moved, rewritten in place) once the listing fenced a newer writer. Five calls in
        # sequence.
        assert set(path[:3]) == {("list", "step-"), ("list", "lineage/"), ("delete", f"{old}/{MANIFEST}")}, path
        assert path[3:] == [
            ("move", f"{old}/{TENSORS}"),
            ("overwrite", f"{folder}/{TENSORS}"),
            ("replace", LEASE_KEY),
            ("write", f"{folder}/{MANIFEST}"),
        ], path

    # After the commit, off the critical path: the rotated-out checkpoint goes (manifest first,
    # then the files its manifest lists: no listing), and the step log's chunk. The fence for
    # those deletes is one stat of the lease under compare-and-swap; on Drive rotation lists the
    # root again first: no renewal there proves that no newer writer appeared during the upload.
    after = backend.ops[backend.ops.index(("write", f"{folder}/{MANIFEST}")) + 1 :]
    listed = sorted(k for op, k in after if op == "list" and k in ("step-", "lineage/"))
    assert listed == ([] if backend.capabilities.compare_and_swap else ["lineage/", "step-"])
    deleted = [k for op, k in after if op == "delete"]
    if backend.capabilities.compare_and_swap:
        assert after[0] == ("stat", LEASE_KEY), after
        gone = checkpoint_dir(3, epoch, tag)
        assert deleted == [f"{gone}/{MANIFEST}", f"{gone}/{TENSORS}"]
    elif mode == "delete":
        assert deleted == [f"{old}/{MANIFEST}", f"{old}/{TENSORS}"]
    else:
        assert deleted == []  # recycled before the upload instead
    assert not [op for op, k in after if k == LEASE_KEY and op != "stat"], after
    assert [c.step for c in mgr.list()] == ([4, 5] if backend.capabilities.immediately_consistent else [3, 4, 5])
    assert mgr.stats.committed == 5 and mgr.stats.failed == 0
    mgr.close()
    assert [c.step for c in scan(target.open()).restorable()][:1] == [5]


class _Gate:
    """Tensor writes wait until the gate opens: a store slower than the saves are due."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.writing = threading.Event()  # a tensor write is waiting at the gate

    def __call__(self, op: str, key: str, _n: int) -> BaseException | None:
        if op == "write" and key.endswith(TENSORS):
            self.writing.set()
            assert self.open.wait(120), "the gate was never opened"
        return None


def test_saves_never_wait_for_a_slow_store_and_the_newest_commits(make_backend_target: Callable[..., Any]) -> None:
    """A save due while the previous one writes returns at once (the gate is shut: waiting would
    hang); a newer save replaces the one waiting; the newest state commits; training goes on."""
    gate = _Gate()
    backend = FaultyBackend(make_backend_target("local").open(), fail_on=gate)
    mgr = CheckpointManager(backend, keep_last=3, lease_options=LeaseOptions(ttl=60))
    state = _state()
    mgr.restore(state)
    gate.open.clear()
    mgr.save(state, step=1, blocking=False)
    assert gate.writing.wait(60)  # the worker is stuck in the slow write of step 1
    for step in (2, 3, 4):
        _train(state)  # the optimizer step waits only for the snapshot copy, never for storage
        info = mgr.save(state, step=step, blocking=False)
        assert not info.committed and info.reason == "save in progress"
    expected = {k: v.clone() for k, v in state.objects["model"].state_dict().items()}
    _train(state)  # changes the live state after the save of step 4: the snapshot must not see it
    assert mgr.stats.replaced == 2 and mgr.stats.committed == 0
    gate.open.set()
    assert mgr.wait(timeout=120)
    assert [c.step for c in mgr.list()] == [1, 4]
    assert mgr.stats.committed == 2 and mgr.stats.replaced == 2 and mgr.stats.skipped == 0
    mgr.close()
    reader = CheckpointManager(backend.inner.url, read_only=True)
    fresh = _state(seed=1)
    assert reader.restore(fresh).step == 4
    for name, value in fresh.objects["model"].state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_a_save_past_the_staging_budget_is_skipped_and_counted(
    make_backend_target: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """With room for one snapshot only, a save due while one writes is skipped (counted, said
    once); the save in flight still commits, and a later save after it does too."""
    gate = _Gate()
    backend = FaultyBackend(make_backend_target("memory").open(), fail_on=gate)
    mgr = CheckpointManager(
        backend, keep_last=3, lease_options=LeaseOptions(ttl=60), save_options=SaveOptions(max_staging_bytes=1)
    )
    state = _state()
    mgr.restore(state)
    mgr.save(state, step=1, blocking=False)  # one save done: the warning can say how long saves take
    assert mgr.wait(timeout=60)
    gate.writing.clear()
    gate.open.clear()
    mgr.save(state, step=2, blocking=False)
    assert gate.writing.wait(60)
    with caplog.at_level(logging.WARNING, logger="ckptsdk.checkpoint.writing.scheduling"):
        for step in (3, 4):
            _train(state)
            info = mgr.save(state, step=step, blocking=False)
            assert not info.committed and info.reason is not None and info.reason.startswith("skipped")
    told = [r for r in caplog.records if "cannot keep up" in r.getMessage()]
    assert len(told) == 1 and "max_staging_bytes" in told[0].getMessage()
    assert mgr.stats.skipped == 2
    gate.open.set()
    assert mgr.wait(timeout=60)
    mgr.save(state, step=5, blocking=False)
    mgr.close()  # close commits the newest
    assert [c.step for c in mgr.list()] == [1, 2, 5]
    assert mgr.stats.committed == 3 and mgr.stats.skipped == 2


def test_the_single_renewal_fences_a_zombie(make_backend_target: Callable[..., Any]) -> None:
    """A writer taken over between two saves writes its tensor file (it cannot know yet), then
    its one renewal fails: no manifest, LeaseLostError, nothing of the new writer touched; the
    new writer removes the zombie's uncommitted folder at its next listing (its first save's)."""
    target = make_backend_target("local")
    zombie_store = CountingBackend(target.open())
    zombie = CheckpointManager(zombie_store, keep_last=1, lease_options=LeaseOptions(ttl=60), _simulation=NO_HEARTBEAT)
    state = _state()
    zombie.restore(state)
    zombie.save(state, step=1, blocking=True)
    # Save 1's rotation runs on the worker after it: let it end first, so the takeover comes
    # between the two saves (a fresh-clone run saw it fence the zombie before save 2 began).
    assert zombie.wait(timeout=60)
    now = [0.0]
    heir = CheckpointManager(
        target.url,
        keep_last=1,
        lease_options=LeaseOptions(ttl=60, force=True),
        _simulation=Simulation(heartbeat=False, clock=lambda: now[0], sleep=lambda s: None),
    )
    heir_state = _state(seed=2)
    assert heir.restore(heir_state).step == 1  # anchored under the heir's epoch
    _train(state)
    start = len(zombie_store.ops)
    with pytest.raises(LeaseLostError) as info:
        zombie.save(state, step=2, blocking=True)
    assert info.value.newer_epoch == heir.lease.epoch
    ops = zombie_store.ops[start:]
    folder = checkpoint_dir(2, zombie.lease.epoch)
    assert ops[:2] == [("write", f"{folder}/{TENSORS}"), ("replace", LEASE_KEY)]
    assert all(op in ("read", "stat") for op, _key in ops[2:]), ops  # judging what it found
    assert not target.open().exists(f"{folder}/{MANIFEST}")
    # Restore listed no manifest (its catalog is built at the first save): that first save
    # lists the root, sees the folder and removes it (at once under compare-and-swap).
    heir.save(heir_state, step=3, blocking=True)
    heir.wait()  # after the commit, on the worker
    assert not target.open().exists(f"{folder}/{TENSORS}")
    now[0] += RELIST_S + 1  # the periodic relist finds nothing more to remove
    heir.save(heir_state, step=4, blocking=True)
    assert heir.wait(timeout=60)  # rotation (and the leftover's removal) follow a sync save on the worker
    cat = scan(target.open())
    assert [(c.step, c.epoch) for c in cat.restorable()] == [(4, heir.lease.epoch)]
    assert not any(c.key == folder for c in cat.checkpoints)
    heir.close()
    zombie.close()


def test_a_drive_zombie_retires_only_its_own_doomed_checkpoint_and_touches_no_file(
    make_backend_target: Callable[..., Any],
) -> None:
    """Drive, recycle mode: the retire runs beside the listing, so a zombie may delete the
    manifest of the checkpoint its own retention lets go at this save. Nothing more: the listing
    shows the heir, the save stops with LeaseLostError before any file is moved, rewritten or
    written, and the heir's checkpoints restore exactly."""
    target = make_backend_target("drive")
    store = CountingBackend(target.open())
    zombie = CheckpointManager(
        store, keep_last=1, lease_options=LeaseOptions(ttl=60, settle=0.05), _simulation=NO_HEARTBEAT
    )
    state = _state()
    zombie.restore(state)
    for step in (1, 2, 3):  # the save of step 3 recycled step 1's file: the steady state
        _train(state)
        zombie.save(state, step=step, blocking=False)
        assert zombie.wait(timeout=60)
    epoch, tag = zombie.lease.epoch, zombie._saving.tag
    heir = CheckpointManager(
        target.url,
        keep_last=1,
        lease_options=LeaseOptions(ttl=60, settle=0.05, force=True),
        _simulation=Simulation(heartbeat=False),
    )
    heir_state = _state(seed=2)
    assert heir.restore(heir_state).step == 3
    expected = {k: v.clone() for k, v in heir_state.objects["model"].state_dict().items()}
    _train(state)
    start = len(store.ops)
    zombie.save(state, step=4, blocking=False)
    with pytest.raises(LeaseLostError):
        zombie.wait(timeout=60)
    ops = store.ops[start:]
    doomed = checkpoint_dir(2, epoch, tag)
    assert [k for op, k in ops if op == "delete"] == [f"{doomed}/{MANIFEST}"], ops  # retired beside the listing
    assert not [(op, k) for op, k in ops if op in ("move", "overwrite", "write", "create")], ops
    assert target.open().exists(f"{doomed}/{TENSORS}")  # its file stays where it was
    heir.save(heir_state, step=4, blocking=True)
    heir.close()
    fresh = _state(seed=3)
    assert CheckpointManager(target.url, read_only=True).restore(fresh).step == 4
    reread = CheckpointManager(target.url, read_only=True).load(step=3)
    for name, value in expected.items():
        assert torch.equal(reread["objects"]["model"][name], value), name
    zombie.close()


def _fsynced_paths(monkeypatch: pytest.MonkeyPatch, root: str) -> list[str]:
    """Every fsync from now on, as a path under ``root`` with temp-file names reduced to their target."""
    paths: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        path = os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), root)
        folder, _, name = path.rpartition("/")
        if name.startswith(TMP_PREFIX):
            name = "tmp:" + name[len(TMP_PREFIX) :].rsplit(".", 2)[0]
        paths.append(f"{folder}/{name}" if folder else name)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return paths


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fsynced files through /proc")
def test_a_steady_state_sync_save_makes_five_fsyncs(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Local disk: the tensor file, the lease's temp file, the manifest's temp file (each before its
    rename), then once each the step folder (both renames) and the root (the lease's rename and
    the new folder's name), all before save() returns; rotation's deletes after it add none."""
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, keep_last=1, lease_options=LeaseOptions(ttl=60), _simulation=NO_HEARTBEAT)
    state = _state()
    mgr.restore(state)
    for step in (1, 2):  # the first save lists, writes lineage and tidies: not the steady state
        _train(state)
        mgr.save(state, step=step, blocking=True)
    assert mgr.wait(timeout=60)
    _train(state)
    folder = checkpoint_dir(3, mgr.lease.epoch, mgr._saving.tag)
    paths = _fsynced_paths(monkeypatch, root)
    mgr.save(state, step=3, blocking=True)
    in_save = list(paths)
    assert mgr.wait(timeout=60)
    assert in_save == [
        f"{folder}/tmp:{TENSORS}",
        f"tmp:{LEASE_KEY}",
        f"{folder}/tmp:{MANIFEST}",
        folder,
        ".",
    ], in_save
    assert paths == in_save  # rotation (step 2's manifest and file, its folder) fsyncs nothing
    monkeypatch.undo()
    assert [c.step for c in mgr.list()] == [3]
    mgr.close()
    assert CheckpointManager(root, read_only=True).restore(_state(seed=3)).step == 3


class _DeleteGate:
    """Deletes wait until the gate opens; records whether the new manifest existed at the first."""

    def __init__(self, inner: Any, manifest: str) -> None:
        self.inner = inner
        self.manifest = manifest
        self.open = threading.Event()
        self.deleting = threading.Event()
        self.committed_first: bool | None = None

    def __call__(self, op: str, key: str, _n: int) -> BaseException | None:
        if op == "delete":
            if self.committed_first is None:
                self.committed_first = self.inner.exists(self.manifest)
            self.deleting.set()
            assert self.open.wait(120), "the gate was never opened"
        return None


def test_a_sync_save_returns_before_rotation_deletes_and_close_waits_for_them(
    make_backend_target: Callable[..., Any],
) -> None:
    """With every delete held at a gate, save(blocking=True) returns (were the delete on its path
    it would hang); the delete starts only after the commit; the old checkpoint stays until the
    gate opens, and close() waits for rotation to finish."""
    target = make_backend_target("local")
    inner = target.open()
    mgr = CheckpointManager(
        FaultyBackend(inner), keep_last=1, lease_options=LeaseOptions(ttl=60), _simulation=NO_HEARTBEAT
    )
    state = _state()
    mgr.restore(state)
    mgr.save(state, step=1, blocking=True)
    assert mgr.wait(timeout=60)
    old = checkpoint_dir(1, mgr.lease.epoch, mgr._saving.tag)
    new = checkpoint_dir(2, mgr.lease.epoch, mgr._saving.tag)
    gate = _DeleteGate(inner, f"{new}/{MANIFEST}")
    gate.open.clear()
    mgr.backend = FaultyBackend(inner, fail_on=gate)
    _train(state)
    info = mgr.save(state, step=2, blocking=True)
    assert info.committed and info.key == new
    assert inner.exists(f"{new}/{MANIFEST}") and inner.exists(f"{old}/{MANIFEST}")
    assert gate.deleting.wait(60)  # rotation started on the worker, after save() returned
    assert gate.committed_first is True
    assert inner.exists(f"{old}/{MANIFEST}")  # held at the gate: nothing deleted yet
    assert not mgr.wait(timeout=0)  # the rotation is waited for like a save
    gate.open.set()
    mgr.close()
    assert not inner.exists(f"{old}/{MANIFEST}") and not inner.exists(f"{old}/{TENSORS}")
    assert [c.step for c in scan(inner).restorable()] == [2]


def test_the_deferred_copies_start_last_and_even_when_the_submit_fails(
    make_backend_target: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copier thread is woken as the last act of save() (woken earlier, its Python loop took
    the GIL from the rest of save()), and always: the next optimizer step waits for its copies."""
    mgr = CheckpointManager(make_backend_target("memory").open(), keep_last=2, lease_options=LeaseOptions(ttl=60))
    state = _state()
    mgr.restore(state)
    slots = mgr._saving._slots
    order: list[str] = []
    for name in ("submit", "start_copies"):
        real = getattr(slots, name)
        monkeypatch.setattr(slots, name, lambda *a, _r=real, _n=name: (order.append(_n), _r(*a))[1])
    _train(state)
    mgr.save(state, step=1, blocking=False)
    assert order == ["submit", "start_copies"]
    assert mgr.wait(timeout=60) and [c.step for c in mgr.list()] == [1]

    class Refused(RuntimeError):
        pass

    def refuse(_job: Any) -> None:
        raise Refused("the worker could not take the save")

    real_submit = slots.submit
    monkeypatch.setattr(slots, "submit", refuse)
    for step in (2, 3):  # two staging buffers at most: each failure must give its own back
        with pytest.raises(Refused):
            mgr.save(state, step=step, blocking=False)
        stepped = threading.Thread(target=_train, args=(state,), daemon=True)
        stepped.start()  # waits for the deferred copies of this snapshot: they ran
        stepped.join(60)
        assert not stepped.is_alive(), "the optimizer step waits for copies that never started"
    assert [c.step for c in mgr.list()] == [1]  # nothing lost
    monkeypatch.setattr(slots, "submit", real_submit)
    info = mgr.save(state, step=4, blocking=False)
    assert info.reason == "save in progress"  # not skipped: both buffers are free again
    assert mgr.wait(timeout=60) and [c.step for c in mgr.list()] == [1, 4]
    assert mgr.stats.skipped == 0
    mgr.close()
