"""CheckpointManager: the face of one run's checkpoints under one root URL.

It holds the configuration, acquires the writer lease, restores (recording where this writer's
lineage starts, and anchoring the resume point after a takeover) and fronts the step log. Reading
(listing, picking, verified reads, verify) is :mod:`ckptsdk.checkpoint.reading.reader`'s; the save pipeline
(snapshot, write, the lease renewals before the write and right before the commit, fencing,
lineage) is :mod:`ckptsdk.checkpoint.writing.saving`'s; rotation and gc, which delete only after a commit and only
while the lease still checks out, are :mod:`ckptsdk.checkpoint.pruning.rotation`'s; ending (the last save after a
stop signal, close, interpreter exit) is :mod:`ckptsdk.checkpoint.writing.shutdown`'s. This module wires them together.
"""

from __future__ import annotations

import atexit
import builtins
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ckptsdk.backends import open_backend
from ckptsdk.backends.base import Backend
from ckptsdk.backends.probe import prove_preconditions
from ckptsdk.checkpoint.pruning.recorded import KeepDecisions
from ckptsdk.checkpoint.pruning.rotation import GcReport, Rotation
from ckptsdk.checkpoint.reading.catalog import CheckpointInfo, Judge
from ckptsdk.checkpoint.reading.outline import Outline
from ckptsdk.checkpoint.reading.reader import CheckpointReader, LiveTarget, ResumePoint, Verdict, resume_point
from ckptsdk.checkpoint.retention import Mode, Rule, warn_if_changed
from ckptsdk.checkpoint.writing.anchoring import Anchor
from ckptsdk.checkpoint.writing.opening import take_lease
from ckptsdk.checkpoint.writing.saving import SavePipeline
from ckptsdk.checkpoint.writing.scheduling import SaveStats
from ckptsdk.checkpoint.writing.shutdown import Shutdown, close_at_exit
from ckptsdk.checkpoint.writing.writer import WriterSession
from ckptsdk.errors import ConfigError, NoValidCheckpointError
from ckptsdk.format.layout import writer_tag
from ckptsdk.format.manifest import FileEntry, Manifest, Position
from ckptsdk.format.userfield import user_fields
from ckptsdk.lease.acquire import Lease
from ckptsdk.loader import loaders_of, resolve_position
from ckptsdk.options import (
    DEFAULT_SAVE_DEADLINE,
    DEPRECATED,
    LeaseOptions,
    Retention,
    SaveOptions,
    deprecated_shorthand,
    grouped,
)
from ckptsdk.preemption import Preemption
from ckptsdk.runlog.writer import RunLog
from ckptsdk.state import Restorable, Stateful, TrainState, preflight

if TYPE_CHECKING:
    from ckptsdk.runlog.audit import AuditReport

logger = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "GcReport", "ResumePoint", "Simulation", "save_due"]


@dataclass(frozen=True)
class Simulation:
    """Time and the lease heartbeat under a test's or benchmark's control; never for a real job.

    Passed as ``CheckpointManager(..., _simulation=Simulation(...))`` (and to
    ``DistributedCheckpointManager``): off the public signature, because a job that turns the
    heartbeat off or fakes the clock breaks the lease's guarantees.

    Attributes:
        heartbeat: renew the lease from a background thread every ttl/3. Off: only saves renew it
            (simulations that drive time themselves; fault injectors that count backend calls).
        clock: the lease's monotonic clock.
        sleep: the lease's sleep.
    """

    heartbeat: bool = True
    clock: Callable[[], float] = field(default=time.monotonic)
    sleep: Callable[[float], None] = field(default=time.sleep)


def save_due(step: int, save_every: int | None) -> bool:
    """The ``save_every`` rule of ``should_save``: every ``save_every`` steps, never at step 0."""
    return save_every is not None and step > 0 and step % save_every == 0


