"""The first minute on Drive (issue 50): nobody waits for the settle, and lineage decides.

Real processes (tests/support/_story_writer.py ``train``), each "VM" a folder of the Drive
simulation (ckptsdk/testing/drive_sim.py) and, where two VMs run at once, one of them in its own
hostname and pid namespace (``unshare``): what one machine can check about the other is exactly
what it could on two Colab VMs. Which of two writers of one epoch outranks the other is fixed by
their lease nonces (``--nonce-prefix``), so both orders are tested, not left to chance.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptsdk.manager import CheckpointManager
from ckptsdk.state import TrainState
from ckptsdk.testing.drive_sim import DriveSim
from tests.support._story_writer import state_digest
from tests.support.story_child import can_unshare, read_events, spawn, wait_event, wait_events

SIM_DELAY = 1.0  # each change reaches the other VM this long after it was made
SETTLE = 3.0  # longer than the delay, as the default 60 s is meant to be on Drive
INTERVAL = 0.4  # seconds between saves


def _train(sim: DriveSim, vm: str, events: Path, *args: str, host: str | None = None) -> subprocess.Popen[bytes]:
    return spawn("train", "drive://run", events, *args, options={}, env=sim.env(vm), host=host)


def _reap(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def _fresh_restore(sim: DriveSim, vm: str) -> tuple[Any, str]:
    """A new runtime's restore on ``vm``: what it resumes from, and the model it gets."""
    sim.backend(vm, "run")  # sets nothing up but checks the root is there
    model = torch.nn.Linear(8, 4)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    import os

    old = os.environ.get("CKPTSDK_DRIVE_ROOT")
    os.environ["CKPTSDK_DRIVE_ROOT"] = str(sim.root(vm))
    try:
        with CheckpointManager("drive://run", read_only=True) as reader:
            pos = reader.restore(state)
    finally:
        if old is None:
            os.environ.pop("CKPTSDK_DRIVE_ROOT", None)
        else:
            os.environ["CKPTSDK_DRIVE_ROOT"] = old
    return pos, state_digest(model)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_fresh_root_opens_at_once_and_its_saves_restore_exactly(tmp_path: Path) -> None:
    with DriveSim(tmp_path / "sim", delay=SIM_DELAY, poll=0.05, max_runtime=240) as sim:
        events = tmp_path / "a.jsonl"
        proc = _train(sim, "vm1", events, "--saves", "4", "--interval", "0.1", "--settle", "600", "--ttl", "45")
        try:
            acquired = wait_event(events, proc, "acquired", 120)
            assert proc.wait(120) == 0
        finally:
            _reap(proc)
        evs = read_events(events)
        saved = [e for e in evs if e["event"] == "saved"]
        assert len(saved) == 4 and acquired["epoch"] == 1
        assert acquired["t"] - acquired["t_open"] < 600
        # The four saves and the close happened long before a 600 s settle could have passed:
        # the open did not wait for it.
        assert [e["event"] for e in evs][-1] == "closed"
        pos, digest = _fresh_restore(sim, "vm1")
        assert pos is not None and pos.key == saved[-1]["key"] and digest == saved[-1]["state"]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not can_unshare(), reason="needs root and namespaces (unshare) to play another machine")
