"""A stray lineage record on Drive: the next writer resumes the run's progress, a zombie stops.

Found 2026-12-03. On Drive a writer lists before it takes the lease, so it takes its epoch above
a stray ``lineage/epoch-000999.json``; it then judged the record by its *own* lease (epoch 1000),
believed it ("one above everything seen") and started fresh while steps 10 and 20 were committed.
A writer now judges records by the lease it took over from, and a fresh start that saved
nothing erases no run's progress (``epoch-000002``, the very next epoch). The other half (deep lineage profile,
invariant [3]): a zombie on Drive that sees a newer writer's record two epochs above anything
else it knows must stop, though nobody believes that record yet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState, open_backend
from ckptsdk.errors import LeaseLostError
from ckptsdk.format.manifest import parse_lineage
from ckptsdk.manager import Simulation
from tests.stories.test_faults_hostile import INTACT
from tests.support._fault_state import expected, make_state, observe

KW: dict[str, Any] = dict(
    keep_last=3, lease_options=LeaseOptions(ttl=5, settle=0), save_options=SaveOptions(on_signal=False)
)


def _state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    return TrainState(model=torch.nn.Linear(4, 3))


def _weights(state: TrainState) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.objects["model"].state_dict().items()}


def _stray(url: str, epoch: int, resumed_from_step: int | None = None) -> str:
    """Write a lineage record of ``epoch`` that no writer wrote (copied from the real one)."""
    backend = open_backend(url)
    real = parse_lineage(backend.read(backend.list("lineage/")[0].key))
    forged = real.model_copy(
        update={
            "epoch": epoch,
            "resumed_from_step": resumed_from_step,
            "resumed_from_epoch": None if resumed_from_step is None else real.epoch,
        }
    )
    key = f"lineage/epoch-{epoch:06d}.json"
    backend.write(key, forged.to_json())
    return key


@pytest.fixture
def drive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "MyDrive").mkdir()
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path))
    return "drive://run"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attack", INTACT, ids=lambda f: f.__name__)
def test_the_hostile_stray_records_change_nothing_on_drive_either(drive: str, tmp_path: Path, attack: Any) -> None:
    """The hostile attacks that must change nothing (tests/stories/test_faults_hostile.py), on a
    Drive root: there the lease cannot vouch by name alone, so the rules differ."""
    with CheckpointManager(drive, _simulation=Simulation(heartbeat=False), lease_options=LeaseOptions(settle=0)) as mgr:
        mgr.restore(make_state(0))
        mgr.log_step(1, loss=0.5)
        mgr.save(make_state(1), step=1)
        mgr.log_step(2, loss=0.25)
        mgr.save(make_state(2), step=2)
    attack(tmp_path / "run")
    report = observe(drive)
    assert report["step"] == 2 and report["digest"] == expected(2), report
    with CheckpointManager(drive, _simulation=Simulation(heartbeat=False), lease_options=LeaseOptions(settle=0)) as mgr:
        assert mgr.restore(make_state(0)).step == 2  # neither fenced nor sent back
        mgr.save(make_state(3), step=3)
        assert mgr.audit() is not None
    assert observe(drive)["digest"] == expected(3)


def _run_to_20(url: str) -> dict[str, torch.Tensor]:
    with CheckpointManager(url, **KW) as first:
        s = _state(0)
        assert first.restore(s) is None
        first.save(s, step=10, blocking=True)
        with torch.no_grad():
            s.objects["model"].weight.add_(1.0)
        first.save(s, step=20, blocking=True)
        return _weights(s)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("epoch", [999, 5, 2])
def test_a_stray_record_far_above_does_not_make_the_next_writer_start_fresh(drive: str, epoch: int) -> None:
    saved = _run_to_20(drive)
    _stray(drive, epoch)
    with CheckpointManager(drive, **KW) as nxt:
        back = _state(1)
        got = nxt.restore(back)
        assert got is not None and got.step == 20, got
        assert nxt.lease.epoch == epoch + 1  # above the stray: names stay unique
        assert all(torch.equal(v, saved[k]) for k, v in back.objects["model"].state_dict().items())
        nxt.save(back, step=30, blocking=True)
        rows = {c.step: c for c in nxt.list()}
    assert rows[20].valid and rows[30].valid and rows[10].valid, rows  # nothing was orphaned
    reader = CheckpointManager(drive, read_only=True)
    assert reader.restore(_state(2)).step == 30
    assert [c.step for c in reader.list() if c.valid] == [10, 20, 30]


@pytest.mark.timeout(120)
def test_a_stray_record_that_names_a_newer_writer_stops_a_drive_writer_loudly(drive: str) -> None:
    """A record two epochs above everything this writer knows: it may be a genuine takeover whose
    lease has not reached this VM yet, so the writer stops (nothing written, nothing deleted);
    the error says the record may be stray, and reopening resumes exactly."""
    with CheckpointManager(drive, **KW) as w:
        s = _state(0)
        assert w.restore(s) is None
        w.save(s, step=10, blocking=True)
        w.save(s, step=20, blocking=True)
        saved = _weights(s)
        before = sorted(o.key for o in open_backend(drive).list(""))
        _stray(drive, w.lease.epoch + 2)
        with pytest.raises(LeaseLostError, match="stray: reopening is safe"):  # Drive lists before each upload
            w.save(s, step=30, blocking=True)
    after = sorted(o.key for o in open_backend(drive).list("") if not o.key.startswith("lineage/epoch-000003"))
    assert [k for k in after if k.startswith("step-")] == [k for k in before if k.startswith("step-")]
    with CheckpointManager(drive, **KW) as nxt:
        back = _state(1)
        got = nxt.restore(back)
        assert got is not None and got.step == 20
        assert all(torch.equal(v, saved[k]) for k, v in back.objects["model"].state_dict().items())