class CheckpointManager:
    """Checkpoints of one training run under one root URL.

    Opening a manager for writing acquires the root's writer lease (waiting for, or taking over
    from, a previous writer as the lease rules say); ``read_only=True`` never touches the lease.
    The read API (``list``, ``latest``, ``load``, ``load_manifest``, ``verify``) is
    :class:`~ckptsdk.checkpoint.reading.reader.CheckpointReader`'s.

    Options come in three groups (:mod:`ckptsdk.options`); the four options of the README's first
    loop also have a flat keyword (``keep_last``, ``keep``, ``save_every``, ``async_save``), and
    giving a group and one of its flat keywords is a ``ConfigError``. A flat keyword left at None
    takes the group's default. The other flat keywords of ckptsdk 0.1.0 (``lease_ttl=``,
    ``snapshot=``, ...: :data:`ckptsdk.options.DEPRECATED`) still work, with a
    ``DeprecationWarning`` naming their group field, until ckptsdk 0.3.0.

    Args:
        url: the root: a path, ``file://``, ``drive://REL``, ``gs://bucket/prefix``, ``memory://name``.
        retention: what rotation keeps (:class:`~ckptsdk.options.Retention`).
        lease_options: how the writer lease is taken (:class:`~ckptsdk.options.LeaseOptions`).
        save_options: when saves are due and how they run (:class:`~ckptsdk.options.SaveOptions`).
        read_only: inspect without taking the lease; ``save`` is refused.
        storage_options: passed to fsspec for ``gs://`` (``endpoint_url``, ``token``, ...).
        run_id: name of the run (kept across takeovers); a new uuid on a fresh root by default.
        keep_last: shorthand of ``Retention.keep_last`` (default 3).
        keep: shorthand of ``Retention.keep``: more keep rules, e.g.
            ``[keep.best("val_loss", 2), keep.every(1000)]`` from :mod:`ckptsdk.keep`.
        save_every: shorthand of ``SaveOptions.every``.
        async_save: shorthand of ``SaveOptions.asynchronous``.
        _simulation: tests and benchmarks only (see :class:`Simulation`).
        **deprecated: the deprecated flat keywords (:data:`ckptsdk.options.DEPRECATED`).

    Raises:
        ConfigError: an option value out of range or not one of its choices, a group given
            together with its flat keywords, ``save_on_signal=True`` off the main thread.
        TypeError: a keyword that is neither in the signature nor a deprecated flat keyword.

    Example:
        >>> import torch
        >>> from ckptsdk import CheckpointManager, TrainState
        >>> mgr = CheckpointManager("memory://doc", keep_last=2, save_every=10)
        >>> state = TrainState(model=torch.nn.Linear(2, 2))
        >>> mgr.restore(state) is None
        True
        >>> mgr.save(state, step=10).step
        10
        >>> mgr.close()
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | Backend,
        *,
        retention: Retention | None = None,
        lease_options: LeaseOptions | None = None,
        save_options: SaveOptions | None = None,
        read_only: bool = False,
        storage_options: Mapping[str, object] | None = None,
        run_id: str | None = None,
        keep_last: int | None = None,
        keep: Rule | Sequence[Rule] | None = None,
        save_every: int | None = None,
        async_save: bool | None = None,
        _simulation: Simulation | None = None,
        **deprecated: Any,
    ) -> None:
        # Every option is checked here, by its group, before the store is opened.
        flat: dict[str, Any] = dict(keep_last=keep_last, keep=keep, save_every=save_every, async_save=async_save)
        flat.update(deprecated_shorthand(deprecated, DEPRECATED, owner="CheckpointManager.__init__"))
        kept = grouped("retention", retention, Retention, flat)
        leasing = grouped("lease_options", lease_options, LeaseOptions, flat)
        saves = grouped("save_options", save_options, SaveOptions, flat)
        main = threading.current_thread() is threading.main_thread()
        if saves.on_signal and not main:
            raise ConfigError(
                "SaveOptions(on_signal=True) needs the manager to be created in the main thread (Python "
                "delivers signals only there); pass save_options=SaveOptions(on_signal=False)"
            )
        if isinstance(url, (str, os.PathLike)):
            backend = open_backend(os.fspath(url), **dict(storage_options or {}))
        else:  # an already opened backend (custom storage, simulations)
            backend = url
        self.reader = CheckpointReader(backend, judge=self._judge, before_listing=self._before_listing)
        self.url = os.fspath(url) if isinstance(url, (str, os.PathLike)) else backend.url
        sim = _simulation or Simulation()
        self.lease_options = leasing
        self.save_options = saves
        self.keep_last = kept.keep_last
        self.keep_every = kept.keep_every
        self.save_every = saves.every
        self.read_only = read_only
        self.async_save = saves.asynchronous
        self.snapshot = saves.snapshot
        self._preemption: Preemption | None = None
        self._lock = threading.RLock()
        caps = backend.capabilities
        mode = kept.mode or ("recycle" if caps.trash_on_delete and caps.rewrite_in_place else "delete")
        self.retention = dataclasses.replace(kept, mode=mode)  # as applied: the store's choice filled in
        self.keep: tuple[Rule, ...] = (kept.keep,) if isinstance(kept.keep, Rule) else tuple(kept.keep)
        self._rotation = Rotation(
            backend,
            keep_last=kept.keep_last,
            keep_every=kept.keep_every,
            rules=self.keep,
            mode=mode,
            leftover_grace=kept.leftover_grace,
        )
        # A reader given no keep rules judges by the writer's, as the root records them (recorded.py).
        by_record = (
            read_only and retention is None and all(flat.get(kw) is None for kw in ("keep_last", "keep_every", "keep"))
        )
        self._keeping = KeepDecisions(self.url, self._rotation, self.reader.scan, by_record=by_record)
        self._writer: WriterSession | None = None
        self._saving: SavePipeline | None = None
        self._read_from: CheckpointInfo | None = None  # a reader's last restore (a writer's: its session's)
        self._opened: Outline | None = None  # the listing taken at open, for the first restore
        self.lease: Lease | None = None
        self.runlog: RunLog | None = None
        self._shutdown = Shutdown(self.url, lease=None, runlog=None, saving=None, preemption=None, lock=self._lock)
        if read_only:
            return
        self._open_writer(leasing, saves, run_id, sim, main)

    def _open_writer(
        self, leasing: LeaseOptions, saves: SaveOptions, run_id: str | None, sim: Simulation, main: bool
    ) -> None:
        """Take the lease and build the writer's session, its save pipeline and its ending."""
        prove_preconditions(self.backend)  # a writer trusts no server's word for its conditions
        self.lease = Lease(
            self.backend,
            ttl=leasing.ttl,
            force=leasing.force,
            run_id=run_id,
            wait_timeout=leasing.wait,
            settle=leasing.settle,
            clock=sim.clock,
            sleep=sim.sleep,
        )
        self._opened = take_lease(self.lease, self.backend, self.reader.outline)
        if sim.heartbeat:
            self.lease.start_heartbeat()
        self.runlog = RunLog(
            self.backend,
            run_id=self.lease.run_id,
            attempt=self.lease.attempt,
            lease_epoch=self.lease.epoch,
            resumed_from_step=None,
            background=True,
        )
        self._writer = WriterSession(
            self.backend, self.lease, scan=self.reader.scan, memo=self.reader.memo, clock=sim.clock
        )
        self._saving = SavePipeline(
            self._writer,
            rotation=self._rotation,
            runlog=self.runlog,
            max_staging_bytes=saves.max_staging_bytes,
            # A ttl the user chose bounds a save as before; the default ttl is short now (renewals
            # are cheap), and a save's budget is not about the lease: it keeps the old minute.
            save_deadline=saves.save_deadline or (leasing.ttl if leasing.ttl is not None else DEFAULT_SAVE_DEADLINE),
            incremental=saves.incremental,
            frozen=saves.frozen,
            frozen_source=saves.frozen_source,
        )
        self._anchor = Anchor(self._writer, self._saving)
        if saves.on_signal or (saves.on_signal is None and main):
            preemption = Preemption(deadline=saves.signal_deadline)
            if preemption.install():
                self._preemption = preemption
        self._shutdown = Shutdown(
            self.url,
            lease=self.lease,
            runlog=self.runlog,
            saving=self._saving,
            preemption=self._preemption,
            lock=self._lock,
        )
        # An interpreter exit with a save in flight waits for it (or says it abandons it).
        atexit.register(close_at_exit, weakref.ref(self._shutdown))
        logger.info(
            "writer of %s: run %s, attempt %d, lease epoch %d",
            self.url,
            self.lease.run_id,
            self.lease.attempt,
            self.lease.epoch,
        )

    @property
    def backend(self) -> Backend:
        """The storage of the root (the lease keeps the one it was opened with)."""
        return self.reader.backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        # Tests wrap the storage in a fault injector after opening; reads, saving and rotation follow.
        self.reader.backend = backend
        self._rotation.backend = backend
        if self._writer is not None:
            self._writer.backend = backend
        if self.runlog is not None:
            self.runlog.backend = backend

    @property
    def resumed_from(self) -> CheckpointInfo | None:
        """The checkpoint the first restore loaded (None: a fresh start, or no restore yet)."""
        return self._writer.resumed_from if self._writer is not None else self._read_from

    @property
    def closed(self) -> bool:
        """``close()`` was called: ``save`` and ``restore`` are refused from now on."""
        return self._shutdown.closed

    @property
    def stats(self) -> SaveStats:
        """Saves committed, replaced (by a newer one while waiting), skipped, failed; save times.

        Example:
            >>> import torch
            >>> from ckptsdk import CheckpointManager
            >>> mgr = CheckpointManager("memory://stats")
            >>> _ = mgr.save({"w": torch.ones(2)}, step=1)
            >>> mgr.stats.committed, mgr.stats.replaced, mgr.stats.skipped
            (1, 0, 0)
            >>> mgr.close()
        """
        return self._shutdown.stats

    # ------------------------------------------------------------------ reading (CheckpointReader's)

    def outline(self) -> Outline:
        """One listing of the root (see :meth:`CheckpointReader.outline`)."""
        return self.reader.outline()

    def list(self) -> builtins.list[CheckpointInfo]:  # `list`: this method, in the class
        """One row per step, oldest first (see :meth:`CheckpointReader.list`)."""
        return self.reader.list()

    def latest(self) -> CheckpointInfo | None:
        """The newest restorable checkpoint (see :meth:`CheckpointReader.latest`)."""
        return self.reader.latest()

    def best(self, metric: str, mode: Mode | None = None) -> CheckpointInfo | None:
        """The best checkpoint by ``metric`` (see :meth:`CheckpointReader.best`)."""
        return self.reader.best(metric, mode)

    def load_manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (None: the newest; see :meth:`CheckpointReader.load_manifest`)."""
        return self.reader.load_manifest(step)

    def load(self, step: int | None = None) -> Any:
        """The state tree of ``step`` (see :meth:`CheckpointReader.load`)."""
        return self.reader.load(step)

    def verify(self, step: int | None = None, *, key: str | None = None) -> CheckpointInfo:
        """Re-hash one checkpoint's files (see :meth:`CheckpointReader.verify`)."""
        return self.reader.verify(step, key=key)

    def check(self, info: CheckpointInfo) -> Verdict:
        """Re-hash ``info``'s files and judge it (see :meth:`CheckpointReader.check`)."""
        return self.reader.check(info)

    def pick(self, step: int | None, *, key: str | None = None) -> CheckpointInfo:
        """The checkpoint a step (or folder key) names (see :meth:`CheckpointReader.pick`)."""
        return self.reader.pick(step, key=key)

    def read_tree(self, info: CheckpointInfo, into: LiveTarget | None = None) -> Any:
        """The verified state tree of ``info`` (see :meth:`CheckpointReader.read_tree`)."""
        return self.reader.read_tree(info, into)

    # ------------------------------------------------------------------ keep decisions (KeepDecisions')

    def gc(
        self,
        *,
        keep_last: int | None = None,
        keep: Sequence[Rule] | None = None,
        dry_run: bool = False,
        grace: float = 3600.0,
    ) -> GcReport:
        """Remove orphans, torn and rotated-out checkpoints (see :meth:`KeepDecisions.gc`)."""
        return self._keeping.gc(keep_last=keep_last, keep=keep, dry_run=dry_run, grace=grace)

    def kept(self, *, keep_last: int | None = None, keep: Sequence[Rule] | None = None) -> dict[int, tuple[str, ...]]:
        """Each step the keep rules keep, with why (see :meth:`KeepDecisions.kept`)."""
        return self._keeping.kept(keep_last=keep_last, keep=keep)

    def rules(self, *, keep_last: int | None = None, keep: Sequence[Rule] | None = None) -> str:
        """The keep rules in force, as written (see :meth:`KeepDecisions.rules`)."""
        return self._keeping.rules(keep_last=keep_last, keep=keep)

    @property
    def preempted(self) -> bool:
        """A stop signal arrived (``save_on_signal``): the next ``save`` is the last one."""
        return self._preemption is not None and self._preemption.requested

    def should_save(self, step: int) -> bool:
        """True every ``save_every`` steps (never at step 0), and at once after a stop signal."""
        return self.preempted or save_due(step, self.save_every)

    def audit(self, tolerance: float = 0.0, *, series: bool = False) -> AuditReport:
        """Compare the steps run by several attempts (see :func:`ckptsdk.runlog.audit.audit`;
        ``series=True`` keeps every step's scalars too, for ``plot_audit``)."""
        from ckptsdk.runlog.audit import audit

        if self.runlog is not None:
            self.runlog.flush()
        return audit(self.backend, tolerance=tolerance, series=series)

    def _judge(self) -> Judge | None:
        """A writer judges lineage records by the lease it took over from (see ``Judge``)."""
        if self.lease is None or (record := self.lease.record) is None:
            return None  # a reader, or a writer before its lease (Drive's first listing: the epoch floor)
        cas = self.backend.capabilities.compare_and_swap
        return Judge(self.lease.previous, (record.epoch, writer_tag(record.holder.nonce, compare_and_swap=cas)))

    def _before_listing(self) -> None:
        """The reads see this writer's rotations: a sync save's, still on the worker, ends first."""
        self._opened = None  # gc and friends may change the root; a restore then lists it again
        if self._saving is not None:
            self._saving.settle()

    # ------------------------------------------------------------------ restoring

    def restore(
        self,
        state: TrainState | Restorable,
        *,
        strict: bool = True,
        _accept: Callable[[Any, CheckpointInfo], None] | None = None,
    ) -> ResumePoint | None:
        """Load the newest valid checkpoint into ``state`` (objects and RNGs).

        Torn, corrupt, unknown-format or orphaned checkpoints are skipped with a warning naming
        them and why. The restored checkpoint of an earlier writer is re-committed under this
        writer's epoch at once (the anchor: a hard link or server-side copy where the store has
        one, a full rewrite on Drive), so that a previous writer that is still alive (a zombie,
        still rotating) can no longer rotate this run's resume point away.

        Where a writer's lineage starts is fixed by its first restore (or, without one, its first
        save). A later restore only loads the newest checkpoint (after a save, this writer's own)
        into ``state``: the lineage, ``resumed_from`` and the step log stay as they were, so this
        writer's manifests go on agreeing with its lineage record.

        A checkpoint that records its frozen base by reference (``SaveOptions(frozen="reference")``)
        is restored only once the live tensors are proven to hold that base (hashed, before
        anything is loaded); another base raises ``StateMismatchError`` with every live object
        untouched.

        Args:
            state: a :class:`~ckptsdk.TrainState` (or anything with ``load_state_dict``).
            strict: False restores the objects ``state`` holds and leaves out what the checkpoint
                holds besides (an optimizer, for evaluation), named in the result's
                ``unrestored`` and logged; module keys on one side only are left out too (a
                TrainState's ``load_state_dict(strict=False)``). The RNG states are restored.

        Returns:
            The :class:`ResumePoint`, or ``None`` when the root holds no checkpoint.

        Raises:
            NoValidCheckpointError: checkpoints exist but none can be restored (lists each and why).
            StateMismatchError: the checkpoint does not fit ``state`` (lists the mismatches).
            ConfigError: after ``close()``, or ``state`` is a bare module/optimizer.
            UnsupportedStateError: an object's state cannot be saved (found now, not at a save;
                a ``read_only`` manager, which never saves, does not check this).
        """
        if self.closed:
            raise ConfigError(f"restore() after close() on {self.url}; open a new CheckpointManager")
        # Before any training: what cannot be saved fails here. A reader never saves, so it
        # skips the encode of the live state (a few ms of a cold restore).
        preflight(state, "restore", encode=not self.read_only)
        if self._saving is not None:
            self._saving.wait()  # a pipelined copy may still read the live tensors
        writer = self._writer
        fixed = writer is not None and writer.lineage_written
        if self.runlog is not None:  # each step logs which samples it ran on (the audit compares them)
            for name, loader in loaders_of(state).items():
                self.runlog.watch_data(f"data/{name}", loader.batch_digest)
        try:
            # _accept: ckptsdk.distributed's all-rank check; a TrainState's module tensors are read into
            into = state if callable(getattr(state, "live_tensors", None)) else None
            # The listing taken at open, unless something was saved or scanned since (then a
            # listing of its own): one listing for opening and restoring a writer.
            opened, self._opened = self._opened, None
            tree, info = self.reader.read_newest(_accept, into, opened, strict=strict)  # type: ignore[arg-type]
        except NoValidCheckpointError as exc:
            if exc.tried:
                raise
            self._start_fresh(writer)
            return None
        unrestored = self._load(state, tree, fitted=into is not None, strict=strict)
        if writer is None:
            self._read_from = info
        else:
            writer.confirm(self.reader.outline)
            if not fixed:  # this restore is where the writer's lineage starts
                self._start_lineage(writer, tree, info)
        logger.info("restored %s (step %d) from %s", info.key, info.step, self.url)
        if unrestored:
            logger.info(
                "restore(strict=False) of %s left out what the state does not hold: %s",
                info.key,
                ", ".join(unrestored),
            )
        return dataclasses.replace(resume_point(info), unrestored=unrestored)

    def _start_fresh(self, writer: WriterSession | None) -> None:
        """No checkpoint to resume from: this writer's lineage starts from nothing."""
        if writer is not None:
            writer.confirm(self.reader.outline)
            writer.write_lineage(None, None)  # nothing once the lineage is fixed
        if self.runlog is not None:
            self.runlog.start()

    @staticmethod
    def _load(state: TrainState | Restorable, tree: Any, *, fitted: bool, strict: bool) -> tuple[str, ...]:
        """Load ``tree`` into ``state``; the objects a partial restore left out (none when strict)."""
        # read_tree checked a TrainState's fit (check_fit, check_rng): its load need not check again
        fitted = fitted and type(state).load_state_dict is TrainState.load_state_dict
        if strict:
            (state._load_fitted if fitted else state.load_state_dict)(tree)  # type: ignore[union-attr]
            return ()
        if fitted:
            state._load_fitted(tree, strict=False)  # type: ignore[union-attr]
        else:
            state.load_state_dict(tree, strict=False)  # type: ignore[call-arg]
        return _unrestored(state, tree)

    def _start_lineage(self, writer: WriterSession, tree: Any, info: CheckpointInfo) -> None:
        """Record that this writer resumes from ``info`` (lineage, step log) and anchor it."""
        assert self.runlog is not None
        writer.resume_from(info)
        warn_if_changed(info.manifest, self._rotation.retention_rules(), self.url)
        writer.write_lineage(info.step, info.epoch)
        self.runlog.resumed_from_step = info.step
        self.runlog.start()
        # Anchor after every takeover. After an unclean end the previous writer may still be
        # rotating; on Drive another VM's takeover may not be visible yet (its late lineage
        # record would orphan the resume point: the lineage property test finds that schedule);
        # and the catalog believes a lineage record that would orphan checkpoints only when its
        # writer left a checkpoint folder (or holds the lease), which the anchor is. It is cheap
        # where the store allows (a hard link, a server-side copy) and replaces the copies it
        # re-committed at this writer's next save (see ``Rotation.drop_copies``).
        if info.rank < writer.rank:
            self._anchor.anchor(tree, info)

    # ------------------------------------------------------------------ saving

    def save(
        self,
        state: TrainState | Stateful | Mapping[str, Any],
        *,
        step: int,
        epoch: int | None = None,
        batch_idx: int | None = None,
        metrics: Mapping[str, object] | None = None,
        extra: Mapping[str, object] | None = None,
        tags: Mapping[str, str] | None = None,
        blocking: bool | None = None,
        extra_files: Sequence[FileEntry] = (),
    ) -> CheckpointInfo:
        """Commit a checkpoint of ``state`` at ``step``, then rotate old ones.

        Never draws from the global RNGs, so what ``restore()`` brings back is the state here.

        Args:
            state: a :class:`~ckptsdk.TrainState` (or a plain state tree).
            step: the global step just completed.
            epoch, batch_idx: where to resume (``batch_idx`` = batches of ``epoch`` already done);
                with one :class:`ckptsdk.DataLoader` in ``state`` they default to its position
                and must agree with it.
            metrics: numbers to keep in the manifest.
            extra: more JSON position fields the job needs to resume.
            tags: string tags (e.g. ``{"data_hash": ...}``) checked by the job on resume.
            blocking: False does in-memory work only and returns: the snapshot (see the
                manager's ``snapshot`` option) and everything that touches storage (listing,
                lineage, step-log flush, tensor write, lease renewal, commit, rotation) run on
                a background worker; a failure there surfaces on the next ``save``, ``wait`` or
                ``close``. None uses the manager's ``async_save``. After a stop signal
                (``save_on_signal``) the save is blocking, then the signal takes effect.
            extra_files: files other processes already wrote into this save's folder (the
                ranks of :mod:`ckptsdk.distributed`), listed in the manifest so that listing,
                ``verify`` and ``restore`` check them and a takeover's anchor copies them.

        Returns:
            The committed (or, when not blocking, the pending) checkpoint.

        Raises:
            LeaseLostError: another writer took over; this save (or the previous background
                one) committed and deleted nothing.
            BackendError: storage failed; the previous checkpoints are intact.
        """
        if self.read_only or self._saving is None:
            raise ConfigError(f"{self.url} was opened read_only: save() is refused; open it without read_only")
        self._opened = None  # a restore after this save lists the root again
        if self.closed:
            raise ConfigError(f"save() after close() on {self.url}")
        if step < 0:
            raise ConfigError(f"step must be >= 0, got {step}")
        preflight(state, "save", encode=False)
        metrics, extra = user_fields(metrics=metrics, extra=extra, tags=tags)  # and what readers parse
        epoch, batch_idx = resolve_position(state, epoch, batch_idx)  # checked against its loader
        blocking = (not self.async_save) if blocking is None else blocking
        position = Position(epoch=epoch, batch_idx=batch_idx, extra=dict(extra or {}))
        if self.runlog is not None and (blocking or self.preempted):
            # The steps up to a blocking save reach storage beside its tensor write, off this
            # thread: a kill inside the save leaves them on record for the audit to compare.
            self.runlog.flush_soon()
        if self.preempted:
            return self._shutdown.save_and_stop(
                state, step=step, position=position, metrics=metrics, tags=tags, extra_files=extra_files
            )
        try:
            with self._lock:
                return self._saving.save(
                    state,
                    step=step,
                    position=position,
                    metrics=metrics,
                    tags=tags,
                    blocking=blocking,
                    snapshot=self.snapshot,
                    extra_files=extra_files,
                )
        finally:
            # A non-blocking save asks last: the flusher, woken before the snapshot, took the GIL
            # from it (a stall of up to a switch interval). Its tensors are written later anyway.
            if self.runlog is not None and not blocking:
                self.runlog.flush_soon()

    # ------------------------------------------------------------------ step log, lifecycle

    def log_step(self, step: int, **scalars: float | torch.Tensor | np.generic) -> None:
        """Append ``scalars`` (loss, lr, ...) for ``step`` to this attempt's step log.

        A one-element tensor is read at the log's next flush (no device sync per step).
        """
        if self.runlog is None:
            raise ConfigError(f"{self.url} was opened read_only: log_step() needs a writer")
        self.runlog.log_step(step, **scalars)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a background save; re-raise its failure. False if it is still running."""
        return self._shutdown.wait(timeout)

    def close(self) -> None:
        """Wait for a background save, flush the step log, release the lease. Idempotent.

        A stop signal that arrived since (``save_on_signal``) and was not yet acted on by a
        save takes effect here, once the lease is released; then all of this is bounded by
        ``signal_deadline``, as after the last save.
        """
        self._shutdown.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unrestored(state: Any, tree: Any) -> tuple[str, ...]:
    """The objects of a restored tree ``state`` does not hold (a partial restore's report)."""
    saved = tree.get("objects") if isinstance(tree, Mapping) else None
    objects = getattr(state, "objects", None)
    if not isinstance(saved, Mapping) or not isinstance(objects, Mapping):
        return ()
    return tuple(sorted(str(name) for name in saved if name not in objects))
