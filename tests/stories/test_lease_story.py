"""The story, replayed with real processes: a frozen zombie must never clobber the resumed run.

Process A trains and saves every ~200 ms (keep_last=3); A is frozen (SIGSTOP) for longer than the
lease ttl; process B opens the same root, takes over, resumes from A's newest checkpoint and
saves; A is thawed (SIGCONT) and keeps going. A's next save must raise LeaseLostError, none of B's
checkpoints may be deleted or overwritten, and a restore afterwards picks B's newest. On local
disk, on GCS (patched emulator) and on a simulated Drive shared by two VMs with a 3 s delay.
The story's worst case is replayed on Drive too: A is never frozen, B breaks the lease with
force=True while A keeps training and rotating, and A sees the takeover only 3 s late.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ckptsdk.backends import open_backend
from ckptsdk.backends.posix import LOCK_NAME
from ckptsdk.manager import CheckpointManager
from ckptsdk.testing.drive_sim import DriveSim
from tests.support.freezing import freeze
from tests.support.story_child import child_log, read_events, spawn, wait_events

SIM_DELAY = 3.0


@dataclass
class Side:
    """How one process opens the root: URL, storage options, extra environment."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @contextlib.contextmanager
    def _environment(self) -> Iterator[None]:
        """This side's variables, for the duration (drive:// resolves CKPTSDK_DRIVE_ROOT when opened)."""
        old = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def backend(self) -> Any:
        with self._environment():
            return open_backend(self.url, **self.options)

    def read_only(self) -> CheckpointManager:
        with self._environment():
            return CheckpointManager(self.url, read_only=True, storage_options=self.options)


def _spawn(side: Side, events: Path, *args: str) -> subprocess.Popen[bytes]:
    return spawn("train", side.url, events, *args, options=side.options, env=side.env)


def _count(name: str) -> Any:
    return lambda evs: [e for e in evs if e["event"] == name]


def _digests(backend: Any, folder: str) -> dict[str, str] | None:
    import hashlib

    objs = backend.list(folder + "/")
    if not objs:
        return None
    return {o.key: hashlib.sha256(backend.read(o.key)).hexdigest() for o in objs}


