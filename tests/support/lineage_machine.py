"""The lineage state machine: writers and a reader on one checkpoint root, invariants after every step.

Shared by the lineage tests (test_lineage_invariants.py runs it over many schedules,
test_lineage_sabotage.py proves its checks catch broken rules, test_lineage_regressions.py reuses
its ``Weights`` and naming helpers); it holds no tests itself.

Two to five writers and a reader share one checkpoint root: a simulated Drive folder
(tests/support/drive_deterministic_sim.py: per-VM views, propagation delays and reorderings drawn by
hypothesis), a real local-disk root, and the memory backend. Writers open (takeover, also with
``force``), restore, save (which rotates), pause, die, close; a reader restores. Everything runs on one fake clock:
lease acquisitions are cooperative tasks that sleep on it, so nothing really sleeps.

Writers are ordered by rank, (lease epoch, tag): the tag is empty where the store has
compare-and-swap and the lease nonce's first 8 hex digits on Drive, where two VMs can share an
epoch but never a rank. Invariants checked after every step (precise forms in ``LineageMachine``);
a failure prints the shrunk schedule as a story: who did what, when, and what each VM could see.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ckptsdk import LeaseOptions
from ckptsdk.backends.local import LocalBackend
from ckptsdk.backends.memory import MemoryBackend
from ckptsdk.errors import (
    LeaseHeldError,
    LeaseLostError,
    NoValidCheckpointError,
)
from ckptsdk.format.layout import SHARED_PREFIX
from ckptsdk.lease import acquire as lease_module
from ckptsdk.manager import CheckpointManager, Simulation
from tests.support.drive_deterministic_sim import FakeClock, FrozenBackend, SimDrive

# A writer's rank is (lease epoch, tag): the tag is "" where the store has compare-and-swap, else
# the first 8 hex digits of the writer's lease nonce, and it is part of every name the writer makes.
Rank = tuple[int, str]
_FOLDER_RE = re.compile(r"^step-(\d{10,})\.e(\d+)(?:\.([0-9a-f]{8}))?/(.+)$")
_KEY_RE = re.compile(r"^step-(\d{10,})\.e(\d+)(?:\.([0-9a-f]{8}))?$")
_LINEAGE_RE = re.compile(r"^lineage/epoch-(\d+)(?:\.([0-9a-f]{8}))?\.json$")
LEASE = "LEASE.json"
POLL = 5.0  # the lease's longest observation poll (ckptsdk.lease.acquire._POLL_MAX)
PAUSES: dict[str, Callable[[float], float]] = {  # how long a pause lasts, given the ttl
    "1 s": lambda ttl: 1.0,
    "10 s": lambda ttl: 10.0,
    "ttl/4": lambda ttl: ttl / 4,
    "ttl/2": lambda ttl: ttl / 2,
    "ttl+5%": lambda ttl: ttl * 1.05,
    "1.5 ttl": lambda ttl: ttl * 1.5,
}


def _folder(key: str) -> tuple[int, Rank, str] | None:
    """(step, writer rank, file name) of a key inside a checkpoint folder, else None."""
    m = _FOLDER_RE.match(key)
    return (int(m.group(1)), (int(m.group(2)), m.group(3) or ""), m.group(4)) if m else None


def _lineage_rank(key: str) -> Rank | None:
    """The writer rank whose lineage record ``key`` is, else None."""
    m = _LINEAGE_RE.match(key)
    return (int(m.group(1)), m.group(2) or "") if m else None


def _key_rank(folder: str) -> Rank:
    """The writer rank of a checkpoint folder name (a ResumePoint's ``key``)."""
    m = _KEY_RE.match(folder)
    assert m is not None, f"not a checkpoint folder name: {folder!r}"
    return int(m.group(2)), m.group(3) or ""


def folder_name(step: int, rank: Rank) -> str:
    """The folder name a writer of ``rank`` must use for ``step``."""
    return f"step-{step:010d}.e{rank[0]}" + (f".{rank[1]}" if rank[1] else "")


def _r(rank: Rank | None) -> str:
    """A rank for the story: e2, or e2.1a2b (the tag's first 4 digits) where it is tagged."""
    if rank is None:
        return "e?"
    return f"e{rank[0]}" + (f".{rank[1][:4]}" if rank[1] else "")


class _Abort(BaseException):
    """Raised inside a parked acquisition whose writer died: unwinds its thread."""


# ---------------------------------------------------------------------- cooperative tasks
@dataclass
class Task:
    name: str
    wake_at: float | None = None
    running: bool = False
    done: bool = False
    abort: bool = False
    result: Any = None
    error: BaseException | None = None
    finished_at: float | None = None
    thread: threading.Thread | None = None


class Coop:
    """Runs blocking calls that sleep on the fake clock as tasks: exactly one thread runs at a time.

    ``sleep`` (given to the lease) parks the calling task until the main thread advances the clock
    past its wake-up time; time passes for everybody (changes in flight are delivered) meanwhile.
    """

    def __init__(self, clock: FakeClock, advance_to: Callable[[float], None]) -> None:
        self.clock = clock
        self._advance_to = advance_to
        self.cv = threading.Condition()
        self.tasks: list[Task] = []
        self._local = threading.local()

    def sleep(self, dt: float) -> None:
        task: Task | None = getattr(self._local, "task", None)
        if task is None:  # the main thread sleeping: just let time pass
            self._advance_to(self.clock.now + max(0.0, dt))
            return
        with self.cv:
            task.wake_at = self.clock.now + max(0.0, dt)
            task.running = False
            self.cv.notify_all()
            if not self.cv.wait_for(lambda: task.running or task.abort, timeout=120):
                task.abort = True
            if task.abort:
                raise _Abort()

    def start(self, name: str, fn: Callable[[], Any]) -> Task:
        task = Task(name)

        def body() -> None:
            self._local.task = task
            with self.cv:
                self.cv.wait_for(lambda: task.running or task.abort, timeout=120)
            try:
                if task.abort:
                    raise _Abort()
                task.result = fn()
            except _Abort:
                pass
            except BaseException as exc:  # kept for the main thread, never escapes the thread
                task.error = exc
            finally:
                with self.cv:
                    task.done, task.running = True, False
                    task.finished_at = self.clock.now
                    self.cv.notify_all()

        task.thread = threading.Thread(target=body, name=f"lineage-{name}", daemon=True)
        self.tasks.append(task)
        task.thread.start()
        self._run(task)
        return task

    def _run(self, task: Task) -> None:
        with self.cv:
            task.running = True
            self.cv.notify_all()
            if not self.cv.wait_for(lambda: not task.running, timeout=120):
                raise RuntimeError(f"task {task.name} did not park or finish within 120 s")

    def advance(self, dt: float) -> None:
        """Let ``dt`` seconds pass: deliver changes and wake sleeping tasks in time order."""
        target = self.clock.now + dt
        for _ in range(100_000):
            due = [t for t in self.tasks if not t.done and t.wake_at is not None and t.wake_at <= target]
            if not due:
                break
            task = min(due, key=lambda t: t.wake_at)  # type: ignore[arg-type,return-value]
            self._advance_to(max(self.clock.now, task.wake_at))  # type: ignore[arg-type]
            task.wake_at = None
            self._run(task)
        self._advance_to(target)

    def kill(self, task: Task) -> None:
        with self.cv:
            task.abort = True
            self.cv.notify_all()
        if task.thread is not None:
            task.thread.join(timeout=30)

    def close(self) -> None:
        for task in self.tasks:
            if not task.done:
                self.kill(task)


# ---------------------------------------------------------------------- writers and taps
#: A frozen base every writer holds (1 MiB: at the threshold of ckptsdk's shared tensor files), so
#: the machine's saves write, refer to, re-home and delete shared files as a fine-tune's do.
BASE = torch.arange(1 << 18, dtype=torch.float32)


class Weights:
    """A one-tensor "model" whose value names who computed it: (writer uid, step), and the frozen base."""

    def __init__(self, uid: int, step: int) -> None:
        self.set(uid, step)
        self.base = BASE.clone()

    def set(self, uid: int, step: int) -> None:
        self.w = torch.tensor([float(uid), float(step)], dtype=torch.float64)

    @property
    def payload(self) -> tuple[int, int]:
        return int(self.w[0]), int(self.w[1])

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w, "base": self.base}

    def load_state_dict(self, tree: dict[str, Any]) -> None:
        if "base" in tree and not torch.equal(tree["base"], BASE):  # a stale or foreign shared file
            raise AssertionError("restored a base that is not the frozen base every writer saved")
        self.w = tree["w"].clone()
        if "base" in tree:
            self.base.copy_(tree["base"])  # in place, as load_state_dict does: it stays put after


