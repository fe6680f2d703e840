"""The save path: nothing touches storage on the training thread, fencing stays as strong, and a
background failure surfaces on the next call with the previous checkpoints intact."""

from __future__ import annotations

import threading

import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState, open_backend
from ckptsdk.errors import BackendError, CheckpointError, LeaseLostError
from ckptsdk.format.layout import MANIFEST, TENSORS, checkpoint_dir
from ckptsdk.manager import Simulation
from ckptsdk.testing import FaultyBackend


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return TrainState(model=model, optimizer=opt)


class _Threads:
    """Records the thread of every storage call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    def __call__(self, op: str, key: str, n: int) -> None:
        self.calls.append((threading.current_thread().name, op, key))
        return None


@pytest.mark.parametrize("snapshot", ["pipelined", "copy"])
def test_async_save_makes_no_storage_call_on_the_calling_thread(tmp_path, snapshot):
    rec = _Threads()
    backend = FaultyBackend(open_backend(str(tmp_path / "r")), fail_on=rec)
    mgr = CheckpointManager(
        backend,
        lease_options=LeaseOptions(ttl=30),
        save_options=SaveOptions(on_signal=False, snapshot=snapshot),
        keep_last=2,
    )
    state = _state()
    mgr.restore(state)
    me = threading.current_thread().name
    for step in range(1, 5):  # the first save (lineage record) and later ones (rotation)
        for i in range(3):
            mgr.log_step(step * 10 + i, loss=0.5)
        rec.calls.clear()
        mgr.save(state, step=step, blocking=False)
        on_caller = [c for c in rec.calls if c[0] == me]
        assert on_caller == [], on_caller
        state.objects["optimizer"].step()  # waits for a pipelined copy, never for storage
        mgr.wait()
        ops = {(op, key.rsplit("/", 1)[-1]) for _t, op, key in rec.calls}
        assert ("write", MANIFEST) in ops and ("replace", "LEASE.json") in ops  # renewed, then committed
    assert [c.step for c in mgr.list() if c.valid] == [3, 4]
    mgr.close()


def test_fenced_writer_commits_and_deletes_nothing_and_says_so_on_the_next_call(tmp_path):
    url = str(tmp_path / "r")
    state = _state()
    zombie = CheckpointManager(
        url,
        keep_last=1,
        lease_options=LeaseOptions(ttl=30),
        save_options=SaveOptions(on_signal=False),
        _simulation=Simulation(heartbeat=False),
    )
    zombie.save(state, step=1)
    newcomer = CheckpointManager(
        url, keep_last=1, lease_options=LeaseOptions(ttl=30, force=True), save_options=SaveOptions(on_signal=False)
    )
    # The zombie has not seen the takeover: its foreground reads only its (stale) flag and
    # returns; the worker writes the tensor file (the lean commit renews once, right before the
    # commit) and its renewal finds the newer writer: no manifest.
    zombie.save(state, step=2, blocking=False)
    with pytest.raises(LeaseLostError):
        zombie.wait()
    assert not (tmp_path / "r" / checkpoint_dir(2, 1) / MANIFEST).exists()
    assert (tmp_path / "r" / checkpoint_dir(1, 1) / MANIFEST).exists()  # nothing deleted
    with pytest.raises(LeaseLostError):
        zombie.save(state, step=3, blocking=False)
    newcomer.close()
    zombie.close()


def test_takeover_during_the_write_is_caught_by_the_renewal_before_the_commit(tmp_path):
    url = str(tmp_path / "r")
    state = _state()
    holder: dict[str, CheckpointManager] = {}

    def take_over(op: str, key: str, n: int) -> None:
        if op == "write" and key.endswith(TENSORS) and "new" not in holder:
            # Another runtime takes the lease while our tensors are being written.
            holder["new"] = CheckpointManager(
                url, lease_options=LeaseOptions(ttl=30, force=True), save_options=SaveOptions(on_signal=False)
            )
        return None

    backend = FaultyBackend(open_backend(url), fail_on=take_over)
    zombie = CheckpointManager(
        backend,
        lease_options=LeaseOptions(ttl=30),
        save_options=SaveOptions(on_signal=False),
        _simulation=Simulation(heartbeat=False),
    )
    zombie.save(state, step=5, blocking=False)
    with pytest.raises(LeaseLostError):
        zombie.wait()
    assert not (tmp_path / "r" / checkpoint_dir(5, 1) / MANIFEST).exists()  # never committed
    holder["new"].close()
    zombie.close()


def test_background_failure_surfaces_on_the_next_save_and_loses_nothing(tmp_path):
    state = _state()
    broken = {"on": False}

    def disk_full(op: str, key: str, n: int) -> BaseException | None:
        if broken["on"] and op == "write" and key.endswith(TENSORS):
            return BackendError("No space left on device", key=key)
        return None

    backend = FaultyBackend(open_backend(str(tmp_path / "r")), fail_on=disk_full)
    mgr = CheckpointManager(
        backend, keep_last=1, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    )
    mgr.save(state, step=1, blocking=False)
    mgr.wait()
    broken["on"] = True
    mgr.save(state, step=2, blocking=False)  # returns: the failure happens on the worker
    # It surfaces on the first save, wait or close after it happened (a save never waits for
    # the previous one, so here the test waits).
    with pytest.raises(BackendError, match="No space left"):
        mgr.wait()
    broken["on"] = False
    assert [c.step for c in mgr.list() if c.valid] == [1]  # the previous one is intact
    mgr.save(state, step=3, blocking=False)
    mgr.close()
    with CheckpointManager(str(tmp_path / "r"), read_only=True) as ro:
        assert ro.latest().step == 3


def test_an_abandoned_save_publishes_no_manifest(tmp_path):
    state = _state()
    gate = threading.Event()

    def slow(op: str, key: str, n: int) -> None:
        if op == "write" and key.endswith(TENSORS):
            gate.wait(30)
        return None

    backend = FaultyBackend(open_backend(str(tmp_path / "r")), fail_on=slow)
    mgr = CheckpointManager(backend, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False))
    mgr.save(state, step=1, blocking=False)
    assert mgr.wait(0.05) is False  # still writing
    mgr._saving.abandon()
    gate.set()
    with pytest.raises(CheckpointError, match="abandoned"):
        mgr.wait()
    assert not (tmp_path / "r" / checkpoint_dir(1, 1) / MANIFEST).exists()
    mgr.close()


def test_due_step_log_flushes_run_off_the_training_thread(tmp_path):
    rec = _Threads()
    backend = FaultyBackend(open_backend(str(tmp_path / "r")), fail_on=rec)
    mgr = CheckpointManager(backend, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False))
    mgr.restore(_state())
    mgr.runlog.flush_every = 5
    rec.calls.clear()
    for step in range(1, 21):
        mgr.log_step(step, loss=float(step))
    mgr.close()
    chunks = [c for c in rec.calls if "chunk-" in c[2] and c[1] == "create"]
    me = threading.current_thread().name
    assert chunks and all(t != me for t, _op, key in chunks[:-1])  # only close() publishes here
    report = CheckpointManager(str(tmp_path / "r"), read_only=True).audit()
    assert report.attempts[0].steps == 20 and not report.attempts[0].missing_chunks


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("store", ["local", "drive"])
def test_a_save_reports_the_writers_full_rank_as_the_listing_does(tmp_path, monkeypatch, store, blocking):
    """The info a save returns (and rotation's catalog keeps) carries the writer's tag (in Drive's
    folder names): without it the tidy took the newest commit for another lineage's and spared this
    writer's own failed save's folder."""
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path))
    url = "drive://r" if store == "drive" else str(tmp_path / "r")
    mgr = CheckpointManager(
        url, lease_options=LeaseOptions(ttl=30, settle=0), save_options=SaveOptions(on_signal=False)
    )
    info = mgr.save(_state(), step=1, blocking=blocking)
    assert mgr.wait(timeout=60)
    listed = CheckpointManager(url, read_only=True).list()
    assert [c.rank for c in listed] == [info.rank]
    assert (info.tag != "") == (store == "drive")


@pytest.mark.parametrize("blocking", [False, True])
@pytest.mark.parametrize("fails", [False, True])
def test_the_step_log_flusher_is_woken_after_a_background_snapshot_and_before_a_blocking_save(
    tmp_path, fails, blocking
):
    """Non-blocking: woken first, the flusher thread took the GIL from the snapshot (a stall of up
    to a switch interval inside save()), so it is woken last. Blocking: first, so that the steps
    up to the save are on storage when a kill lands inside it (the audit compares them). Either
    way, failed save or not, the steps up to a save reach storage."""
    mgr = CheckpointManager(
        str(tmp_path / "r"), lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    )
    mgr.restore(_state())
    order: list[str] = []
    pipeline_save, flush_soon = mgr._saving.save, mgr.runlog.flush_soon

    def save(*args, **kwargs):
        order.append("save")
        if fails:
            raise BackendError("a failing store")
        return pipeline_save(*args, **kwargs)

    def wake() -> None:
        order.append("flush_soon")
        flush_soon()

    mgr._saving.save, mgr.runlog.flush_soon = save, wake
    mgr.log_step(1, loss=1.0)
    if fails:
        with pytest.raises(BackendError, match="a failing store"):
            mgr.save(_state(), step=1, blocking=blocking)
    else:
        mgr.save(_state(), step=1, blocking=blocking)
    assert order == (["flush_soon", "save"] if blocking else ["save", "flush_soon"])
    mgr.close()
    report = CheckpointManager(str(tmp_path / "r"), read_only=True).audit()
    assert report.attempts[0].steps == 1  # the step logged before the save reached storage
    assert [c.step for c in CheckpointManager(str(tmp_path / "r"), read_only=True).list()] == ([] if fails else [1])
