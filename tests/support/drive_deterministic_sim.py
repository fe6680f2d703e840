"""A deterministic, in-memory simulation of one Google Drive folder shared by several "VMs".

For the lineage property tests (tests/support/lineage_machine.py, run by tests/test_lineage_*.py): no
threads, no disk, no real time.
Each VM has its own view; a VM's change lands in its view at once, reaches the "cloud" after an
upload delay and every other VM after a further download delay, each delay asked of a
``delay`` callable (the test draws them from hypothesis, so files arrive out of order: a manifest
before its tensors, a delete before the write it follows). Conflicts resolve last-writer-wins by
the moment a change was made. ``create``/``replace`` check only the writing VM's view, as on the
real mount. Real-thread Drive simulation for story tests lives in ckptsdk/testing/drive_sim.py, not here.
"""

from __future__ import annotations

import heapq
import io
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckptsdk.backends.base import Data, ObjectInfo, check_key, check_prefix, iter_chunks
from ckptsdk.backends.drive import DriveBackend
from ckptsdk.errors import ObjectNotFound, PreconditionFailed

CLOUD = "cloud"

# The simulation models the real Drive backend: it claims exactly what that backend claims.
DRIVE_CAPABILITIES = DriveBackend.capabilities


@dataclass(frozen=True)
class Obj:
    """One revision of a key: its bytes (None: a deletion), version token, and LWW stamp."""

    data: bytes | None
    version: str
    stamp: tuple[float, int]  # (time the change was made, global sequence number)
    origin: str  # the VM that made it


class FakeClock:
    """Monotonic seconds that move only when the simulation says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now


class SimDrive:
    """The cloud copy, each VM's view, and the changes in flight between them.

    Args:
        clock: the shared fake clock (the lease reads it too).
        delay: ``delay(hop, key) -> seconds`` for one change on one hop (``"up"``: VM to cloud,
            ``"down:VM"``: cloud to that VM). Default: 0 (immediately consistent).
    """

    def __init__(self, clock: FakeClock | None = None, delay: Callable[[str, str], float] | None = None) -> None:
        self.clock = clock or FakeClock()
        self.delay: Callable[[str, str], float] = delay or (lambda hop, key: 0.0)
        self.cloud: dict[str, Obj] = {}
        self.views: dict[str, dict[str, Obj]] = {}
        # When a key last changed in a VM's view because of *another* VM (for liveness bounds).
        self.arrived: dict[tuple[str, str], float] = {}
        self._pending: list[tuple[float, int, str, str, Obj]] = []  # (due, seq, dest, key, obj)
        self._seq = itertools.count(1)

    # ------------------------------------------------------------------ VMs
    def add_vm(self, vm: str) -> None:
        """A VM mounting the folder now: it starts from the cloud's current content."""
        if vm in self.views:
            raise ValueError(f"VM {vm!r} exists")
        self.views[vm] = dict(self.cloud)

    def backend(self, vm: str) -> SimDriveBackend:
        """A Drive backend as seen from ``vm``."""
        return SimDriveBackend(self, vm)

    # ------------------------------------------------------------------ time
    @property
    def now(self) -> float:
        return self.clock.now

    def advance_to(self, t: float) -> None:
        """Deliver, in due order, every change due by ``t``; then set the clock to ``t``."""
        while self._pending and self._pending[0][0] <= t:
            due, _seq, dest, key, obj = heapq.heappop(self._pending)
            self.clock.now = max(self.clock.now, due)
            self._deliver(dest, key, obj)
        self.clock.now = max(self.clock.now, t)

    def lose_vm(self, vm: str) -> int:
        """The VM vanishes: its uploads still in flight are lost (docs/DRIVE.md: what is not yet
        uploaded is lost with the VM). Returns how many changes were dropped."""
        keep = [p for p in self._pending if not (p[2] == CLOUD and p[4].origin == vm)]
        dropped = len(self._pending) - len(keep)
        self._pending = keep
        heapq.heapify(self._pending)
        return dropped

    def in_flight(self, key: str | None = None) -> list[tuple[float, str, str, Obj]]:
        """Changes not yet delivered (due, dest, key, obj), optionally of one key."""
        return [(d, dest, k, o) for d, _s, dest, k, o in sorted(self._pending) if key is None or k == key]

    def converged_cloud(self) -> dict[str, Obj]:
        """What every VM will hold once all changes in flight are delivered (changes are never lost)."""
        cloud = dict(self.cloud)
        for _due, _seq, dest, key, obj in self._pending:
            if dest == CLOUD:
                cur = cloud.get(key)
                if cur is None or cur.stamp < obj.stamp:
                    cloud[key] = obj
        # A change already on its way down has reached the cloud first, so it is in ``cloud``.
        return {k: o for k, o in cloud.items() if o.data is not None}

    # ------------------------------------------------------------------ changes
    def change(self, vm: str, key: str, data: bytes | None) -> Obj:
        """A change made on ``vm`` now: in its view at once, uploaded after a delay."""
        seq = next(self._seq)
        obj = Obj(data=data, version=f"v{seq}", stamp=(self.now, seq), origin=vm)
        self.views[vm][key] = obj
        heapq.heappush(self._pending, (self.now + float(self.delay("up", key)), seq, CLOUD, key, obj))
        return obj

    def _deliver(self, dest: str, key: str, obj: Obj) -> None:
        target = self.cloud if dest == CLOUD else self.views[dest]
        cur = target.get(key)
        if cur is not None and cur.stamp >= obj.stamp:
            return  # last writer wins: an older change arriving late is dropped
        target[key] = obj
        if dest == CLOUD:
            for vm in self.views:
                if vm != obj.origin:
                    due = self.now + float(self.delay(f"down:{vm}", key))
                    heapq.heappush(self._pending, (due, next(self._seq), vm, key, obj))
        else:
            self.arrived[(dest, key)] = self.now

    # ------------------------------------------------------------------ inspection
    def visible(self, vm: str) -> dict[str, bytes]:
        """The keys ``vm`` sees now and their bytes."""
        return {k: o.data for k, o in self.views[vm].items() if o.data is not None}