@dataclass(repr=False)
class Writer:
    name: str
    uid: int
    vm: str
    force: bool
    backend: Any
    opened_at: float
    state: str = "opening"  # opening, open, failed, dead, closed
    task: Task | None = None
    mgr: CheckpointManager | None = None
    epoch: int | None = None
    tag: str = ""  # "" with compare-and-swap, else the lease nonce's first 8 hex digits
    nonce: str = ""
    step: int = 0
    weights: Weights = field(default_factory=lambda: Weights(0, 0))
    begun: bool = False  # lineage written (restore or first save)
    fenced_seen: str | None = None  # evidence of a higher rank this writer had in view
    solo: bool = True  # no other writer alive during its whole acquisition (liveness applies)
    frozen: bool = False  # its VM stalls: no heartbeat until it next acts

    @property
    def alive(self) -> bool:
        return self.state in ("opening", "open")

    @property
    def rank(self) -> Rank | None:
        return None if self.epoch is None else (self.epoch, self.tag)

    def label(self) -> str:
        return f"{self.name}({self.vm}{',' + _r(self.rank) if self.epoch else ''})"

    def __repr__(self) -> str:  # hypothesis prints drawn writers in the failing schedule
        return self.label()


class _Tap:
    """A writer's (or reader's) backend: forwards everything, reporting writes and deletes first."""

    def __init__(
        self, inner: Any, actor: Writer | None, hook: Callable[[Writer | None, str, str, bytes | None], None]
    ) -> None:
        self._inner = inner
        self._actor = actor
        self._hook = hook
        self.url = inner.url
        self.capabilities = inner.capabilities

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _data(self, data: Any) -> bytes:
        if isinstance(data, (bytes, bytearray, memoryview)):
            return bytes(data)
        return b"".join(bytes(c) for c in data)

    def write(self, key: str, data: Any) -> Any:
        blob = self._data(data)
        self._hook(self._actor, "write", key, blob)
        return self._inner.write(key, blob)

    def create(self, key: str, data: Any) -> Any:
        blob = self._data(data)
        info = self._inner.create(key, blob)
        self._hook(self._actor, "create", key, blob)
        return info

    def replace(self, key: str, data: Any, version: str) -> Any:
        blob = self._data(data)
        info = self._inner.replace(key, blob, version)
        self._hook(self._actor, "replace", key, blob)
        return info

    def delete(self, key: str, *, version: str | None = None) -> None:
        self._hook(self._actor, "delete", key, None)
        self._inner.delete(key, version=version)

    def move(self, src: str, dst: str) -> Any:  # Drive's recycle ring: a delete and a write
        blob = self._inner.read(src)
        self._hook(self._actor, "delete", src, None)
        self._hook(self._actor, "write", dst, blob)
        return self._inner.move(src, dst)

    def overwrite(self, key: str, data: Any) -> Any:
        blob = self._data(data)
        self._hook(self._actor, "write", key, blob)
        return self._inner.overwrite(key, blob)


