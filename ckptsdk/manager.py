"""CheckpointManager: save, restore and rotate checkpoints of one run under one root URL.

It owns the writer lease (fencing), the per-attempt step log, lineage records and an optional
background save worker. Encoding a state tree, the tensor-file format, the lease protocol and the
retention policies live in their own modules; this one orders them so that every crash window
leaves the previous committed checkpoint intact.

Ordering that matters (each is a crash window or a zombie window):
  - tensors first, manifest last: a checkpoint exists only once its manifest is published;
  - the lease is renewed before anything is written and again before anything is deleted;
  - a writer deletes only checkpoints of its own epoch or older (never a newer epoch's), nothing
    while fenced, never the newest, never its resume point until a newer one is committed;
  - deletion removes the manifest first, then the data.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch

from . import catalog as _catalog
from . import codec, retention
from .backends import open_backend
from .backends.base import Backend
from .catalog import MANIFEST, TENSORS, CheckpointInfo, Rank, checkpoint_dir, lineage_key
from .errors import (
    BackendError,
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    LeaseLostError,
    ManifestError,
    NoValidCheckpointError,
    ObjectNotFound,
    PreconditionFailed,
)
from .lease import Lease
from .manifest import Environment, FileEntry, LineageRecord, Manifest, Position, Writer, user_fields
from .audit import audit as _audit
from .runlog import RunLog
from .state import preflight
from .staging import Stager
from .tensorfile import DIGEST_ALGORITHM, read_tensorfile, verify_file, write_tensorfile

logger = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "ResumePoint", "GcReport"]


@dataclass(frozen=True)
class ResumePoint:
    """Where a restored run continues: what ``restore()`` returns.

    Attributes:
        step: the saved step (the next step to run is ``step + 1``).
        epoch: the training epoch saved with it, if any.
        batch_idx: the batch index within that epoch, if any.
        extra: free-form position fields the job saved.
        metrics: metrics saved with the checkpoint.
        tags: string tags saved with the checkpoint (e.g. a dataset hash).
        key: the checkpoint folder restored from.
        lease_epoch: the lease epoch that wrote it.
    """

    step: int
    epoch: int | None
    batch_idx: int | None
    extra: dict[str, Any]
    metrics: dict[str, Any]
    tags: dict[str, str]
    key: str
    lease_epoch: int


@dataclass(frozen=True)
class GcReport:
    """What ``gc`` removed (or would remove, with ``dry_run``), each with why."""

    deleted: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    dry_run: bool = False


class _BackgroundSave:
    """One save in flight on a worker thread; its failure is kept until someone asks."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def start(self, fn: Any, name: str) -> None:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # kept and re-raised on the caller's thread
                with self._lock:
                    self._error = exc

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the save in flight; re-raise its failure here. False if still running."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error
        return True