@pytest.mark.parametrize("loser_ahead", [False, True], ids=["winner-ahead", "loser-ahead"])
def test_two_runtimes_starting_together_on_a_fresh_root_end_with_one_lineage(tmp_path: Path, loser_ahead: bool) -> None:
    """Two Colab tabs, "Run all" twice: both train during the settle; the lower writer is fenced
    within the settle plus a save interval (plus the simulation's delay), and a fresh restore
    gives the higher writer's newest step exactly, also when the lower one's steps are ahead."""
    with DriveSim(tmp_path / "sim", delay=SIM_DELAY, poll=0.05, max_runtime=300) as sim:
        go = tmp_path / "go"
        common = ["--go", str(go), "--ttl", "30", "--settle", str(SETTLE), "--interval", str(INTERVAL)]
        ev_hi, ev_lo = tmp_path / "high.jsonl", tmp_path / "low.jsonl"
        hi = _train(sim, "vm1", ev_hi, *common, "--saves", "25", "--nonce-prefix", "f0", host="colab-vm-1")
        lo = _train(
            sim,
            "vm2",
            ev_lo,
            *common,
            "--saves",
            "60",
            "--nonce-prefix",
            "0f",
            "--step-offset",
            "1000" if loser_ahead else "0",
        )
        try:
            wait_event(ev_hi, hi, "ready", 120)
            wait_event(ev_lo, lo, "ready", 120)
            go.touch()
            lo_open = wait_event(ev_lo, lo, "acquired", 120)
            hi_open = wait_event(ev_hi, hi, "acquired", 120)
            assert lo_open["epoch"] == hi_open["epoch"] == 1  # both took the fresh root
            wait_events(ev_lo, lo, 120, lambda evs: [e for e in evs if e["event"] == "lost"], "the fence")
            assert hi.wait(200) == 0 and lo.wait(60) == 0
        finally:
            _reap(hi, lo)
        hi_evs, lo_evs = read_events(ev_hi), read_events(ev_lo)
        (lost,) = [e for e in lo_evs if e["event"] == "lost"]
        assert not [e for e in hi_evs if e["event"] == "lost"]  # the higher writer was never fenced
        lo_saved = [e for e in lo_evs if e["event"] == "saved"]
        hi_saved = [e for e in hi_evs if e["event"] == "saved"]
        assert lo_saved and len(hi_saved) == 25  # both trained during the settle
        fenced_after = lost["t0"] - lo_open["t_open"]
        print(
            f"\nFRESH-ROOT TWINS ({'loser' if loser_ahead else 'winner'} ahead): the lower writer fenced "
            f"{fenced_after:.1f} s after its open, after {len(lo_saved)} saves"
        )
        # Generous for a loaded machine: the settle, a save interval, two hops of the delay, margin.
        assert fenced_after <= SETTLE + INTERVAL + 2 * SIM_DELAY + 20
        sim.wait_synced(60)
        for vm in ("vm1", "vm2"):
            pos, digest = _fresh_restore(sim, vm)
            assert pos is not None and pos.key == hi_saved[-1]["key"] and pos.step == hi_saved[-1]["step"]
            assert digest == hi_saved[-1]["state"]
        # Nothing of the higher writer's was deleted by the lower one: its kept checkpoints are all there.
        kept = {o.key.split("/")[0] for o in sim.backend("vm1", "run").list("") if o.key.startswith("step-")}
        assert hi_saved[-1]["key"] in kept


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_force_on_this_host_fences_a_live_holder_and_trains_at_once(tmp_path: Path) -> None:
    with DriveSim(tmp_path / "sim", delay=SIM_DELAY, poll=0.05, max_runtime=240) as sim:
        ev_old, ev_new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
        old = _train(sim, "vm1", ev_old, "--ttl", "300", "--interval", str(INTERVAL), "--max-seconds", "120")
        new = None
        try:
            wait_events(ev_old, old, 120, lambda evs: [e for e in evs if e["event"] == "saved"], "a save")
            new = _train(sim, "vm1", ev_new, "--ttl", "300", "--force", "--saves", "3", "--interval", str(INTERVAL))
            opened = wait_event(ev_new, new, "acquired", 120)
            restored = wait_event(ev_new, new, "restored", 120)
            assert new.wait(120) == 0
            wait_events(ev_old, old, 120, lambda evs: [e for e in evs if e["event"] == "lost"], "the fence")
            assert old.wait(60) == 0
        finally:
            _reap(old, *([new] if new is not None else []))
        (lost,) = [e for e in read_events(ev_old) if e["event"] == "lost"]
        assert opened["epoch"] == 2 and lost["newer_epoch"] == 2
        assert opened["t"] - opened["t_open"] < 60  # neither the holder's 300 s ttl nor a 60 s settle
        new_saved = [e for e in read_events(ev_new) if e["event"] == "saved"]
        assert len(new_saved) == 3 and restored["step"] is not None
        pos, digest = _fresh_restore(sim, "vm1")
        assert pos is not None and pos.key == new_saved[-1]["key"] and digest == new_saved[-1]["state"]