# ---------------------------------------------------------------------- the machine
class StoryFailure(AssertionError):
    pass


# What the schedules exercised, per machine class (printed by the tests: run with -s to see it).
STATS: dict[str, Counter[str]] = {}


class LineageMachine(RuleBasedStateMachine):
    """Writers and a reader on one checkpoint root; invariants after every step.

    A writer's *rank* is (lease epoch, tag): the tag is "" on stores with compare-and-swap (local,
    memory) and the first 8 hex digits of its lease nonce on Drive, where two VMs can both believe
    they took the same epoch. Ranks compare as tuples; folder and lineage names carry them.

    Ground truth is kept by the machine from what writers did (taps see every write and delete):
    which (step, rank) each writer committed with which payload, which were deleted, and where
    each rank resumed from (its lineage record). The invariants, as checked:

    0. Unique ranks and names, on every backend: no two writers ever hold the same rank, and a
       writer writes manifests and lineage records only under its own rank's names (so two
       writers never write the same folder). On Drive two writers may share an epoch, not a rank.
    1. A restore (reader on any VM view, or a writer) returns a checkpoint whose content is exactly
       what was committed under its (step, rank) (so never torn, never unverified), and never one
       of rank r at a step beyond the point where any higher rank visible in that view (its
       lineage record or a manifest) resumed from; a fresh start orphans every lower rank.
    2. No writer deletes anything in a checkpoint folder of a higher rank than its own.
    3. Once a writer had a higher rank in view when it was called (a lineage record or checkpoint
       folder of a higher rank; LEASE.json of a higher epoch, or, without compare-and-swap, of the
       same epoch and a higher nonce[:8], not released), it writes no manifest from then on.
    4. "Nothing lost". Let H be the highest rank that wrote a lineage record, and T its newest
       committed, undeleted checkpoint (or, if H committed none, the checkpoint H resumed from;
       none if H started fresh). Immediately consistent roots (local, memory): a reader restores
       exactly T after every step. Drive, where "always" cannot mean "on every VM at once":
       (a) once every change in flight has been delivered (uploads are not lost when a writer
       dies), a reader restores exactly T; (b) read-your-writes: on H's own VM a reader restores
       exactly T at every step, before any propagation.
    5. Liveness: a newcomer that was the only live writer during its whole acquisition takes
       over within ttl + settle + one poll (5 s) after the later of its start and the last change
       of LEASE.json that reached its view; it never fails with LeaseHeldError then (not
       promised on late Drive, where it rests on timing: counted only).
    """

    kind = "drive"
    ttl = 300.0
    settle = 60.0
    delays: tuple[float, ...] = (0.0, 2.0, 10.0, 25.0)  # per hop; two hops < settle
    vms = ("vm1", "vm2", "vm3")
    max_writers = 5
    tmp_root: Path | None = None
    _counter = 0

    def __init__(self) -> None:
        super().__init__()
        type(self)._counter += 1
        self.clock = FakeClock()
        self.t0 = self.clock.now
        self.keep_last = 2
        self._draw: Callable[[], float] = lambda: 0.0
        self.sim: SimDrive | None = None
        self._dir: Path | None = None
        self._mem_name: str | None = None
        if self.kind == "drive":
            self.sim = SimDrive(self.clock, delay=lambda hop, key: self._draw())
            self.coop = Coop(self.clock, self.sim.advance_to)
            self._raw = self.sim.backend(self.vms[0])  # for its capabilities only
        else:
            self.coop = Coop(self.clock, self._tick)
            if self.kind == "local":
                assert self.tmp_root is not None
                self._dir = self.tmp_root / f"root-{type(self)._counter}"
                self._raw: Any = LocalBackend(str(self._dir))
            else:
                self._mem_name = f"lineage-{id(self)}-{type(self)._counter}"
                self._raw = MemoryBackend(self._mem_name)
        self.writers: list[Writer] = []
        self.committed: dict[tuple[int, Rank], tuple[int, int]] = {}  # (step, rank) -> payload
        self.committer: dict[tuple[int, Rank], str] = {}
        self.deleted: set[tuple[int, Rank]] = set()
        # Where each rank resumed from, as its lineage record says: (step, epoch), or None.
        self.resume: dict[Rank, tuple[int, int] | None] = {}
        # The same, as the checkpoint it names: (step, rank) (records carry no tag; see _resolve).
        self.resume_ck: dict[Rank, tuple[int, Rank] | None] = {}
        self.rank_owner: dict[Rank, str] = {}
        self.violations: list[str] = []
        self.next_beat = self.clock.now + self.ttl / 3
        self.story: list[str] = []
        self._restoring: dict[str, Weights] = {}  # a writer's restore target (its anchor's payload)
        self._ops: list[str] = []
        self.stats = STATS.setdefault(type(self).__name__, Counter())
        self.stats["schedules"] += 1
        # Lease nonces order the writers of a shared epoch, so they must come from the schedule,
        # not from uuid4: a replayed schedule must behave the same (hypothesis checks that).
        self._nonces: list[str] = []
        self._nonce_seq = itertools.count(1)
        self._real_uuid = lease_module.uuid
        lease_module.uuid = SimpleNamespace(uuid4=self._next_nonce)  # type: ignore[assignment]

    def _next_nonce(self) -> SimpleNamespace:
        """The next acquisition's nonce: the one the schedule drew, else a counter."""
        n = next(self._nonce_seq)
        return SimpleNamespace(hex=self._nonces.pop(0) if self._nonces else f"ffff{n:04x}" + "0" * 24)

    # ------------------------------------------------------------------ plumbing
    def _tick(self, t: float) -> None:
        self.clock.now = max(self.clock.now, t)

    def _t(self) -> str:
        return f"t={self.clock.now - self.t0:7.1f}"

    def _raw_backend(self, vm: str) -> Any:
        if self.sim is not None:
            return self.sim.backend(vm)
        return LocalBackend(str(self._dir)) if self.kind == "local" else MemoryBackend(self._mem_name or "")

    def _view(self, vm: str) -> dict[str, bytes | None]:
        """Keys visible on ``vm``; bytes only for the small JSON objects we inspect."""
        if self.sim is not None:
            return {k: v for k, v in self.sim.visible(vm).items()}
        out: dict[str, bytes | None] = {}
        for obj in self._raw.list(""):
            out[obj.key] = self._raw.read(obj.key) if obj.key == LEASE else None
        return out

    def _vm_names(self) -> list[str]:
        return list(self.sim.views) if self.sim is not None else ["disk"]

    def _describe_view(self, vm: str) -> str:
        view = self._view(vm)
        lease = "-"
        if view.get(LEASE):
            try:
                rec = json.loads(view[LEASE])  # type: ignore[arg-type]
                who = next(
                    (
                        w.name
                        for w in self.writers
                        if w.mgr is not None
                        and w.mgr.lease is not None
                        and w.mgr.lease.record is not None
                        and w.mgr.lease.record.holder.nonce == rec["holder"]["nonce"]
                    ),
                    "?",
                )
                nonce = "" if self._raw.capabilities.compare_and_swap else f".{rec['holder']['nonce'][:4]}"
                lease = f"e{rec['epoch']}{nonce}/{who}{'(released)' if rec.get('released') else ''}"
            except (ValueError, KeyError, TypeError):
                lease = "unreadable"
        folders: dict[tuple[int, Rank], set[str]] = {}
        lineage = []
        for key in view:
            f = _folder(key)
            if f:
                folders.setdefault((f[0], f[1]), set()).add(f[2])
            lr = _lineage_rank(key)
            if lr:
                lineage.append(lr)
        ckpts = []
        for (s, rank), names in sorted(folders.items()):
            mark = (
                ""
                if {"manifest.json", "tensors.safetensors"} <= names
                else ("~torn" if "manifest.json" in names else "?uncommitted")
            )
            if mark == "~torn":
                self.stats["torn checkpoint in a view (manifest before tensors)"] += 1
            ckpts.append(f"{s}{_r(rank)}{mark}")
        lin = ", ".join(_r(r) for r in sorted(lineage))
        return f"{vm}[lease {lease} | {' '.join(ckpts) or 'no ckpt'} | lineage [{lin}]]"

    def _say(self, line: str) -> None:
        ops = f"  ops: {', '.join(self._ops)}" if self._ops else ""
        self._ops = []
        views = " ".join(self._describe_view(vm) for vm in self._vm_names())
        flight = ""
        if self.sim is not None:
            n = len(self.sim.in_flight())
            flight = f" in flight: {n}"
        self.story.append(f"{self._t()} {line}{ops}\n{'':11}sees: {views}{flight}")

    # Invariants counted but not enforced on this machine (see _violate).
    unpromised: tuple[str, ...] = ()

    def _violate(self, text: str) -> None:
        """Record a broken invariant ([N] prefix). An invariant in ``unpromised`` (liveness on late
        Drive, where it rests on timing) is only counted."""
        if text[:3] in self.unpromised:
            self.stats[f"unpromised {text[:3]} seen"] += 1
            return
        self.violations.append(text)

    def _fail(self, what: str) -> None:
        story = "\n".join(self.story[-80:])
        raise StoryFailure(
            f"{what}\n--- the schedule ({self.kind}, keep_last={self.keep_last}, "
            f"ttl={self.ttl:g}, settle={self.settle:g}) ---\n{story}"
        )

    def _hook(self, actor: Writer | None, op: str, key: str, data: bytes | None) -> None:
        """Every write/create/replace/delete, before (write, delete) or after (create, replace) it."""
        who = actor.label() if actor is not None else "reader"
        tag = actor.name if actor is not None else "reader"
        mine = actor.rank if actor is not None else None
        f = _folder(key)
        if f is not None:
            step, rank, name = f
            if op == "delete":
                self._ops.append(f"{tag}:del {step}{_r(rank)}/{name[:3]}")
                if mine is None or rank > mine:
                    self._violate(
                        f"[2] {who} deleted {key}, a checkpoint of {_r(rank)} (a higher rank than its own, {_r(mine)})"
                    )
                if name == "manifest.json":
                    self.deleted.add((step, rank))
                    self.stats["checkpoints deleted"] += 1
            elif name == "manifest.json":
                self._ops.append(f"{tag}:commit {step}{_r(rank)}")
                self.stats["commits"] += 1
                if self.rank_owner and max(self.rank_owner) > rank:
                    self.stats["commits by a superseded writer"] += 1
                if actor is None or mine != rank:
                    self._violate(f"[0] {who} wrote the manifest of {key}, not under its own rank")
                elif self.committer.get((step, rank), actor.name) != actor.name:
                    self._violate(
                        f"[0] {who} wrote the manifest of {key}, which {self.committer[(step, rank)]} committed"
                    )
                elif actor.fenced_seen is not None:
                    self._violate(f"[3] {who} committed {key} after it had a higher rank in view: {actor.fenced_seen}")
                if actor is not None:
                    payload = self._restoring.get(actor.name, actor.weights).payload
                    self.committed[(step, rank)] = payload
                    self.committer.setdefault((step, rank), actor.name)
        if key.startswith(SHARED_PREFIX):  # the frozen base's shared files: the schedules must reach them
            self.stats["shared files deleted" if op == "delete" else "shared files written"] += 1
        lr = _lineage_rank(key)
        if lr is not None and op != "delete" and data is not None:
            rec = json.loads(data)
            point = None if rec["resumed_from_step"] is None else (rec["resumed_from_step"], rec["resumed_from_epoch"])
            self._ops.append(f"{tag}:lineage {_r(lr)} from {point}")
            owner = actor.name if actor is not None else "reader"
            if mine != lr or rec["epoch"] != lr[0]:
                self._violate(f"[0] {who} wrote {key} (epoch {rec['epoch']}), not its own rank's record")
            if lr in self.resume and self.rank_owner.get(lr) != owner:
                self._violate(f"[0] {who} wrote lineage of {_r(lr)}, already written by {self.rank_owner.get(lr)}")
            self.resume[lr] = point
            self.resume_ck[lr] = self._resolve(actor, point)
            self.rank_owner.setdefault(lr, owner)
        if key == LEASE and data is not None and op != "delete":
            self._ops.append(f"{tag}:lease e{json.loads(data)['epoch']}")

    def _resolve(self, actor: Writer | None, point: tuple[int, int] | None) -> tuple[int, Rank] | None:
        """The checkpoint a lineage record's (step, epoch) names. Records carry no tag; on Drive
        two ranks of one epoch may both hold the step: prefer the one whose payload the writer
        is restoring, then one complete in its view, then the highest. (A restore that returns
        replaces this guess by the exact key.)"""
        if point is None:
            return None
        step, epoch = point
        found = [k for k in self.committed if k[0] == step and k[1][0] == epoch]
        if not found:
            return step, (epoch, "")
        target = self._restoring.get(actor.name) if actor is not None else None
        view = self._view(actor.vm) if actor is not None else {}

        def score(k: tuple[int, Rank]) -> tuple[bool, bool, Rank]:
            complete = all(f"{folder_name(*k)}/{n}" in view for n in ("manifest.json", "tensors.safetensors"))
            return (target is not None and self.committed[k] == target.payload, complete, k[1])

        return max(found, key=score)

    def _higher_evidence(self, w: Writer) -> str | None:
        """A key in ``w``'s view that shows a higher rank than ``w``'s, else None."""
        mine = w.rank
        assert mine is not None
        cas = w.backend.capabilities.compare_and_swap
        for key, data in self._view(w.vm).items():
            f = _folder(key)
            if f is not None and f[1] > mine:
                return key
            lr = _lineage_rank(key)
            if lr is not None and lr > mine:
                return key
            if key == LEASE and data:
                try:
                    rec = json.loads(data)
                    epoch, nonce, released = rec["epoch"], rec["holder"]["nonce"], rec.get("released", False)
                except (ValueError, KeyError, TypeError):
                    continue
                if nonce == w.nonce:
                    continue
                if epoch > mine[0] or (epoch == mine[0] and not released and (cas or nonce[:8] > w.nonce[:8])):
                    return f"LEASE.json of epoch {epoch} (nonce {nonce[:8]})"
        return None

    def _note_evidence(self, w: Writer) -> None:
        if w.fenced_seen is None:
            w.fenced_seen = self._higher_evidence(w)

    def _draw_with(self, data: st.DataObject) -> None:
        """Delays for this step's changes, drawn up front (a parked task runs in another thread,
        outside hypothesis' build context) and used in turn, cycling."""
        if self.sim is not None:
            delays = data.draw(st.lists(st.sampled_from(self.delays), min_size=1, max_size=24), label="delays")
            turn = itertools.cycle(delays)
            self._draw = lambda: next(turn)

    def _no_draw(self) -> None:
        self._draw = lambda: 0.0

    # ------------------------------------------------------------------ task completion
    def _bound(self, w: Writer) -> float:
        last = w.opened_at
        if self.sim is not None:
            last = max(last, self.sim.arrived.get((w.vm, LEASE), last))
        settle = 0.0 if self.sim is None else self.settle
        return last + self.ttl + settle + POLL

    def _reap(self) -> None:
        """Turn finished acquisitions into open (or failed) writers; check liveness."""
        for w in self.writers:
            task = w.task
            if task is None or (w.state != "opening" and (task.error is None or w.state == "failed")):
                continue
            if not task.done:
                if w.solo and self.clock.now > self._bound(w):
                    self._violate(
                        f"[5] {w.label()} alone since {w.opened_at - self.t0:.1f} and still not the "
                        f"writer at {self.clock.now - self.t0:.1f} (bound {self._bound(w) - self.t0:.1f})"
                    )
                continue
            assert task.finished_at is not None
            if task.error is not None:
                w.state = "failed"
                self.story.append(
                    f"t={task.finished_at - self.t0:7.1f} {w.label()} open failed: "
                    f"{type(task.error).__name__}: {task.error}"
                )
                if not isinstance(task.error, LeaseHeldError):
                    raise task.error
                self.stats["open failed (LeaseHeldError)"] += 1
                if w.solo:
                    self._violate(f"[5] {w.label()} was the only live writer and got LeaseHeldError: {task.error}")
                continue

    def _became_writer(self, w: Writer, mgr: CheckpointManager) -> None:
        """Called in the opening task the moment its acquisition returns."""
        assert mgr.lease is not None
        now = self.clock.now
        record = mgr.lease.record
        assert record is not None
        w.mgr, w.epoch, w.state = mgr, mgr.lease.epoch, "open"
        w.nonce = record.holder.nonce
        w.tag = "" if w.backend.capabilities.compare_and_swap else w.nonce[:8]
        self.stats["writers opened"] += 1
        if w.epoch > 1:
            self.stats["takeovers"] += 1
        self._say(f"{w.label()} is the writer: epoch {w.epoch} after {now - w.opened_at:.1f} s")
        assert w.rank is not None
        other = self.rank_owner.get(w.rank)
        if other is not None and other != w.name:
            self._violate(f"[0] {w.label()} acquired rank {_r(w.rank)}, which {other} held")
        if any(o is not w and o.epoch == w.epoch for o in self.writers):
            self.stats["epoch shared by two writers (distinct ranks)"] += 1
        self.rank_owner[w.rank] = w.name
        if w.solo and now > self._bound(w):
            self._violate(
                f"[5] {w.label()} alone from {w.opened_at - self.t0:.1f} took over only at "
                f"{now - self.t0:.1f} (bound {self._bound(w) - self.t0:.1f})"
            )

    # ------------------------------------------------------------------ rules
    @initialize(keep_last=st.integers(1, 3))
    def setup(self, keep_last: int) -> None:
        """W1 opens on a fresh root and restores nothing (a fresh start)."""
        self.keep_last = keep_last
        vm = "disk"
        if self.sim is not None:
            vm = self.vms[0]
            self.sim.add_vm(vm)
        self._start_writer(vm, False, True, None)
        self.coop.advance(self.settle + 1.0)
        self._reap()

    @precondition(lambda self: len(self.writers) < self.max_writers)
    @rule(
        data=st.data(), force=st.sampled_from((False, False, True)), then_restore=st.sampled_from((True, True, False))
    )
    def open_writer(self, data: st.DataObject, force: bool, then_restore: bool) -> None:
        """A newcomer starts; with ``then_restore`` it restores the moment it becomes the writer."""
        if self.sim is not None:
            vm = data.draw(st.sampled_from(self.vms), label="vm")
            if vm not in self.sim.views:
                self.sim.add_vm(vm)
        else:
            vm = "disk"
        self._start_writer(vm, force, then_restore, data)

    def _start_writer(self, vm: str, force: bool, then_restore: bool, data: st.DataObject | None) -> None:
        uid = len(self.writers) + 1
        w = Writer(name=f"W{uid}", uid=uid, vm=vm, force=force, backend=None, opened_at=self.clock.now)
        w.backend = _Tap(self._raw_backend(vm), w, self._hook)
        w.solo = not any(o.alive for o in self.writers)
        for o in self.writers:
            if o.state == "opening":
                o.solo = False
        self.writers.append(w)

        def body() -> CheckpointManager:
            mgr = CheckpointManager(
                w.backend,
                keep_last=self.keep_last,
                lease_options=LeaseOptions(ttl=self.ttl, force=force),
                _simulation=Simulation(heartbeat=False, clock=self.clock, sleep=self.coop.sleep),
                run_id="run",
            )
            self._became_writer(w, mgr)
            if then_restore:
                self._restore_impl(w)
            return mgr

        # The nonce: its first 8 hex digits are the writer's tag on Drive; the drawn half orders
        # writers that end up sharing an epoch, the uid half keeps tags unique. (With
        # compare-and-swap no two writers share an epoch: nothing to draw.)
        order = 0x8000
        if data is not None and self.sim is not None:
            order = data.draw(st.integers(0, 0xFFFE), label="nonce order")
        self._nonces.append(f"{order:04x}{uid:04x}" + "0" * 24)
        if data is not None:
            self._draw_with(data)
        try:
            self.stats["opens"] += 1
            self._say(
                f"{w.name} starts opening on {vm}{' with force=True' if force else ''}"
                f"{', will restore' if then_restore else ''}"
            )
            w.task = self.coop.start(w.name, body)
        finally:
            self._no_draw()
        self._reap()

    @rule(data=st.data(), how_long=st.sampled_from(tuple(PAUSES)))
    def pause(self, data: st.DataObject, how_long: str) -> None:
        self.pause_for(data, PAUSES[how_long](self.ttl))

    def _open_writers(self) -> list[Writer]:
        return [w for w in self.writers if w.state == "open"]

    @precondition(lambda self: any(w.state == "open" and not w.begun for w in self.writers))
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        """A writer that became the writer earlier restores only now (time may have passed)."""
        w = data.draw(st.sampled_from([w for w in self.writers if w.state == "open" and not w.begun]), label="writer")
        self._draw_with(data)
        try:
            self._restore_impl(w)
        finally:
            self._no_draw()

    def _restore_impl(self, w: Writer) -> None:
        assert w.mgr is not None
        w.frozen = False
        self._note_evidence(w)
        state = Weights(0, 0)
        self._restoring[w.name] = state
        try:
            rp = None
            try:
                rp = w.mgr.restore(state)
                # A takeover's anchor (the restored checkpoint re-committed under this rank) may
                # run on a worker thread: finish it now, so the schedule stays deterministic.
                w.mgr.wait()
            except (LeaseLostError, NoValidCheckpointError) as exc:
                self.stats["writer restore refused"] += 1
                self._say(f"{w.label()} restore refused: {type(exc).__name__}: {exc}")
                return
        finally:
            self._restoring.pop(w.name, None)
        w.begun = True
        if rp is None:
            self._say(f"{w.label()} restores: fresh start")
            if self.resume.get(w.rank, "missing") is not None:  # type: ignore[arg-type]
                self._violate(
                    f"[1] {w.label()} restored nothing but its lineage says {self.resume.get(w.rank, 'missing')}"
                )  # type: ignore[arg-type]
            return
        w.weights = state
        w.step = rp.step
        self.stats["writer restores a checkpoint"] += 1
        self._say(f"{w.label()} restores {rp.key} (payload {state.payload})")
        self._check_restored(f"{w.label()}'s restore", w.vm, rp.step, _key_rank(rp.key), state.payload)
        assert w.rank is not None
        if self.resume.get(w.rank, "missing") != (rp.step, rp.lease_epoch):
            self._violate(
                f"[1] {w.label()} restored {rp.key} but its lineage record says {self.resume.get(w.rank, 'missing')}"
            )
        else:
            self.resume_ck[w.rank] = (rp.step, _key_rank(rp.key))

    @precondition(lambda self: any(w.state == "open" for w in self.writers))
    @rule(data=st.data(), steps=st.integers(1, 2))
    def save(self, data: st.DataObject, steps: int) -> None:
        w = data.draw(st.sampled_from(self._open_writers()), label="writer")
        self._save_impl(w, data, steps)

    def _save_impl(self, w: Writer, data: st.DataObject, steps: int) -> None:
        assert w.mgr is not None
        w.frozen = False
        self._note_evidence(w)
        step = w.step + 10 * steps
        before = dict(self.committed)
        self._draw_with(data)
        try:
            w.weights.set(w.uid, step)
            w.mgr.save(w.weights, step=step)
            # Rotation after a commit runs on a worker thread: finish it now (its listing draws
            # delays too), so the schedule stays deterministic.
            w.mgr.wait()
        except LeaseLostError as exc:
            self.stats["save refused (fenced)"] += 1
            self._say(
                f"{w.label()} save step {step} refused: LeaseLostError "
                f"({f'fenced by epoch {exc.newer_epoch}' if exc.newer_epoch else 'stale lease'})"
            )
            return
        finally:
            self._no_draw()
        w.begun = True
        w.step = step
        new = sorted(set(self.committed) - set(before))
        self._say(f"{w.label()} saves step {step}" + ("" if new else " (nothing committed)"))

    @precondition(lambda self: len(self.writers) < self.max_writers and any(w.state == "open" for w in self.writers))
    @rule(data=st.data(), steps=st.integers(1, 2))
    def forced_takeover_while_training(self, data: st.DataObject, steps: int) -> None:
        """The story's accident as one step: a newcomer on another VM forces the lease (and
        restores) while the old writer keeps training; once the newcomer's settle is over, the old
        writer saves again (it has not necessarily seen anything yet)."""
        old = data.draw(st.sampled_from(self._open_writers()), label="old writer")
        vm = "disk"
        if self.sim is not None:
            vm = data.draw(st.sampled_from([v for v in self.vms if v != old.vm]), label="newcomer vm")
            if vm not in self.sim.views:
                self.sim.add_vm(vm)
        self._start_writer(vm, True, True, data)
        self.pause_for(data, self.settle + 1.0)
        if old.state == "open":
            self._save_impl(old, data, steps)

    def pause_for(self, data: st.DataObject, seconds: float) -> None:
        """Time passes for everybody: changes arrive, acquisitions wake, and every open writer
        that is not frozen renews its lease every ttl/3 (the heartbeat thread, made deterministic)."""
        target = self.clock.now + seconds
        beats: list[str] = []
        self._draw_with(data)
        try:
            for _ in range(10_000):
                if self.next_beat > target:
                    break
                self.coop.advance(max(0.0, self.next_beat - self.clock.now))
                self._reap()
                self.next_beat += self.ttl / 3
                for w in self._open_writers():
                    if w.frozen or w.mgr is None or w.mgr.lease is None or w.mgr.lease.fenced:
                        continue
                    self._note_evidence(w)
                    try:
                        w.mgr.lease.renew()
                        self.stats["heartbeat renewals"] += 1
                    except LeaseLostError:
                        self.stats["heartbeat found itself fenced"] += 1
                        beats.append(f"{w.label()} heartbeat: fenced")
            self.coop.advance(max(0.0, target - self.clock.now))
        finally:
            self._no_draw()
        self._reap()
        self._say(f"{seconds:g} s pass" + (f" ({'; '.join(beats)})" if beats else ""))

    @precondition(lambda self: any(w.state == "open" and not w.frozen for w in self.writers))
    @rule(data=st.data())
    def freeze(self, data: st.DataObject) -> None:
        """A writer's VM stalls (no heartbeat) until the writer next does something."""
        w = data.draw(st.sampled_from([w for w in self._open_writers() if not w.frozen]), label="writer")
        w.frozen = True
        self._say(f"{w.label()} freezes (no heartbeat until it next acts)")

    @precondition(lambda self: any(w.state == "open" for w in self.writers))
    @rule(data=st.data(), steps=st.integers(1, 2))
    def save_again(self, data: st.DataObject, steps: int) -> None:
        """Saving is what writers do most: a second rule doubles its weight."""
        self.save(data, steps)

    @precondition(lambda self: any(w.alive for w in self.writers) and sum(w.state == "dead" for w in self.writers) < 3)
    @rule(data=st.data())
    def die(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from([w for w in self.writers if w.alive]), label="writer")
        if w.state == "opening" and w.task is not None:
            self.coop.kill(w.task)
        w.state = "dead"
        self.stats["deaths"] += 1
        self._say(f"{w.label()} dies (VM gone; nothing closed)")

    @precondition(lambda self: any(w.state == "open" for w in self.writers))
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from(self._open_writers()), label="writer")
        assert w.mgr is not None
        self._note_evidence(w)
        self._draw_with(data)
        try:
            w.mgr.close()
        finally:
            self._no_draw()
        w.state = "closed"
        self.stats["closes"] += 1
        self._say(f"{w.label()} closes (releases the lease)")

    @rule(data=st.data())
    def reader_restores(self, data: st.DataObject) -> None:
        vm = data.draw(st.sampled_from(self._vm_names()), label="reader vm")
        rp, payload = self._read(self._raw_backend(vm))
        if rp is None:
            self._say(f"reader on {vm} restores: {payload}")
            return
        self.stats["reader restores a checkpoint"] += 1
        self._say(f"reader on {vm} restores {rp.key}")
        self._check_restored(f"reader on {vm}", vm, rp.step, _key_rank(rp.key), payload)

    # ------------------------------------------------------------------ checks
    def _read(self, backend: Any) -> tuple[Any, Any]:
        reader = CheckpointManager(_Tap(backend, None, self._hook), read_only=True)
        state = Weights(0, 0)
        try:
            rp = reader.restore(state)
        except NoValidCheckpointError as exc:
            self.stats["restore: NoValidCheckpointError"] += 1
            return None, f"NoValidCheckpointError ({exc})"
        if any(c.orphan for c in reader.list()):
            self.stats["restore with orphans present"] += 1
        return rp, (state.payload if rp is not None else "nothing (fresh start)")

    def _check_restored(self, who: str, vm: str | None, step: int, rank: Rank, payload: Any) -> None:
        truth = self.committed.get((step, rank))
        if truth is None:
            self._violate(f"[1] {who} got step {step} of {_r(rank)}, which nobody committed")
        elif truth != payload:
            self._violate(f"[1] {who} got step {step} of {_r(rank)} with payload {payload}, committed was {truth}")
        if vm is None:
            return
        for key in self._view(vm):
            higher = _lineage_rank(key)
            f = _folder(key)
            if f is not None and f[2] == "manifest.json":
                higher = f[1]
            if higher is None or higher <= rank or higher not in self.resume:
                continue
            if not self._counts(higher, self._view(vm)):
                continue
            point = self.resume[higher]
            if point is None or step > point[0]:
                self._violate(
                    f"[1] {who} got step {step} of {_r(rank)}, but {_r(higher)} (visible as {key}) resumed from {point}"
                )

    def _counts(self, rank: Rank, keys: Any) -> bool:
        """Whether the lineage record of ``rank`` supersedes anything: not a fresh start whose
        writer saved nothing (no folder of ``rank`` among ``keys``), which erases no run's progress."""
        if self.resume.get(rank) is not None:
            return True
        return any((f := _folder(k)) is not None and f[1] == rank for k in keys)

    def _tip(self, keys: Any = ()) -> tuple[int, Rank] | None:
        """The newest committed, undeleted checkpoint of the highest rank with a lineage record
        that counts (see ``_counts``; else the checkpoint that rank resumed from; None for a
        fresh start)."""
        counted = [r for r in self.resume if self._counts(r, keys)]
        if not counted:
            return None
        top = max(counted)
        own = [s for (s, r) in self.committed if r == top and (s, r) not in self.deleted]
        if own:
            return max(own), top
        point = self.resume_ck[top]
        if point is None:
            return None
        if point in self.deleted:
            self._violate(
                f"[4] {_r(top)} resumed from step {point[0]} of {_r(point[1])}, which was "
                "deleted before it committed anything of its own"
            )
        return point

    def _expect_tip(self, where: str, backend: Any) -> None:
        tip = self._tip([o.key for o in backend.list("")])
        rp, payload = self._read(backend)
        got = None if rp is None else (rp.step, _key_rank(rp.key))
        if got != tip:
            self._violate(
                f"[4] {where}: a reader restores {got} ({payload}); the newest checkpoint of the highest rank is {tip}"
            )
        elif got is not None and self.committed.get(got) != payload:
            self._violate(
                f"[1] {where}: restored {got} with payload {payload}, committed was {self.committed.get(got)}"
            )

    @invariant()
    def invariants_hold(self) -> None:
        self._reap()
        if self.sim is None:
            self._expect_tip("after this step", self._raw_backend("disk"))
        else:
            self._expect_tip("once everything in flight is delivered", FrozenBackend(self.sim.converged_cloud()))
            if self.resume:
                top = max(self.resume)
                owner = next((w for w in self.writers if w.name == self.rank_owner.get(top)), None)
                # (a fresh start that saved nothing supersedes nothing: its VM has no claim then,
                # and lower writers' checkpoints may still be in flight to it)
                if owner is not None and self._counts(top, self._view(owner.vm)):
                    self._expect_tip(f"on {owner.vm}, the VM of {_r(top)}", self._raw_backend(owner.vm))
        if self.violations:
            self._fail("invariant broken: " + "; ".join(dict.fromkeys(self.violations)))

    def teardown(self) -> None:
        self.coop.close()
        lease_module.uuid = self._real_uuid  # type: ignore[assignment]
        for w in self.writers:
            if w.mgr is not None:
                # A dead VM runs no exit handlers: keep the manager's atexit close from releasing
                # leases of this finished simulation.
                w.mgr._shutdown._closed = True
                w.mgr = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        if self._mem_name is not None:
            MemoryBackend.discard_store(self._mem_name)


class DriveLateLineage(LineageMachine):
    """Drive as docs/DRIVE.md describes it: changes reach other VMs up to 20 minutes late (far beyond
    the settle time and the ttl). The lease cannot exclude anyone then (two writers may share an
    epoch, never a rank); ranks and lineage must keep invariants 0-4. Liveness (5) rests on
    timing and is only counted."""

    delays = (0.0, 5.0, 30.0, 90.0, 240.0, 600.0)
    unpromised = ("[5]",)


class LocalLineage(LineageMachine):
    kind = "local"
    ttl = 60.0
    settle = 0.0
    max_writers = 4
    unpromised = ()  # compare-and-swap: every invariant, 0-5, is promised


class MemoryLineage(LineageMachine):
    kind = "memory"
    ttl = 60.0
    settle = 0.0
    max_writers = 4
    unpromised = ()