class CheckpointManager:
    """Checkpoints of one training run under one root URL.

    Opening a manager for writing acquires the root's writer lease (waiting for, or taking over
    from, a previous writer as the lease rules say); ``read_only=True`` never touches the lease.

    Args:
        url: the root: a path, ``file://``, ``drive://REL``, ``gs://bucket/prefix``, ``memory://name``.
        keep_last: committed checkpoints to keep (the newest is always kept).
        keep_every: also keep, forever, every checkpoint whose step is a multiple of this.
        save_every: ``should_save(step)`` is true every this many steps.
        lease_ttl: seconds a silent lease must stay unchanged before a newcomer takes over.
            None: 60 s on local disk and GCS, 300 s on Drive (see :mod:`ckptsdk.lease`).
        lease_wait: seconds to wait for a live holder before ``LeaseHeldError`` (None: five ttls).
        lease_settle: on backends without compare-and-swap (Drive): seconds between writing the
            lease and reading it back to confirm it is ours. Must exceed the time another VM's
            write takes to reach this one. None: ttl/5 on Drive, 0 elsewhere.
        force: break a live lease at once (only when you know the other writer is gone).
        read_only: inspect without taking the lease; ``save`` is refused.
        storage_options: passed to fsspec for ``gs://`` (``endpoint_url``, ``token``, ...).
        async_save: make ``save`` non-blocking by default (see ``save(blocking=)``).
        run_id: name of the run (kept across takeovers); a new uuid on a fresh root by default.
        heartbeat: renew the lease from a background thread every ttl/3 (off only in
            simulations that drive time themselves; then every save still renews).
        clock, sleep: the lease's monotonic clock and sleep, injectable for simulations.

    Example:
        >>> mgr = CheckpointManager("memory://doc", keep_last=2, save_every=10, lease_ttl=5)
        >>> state = TrainState(model=torch.nn.Linear(2, 2))
        >>> mgr.restore(state) is None
        True
        >>> mgr.save(state, step=10).step
        10
        >>> mgr.close()
    """

    def __init__(
        self,
        url: str | Backend,
        *,
        keep_last: int = 3,
        keep_every: int | None = None,
        save_every: int | None = None,
        lease_ttl: float | None = None,
        lease_wait: float | None = None,
        lease_settle: float | None = None,
        force: bool = False,
        read_only: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        async_save: bool = False,
        run_id: str | None = None,
        heartbeat: bool = True,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1, got {keep_last}: the newest checkpoint is always kept")
        if save_every is not None and save_every < 1:
            raise ConfigError(f"save_every must be >= 1 or None, got {save_every}")
        if isinstance(url, (str, os.PathLike)):
            self.url = os.fspath(url)
            self.backend: Backend = open_backend(self.url, **dict(storage_options or {}))
        else:  # an already opened backend (custom storage, simulations)
            self.backend = url
            self.url = url.url
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.save_every = save_every
        self.read_only = read_only
        self.async_save = async_save
        self._memo: dict[tuple[str, str], object] = {}
        self._lock = threading.RLock()
        self._bg = _BackgroundSave()
        self._stager: Stager | None = None
        self._closed = False
        self._lineage_written = False
        self._trashed_bytes = 0
        self._trash_warned = False
        self.resumed_from: CheckpointInfo | None = None
        self.restored_manifest: Manifest | None = None
        self.lease: Lease | None = None
        self.runlog: RunLog | None = None
        if read_only:
            return
        self.lease = Lease(self.backend, ttl=lease_ttl, force=force, run_id=run_id, wait_timeout=lease_wait,
                           settle=lease_settle, clock=clock, sleep=sleep)
        # Epochs never go back, even on a root whose LEASE.json was lost: names stay unique.
        record = self.lease.acquire(min_epoch=self._scan().max_epoch + 1)
        # Where compare-and-swap makes every epoch exclusive the tag is empty; on Drive two VMs
        # can take the same epoch, and the tag keeps their names apart and orders them.
        self._tag = "" if self.backend.capabilities.compare_and_swap else record.holder.nonce[:8]
        self._rank: Rank = (self.lease.epoch, self._tag)
        if heartbeat:
            self.lease.start_heartbeat()
        self.runlog = RunLog(
            self.backend, run_id=self.lease.run_id, attempt=self.lease.attempt,
            lease_epoch=self.lease.epoch, resumed_from_step=None,
        )
        # An interpreter exit with a save in flight waits for it (or says it abandons it).
        atexit.register(_close_at_exit, weakref.ref(self))
        logger.info(
            "writer of %s: run %s, attempt %d, lease epoch %d",
            self.url, self.lease.run_id, self.lease.attempt, self.lease.epoch,
        )

    # ------------------------------------------------------------------ reading

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint folder under the root (valid or not, with why), oldest first."""
        return self._scan().checkpoints

    def latest(self) -> CheckpointInfo | None:
        """The newest restorable checkpoint (sizes checked, digests not yet), or None."""
        good = self._scan().restorable()
        return good[0] if good else None

    def load_manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (newest restorable if None)."""
        info = self._pick(step)
        assert info.manifest is not None
        return info.manifest

    def load(self, step: int | None = None) -> Any:
        """The raw state tree of a checkpoint (newest restorable one if ``step`` is None), verified.

        Raises:
            NoValidCheckpointError: no checkpoint of that step (or none at all) can be read.
            CorruptCheckpointError: a given ``step`` fails its digest check.
        """
        if step is not None:
            return self._read_tree(self._pick(step))[0]
        tree, _info = self._read_newest()
        return tree

    def verify(self, step: int | None = None, *, key: str | None = None) -> CheckpointInfo:
        """Re-hash a checkpoint's files against its manifest; raise ``CorruptCheckpointError``.

        Args:
            step: the step to check (the newest restorable one if None and no ``key``).
            key: one checkpoint folder (``step-0000000040.e2``), when several lease epochs hold
                the same step (a takeover re-commits its resume point under its own epoch).
        """
        info = self._pick(step, key=key)
        assert info.manifest is not None
        for entry in info.manifest.files:
            verify_file(
                self.backend, f"{info.key}/{entry.name}", size=entry.size, digest=entry.digest,
                algorithm=entry.algorithm,
            )
        return info

    def should_save(self, step: int) -> bool:
        """True every ``save_every`` steps (never at step 0)."""
        return bool(self.save_every) and step > 0 and step % self.save_every == 0  # type: ignore[operator]

    def audit(self, tolerance: float = 0.0) -> Any:
        """Compare the steps run by several attempts (see :func:`ckptsdk.audit.audit`)."""
        if self.runlog is not None:
            self.runlog.flush()
        return _audit(self.backend, tolerance=tolerance)

    # ------------------------------------------------------------------ restoring

    def restore(self, state: Any) -> ResumePoint | None:
        """Load the newest valid checkpoint into ``state`` (objects and RNGs).

        Torn, corrupt, unknown-format or orphaned checkpoints are skipped with a warning naming
        them and why. After a takeover, the restored state is re-committed under this writer's
        epoch at once, so this run's resume point can no longer be rotated away by a zombie.

        Args:
            state: a :class:`~ckptsdk.TrainState` (or anything with ``load_state_dict``).

        Returns:
            The :class:`ResumePoint`, or ``None`` when the root holds no checkpoint.

        Raises:
            NoValidCheckpointError: checkpoints exist but none can be restored (lists each and why).
            StateMismatchError: the checkpoint does not fit ``state`` (lists the mismatches).
            ConfigError: after ``close()``, or ``state`` is a bare module/optimizer.
            UnsupportedStateError: an object's state cannot be saved (found now, not at a save).
        """
        if self._closed:
            raise ConfigError(f"restore() after close() on {self.url}; open a new CheckpointManager")
        preflight(state, "restore")  # before any training: what cannot be saved fails here
        self._raise_background_failure()
        try:
            tree, info = self._read_newest()
        except NoValidCheckpointError as exc:
            if not exc.tried:
                if self.lease is not None:
                    self._confirm_writer()
                self._write_lineage(None, None)
                if self.runlog is not None:
                    self.runlog.start()
                return None
            raise
        state.load_state_dict(tree)
        manifest = info.manifest
        assert manifest is not None
        self.resumed_from = info
        self.restored_manifest = manifest
        if self.lease is not None:
            # A writer taken over between opening and restoring must not record a lineage or
            # anchor anything: confirm the lease and look for newer writers first.
            self._confirm_writer()
            self._write_lineage(info.step, info.epoch)
            assert self.runlog is not None
            self.runlog.resumed_from_step = info.step
            self.runlog.start()
            if info.rank < self._rank:
                self._anchor(tree, manifest)
        logger.info("restored %s (step %d) from %s", info.key, info.step, self.url)
        pos = manifest.position
        return ResumePoint(
            step=manifest.step, epoch=pos.epoch, batch_idx=pos.batch_idx, extra=dict(pos.extra),
            metrics=dict(manifest.metrics), tags=dict(manifest.tags), key=info.key,
            lease_epoch=info.epoch,
        )

    def _read_newest(self) -> tuple[Any, CheckpointInfo]:
        cat = self._scan()
        tried: dict[str, str] = {}
        newest_first = sorted(cat.checkpoints, key=lambda c: (c.step, c.rank), reverse=True)
        for info in newest_first:
            if not info.valid:
                tried[info.key] = info.reason or ""
                if info.committed and not info.orphan:
                    logger.warning("skipping checkpoint %s/%s: %s", self.url, info.key, info.reason)
                else:  # a save in progress, or a superseded writer's leftover: expected
                    logger.info("not restoring %s/%s: %s", self.url, info.key, info.reason)
                continue
            try:
                return self._read_tree(info)
            except (CorruptCheckpointError, ManifestError) as exc:
                logger.warning("skipping checkpoint %s/%s: %s", self.url, info.key, exc)
                tried[info.key] = str(exc)
        # Only committed checkpoints of the live lineage count: a root holding nothing but an
        # interrupted first save (or a superseded writer's orphans) is a fresh start.
        blocking = {c.key for c in cat.checkpoints if c.committed and not c.orphan}
        if not blocking:
            tried = {}
        listing = "; ".join(f"{k}: {v}" for k, v in sorted(tried.items())) or "none"
        raise NoValidCheckpointError(
            f"no valid checkpoint under {self.url}: tried {len(tried)} ({listing}). "
            "Inspect with `ckptsdk ls URL` / `ckptsdk verify URL`; restore a copy, or start a new root",
            url=self.url, tried=tried,
        )

    def _read_tree(self, info: CheckpointInfo) -> tuple[Any, CheckpointInfo]:
        manifest = info.manifest
        assert manifest is not None
        entry = next((f for f in manifest.files if f.name == TENSORS), None)
        if entry is None:
            raise ManifestError(f"{info.key}/{MANIFEST} lists no {TENSORS}", url=self.url, step=info.step)
        tensors = read_tensorfile(
            self.backend, f"{info.key}/{TENSORS}", size=entry.size, digest=entry.digest,
            algorithm=entry.algorithm,
        )
        try:
            tree = codec.decode(manifest.tree, tensors)
        except (KeyError, ValueError, TypeError) as exc:
            raise CorruptCheckpointError(
                f"checkpoint {self.url}/{info.key}: its manifest tree does not match its tensors "
                f"({exc}); it cannot be restored", url=self.url, step=info.step, key=info.key,
            ) from exc
        return tree, info

    def _pick(self, step: int | None, *, key: str | None = None) -> CheckpointInfo:
        cat = self._scan()
        if key is not None:
            match = next((c for c in cat.checkpoints if c.key == key.rstrip("/")), None)
            if match is None or match.manifest is None:
                why = match.reason if match is not None else "no such checkpoint folder"
                raise NoValidCheckpointError(f"cannot read checkpoint {self.url}/{key}: {why}",
                                             url=self.url, tried={key: why or ""})
            return match
        if step is None:
            good = cat.restorable()
            if not good:
                raise NoValidCheckpointError(f"no valid checkpoint under {self.url}", url=self.url,
                                             tried={c.key: c.reason or "" for c in cat.checkpoints})
            return good[0]
        found = cat.find(step)
        usable = [c for c in found if c.manifest is not None and not c.orphan]
        if not usable:
            why = "; ".join(f"{c.key}: {c.reason}" for c in found) or "no such step"
            raise NoValidCheckpointError(
                f"no readable checkpoint of step {step} under {self.url} ({why}); "
                "`ckptsdk ls URL` lists the steps", url=self.url,
                tried={c.key: c.reason or "" for c in found},
            )
        return usable[0]

    # ------------------------------------------------------------------ saving

    def save(
        self,
        state: Any,
        *,
        step: int,
        epoch: int | None = None,
        batch_idx: int | None = None,
        metrics: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        tags: Mapping[str, str] | None = None,
        blocking: bool | None = None,
    ) -> CheckpointInfo:
        """Commit a checkpoint of ``state`` at ``step``, then rotate old ones.

        Never draws from the global RNGs, so what ``restore()`` brings back is the state here.

        Args:
            state: a :class:`~ckptsdk.TrainState` (or a plain state tree).
            step: the global step just completed.
            epoch, batch_idx: where to resume (``batch_idx`` = batches of ``epoch`` already done).
            metrics: numbers to keep in the manifest.
            extra: more JSON position fields the job needs to resume.
            tags: string tags (e.g. ``{"data_hash": ...}``) checked by the job on resume.
            blocking: False returns once the state is snapshotted into staging buffers and
                writes in the background; None uses the manager's ``async_save``.

        Returns:
            The committed (or, when not blocking, the pending) checkpoint.

        Raises:
            LeaseLostError: another writer took over; nothing was written or deleted.
            BackendError: storage failed; the previous checkpoints are intact.
        """
        if self.read_only or self.lease is None:
            raise ConfigError(f"{self.url} was opened read_only: save() is refused; open it without read_only")
        if self._closed:
            raise ConfigError(f"save() after close() on {self.url}")
        if step < 0:
            raise ConfigError(f"step must be >= 0, got {step}")
        preflight(state, "save", encode=False)
        metrics, extra = user_fields(metrics=metrics, extra=extra)
        blocking = (not self.async_save) if blocking is None else blocking
        with self._lock:
            self._bg.wait()  # one save in flight; its failure surfaces here
            self.lease.check()
            self.lease.renew()
            cat = self._scan()
            self._fence_if_newer(cat.max_rank)
            folder = checkpoint_dir(step, self.lease.epoch, self._tag)
            existing = next((c for c in cat.checkpoints if c.key == folder and c.committed), None)
            if existing is not None:
                logger.debug("step %d already committed as %s; not saving it twice", step, folder)
                return existing
            self._write_lineage(None, None)
            tree = state.state_dict() if hasattr(state, "state_dict") else state
            tensors, skeleton = codec.encode(tree)
            position = Position(epoch=epoch, batch_idx=batch_idx, extra=dict(extra or {}))
            device = _device_of(tensors)
            if self.runlog is not None:
                self.runlog.flush()
            if blocking:
                return self._commit(folder, step, tensors, skeleton, position, metrics, tags, device)
            if self._stager is None:
                self._stager = Stager()
            staged = self._stager.snapshot(tensors)
            skeleton = json.loads(json.dumps(skeleton))  # detached from live objects
            self._bg.start(
                lambda: self._commit(folder, step, staged, skeleton, position, metrics, tags, device),
                name=f"ckptsdk-save-{step}",
            )
            return CheckpointInfo(step=step, epoch=self.lease.epoch, key=folder, size=0, committed=False,
                                  valid=False, reason="save in progress")

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a background save; re-raise its failure. False if it is still running."""
        return self._bg.wait(timeout)

    def _commit(
        self, folder: str, step: int, tensors: dict[str, torch.Tensor], skeleton: Any,
        position: Position, metrics: Mapping[str, Any] | None, tags: Mapping[str, str] | None,
        device: str,
    ) -> CheckpointInfo:
        assert self.lease is not None
        self.lease.check()
        size, digest = write_tensorfile(self.backend, f"{folder}/{TENSORS}", tensors)
        manifest = Manifest(
            step=step,
            position=position,
            created_at=datetime.now(timezone.utc).isoformat(),
            writer=Writer(
                run_id=self.lease.run_id, attempt=self.lease.attempt, lease_epoch=self.lease.epoch,
                host=socket.gethostname(), pid=os.getpid(),
                resumed_from_step=self.resumed_from.step if self.resumed_from else None,
            ),
            files=[FileEntry(name=TENSORS, size=size, digest=digest, algorithm=DIGEST_ALGORITHM)],
            tree=skeleton,
            metrics=_plain_metrics(metrics),
            environment=Environment.current(device=device),
            tags=dict(tags or {}),
        )
        # A zombie that lost the lease while writing the tensors must not commit them: renew
        # (not just check) so a takeover during a long write is seen before the commit.
        self.lease.renew()
        published = self.backend.write(f"{folder}/{MANIFEST}", manifest.to_json())
        self._memo[(published.key, published.version)] = manifest  # the next scan need not re-read it
        logger.info("committed %s/%s (%d bytes)", self.url, folder, size)
        self._rotate()
        return CheckpointInfo(step=step, epoch=self.lease.epoch, key=folder, size=size, committed=True,
                              valid=True, manifest=manifest)

    def _anchor(self, tree: Any, manifest: Manifest) -> None:
        """Re-commit a restored checkpoint under this epoch (see ``restore``)."""
        assert self.lease is not None
        tensors, skeleton = codec.encode(tree)
        folder = checkpoint_dir(manifest.step, self.lease.epoch, self._tag)
        self._commit(folder, manifest.step, tensors, skeleton, manifest.position, manifest.metrics,
                     manifest.tags, manifest.environment.device or "cpu")

    def _write_lineage(self, step: int | None, epoch: int | None) -> None:
        """Record, once per epoch, where this writer's lineage starts (before its first commit)."""
        if self._lineage_written or self.lease is None:
            return
        record = LineageRecord(
            epoch=self.lease.epoch, attempt=self.lease.attempt, run_id=self.lease.run_id,
            resumed_from_step=step, resumed_from_epoch=epoch, host=socket.gethostname(),
            pid=os.getpid(), created_at=datetime.now(timezone.utc).isoformat(),
        )
        self.lease.check()
        try:
            self.backend.create(lineage_key(self.lease.epoch, self._tag), record.to_json())
        except PreconditionFailed as exc:
            # Only the holder of this epoch writes this key: someone else did -> we lost the lease.
            self.lease.fence(f"lineage record of epoch {self.lease.epoch} already exists", None)
            raise LeaseLostError(
                f"another writer already recorded epoch {self.lease.epoch} under {self.url}; "
                "this writer stops (nothing was written or deleted)", url=self.url,
                epoch=self.lease.epoch,
            ) from exc
        self._lineage_written = True

    def _fence_if_newer(self, seen: Rank) -> None:
        assert self.lease is not None
        if seen > self._rank:
            self.lease.fence(f"saw a newer writer (epoch {seen[0]}) under {self.url}", seen[0])
            self.lease.check()  # raises LeaseLostError

    def _confirm_writer(self) -> None:
        """Renew the lease and look for newer writers; LeaseLostError if this one is stale."""
        assert self.lease is not None
        self.lease.renew()
        self._fence_if_newer(self._scan().max_rank)

    # ------------------------------------------------------------------ rotation and gc

    def _rotate(self) -> None:
        """Delete what retention allows, of this lineage only, unless fenced.

        The lease was renewed just before the manifest was published (and the heartbeat keeps
        watching); a fresh listing then shows any newer writer. Safety does not rest on this
        check's timing: a takeover anchors its resume point under its own rank, which no
        lower-ranked writer ever deletes.
        """
        assert self.lease is not None
        try:
            self.lease.check()
        except LeaseLostError:
            logger.warning("lease lost after a commit under %s: rotation deletes nothing", self.url)
            return
        cat = self._scan()
        if cat.max_rank > self._rank:
            self.lease.fence(f"saw epoch {cat.max_epoch} under {self.url}", cat.max_epoch)
            logger.warning("a newer writer (epoch %d) exists under %s: rotation deletes nothing",
                           cat.max_epoch, self.url)
            return
        mine = [c for c in cat.checkpoints if c.valid and c.rank <= self._rank]
        # Where writes reach the cloud late and out of order (Drive), a rotation's small deletes
        # can arrive long before the new checkpoint's tensor file: rotate one save late, so the
        # newest checkpoint has a whole save interval to upload before its predecessor goes.
        late = 0 if self.backend.capabilities.immediately_consistent else 1
        protected: list[int] = []
        if self.resumed_from is not None:
            newer_own = any(c.rank == self._rank and c.step > self.resumed_from.step for c in mine)
            if not newer_own:
                protected.append(self.resumed_from.step)
        for c in self._beyond_retention(mine, self.keep_last + late, protected):
            self.lease.check()
            self._delete_checkpoint(c)

    def _beyond_retention(
        self, checkpoints: list[CheckpointInfo], keep_last: int, protected: Sequence[int] = ()
    ) -> list[CheckpointInfo]:
        """The checkpoints retention lets go: keep_last steps, keep_every milestones, protected
        steps kept. Every folder of a step (several writers may hold one) shares its fate."""
        by_step: dict[int, list[CheckpointInfo]] = {}
        for c in checkpoints:
            by_step.setdefault(c.step, []).append(c)
        policies = [retention.keep_last(keep_last)]
        if self.keep_every:
            policies.append(retention.keep_every(self.keep_every))
        if protected:
            policies.append(retention.protect(protected))
        _kept, doomed = retention.plan(by_step, policies)
        return [c for step in doomed for c in by_step[step]]

    def _delete_checkpoint(self, info: CheckpointInfo) -> None:
        """Manifest first (the checkpoint stops existing), then the data."""
        keys = [f"{info.key}/{MANIFEST}"] + [
            o.key for o in self.backend.list(info.key + "/") if not o.key.endswith("/" + MANIFEST)
        ]
        for key in keys:
            try:
                self.backend.delete(key)
            except ObjectNotFound:
                pass  # already gone (another cleaner); deletion is idempotent
        logger.info("rotated out %s/%s", self.url, info.key)
        if self.backend.capabilities.trash_on_delete:
            # Drive moves deleted files to its trash, which counts against the quota for 30 days.
            self._trashed_bytes += info.size
            log = logger.warning if not self._trash_warned else logger.info
            self._trash_warned = True
            log("%s keeps deleted checkpoints in its trash for 30 days, counting against your quota: "
                "%.1f MB sent there by this run so far. Empty the Drive trash, or raise save_every / "
                "lower keep_last", self.url, self._trashed_bytes / 1e6)

    def gc(self, *, keep_last: int | None = None, dry_run: bool = False, grace: float = 3600.0) -> GcReport:
        """Remove orphans of superseded writers, torn checkpoints and rotated-out checkpoints.

        Works without the lease, so a running writer is not disturbed: orphans are never
        restorable, retention keeps the newest ``keep_last`` steps, and temp files of crashed
        writes are swept when older than ``grace`` seconds. Uncommitted folders (a save in
        progress, or one that crashed) are left alone. Where writes reach other hosts late
        (Drive), a checkpoint that looks torn here may still be uploading from the VM that wrote
        it, so gc keeps torn checkpoints there (delete them by hand once no VM is writing).
        """
        keep = keep_last or self.keep_last
        cat = self._scan()
        reasons: dict[str, str] = {}
        settled = self.backend.capabilities.immediately_consistent
        for c in cat.checkpoints:
            if c.orphan:
                reasons[c.key] = c.reason or "orphan"
            elif c.committed and not c.valid:
                if settled:
                    reasons[c.key] = c.reason or "invalid"
                else:
                    logger.info("gc keeps %s/%s (%s): it may still be uploading from another VM",
                                self.url, c.key, c.reason)
        for c in self._beyond_retention([c for c in cat.checkpoints if c.valid], keep):
            reasons[c.key] = f"beyond keep_last={keep}"
        if not dry_run:
            for c in cat.checkpoints:
                if c.key in reasons:
                    self._delete_checkpoint(c)
            for key in self.backend.sweep(grace):
                reasons[key] = f"temp file of a crashed write, older than {grace:.0f} s"
        return GcReport(deleted=sorted(reasons), reasons=reasons, dry_run=dry_run)

    # ------------------------------------------------------------------ step log, lifecycle

    def log_step(self, step: int, **scalars: Any) -> None:
        """Append ``scalars`` (loss, lr, ...) for ``step`` to this attempt's step log."""
        if self.runlog is None:
            raise ConfigError(f"{self.url} was opened read_only: log_step() needs a writer")
        self.runlog.log_step(step, **scalars)

    def close(self) -> None:
        """Wait for a background save, flush the step log, release the lease. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._bg.wait()
        finally:
            try:
                if self.runlog is not None:
                    self.runlog.close()
            finally:
                if self.lease is not None:
                    self.lease.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _scan(self) -> _catalog.Catalog:
        return _catalog.scan(self.backend, cache=self._memo)

    def _raise_background_failure(self) -> None:
        if not self._bg.busy:
            self._bg.wait()


def _close_at_exit(ref: weakref.ReferenceType[CheckpointManager]) -> None:
    mgr = ref()
    if mgr is None or mgr._closed:
        return
    if mgr._bg.busy:
        logger.warning("interpreter exit: waiting for the checkpoint save in flight under %s", mgr.url)
    try:
        mgr.close()
    except CheckpointError as exc:
        logger.error("interpreter exit: the last save under %s failed: %s", mgr.url, exc)
    except (BackendError, LeaseLostError) as exc:
        logger.error("interpreter exit: closing %s failed: %s (the last committed checkpoint is intact)",
                     mgr.url, exc)


def _device_of(tensors: Mapping[str, torch.Tensor]) -> str:
    for t in tensors.values():
        if t.device.type != "cpu":
            return str(t.device)
    return "cpu"


def _plain_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, torch.Tensor):
            v = v.item()
        elif hasattr(v, "item") and callable(v.item):
            v = v.item()  # numpy scalars
        out[str(k)] = v
    return out