class _LeaseArrival:
    """Watches one VM's copy of LEASE.json; ``at``: when a record of a newer epoch than
    ``after_epoch`` was first seen there (the test's monotonic clock, as the children's events)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, *, after_epoch: int) -> None:
        def watch() -> None:
            while self.at is None and not self._stop.wait(0.01):
                try:
                    epoch = json.loads(self.path.read_bytes()).get("epoch")
                except (OSError, ValueError):
                    continue  # not there, or being replaced
                if isinstance(epoch, int) and epoch > after_epoch:
                    self.at = time.monotonic()

        self._thread = threading.Thread(target=watch, name="lease-arrival", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


REPORT: dict[str, dict[str, Any]] = {}


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    [
        "local",
        pytest.param("gcs", marks=pytest.mark.gcs),
        pytest.param("s3", marks=pytest.mark.s3),
        "drive-sim",
        "drive-sim-force",
    ],
)
def test_zombie_cannot_clobber_the_resumed_run(kind: str, make_backend_target: Any, tmp_path: Path) -> None:
    sim: DriveSim | None = None
    frozen = kind != "drive-sim-force"  # else A keeps running and B breaks the lease
    if kind.startswith("drive-sim"):
        sim = DriveSim(tmp_path / "sim", delay=SIM_DELAY, poll=0.05, max_runtime=240).start()
        side_a = Side("drive://run", env=sim.env("vm1"))
        side_b = Side("drive://run", env=sim.env("vm2"))
        ttl = 4.0  # > the 3 s delay plus a renewal period (ttl/3)
    else:
        target = make_backend_target(kind)
        side_a = side_b = Side(target.url, dict(target.options), dict(target.env))
        ttl = 2.0
    ev_a, ev_b = tmp_path / "A.jsonl", tmp_path / "B.jsonl"
    go_b, check_b = tmp_path / "go-b", tmp_path / "check-b"
    common = ["--ttl", str(ttl), "--wait", "90", "--max-seconds", "150", "--keep-last", "3"]
    # Forced over a running zombie on Drive, B reads A's newest checkpoint as its VM sees it,
    # while A's rotation of it (keep_last x interval later) is already on its way: 0.4 s leaves
    # B 1.2 s to read and anchor it on a loaded CI machine (0.2 s would leave 0.6 s).
    proc_a = _spawn(side_a, ev_a, *common, "--interval", "0.2" if frozen else "0.4")
    proc_b = _spawn(
        side_b,
        ev_b,
        *common,
        "--interval",
        "0.2",
        "--saves",
        "3",
        "--go",
        str(go_b),
        "--check",
        str(check_b),
        *([] if frozen else ["--force"]),
    )
    arrived = _LeaseArrival(sim.root("vm1") / "run" / "LEASE.json") if sim is not None else None
    try:
        wait_events(ev_a, proc_a, 90, lambda evs: len(_count("saved")(evs)) >= 8, "8 saves by A")
        if arrived is not None:
            arrived.start(after_epoch=_count("acquired")(read_events(ev_a))[0]["epoch"])
        if sim is not None:
            # The story's premise: A has run long enough for its lease and checkpoints to reach
            # B's VM. (A newcomer that finds the root still empty takes epoch 1 too; only a settle
            # longer than the propagation delay catches that: see test_lease.py.)
            sim.wait_delivered(30)
        wait_events(ev_b, proc_b, 90, _count("ready"), "B ready")
        if frozen:
            # the deleted runtime: frozen, not dead (and not inside the local root's flock: freezing.py)
            freeze(proc_a.pid, Path(side_a.url) / LOCK_NAME if kind == "local" else None)
        t_stop = time.monotonic()
        go_b.touch()
        evs_b = wait_events(ev_b, proc_b, 120, _count("mine"), "B's takeover, resume and saves")
        if frozen:
            os.kill(proc_a.pid, signal.SIGCONT)  # the zombie thaws and keeps training
        t_cont = time.monotonic()
        evs_a = wait_events(
            ev_a, proc_a, 60, lambda evs: _count("lost")(evs) or _count("closed")(evs), "A's LeaseLostError"
        )
        proc_a.wait(60)
        if sim is not None:
            sim.wait_delivered(60)  # whatever the zombie wrote has reached B's VM
        check_b.touch()
        evs_b = wait_events(ev_b, proc_b, 60, _count("closed"), "B's final restore")
        proc_b.wait(30)
        if sim is not None:
            sim.wait_synced(60)
        evs_a = read_events(ev_a)
    finally:
        if arrived is not None:
            arrived.stop()
        for proc in (proc_a, proc_b):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait(10)
        if sim is not None:
            sim.stop()

    a_saved = _count("saved")(evs_a)
    a_lost = _count("lost")(evs_a)
    b_acq = _count("acquired")(evs_b)[0]
    b_restored = _count("restored")(evs_b)[0]
    b_mine: dict[str, dict[str, str]] = _count("mine")(evs_b)[0]["checkpoints"]
    b_final = _count("final_restore")(evs_b)[0]
    a_epoch = _count("acquired")(evs_a)[0]["epoch"]

    # B took over (epoch +1, attempt +1, same run) and resumed from A's newest checkpoint (on
    # Drive: the newest its VM could see).
    assert (b_acq["epoch"], b_acq["attempt"]) == (a_epoch + 1, 2)
    assert b_acq["run_id"] == _count("acquired")(evs_a)[0]["run_id"]
    assert b_restored["lease_epoch"] == a_epoch
    assert b_restored["step"] <= max(e["step"] for e in a_saved)
    assert a_lost, f"A never lost the lease:\n{child_log(ev_a)}"
    assert a_lost[0]["epoch"] == a_epoch
    assert not _count("error")(evs_a), _count("error")(evs_a)
    a_renewed = _count("renewed")(evs_a)
    first_renew_lost = min((e["t"] for e in _count("renew_lost")(evs_a)), default=a_lost[0]["t"])
    # Once A knew it lost the lease, no save of its began (let alone committed).
    assert not [e for e in a_saved if e["t0"] > first_renew_lost], (first_renew_lost, a_saved[-3:])
    if frozen:
        # B took over while A was frozen (after a whole ttl of A's silence, by its own clock:
        # see test_lease.py), and resumed from A's newest save before the freeze.
        assert t_stop < b_acq["t"] < t_cont
        assert max(e["step"] for e in a_saved if e["t"] < t_stop) <= b_restored["step"]
        # The fence is the moment A's store shows B's lease: at once after the thaw where the
        # store is shared (local, GCS); on Drive only once B's LEASE.json has reached A's VM
        # (up to the sync delay after B's takeover). Before that, A cannot know, and a thawed
        # zombie may still commit (issue 29.4: saves 26-28 of a loaded run): those are orphans
        # of a superseded epoch, checked below to be invisible to restore and harmless to B.
        # After it, no save A began committed and no renewal it began succeeded.
        fence = t_cont
        if arrived is not None:
            assert arrived.at is not None, "B's lease never reached A's VM"
            fence = max(t_cont, arrived.at)
        assert not [e for e in a_saved if e["t0"] > fence], (fence, a_saved[-3:])
        assert not [e for e in a_renewed if e["t0"] > fence], (fence, a_renewed[-3:])
        late = [e for e in a_saved if e["t0"] > t_cont]
        assert not late or sim is not None, late  # the window exists on Drive only
        assert all(e["step"] > b_restored["step"] for e in late), late  # orphans by lineage
    else:
        # A kept saving (orphans, invisible to restore) until B's epoch reached its VM; the
        # first renewal A began after that failed (A noticed at once, never wrote over B).
        assert arrived is not None and arrived.at is not None, "B's lease never reached A's VM"
        assert not [e for e in a_renewed if e["t0"] > arrived.at], (arrived.at, a_renewed[-3:])
        assert b_acq["t"] < a_lost[0]["t"]

    # Nothing of B's was deleted or overwritten, on every copy of the root.
    assert b_mine, "B reported no checkpoint of its own"
    sides = [side_b] + ([side_a] if sim is not None else [])
    lost: list[str] = []
    for side in sides:
        backend = side.backend()
        for key, digests in b_mine.items():
            if _digests(backend, key) != digests:
                lost.append(f"{side.env or side.url}:{key}")
    newest_b = max(b_mine, key=lambda k: int(k.split("-")[1].split(".")[0]))
    for side in sides:
        latest = side.read_only().latest()
        assert latest is not None and latest.key == newest_b, (side, latest)
    assert b_final["key"] == newest_b
    took = b_acq["t"] - t_stop  # from A's freeze (or, forced, from B's start) to B holding it
    REPORT[kind] = {
        "death_to_takeover_s" if frozen else "force_takeover_s": round(took, 2),
        "open_to_takeover_s": round(b_acq["t"] - b_acq["t_open"], 2),
        "b_checkpoints": len(b_mine),
        "b_lost": len(lost),
        "a_newer_epoch_seen": a_lost[0]["newer_epoch"],
        "a_saves_after_takeover": len([e for e in a_saved if e["t"] > b_acq["t"]]),
        "a_saves_after_thaw": len([e for e in a_saved if e["t0"] > t_cont]) if frozen else None,
        "takeover_to_a_vm_sees_it_s": round(arrived.at - b_acq["t"], 2) if arrived and arrived.at else None,
    }
    print(f"\nSTORY {kind}: {json.dumps(REPORT[kind])}")
    assert lost == []