class SimDriveBackend:
    """The Backend protocol over one VM's view of a :class:`SimDrive` (Drive capabilities)."""

    capabilities = DRIVE_CAPABILITIES

    def __init__(self, sim: SimDrive, vm: str) -> None:
        self.sim = sim
        self.vm = vm
        self.url = f"simdrive://{vm}/run"

    def _view(self) -> dict[str, Obj]:
        return self.sim.views[self.vm]

    def _get(self, key: str) -> Obj:
        check_key(key, url=self.url)
        obj = self._view().get(key)
        if obj is None or obj.data is None:
            raise ObjectNotFound(f"no object {key!r} under {self.url}", url=self.url, key=key)
        return obj

    def read(self, key: str) -> bytes:
        data = self._get(key).data
        assert data is not None
        return data

    def open(self, key: str) -> BinaryIO:
        return io.BytesIO(self.read(key))

    def stat(self, key: str) -> ObjectInfo:
        obj = self._get(key)
        assert obj.data is not None
        return ObjectInfo(key, len(obj.data), obj.version, obj.stamp[0])

    def exists(self, key: str) -> bool:
        check_key(key, url=self.url)
        obj = self._view().get(key)
        return obj is not None and obj.data is not None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        check_prefix(prefix, url=self.url)
        return [
            ObjectInfo(k, len(o.data), o.version, o.stamp[0])
            for k, o in sorted(self._view().items())
            if o.data is not None and k.startswith(prefix)
        ]

    def write(self, key: str, data: Data) -> ObjectInfo:
        check_key(key, url=self.url)
        blob = b"".join(bytes(c) for c in iter_chunks(data))
        obj = self.sim.change(self.vm, key, blob)
        return ObjectInfo(key, len(blob), obj.version, obj.stamp[0])

    def create(self, key: str, data: Data) -> ObjectInfo:
        # Checks this VM's view only: another VM's object of the same name may be in flight.
        if self.exists(key):
            raise PreconditionFailed(
                f"create of {key!r} under {self.url}: it exists on this VM",
                url=self.url,
                key=key,
                expected=None,
                actual=self._view()[key].version,
            )
        return self.write(key, data)

    def replace(self, key: str, data: Data, version: str) -> ObjectInfo:
        obj = self._view().get(key)
        actual = None if obj is None or obj.data is None else obj.version
        if actual != version:
            raise PreconditionFailed(
                f"replace of {key!r} under {self.url}: version {actual}, expected {version}",
                url=self.url,
                key=key,
                expected=version,
                actual=actual,
            )
        return self.write(key, data)

    def delete(self, key: str, *, version: str | None = None) -> None:
        obj = self._get(key)
        if version is not None and obj.version != version:
            raise PreconditionFailed(
                f"delete of {key!r} under {self.url}: version {obj.version}, expected {version}",
                url=self.url,
                key=key,
                expected=version,
                actual=obj.version,
            )
        self.sim.change(self.vm, key, None)

    def move(self, src: str, dst: str) -> ObjectInfo:
        """The recycle ring's rename: gone from ``src``, there at ``dst`` (checked in this view)."""
        data = self.read(src)
        if self.exists(dst):
            raise PreconditionFailed(
                f"move to {dst!r} under {self.url}: it exists on this VM",
                url=self.url,
                key=dst,
                expected=None,
                actual=self._view()[dst].version,
            )
        info = self.write(dst, data)
        self.sim.change(self.vm, src, None)
        return info

    def overwrite(self, key: str, data: Data) -> ObjectInfo:
        """A rewrite in place of an existing file (atomic here; readers verify digests anyway)."""
        self._get(key)
        return self.write(key, data)

    def sweep(self, older_than: float, *, only: Any = None) -> list[str]:
        return []


class FrozenBackend(SimDriveBackend):
    """A read-only snapshot (e.g. :meth:`SimDrive.converged_cloud`) served through the protocol."""

    def __init__(self, objects: dict[str, Obj], name: str = "converged") -> None:
        sim = SimDrive()
        sim.views[name] = dict(objects)  # same version tokens as in the simulation
        super().__init__(sim, name)
        self.url = f"simdrive://{name}/run"
