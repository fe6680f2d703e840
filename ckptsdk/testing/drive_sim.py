"""The Drive mount simulated on disk, in real time: one folder shared by several "VMs", for lease
and story tests (the deterministic, in-memory model for property tests is
tests/support/drive_deterministic_sim.py).

Each VM is a plain directory used through ``DriveBackend`` (``CKPTSDK_DRIVE_ROOT`` = that VM's
directory); a syncer thread carries creations, updates and deletions between them through a
"cloud" copy, each change arriving ``delay`` seconds after it was seen. Conflicts resolve
last-writer-wins by the time a change was seen. ``.ckptsdk-*`` names (temp and lock files) never
sync. Not a model of Drive's quirks beyond that (no ``name (1)`` duplicates, no lost uploads).

Example:
    with DriveSim(tmp_path, delay=3.0) as sim:
        a = sim.backend("vm1", "run")  # DriveBackend on vm1's copy of drive://run
        a.write("x", b"1"); sim.wait_synced(timeout=10)
        assert sim.backend("vm2", "run").read("x") == b"1"
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ckptsdk.backends.drive import DriveBackend

logger = logging.getLogger(__name__)

RESERVED = ".ckptsdk-"  # temp files and locks of the backends: local to one VM, never synced
_SIM_TMP = ".ckptsdk-sim."  # our own temp names (reserved too, so never listed nor synced)
_DELETED = None  # a cloud entry / change whose content is None is a deletion

# (size, mtime_ns, inode): what a VM's copy of a file looked like when we last scanned/wrote it
_Sig = tuple[int, int, int]


def _sig(st: os.stat_result) -> _Sig:
    return (st.st_size, st.st_mtime_ns, st.st_ino)


class DriveSim:
    """Several VM folders kept in sync through a simulated cloud, with a delay.

    Args:
        base: a folder (under ``tmp_path``) to hold ``vm*/`` and nothing else.
        vms: the VM names; each gets ``base/NAME`` as its Drive root.
        delay: seconds between a change being seen on one VM and it landing on the others.
        poll: seconds between scans of the VM folders.
        max_runtime: the syncer stops by itself after this many seconds (a bound, not a feature).
    """

    def __init__(
        self,
        base: str | os.PathLike[str],
        *,
        vms: tuple[str, ...] = ("vm1", "vm2"),
        delay: float = 2.0,
        poll: float = 0.05,
        max_runtime: float = 600.0,
    ) -> None:
        self.base = Path(base)
        self.delay = float(delay)
        self.poll = float(poll)
        self.max_runtime = float(max_runtime)
        self.vms = tuple(vms)
        for vm in self.vms:
            (self.base / vm).mkdir(parents=True, exist_ok=True)
        self._known: dict[str, dict[str, _Sig]] = {vm: {} for vm in self.vms}
        self._cloud: dict[str, tuple[float, bytes | None]] = {}  # rel -> (seen_at, content)
        # vm -> rel -> when its latest local change was seen (an older arrival must not undo it)
        self._local_seen: dict[str, dict[str, float]] = {vm: {} for vm in self.vms}
        self._pending: list[tuple[float, int, str, str, float, bytes | None]] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.applied = 0  # changes written onto other VMs (for tests and reports)
        # What the VMs' own changes would cost on Drive (docs/DRIVE.md):
        self.trashed_bytes = 0  # files deleted: Drive's trash keeps them 30 days, on the quota
        self.trashed_files = 0
        self.replaced_bytes = 0  # files renamed over (os.replace): trash or revision, undocumented
        self.revision_bytes = 0  # files rewritten in place: old content kept as a revision
        self.moved_files = 0  # renames of one file (same inode): metadata only
        self.trashed_by_name: dict[str, int] = {}  # trashed bytes by file name (tensor files vs the rest)

    # ------------------------------------------------------------------ public
    def root(self, vm: str) -> Path:
        """The Drive root (``CKPTSDK_DRIVE_ROOT``) of ``vm``."""
        return self.base / vm

    def env(self, vm: str) -> dict[str, str]:
        """Environment for a child process running on ``vm`` (``drive://REL`` opens its copy)."""
        return {"CKPTSDK_DRIVE_ROOT": str(self.root(vm))}

    def backend(self, vm: str, rel: str = "") -> DriveBackend:
        """A ``DriveBackend`` on ``vm``'s copy of ``drive://REL``."""
        root = self.root(vm)
        path = root / rel if rel else root
        old = os.environ.get("CKPTSDK_DRIVE_ROOT")
        os.environ["CKPTSDK_DRIVE_ROOT"] = str(root)  # DriveBackend checks the mount exists
        try:
            return DriveBackend(str(path), url=f"drive://{rel}")
        finally:
            if old is None:
                del os.environ["CKPTSDK_DRIVE_ROOT"]
            else:
                os.environ["CKPTSDK_DRIVE_ROOT"] = old

    def start(self) -> DriveSim:
        """Start the syncer thread (idempotent)."""
        if self._thread is None:
            self._scan_all(initial=True)
            self._thread = threading.Thread(target=self._run, name="drive-sim-syncer", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the syncer; re-raise anything it failed with."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            if self._thread.is_alive():
                raise RuntimeError("drive simulation syncer did not stop within 10 s")
        if self._error is not None:
            raise RuntimeError(f"drive simulation syncer failed: {self._error!r}") from self._error

    def __enter__(self) -> DriveSim:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def wait_synced(self, timeout: float) -> None:
        """Wait until no change is pending and every VM holds the cloud's content.

        Raises:
            TimeoutError: still out of sync after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._error is not None:
                raise RuntimeError("drive simulation syncer failed") from self._error
            with self._lock:
                quiet = not self._pending
            if quiet and self._converged():
                return
            time.sleep(self.poll)
        raise TimeoutError(f"drive simulation under {self.base} not in sync after {timeout} s")

    def wait_delivered(self, timeout: float) -> None:
        """Wait until every change made before this call has reached every VM.

        Unlike :meth:`wait_synced`, this returns while writers keep writing (a lease heartbeat).

        Raises:
            TimeoutError: older changes still pending after ``timeout`` seconds.
        """
        start = time.monotonic()
        deadline = start + timeout
        time.sleep(3 * self.poll)  # the syncer has scanned every VM since ``start``
        while time.monotonic() < deadline:
            if self._error is not None:
                raise RuntimeError("drive simulation syncer failed") from self._error
            with self._lock:
                oldest = min((p[4] for p in self._pending), default=float("inf"))
            if oldest > start + 2 * self.poll:  # changes seen later were made after ``start``
                return
            time.sleep(self.poll)
        raise TimeoutError(f"drive simulation under {self.base}: changes older than {timeout} s still not delivered")

    # ------------------------------------------------------------------ syncer
    def _run(self) -> None:
        started = time.monotonic()
        try:
            while not self._stop.wait(self.poll):
                if time.monotonic() - started > self.max_runtime:
                    logger.warning("drive simulation stops after max_runtime %.0f s", self.max_runtime)
                    return
                self._scan_all()
                self._deliver_due()
        except BaseException as exc:  # surfaced by stop()/wait_synced(), not lost in a thread
            self._error = exc

    def _files(self, vm: str) -> dict[str, _Sig]:
        root = self.root(vm)
        out: dict[str, _Sig] = {}
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(RESERVED)]
            for name in files:
                if name.startswith(RESERVED):
                    continue
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                out[os.path.relpath(path, root).replace(os.sep, "/")] = _sig(st)
        return out

    def _scan_all(self, *, initial: bool = False) -> None:
        for vm in self.vms:
            self._scan(vm, initial=initial)

    def account(self) -> None:
        """Scan every VM now (without the syncer thread): count what their changes cost."""
        self._scan_all()

    def _scan(self, vm: str, *, initial: bool = False) -> None:
        """Turn what changed on ``vm`` since we last looked into pending changes."""
        now = time.monotonic()
        current = self._files(vm)
        known = self._known[vm]
        if not initial:
            self._count_costs(known, current)
        for rel, sig in current.items():
            if known.get(rel) == sig:
                continue
            content = self._read(vm, rel)
            if content is None:  # vanished while we looked: the next scan sees the delete
                continue
            data, real_sig = content
            known[rel] = real_sig
            self._change(vm, rel, now, data, initial=initial)
        for rel in [r for r in known if r not in current]:
            del known[rel]
            self._change(vm, rel, now, _DELETED, initial=initial)

    def _count_costs(self, known: dict[str, _Sig], current: dict[str, _Sig]) -> None:
        """Classify one VM's changes since the last scan by what Drive would keep of them."""
        # A rename keeps the inode and (for the ring's tensor files) the file name. Requiring both
        # keeps a freed inode that a new file of another name reuses from passing as a rename.
        new_inodes = {(sig[2], rel.rpartition("/")[2]): sig for rel, sig in current.items() if known.get(rel) != sig}
        for rel, old in known.items():
            sig = current.get(rel)
            ident = (old[2], rel.rpartition("/")[2])
            if sig is None:
                if ident in new_inodes:
                    self.moved_files += 1  # the same file under another name: no trash
                    if new_inodes[ident][:2] != old[:2]:  # and rewritten since: a revision
                        self.revision_bytes += old[0]
                else:
                    self.trashed_bytes += old[0]
                    self.trashed_files += 1
                    name = rel.rpartition("/")[2]
                    self.trashed_by_name[name] = self.trashed_by_name.get(name, 0) + old[0]
            elif sig != old:
                if sig[2] == old[2]:
                    self.revision_bytes += old[0]
                else:
                    self.replaced_bytes += old[0]

    def _read(self, vm: str, rel: str) -> tuple[bytes, _Sig] | None:
        try:
            with open(self.root(vm) / rel, "rb") as f:
                # fstat of the open file: the signature of exactly the bytes we read.
                return f.read(), _sig(os.fstat(f.fileno()))
        except (FileNotFoundError, IsADirectoryError):
            return None

    def _change(self, vm: str, rel: str, seen_at: float, data: bytes | None, *, initial: bool) -> None:
        due = seen_at if initial else seen_at + self.delay
        self._local_seen[vm][rel] = seen_at
        with self._lock:
            heapq.heappush(self._pending, (due, next(self._seq), vm, rel, seen_at, data))

    def _deliver_due(self) -> None:
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._pending or self._pending[0][0] > now:
                    return
                _due, _n, origin, rel, seen_at, data = heapq.heappop(self._pending)
            current = self._cloud.get(rel)
            if current is not None and current[0] > seen_at:
                continue  # a change seen later already won (last writer wins)
            self._cloud[rel] = (seen_at, data)
            for vm in self.vms:
                if vm != origin and self._local_seen[vm].get(rel, float("-inf")) <= seen_at:
                    self._apply(vm, rel, data)

    def _apply(self, vm: str, rel: str, data: bytes | None) -> None:
        """Write the cloud's version of ``rel`` onto ``vm``, unless ``vm`` changed it since."""
        for _ in range(10):
            if self._apply_once(vm, rel, data):
                return
        raise RuntimeError(f"drive simulation: {vm}/{rel} kept vanishing while the syncer wrote it")

    def _apply_once(self, vm: str, rel: str, data: bytes | None) -> bool:
        """One try of :meth:`_apply`; False when the VM removed the folder meanwhile (try again)."""
        path = self.root(vm) / rel
        known = self._known[vm]
        try:
            st: os.stat_result | None = os.stat(path)
        except FileNotFoundError:
            st = None
        if (_sig(st) if st is not None else None) != known.get(rel):
            # A local change not yet seen: it is newer than what arrives, so it wins. Record it now.
            self._scan(vm)
            return True
        if data is _DELETED:
            if st is not None:
                os.unlink(path)
                known.pop(rel, None)
                self._prune(vm, path.parent)
        else:
            tmp = path.parent / f"{_SIM_TMP}{path.name}.{next(self._seq)}"
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()  # the bytes in the file, so that its size and mtime are final
                    # The signature before the rename, which keeps it (same inode, size, mtime):
                    # the VM may unlink `path` the moment it appears, and a stat after the rename
                    # would kill this thread with FileNotFoundError (issue 28).
                    sig = _sig(os.fstat(f.fileno()))
                os.replace(tmp, path)  # readers on the VM see the old file or the new one
            except FileNotFoundError:
                # The VM removed the folder meanwhile (with our temp file). Look again: a file
                # the VM had is now its newer delete, which wins; one it never had still lands.
                tmp.unlink(missing_ok=True)
                return False
            known[rel] = sig  # if the VM already unlinked it, the next scan carries that delete
        self.applied += 1
        return True

    def _prune(self, vm: str, folder: Path) -> None:
        root = self.root(vm)
        while folder != root and root in folder.parents:
            try:
                folder.rmdir()
            except OSError:
                return
            folder = folder.parent

    def _converged(self) -> bool:
        """Every VM holds exactly the cloud's files, byte for byte (nothing unseen, nothing due)."""
        cloud = {rel: data for rel, (_seen, data) in list(self._cloud.items()) if data is not _DELETED}
        for vm in self.vms:
            if set(self._files(vm)) != set(cloud):
                return False
            for rel, data in cloud.items():
                content = self._read(vm, rel)
                if content is None or content[0] != data:
                    return False
        return True
