"""The save pipeline of one writer: snapshot a state, write its tensors, commit, rotate.

It orders the writes so that every crash window leaves the previous committed checkpoint intact,
and fences a writer that lost the lease before it commits or deletes anything. Configuration, the
read API and restore belong to the manager; which checkpoints go is ``rotation``'s, when saves run ``scheduling``'s.

Ordering that matters (each is a crash window or a zombie window):
  - tensors first, manifest last: a checkpoint exists only once its manifest is published;
  - the lease is renewed (compare-and-swap) right before the commit: that renewal is the fence;
    on a store without compare-and-swap (Drive) a listing right before the commit is too;
  - a writer deletes only checkpoints of its own rank or lower, nothing while fenced, and only
    after its commit (rotation, the step log and the sweep are off the save's critical path).

The lean commit: a steady-state save on a store with compare-and-swap makes three round trips
in sequence (tensor upload, renewal, manifest). The writer's catalog lives in memory, updated
by its own commits; it is relisted at the first save, after a failed or fenced save, and every
``RELIST_S`` seconds (to see what ``gc`` or a takeover changed).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ckptsdk.backends.base import Backend, Writable, durable_batch
from ckptsdk.backends.deadline import SAVE_RATE_BPS, bounded
from ckptsdk.checkpoint.aftercommit import RELIST_S, AfterCommit
from ckptsdk.checkpoint.anchoring import Anchoring
from ckptsdk.checkpoint.catalog import Catalog, CheckpointInfo
from ckptsdk.checkpoint.lineage import LineageWriter
from ckptsdk.checkpoint.pacing import Paced
from ckptsdk.checkpoint.recycling import take_file
from ckptsdk.checkpoint.rotation import Rotation
from ckptsdk.checkpoint.scheduling import SaveSlots, SaveStats, _Job
from ckptsdk.checkpoint.sharing import Hints, Plan, Sharing, content_name
from ckptsdk.checkpoint.staging import SnapshotMode
from ckptsdk.errors import CheckpointError, DeadlineExceeded
from ckptsdk.format.digest import DEFAULT as DIGEST_ALGORITHM
from ckptsdk.format.environment import Environment, device_of
from ckptsdk.format.layout import MANIFEST, TENSORS, Rank, shared_key
from ckptsdk.format.manifest import FileEntry, Manifest, Position, SharedFile
from ckptsdk.format.manifest import Writer as WriterRecord
from ckptsdk.format.template import EncodingCache
from ckptsdk.format.tensorfile import write_tensorfile
from ckptsdk.lease.acquire import Lease
from ckptsdk.runlog.writer import RunLog

logger = logging.getLogger(__name__)

__all__ = ["RELIST_S", "SavePipeline"]


@dataclass(frozen=True)
class _Save:
    """What a save commits besides its tensors (captured at ``save()``)."""

    folder: str
    step: int
    position: Position
    metrics: dict[str, Any]
    tags: dict[str, str]
    device: str
    extra_files: tuple[FileEntry, ...] = ()
    verify: Callable[[], None] | None = None  # right before the commit: the pipelined rule held
    hints: Hints | None = None  # what save() saw of the live tensors (incremental saves)
    pace: threading.Event | None = None  # background saves: set while no optimizer step runs


class SavePipeline(AfterCommit, Anchoring):
    """Saves of one lease holder: foreground snapshot, background write, commit, rotation.

    Args:
        backend: the checkpoint root.
        lease: the acquired writer lease (its epoch and nonce name this writer).
        runlog: the attempt's step log, flushed after each commit (off the critical path).
        rotation: applies retention after each commit.
        scan: lists the root (the manager's memoised catalog scan).
        memo: the scan's memo, fed with each manifest just written.
        max_staging_bytes: the most host memory two staging buffers may hold; a save due while
            one is writing and another would exceed it is skipped and counted. None: no bound
            (at most two snapshots of the state).
        clock: monotonic time of the relist period (the lease's clock).
    """

    save_deadline: float | None = None  # SaveOptions.save_deadline (None: the lease's ttl), set by the manager

    def __init__(
        self,
        backend: Backend,
        lease: Lease,
        *,
        runlog: RunLog | None,
        rotation: Rotation,
        scan: Callable[[], Catalog],
        memo: dict[tuple[str, str], object],
        max_staging_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.url = backend.url
        self.lease = lease
        self.runlog = runlog
        self.rotation = rotation
        self._scan = scan
        self._memo = memo
        self._clock = clock
        record = lease.record
        assert record is not None
        self.writer = LineageWriter.of(
            epoch=lease.epoch, nonce=record.holder.nonce, compare_and_swap=backend.capabilities.compare_and_swap
        )
        self._resumed_from: CheckpointInfo | None = None
        self._slots = SaveSlots(max_staging_bytes=max_staging_bytes)
        self._encoding = EncodingCache()
        self.sharing = Sharing()  # the manager sets ``enabled`` (SaveOptions.incremental)
        self._lineage_written = False
        self._abandoned = threading.Event()
        self._committed: dict[str, CheckpointInfo] = {}
        # The writer's own view of the root: None until listed; relisted after a failure.
        self._catalog: Catalog | None = None
        self._listed_at = 0.0
        self._tidy_due = True  # leftovers and the sweep: at the first listing and after a failure
        self._sync_caller = False  # a blocking save is committing on the caller's thread
        self._pacing = threading.local()  # .idle: the running background save's (see pacing.py)
        # Drive's recycle mode: (the checkpoint retired for the save being stored, or None),
        # chosen beside the listing before its upload; None: not chosen yet (see _write).
        self._retired: tuple[CheckpointInfo | None] | None = None

    @property
    def tag(self) -> str:
        """This writer's tag in its names (see :mod:`ckptsdk.format.layout`)."""
        return self.writer.tag

    @property
    def rank(self) -> Rank:
        """This writer's (lease epoch, tag)."""
        return self.writer.rank

    @property
    def resumed_from(self) -> CheckpointInfo | None:
        """The checkpoint this writer resumed from (None: a fresh start, or not restored yet)."""
        return self._resumed_from

    @resumed_from.setter
    def resumed_from(self, info: CheckpointInfo | None) -> None:
        self._resumed_from = info
        self.writer = replace(self.writer, resumed_from=None if info is None else info.step)

    @property
    def busy(self) -> bool:
        """A background save is running or waiting."""
        return self._slots.busy

    @property
    def stats(self) -> SaveStats:
        """Saves committed, replaced, skipped, failed, and how long they take."""
        return self._slots.stats()

    def settle(self) -> None:
        """Wait for a blocking save's rotation still on the worker (not on the worker itself)."""
        if not self._slots.on_worker():
            self._slots.settle()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background saves (running and waiting); re-raise a failure. False on timeout."""
        return self._slots.wait(timeout)

    def stop(self) -> None:
        """No more saves: let the worker thread end after the saves in flight."""
        self._slots.stop()

    def save(
        self,
        state: Any,
        *,
        step: int,
        position: Position,
        metrics: Mapping[str, Any] | None,
        tags: Mapping[str, str] | None,
        blocking: bool,
        snapshot: SnapshotMode = "pipelined",
        extra_files: Sequence[FileEntry] = (),
    ) -> CheckpointInfo:
        """See :meth:`ckptsdk.CheckpointManager.save`.

        Non-blocking saves touch no storage here and never wait for the previous save: the
        fencing check reads the flag the lease heartbeat keeps fresh, the snapshot goes to a free
        staging buffer (replacing a save still waiting for the worker), and everything else runs
        on the worker (:meth:`_store`). ``extra_files`` were written into the folder by others
        (distributed ranks) beforehand.
        """
        self._slots.raise_failure()  # a background failure surfaces at the next save
        if blocking:
            self._slots.wait()
        self.lease.check()
        folder = self.writer.folder(step)
        done = self._committed.get(folder)
        if done is not None:
            logger.debug("step %d already committed as %s; not saving it twice", step, folder)
            return done
        trained = callable(getattr(state, "step_only_flags", None))  # a TrainState (a layer above this one)
        if trained:
            tree = state.state_dict(keep_vars=True)  # the staging copy or tensor_dict() detaches
        else:
            tree = state.state_dict() if hasattr(state, "state_dict") else state
        captured = self._encoding.encode(tree)  # the tree's structure is cached between saves
        stepped = self.sharing.fresh and trained
        hints = self.sharing.hints(
            captured.names, captured.tensors, state.step_only_flags(captured.tensors) if stepped else ()
        )
        job = _Save(
            folder, step, position, dict(metrics or {}), dict(tags or {}), "cpu", tuple(extra_files), hints=hints
        )
        if blocking:
            tensors = captured.tensor_dict()
            # It returns once the commit is durable: what follows (rotation's deletes, the step
            # log) goes to the worker, which the next save and close() wait for.
            self._sync_caller = True
            try:
                info = self._store(replace(job, device=device_of(tensors.values())), tensors, captured.skeleton())
            finally:
                self._sync_caller = False
            self._slots.committed += 1
            return info
        pending_info = CheckpointInfo(
            step=step, epoch=self.writer.epoch, tag=self.tag, key=folder, size=0, committed=False, valid=False
        )
        pipelined = snapshot == "pipelined" and trained and state.optimizers()
        defer = state.step_only_flags(captured.tensors) if pipelined else [False] * len(captured.names)
        staged = self._slots.stage(step, captured, defer, where=f"the save of step {step} under {self.url}: ")
        if staged is None:
            return replace(pending_info, reason="skipped: storage cannot keep up and staging is full")
        pending, buffer = staged
        submitted = False
        try:
            if any(defer):
                state.hold_steps(pending.wait_copied)

            idle = getattr(state, "steps_idle", None)  # a TrainState's (see pacing.py)

            def work() -> None:  # the skeleton is built here, from leaves copied at capture
                pending.wait_finished()
                job_now = replace(job, device=pending.device, verify=pending.verify, pace=idle)
                self._store(job_now, pending.tensors, captured.skeleton())

            self._slots.submit(_Job(run=work, buffer=buffer, step=step, settle=pending.settle))
            submitted = True
            return replace(pending_info, reason="save in progress")
        finally:
            self._slots.start_copies(pending)  # last: see there
            if not submitted:  # the buffer is free again once the copies into it are done
                pending.settle()
                self._slots.release(buffer)

    @property
    def last_committed(self) -> CheckpointInfo | None:
        """The newest checkpoint this pipeline committed, if any."""
        return next(iter(self._committed.values()), None)

    def abandon(self) -> None:
        """Make the saves in flight stop before their commit (preemption past its deadline).

        A publish already under way completes (it is atomic); nothing is published after it.
        """
        self._abandoned.set()

    def _store(self, job: _Save, tensors: Mapping[str, torch.Tensor], skeleton: Any) -> CheckpointInfo:
        """The storage half of a save (tensors, renewal: the fence, commit; then rotate), within one
        deadline (``save_deadline``). Without compare-and-swap (Drive) a listing comes first: a fence too."""
        what, nbytes = f"the save of step {job.step} under {self.url}", sum(t.nbytes for t in tensors.values())
        limit = self.save_deadline or self.lease.ttl
        with bounded(limit, what, option="save_deadline", nbytes=nbytes, rate=SAVE_RATE_BPS):
            try:
                self.lease.check()
                if not self.backend.capabilities.compare_and_swap:
                    # Drive: the listing is a fence (a newer writer's folders and lineage record), and
                    # before the upload, so a zombie stops before it sends a full-size file that could
                    # only end in the trash.
                    self._relist_and_retire(job.step)
                cat = self.catalog()
                existing = next((c for c in cat.checkpoints if c.key == job.folder and c.committed), None)
                if existing is not None:
                    logger.debug("step %d already committed as %s; not saving it twice", job.step, job.folder)
                    self._retired = None  # (its folder, now uncommitted, goes as a leftover)
                    return existing
                self.write_lineage(None, None)  # once: a no-op after this writer's first commit or restore
                self._pacing.idle = job.pace
                try:
                    return self.commit(
                        job.folder,
                        job.step,
                        dict(tensors),
                        skeleton,
                        job.position,
                        job.metrics,
                        job.tags,
                        job.device,
                        job.extra_files,
                        verify=job.verify,
                        hints=job.hints,
                    )
                finally:
                    self._pacing.idle = None
            except BaseException as exc:
                self._catalog = None  # whatever failed, the next save lists the root again
                self._retired = None
                if isinstance(exc, DeadlineExceeded) and job.folder in self._committed:
                    logger.warning("step %d is committed under %s; rotation waits: %s", job.step, self.url, exc)
                    return self._committed[job.folder]
                raise

    def commit(
        self,
        folder: str,
        step: int,
        tensors: dict[str, torch.Tensor],
        skeleton: Any,
        position: Position,
        metrics: Mapping[str, Any] | None,
        tags: Mapping[str, str] | None,
        device: str,
        extra_files: Sequence[FileEntry] = (),
        verify: Callable[[], None] | None = None,
        hints: Hints | None = None,
    ) -> CheckpointInfo:
        """Write the tensor files, renew the lease, publish the manifest (the commit), rotate.

        ``extra_files``: written into ``folder`` by other ranks beforehand; ``verify``: run before
        the commit; ``hints``: what ``save()`` saw of the live tensors (None: write every tensor)."""
        self.lease.check()
        plan = self.sharing.plan(tensors, hints)
        self.sharing.drop_lost(plan, tensors, self.backend, self.url)  # one stat per shared file it refers to
        with durable_batch(self.backend):  # one fsync per folder, once the manifest is in place
            shared = self._write_shared(step, plan)
            info = self._write(
                folder, step, plan.own, skeleton, position, metrics, tags, device, extra_files, verify, shared
            )
        assert info.manifest is not None
        self.sharing.committed(info.manifest, hints)
        self._after_commit(info)
        return info

    def _write(
        self,
        folder: str,
        step: int,
        tensors: dict[str, torch.Tensor],
        skeleton: Any,
        position: Position,
        metrics: Mapping[str, Any] | None,
        tags: Mapping[str, str] | None,
        device: str,
        extra_files: Sequence[FileEntry],
        verify: Callable[[], None] | None,
        shared: list[SharedFile],
    ) -> CheckpointInfo:
        key = f"{folder}/{TENSORS}"
        chosen, self._retired = self._retired, None
        if chosen is not None:  # retired beside the listing before the upload
            source = chosen[0]
        else:
            source = self._retire(self.catalog(), step) if self.rotation.recycles else None
        if source is not None:
            self._forget({source.key})  # its manifest is gone: it is no checkpoint any more
        in_place = take_file(self.backend, f"{source.key}/{TENSORS}", key) if source is not None else None
        if source is not None and in_place is not None:
            # The file this checkpoint reuses is rewritten in place (not atomic: no manifest
            # refers to it now, and a reader holding a stale one fails its digest check).
            size, digest = self._write_tensors(in_place, key, tensors)
            self.rotation.recycled(source, folder, size)
        else:
            size, digest = self._write_tensors(self.backend, key, tensors)
        files = [FileEntry(name=TENSORS, size=size, digest=digest, algorithm=DIGEST_ALGORITHM), *extra_files]
        return self._publish(folder, step, files, skeleton, position, metrics, tags, device, verify, shared=shared)

    def _write_tensors(self, backend: Writable, key: str, tensors: Mapping[str, torch.Tensor]) -> tuple[int, str]:
        """``write_tensorfile``; on the worker paced around optimizer steps, the writes and the hash."""
        idle = getattr(self._pacing, "idle", None)
        if idle is None:
            return write_tensorfile(backend, key, tensors)
        paced = Paced(backend, idle)
        return write_tensorfile(paced, key, tensors, pause=paced.wait)

    def _write_shared(self, step: int, plan: Plan) -> list[SharedFile]:
        """The manifest's ``shared`` list: a new shared file for ``plan.new`` (written here, once),
        and the files already written that ``plan`` refers to (see :mod:`ckptsdk.checkpoint.sharing`)."""
        new = None
        if plan.new:
            epoch, tag = self.rank
            key = shared_key(step, epoch, tag, content_name(plan.new_digests))
            self.lease.check()
            size, digest = self._write_tensors(self.backend, key, plan.written())
            new = SharedFile(
                name=key,
                size=size,
                digest=digest,
                algorithm=DIGEST_ALGORITHM,
                tensors=plan.new_digests,
                aliases=plan.new_aliases,
            )
        if plan.new or plan.refs:
            where = new.name if new else "no new shared file"
            logger.info(
                "the save of step %d under %s writes %d tensor(s) anew to %s and refers to %d unchanged "
                "one(s) in shared files (%d MB hashed to decide)",
                *(step, self.url, len(plan.new), where, plan.reused, plan.hashed >> 20),
            )
        return self.sharing.entries(plan, new)

    def _publish(
        self,
        folder: str,
        step: int,
        files: list[FileEntry],
        skeleton: Any,
        position: Position,
        metrics: Mapping[str, Any] | None,
        tags: Mapping[str, str] | None,
        device: str,
        verify: Callable[[], None] | None = None,
        *,
        shared: Sequence[SharedFile] = (),
    ) -> CheckpointInfo:
        """Publish the manifest of ``folder`` (the commit; its files are in place).

        Inside the caller's ``durable_batch`` block with the files' writes: the tensor file's
        and the manifest's renames share one fsync of their folder (the tensor file's own, 6 ->
        5 fsyncs), the new folder's name rides on the root's fsync the lease renewal needs, at
        the block's end. A power cut before it loses at most this uncommitted save (rotation runs
        after the block); on a journaling filesystem renames land in order, so a durable manifest
        means a durable tensor file, else the reader's size check rejects it and falls back.
        """
        manifest = Manifest.built(  # the skeleton is the codec's own: not validated again
            step=step,
            position=position,
            writer=WriterRecord(
                run_id=self.lease.run_id,
                attempt=self.lease.attempt,
                lease_epoch=self.lease.epoch,
                host=socket.gethostname(),
                pid=os.getpid(),
                resumed_from_step=self.writer.resumed_from,
            ),
            files=files,
            tree=skeleton,
            metrics=dict(metrics or {}),  # checked and converted by userfield.user_fields at save()
            environment=Environment.current(device=device),
            tags=dict(tags or {}),
            keep=self.rotation.keep_record(),
            shared=list(shared),
        )
        # The fence. A zombie that lost the lease while writing the tensors must not commit them:
        # renew (compare-and-swap, not just check) so a takeover during the write is seen here.
        # Where the store has no compare-and-swap (Drive) the renewal reads what LEASE.json shows
        # and the listing before the write (see ``_store``) looked for a newer writer's names.
        if verify is not None:
            verify()
        self.lease.renew()
        if self._abandoned.is_set():
            raise CheckpointError(
                f"the save of step {step} under {self.url} was abandoned before its commit (its "
                "deadline passed); the previous committed checkpoint is intact",
                url=self.url,
                step=step,
                key=folder,
            )
        published = self.backend.write(f"{folder}/{MANIFEST}", manifest.to_json())
        self._memo[(published.key, published.version)] = manifest  # the next scan need not re-read it
        size = sum(f.size for f in files)
        logger.info("committed %s/%s (%d bytes)", self.url, folder, size)
        epoch, tag = self.lease.epoch, self.tag  # the full rank: rotation tells this writer's newest by it
        info = CheckpointInfo(step, epoch, folder, size, committed=True, valid=True, manifest=manifest, tag=tag)
        self._committed = {folder: info}  # the newest only: an older one may have been rotated out
        return info
