"""Nothing piles up: killed saves leave no leftovers, a clean restart writes no copy, and the
anchor still protects a takeover's resume point from a live zombie on Drive.

Kills are real SIGKILLs of forked writer processes (benchmarks/footprint_child.py) on local disk, a
Drive folder and GCS (the patched emulator on 127.0.0.1). Bytes are counted by a wrapper around
the backend (ckptsdk/testing/counting.py), so a full copy cannot hide behind a cheap one.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.footprint_child import read_line as _line
from ckptsdk import CheckpointManager, LeaseOptions, TrainState
from ckptsdk.backends.local import TMP_PREFIX
from ckptsdk.checkpoint.reading.catalog import scan
from ckptsdk.format.layout import TENSORS
from ckptsdk.manager import Simulation
from ckptsdk.testing.counting import CountingBackend
from ckptsdk.testing.drive_sim import DriveSim

REPO = Path(__file__).resolve().parents[2]
KILLS = 10
# Kills go on past KILLS (bounded) until two landed inside a save: where a kill lands is chance,
# and a loaded machine (xdist workers on 2 cores) shifts the odds.
MAX_KILLS = 30
KEEP_LAST = 3
GRACE = {"local": 3600.0, "gcs": 3600.0, "drive": 1.0}  # CAS stores never need the grace


def _step_temp_files(root: Path) -> list[str]:
    """Temp files in checkpoint folders: what a save killed mid-write leaves (full size)."""
    return sorted(str(p.relative_to(root)) for p in root.glob(f"step-*/{TMP_PREFIX}*"))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["local", "drive", pytest.param("gcs", marks=pytest.mark.gcs)])
def test_ten_kills_mid_save_then_one_save_leave_nothing_behind(kind, make_backend_target, tmp_path):
    target = make_backend_target(kind)
    rng = random.Random({"local": 1, "drive": 2, "gcs": 3}[kind])
    env = {**os.environ, "PYTHONPATH": str(REPO), **target.env}
    err = open(tmp_path / "zygote.err", "wb")
    zygote = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.footprint_child", "zygote", target.url, str(KEEP_LAST), str(GRACE[kind])],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=err,
        bufsize=0,
    )
    assert zygote.stdin is not None
    save_times: list[float] = []
    killed_mid_save = 0
    backend = target.open()
    try:
        assert _line(zygote, 120) == "zygote-ready", (tmp_path / "zygote.err").read_text()
        kills = 0
        for trial in range(MAX_KILLS):
            if trial >= KILLS and killed_mid_save >= 2:
                break
            kills += 1
            zygote.stdin.write(b"go 0\n")
            pid = int(_line(zygote, 60).split()[1])
            restored = _line(zygote, 120)
            assert restored.startswith("restored"), restored
            # The writer saves back to back: after its first save, a random moment falls inside
            # one (or in its lease renewal or rotation, around it).
            started = time.monotonic()
            first = _line(zygote, 120)
            assert first.startswith("saved"), first
            if trial < 2:
                save_times.append(time.monotonic() - started)
            time.sleep(rng.uniform(0.0, 1.2 * max(save_times)))
            os.kill(pid, signal.SIGKILL)
            saved = 0
            while not (line := _line(zygote, 60)).startswith("reaped"):
                assert line.startswith("saved"), line
                saved += 1
            assert line.split()[1:] == [str(pid), str(-signal.SIGKILL)], line
            # Did the kill land inside a save? Then it left an uncommitted folder or a temp file.
            leftover = [c.key for c in scan(backend).checkpoints if not c.committed]
            if kind != "gcs":
                leftover += _step_temp_files(Path(backend.root))
            killed_mid_save += bool(leftover)
        if kind == "drive":
            time.sleep(GRACE[kind] + 0.5)  # the killed saves' files age past the grace
        zygote.stdin.write(b"final 0\n")
        lines = []
        while not (line := _line(zygote, 180)).startswith("reaped"):
            lines.append(line)
        assert line.split()[2] == "0", lines + [(tmp_path / "zygote.err").read_text()]
    finally:
        zygote.kill()
        zygote.wait(timeout=30)
        zygote.stdin.close()
        zygote.stdout.close()  # type: ignore[union-attr]
        err.close()
    cat = scan(backend)
    rows = [r for r in cat.rows() if r.committed]
    late = 0 if backend.capabilities.immediately_consistent else 1
    assert len(rows) <= KEEP_LAST + late, [r.key for r in rows]
    assert all(r.valid for r in rows), [(r.key, r.reason) for r in rows]
    if backend.capabilities.immediately_consistent:  # anchors replace their originals at once
        assert len(cat.checkpoints) == len(rows), sorted(c.key for c in cat.checkpoints)
    # No uncommitted folder older than the grace; with compare-and-swap none at all.
    assert cat.leftovers(rank=None, grace=GRACE[kind], exclusive=False) == []
    assert [c.key for c in cat.checkpoints if not c.committed] == []
    if kind in ("local", "drive"):
        assert _step_temp_files(Path(backend.root)) == [], "temp files of killed saves were left"
    assert killed_mid_save >= 2, "too few kills landed inside a save to test anything"
    print(
        f"\n{kind}: {kills} kills, {killed_mid_save} inside a save; after one more save: "
        f"{len(rows)} steps in {len(cat.checkpoints)} folders"
    )


def _state() -> TrainState:
    torch.manual_seed(0)
    return TrainState(model=torch.nn.Linear(256, 256))


@pytest.mark.parametrize("kind", ["memory", "local", "drive", pytest.param("gcs", marks=pytest.mark.gcs)])
def test_clean_restart_writes_no_extra_copy(kind, make_backend_target):
    """close, reopen, restore, save: the new save is the only full write on stores with a cheap
    copy (the anchor is a hard link or a server-side copy, and replaces the original at the next
    save); on Drive the anchor is a full write (a documented decision, see docs/DRIVE.md); either
    way ``list()`` shows each step once."""
    target = make_backend_target(kind)
    state = _state()
    with CheckpointManager(
        target.url, keep_last=3, lease_options=LeaseOptions(ttl=5, settle=0), storage_options=target.options
    ) as mgr:
        for step in (10, 20):
            mgr.save(state, step=step)
        size = mgr.list()[-1].manifest.files[0].size
    counting = CountingBackend(target.open())
    with CheckpointManager(counting, keep_last=3, lease_options=LeaseOptions(ttl=5, settle=0)) as mgr:
        assert mgr.restore(_state()).step == 20
        restore_bytes = tensor_bytes(counting)
        mgr.save(state, step=30)
        rows = mgr.list()
    assert [r.step for r in rows] == [10, 20, 30]
    if counting.capabilities.compare_and_swap:  # the anchor is a hard link / server-side copy
        assert restore_bytes == 0 and counting.calls["copy"] == 1
        assert [len(r.copies) for r in rows] == [0, 0, 0]
    else:
        assert restore_bytes == size  # Drive: the anchor, a full rewrite
        assert rows[1].anchor and len(rows[1].copies) == 1
    assert tensor_bytes(counting) - restore_bytes == size  # the one new save


def tensor_bytes(counting: CountingBackend) -> int:
    return sum(n for key, n in counting.by_key.items() if key.endswith(TENSORS))


@pytest.mark.parametrize("kind", ["local", pytest.param("gcs", marks=pytest.mark.gcs)])
def test_unclean_takeover_anchors_by_cheap_copy(kind, make_backend_target):
    """After a writer that never released, the anchor is written, but as a hard link / a
    server-side copy: no tensor byte passes through this machine."""
    target = make_backend_target(kind)
    state = _state()
    dead = CheckpointManager(
        target.url,
        keep_last=3,
        lease_options=LeaseOptions(ttl=5),
        _simulation=Simulation(heartbeat=False),
        storage_options=target.options,
    )
    dead.save(state, step=10)
    dead._shutdown._closed = True  # dies: never releases
    counting = CountingBackend(target.open())
    with CheckpointManager(counting, keep_last=3, lease_options=LeaseOptions(ttl=5, force=True)) as mgr:
        assert mgr.restore(_state()).step == 10
        rows = mgr.list()
        assert counting.calls["copy"] == 1 and tensor_bytes(counting) == 0
        assert len(rows) == 1 and rows[0].anchor and rows[0].epoch == 2 and len(rows[0].copies) == 1
        assert rows[0].valid
        # Once this writer saved again, its anchor replaces the dead writer's folder of that step
        # (not before: the restore that made it, other ranks included, may still read the original).
        mgr.save(state, step=20)
        after = mgr.list()
    assert [(r.step, r.epoch, r.copies) for r in after] == [(10, 2, ()), (20, 2, ())]
    mgr2 = CheckpointManager(target.url, read_only=True, storage_options=target.options)
    mgr2.verify(key=rows[0].key)  # the anchor's digests hold


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zombie_late_rotation_cannot_take_the_resume_point_on_drive(tmp_path):
    """Drive, two VMs, 5 s apart. A keeps saving and rotating (keep_last=1) after B broke its
    lease; B's resume point survives A's late deletes because B anchored it under its own name,
    whatever the retention mode."""
    with DriveSim(tmp_path / "sim", delay=5.0) as sim:
        a_backend, b_backend = sim.backend("vm1", "run"), sim.backend("vm2", "run")
        state = _state()
        a = CheckpointManager(
            a_backend,
            keep_last=1,
            lease_options=LeaseOptions(ttl=120, settle=0),
            _simulation=Simulation(heartbeat=False),
        )
        for step in (1, 2, 3):
            a.save(state, step=step)
        sim.wait_synced(timeout=30)
        b = CheckpointManager(
            b_backend,
            keep_last=1,
            lease_options=LeaseOptions(ttl=120, settle=0, force=True),
            _simulation=Simulation(heartbeat=False),
        )
        resumed = b.restore(_state())
        assert resumed.step == 3
        # A has not seen B yet (its view is 5 s late): it saves and rotates 3 away.
        for step in (4, 5):
            a.save(state, step=step)
        assert not a_backend.exists(f"step-{3:010d}.e1.{a._saving.tag}/manifest.json")
        a.wait()  # A's last rotation (its late deletes) has run, so the wait below carries it
        sim.wait_delivered(timeout=30)
        b.wait()
        cat = scan(b_backend)
        anchor = [c for c in cat.checkpoints if c.step == 3 and c.rank == b._saving.rank]
        assert anchor and anchor[0].valid and anchor[0].anchor
        reader = CheckpointManager(b_backend, read_only=True)
        assert reader.latest().step == 3 and reader.latest().rank == b._saving.rank
        assert reader.load() is not None  # digests verified
        b.close()
        a._shutdown._closed = True  # the zombie never learns; nothing more to do
