"""The save pipeline of one writer: snapshot a state, write its tensors, commit, rotate.

It orders the writes so that every crash window leaves the previous committed checkpoint intact,
and fences a writer that lost the lease before it commits or deletes anything. Configuration, the
read API and restore belong to the manager; which checkpoints go is ``rotation``'s, when saves run
``scheduling``'s. What the write path shares (lease, rank, resume point, catalog) is the
:class:`~ckptsdk.checkpoint.writing.writer.WriterSession` it is given; what follows a commit is
:class:`~ckptsdk.checkpoint.writing.aftercommit.AfterCommit`'s, the takeover's anchor ``anchoring``'s.

Ordering that matters (each is a crash window or a zombie window):
  - tensors first, manifest last: a checkpoint exists only once its manifest is published;
  - the lease is renewed (compare-and-swap) right before the commit: that renewal is the fence;
    on a store without compare-and-swap (Drive) a listing right before the commit is too;
  - a writer deletes only checkpoints of its own rank or lower, nothing while fenced, and only
    after its commit (rotation, the step log and the sweep are off the save's critical path).

The lean commit: a steady-state save on a store with compare-and-swap makes three round trips
in sequence (tensor upload, renewal, manifest). The writer's catalog lives in memory, updated
by its own commits; it is relisted at the first save, after a failed or fenced save, and every
``RELIST_S`` seconds (to see what ``gc`` or a takeover changed; see ``writer``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ckptsdk.backends.base import Backend, Writable, durable_batch
from ckptsdk.backends.deadline import SAVE_RATE_BPS, bounded
from ckptsdk.checkpoint.pruning.recycling import take_file
from ckptsdk.checkpoint.pruning.rotation import Rotation
from ckptsdk.checkpoint.reading.catalog import CheckpointInfo
from ckptsdk.checkpoint.writing.aftercommit import AfterCommit
from ckptsdk.checkpoint.writing.pacing import Paced
from ckptsdk.checkpoint.writing.scheduling import Job, SaveSlots, SaveStats
from ckptsdk.checkpoint.writing.sharing import FrozenMode, Hints, Plan, Sharing, content_name
from ckptsdk.checkpoint.writing.staging import SnapshotMode
from ckptsdk.checkpoint.writing.writer import RELIST_S, WriterSession
from ckptsdk.errors import CheckpointError, DeadlineExceeded
from ckptsdk.format.digest import DEFAULT as DIGEST_ALGORITHM
from ckptsdk.format.environment import Environment, device_of
from ckptsdk.format.files.tensorfile import write_tensorfile
from ckptsdk.format.layout import MANIFEST, TENSORS, Rank, shared_key
from ckptsdk.format.manifest import FileEntry, Manifest, Position, ReferencedBase, SharedFile
from ckptsdk.format.manifest import Writer as WriterRecord
from ckptsdk.format.template import Captured, EncodingCache
from ckptsdk.lease.acquire import Lease
from ckptsdk.runlog.writer import RunLog

logger = logging.getLogger(__name__)

__all__ = ["RELIST_S", "SavePipeline", "SaveRecord"]


@dataclass(frozen=True)
class SaveRecord:
    """What a save commits besides its tensors (captured at ``save()``; an anchor's from the
    manifest it re-commits), passed whole down the write path."""

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


class SavePipeline:
    """Saves of one lease holder: foreground snapshot, background write, commit, rotation.

    Args:
        writer: the writer's session (lease, rank, resume point, its catalog of the root).
        rotation: applies retention after each commit.
        runlog: the attempt's step log, flushed after each commit (off the critical path).
        max_staging_bytes: the most host memory two staging buffers may hold; a save due while
            one is writing and another would exceed it is skipped and counted. None: no bound
            (at most two snapshots of the state).
        save_deadline: seconds the storage half of one save may take (None: the lease's ttl).
        incremental: keep unchanged tensors in shared files (``SaveOptions.incremental``).
        frozen: ``"reference"`` records frozen weights by digest (``SaveOptions.frozen``).
        frozen_source: the label recorded with them (``SaveOptions.frozen_source``).
    """

    def __init__(
        self,
        writer: WriterSession,
        *,
        rotation: Rotation,
        runlog: RunLog | None,
        max_staging_bytes: int | None = None,
        save_deadline: float | None = None,
        incremental: bool = True,
        frozen: FrozenMode = "store",
        frozen_source: str | None = None,
    ) -> None:
        self.writer = writer
        self.rotation = rotation
        self.save_deadline = save_deadline
        self._slots = SaveSlots(max_staging_bytes=max_staging_bytes)
        self.after = AfterCommit(writer, rotation, runlog, self._slots)
        self._encoding = EncodingCache()
        self.sharing = Sharing(enabled=incremental, mode=frozen, source=frozen_source)
        # (the names tuple of a template, the referenced paths) -> the names staged: the same
        # tuple at every save while both hold, so staging keeps trusting its buffers' layout
        self._staged_names: tuple[tuple[str, ...] | None, frozenset[str], tuple[str, ...]] = (None, frozenset(), ())
        self._abandoned = threading.Event()
        self._committed: dict[str, CheckpointInfo] = {}
        self._sync_caller = False  # a blocking save is committing on the caller's thread
        self._pacing = threading.local()  # .idle: the running background save's (see pacing.py)
        # Drive's recycle mode: (the checkpoint retired for the save being stored, or None),
        # chosen beside the listing before its upload; None: not chosen yet (see _write).
        self._retired: tuple[CheckpointInfo | None] | None = None

    @property
    def backend(self) -> Backend:
        """The root's storage (the writer's: tests swap it for a fault injector)."""
        return self.writer.backend

    @property
    def url(self) -> str:
        return self.writer.url

    @property
    def lease(self) -> Lease:
        return self.writer.lease

    @property
    def tag(self) -> str:
        """This writer's tag in its names (see :mod:`ckptsdk.format.layout`)."""
        return self.writer.tag

    @property
    def rank(self) -> Rank:
        """This writer's (lease epoch, tag)."""
        return self.writer.rank

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
        folder = self.writer.lineage.folder(step)
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
            captured.names,
            captured.tensors,
            state.step_only_flags(captured.tensors) if stepped else (),
            state.frozen_flags(captured.tensors) if stepped and self.sharing.referencing else (),
        )
        job = SaveRecord(
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
            step=step, epoch=self.writer.lineage.epoch, tag=self.tag, key=folder, size=0, committed=False, valid=False
        )
        whole, (captured, live_refs) = captured, self._unreferenced(captured, hints)
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
                self._store(job_now, {**pending.tensors, **live_refs}, whole.skeleton())

            self._slots.submit(Job(run=work, buffer=buffer, step=step, settle=pending.settle))
            submitted = True
            return replace(pending_info, reason="save in progress")
        finally:
            self._slots.start_copies(pending)  # last: see there
            if not submitted:  # the buffer is free again once the copies into it are done
                pending.settle()
                self._slots.release(buffer)

    def _unreferenced(self, captured: Captured, hints: Hints | None) -> tuple[Captured, dict[str, torch.Tensor]]:
        """``captured`` without the tensors ``hints`` records by digest (never staged: the pause and
        the staging memory do not grow with a frozen base), and those live tensors by path."""
        refs = frozenset() if hints is None else hints.referenced
        if not refs:
            return captured, {}
        seen, was, names = self._staged_names
        if seen is not captured.names or was != refs:
            names = tuple(n for n in captured.names if n not in refs)
            self._staged_names = (captured.names, refs, names)
        live: dict[str, torch.Tensor] = {}
        kept: list[torch.Tensor] = []
        for name, t in zip(captured.names, captured.tensors, strict=True):
            if name in refs:
                live[name] = t.detach()
            else:
                kept.append(t)
        nbytes = captured.nbytes - sum(t.nbytes for t in live.values())
        staged = Captured(names, kept, [], None, nbytes=nbytes, sized=captured.sized)
        return staged, live

    def close(self) -> None:
        """At the writer's close, after its last save: stop re-hashing the referenced tensors."""
        self.sharing.close()

    @property
    def last_committed(self) -> CheckpointInfo | None:
        """The newest checkpoint this pipeline committed, if any."""
        return next(iter(self._committed.values()), None)

    def abandon(self) -> None:
        """Make the saves in flight stop before their commit (preemption past its deadline).

        A publish already under way completes (it is atomic); nothing is published after it.
        """
        self._abandoned.set()

    def _store(self, job: SaveRecord, tensors: Mapping[str, torch.Tensor], skeleton: Any) -> CheckpointInfo:
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
                    self._retired = self.after.relist_and_retire(job.step)
                cat = self.writer.catalog()
                existing = next((c for c in cat.checkpoints if c.key == job.folder and c.committed), None)
                if existing is not None:
                    logger.debug("step %d already committed as %s; not saving it twice", job.step, job.folder)
                    self._retired = None  # (its folder, now uncommitted, goes as a leftover)
                    return existing
                self.writer.write_lineage(None, None)  # once: a no-op after this writer's first commit or restore
                self._pacing.idle = job.pace
                try:
                    return self.commit(job, dict(tensors), skeleton)
                finally:
                    self._pacing.idle = None
            except BaseException as exc:
                self.writer.drop_catalog()  # whatever failed, the next save lists the root again
                self._retired = None
                if isinstance(exc, DeadlineExceeded) and job.folder in self._committed:
                    logger.warning("step %d is committed under %s; rotation waits: %s", job.step, self.url, exc)
                    return self._committed[job.folder]
                raise

    def commit(self, job: SaveRecord, tensors: dict[str, torch.Tensor], skeleton: Any) -> CheckpointInfo:
        """Write the tensor files, renew the lease, publish the manifest (the commit), rotate.

        ``job.extra_files``: written into its folder by other ranks beforehand; ``job.verify``: run
        before the commit; ``job.hints``: what ``save()`` saw of the live tensors (None: write every
        tensor)."""
        self.lease.check()
        plan = self.sharing.plan(tensors, job.hints)
        self.sharing.drop_lost(plan, tensors, self.backend, self.url)  # one stat per shared file it refers to
        with durable_batch(self.backend):  # one fsync per folder, once the manifest is in place
            shared = self._write_shared(job.step, plan)
            info = self._write(job, plan.own, skeleton, shared, self.sharing.referenced_entries(plan))
        assert info.manifest is not None
        self.sharing.committed(info.manifest, job.hints)
        self.after_commit(info)
        return info

    def after_commit(self, info: CheckpointInfo) -> None:
        """Rotation and the step log after ``info`` committed (on the worker after a blocking save)."""
        self.after.run(info, on_worker=self._sync_caller)

    def _write(
        self,
        job: SaveRecord,
        tensors: dict[str, torch.Tensor],
        skeleton: Any,
        shared: list[SharedFile],
        referenced: list[ReferencedBase],
    ) -> CheckpointInfo:
        key = f"{job.folder}/{TENSORS}"
        chosen, self._retired = self._retired, None
        if chosen is not None:  # retired beside the listing before the upload
            source = chosen[0]
        else:
            source = self.after.retire(self.writer.catalog(), job.step) if self.rotation.recycles else None
        if source is not None:
            self.writer.forget({source.key})  # its manifest is gone: it is no checkpoint any more
        in_place = take_file(self.backend, f"{source.key}/{TENSORS}", key) if source is not None else None
        if source is not None and in_place is not None:
            # The file this checkpoint reuses is rewritten in place (not atomic: no manifest
            # refers to it now, and a reader holding a stale one fails its digest check).
            size, digest = self._write_tensors(in_place, key, tensors)
            self.rotation.recycled(source, job.folder, size)
        else:
            size, digest = self._write_tensors(self.backend, key, tensors)
        files = [FileEntry(name=TENSORS, size=size, digest=digest, algorithm=DIGEST_ALGORITHM), *job.extra_files]
        return self.publish(job, files, skeleton, shared, referenced)

    def _write_tensors(self, backend: Writable, key: str, tensors: Mapping[str, torch.Tensor]) -> tuple[int, str]:
        """``write_tensorfile``; on the worker paced around optimizer steps, the writes and the hash."""
        idle = getattr(self._pacing, "idle", None)
        if idle is None:
            return write_tensorfile(backend, key, tensors)
        paced = Paced(backend, idle)
        return write_tensorfile(paced, key, tensors, pause=paced.wait)

    def _write_shared(self, step: int, plan: Plan) -> list[SharedFile]:
        """The manifest's ``shared`` list: a new shared file for ``plan.new`` (written here, once),
        and the files already written that ``plan`` refers to (see :mod:`ckptsdk.checkpoint.writing.sharing`)."""
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

    def publish(
        self,
        job: SaveRecord,
        files: list[FileEntry],
        skeleton: Any,
        shared: Sequence[SharedFile] = (),
        referenced: Sequence[ReferencedBase] = (),
    ) -> CheckpointInfo:
        """Publish the manifest of ``job.folder`` (the commit; its files are in place).

        Inside the caller's ``durable_batch`` block with the files' writes: the tensor file's
        and the manifest's renames share one fsync of their folder (the tensor file's own, 6 ->
        5 fsyncs), the new folder's name rides on the root's fsync the lease renewal needs, at
        the block's end. A power cut before it loses at most this uncommitted save (rotation runs
        after the block); on a journaling filesystem renames land in order, so a durable manifest
        means a durable tensor file, else the reader's size check rejects it and falls back.
        """
        manifest = Manifest.built(  # the skeleton is the codec's own: not validated again
            step=job.step,
            position=job.position,
            writer=WriterRecord(
                run_id=self.lease.run_id,
                attempt=self.lease.attempt,
                lease_epoch=self.lease.epoch,
                host=socket.gethostname(),
                pid=os.getpid(),
                resumed_from_step=self.writer.lineage.resumed_from,
            ),
            files=files,
            tree=skeleton,
            metrics=dict(job.metrics),  # checked and converted by userfield.user_fields at save()
            environment=Environment.current(device=job.device),
            tags=dict(job.tags),
            keep=self.rotation.keep_record(),
            shared=list(shared),
            referenced=list(referenced),
        )
        # The fence. A zombie that lost the lease while writing the tensors must not commit them:
        # renew (compare-and-swap, not just check) so a takeover during the write is seen here.
        # Where the store has no compare-and-swap (Drive) the renewal reads what LEASE.json shows
        # and the listing before the write (see ``_store``) looked for a newer writer's names.
        if job.verify is not None:
            job.verify()
        self.lease.renew()
        if self._abandoned.is_set():
            raise CheckpointError(
                f"the save of step {job.step} under {self.url} was abandoned before its commit (its "
                "deadline passed); the previous committed checkpoint is intact",
                url=self.url,
                step=job.step,
                key=job.folder,
            )
        published = self.backend.write(f"{job.folder}/{MANIFEST}", manifest.to_json())
        self.writer.memo[(published.key, published.version)] = manifest  # the next scan need not re-read it
        size = sum(f.size for f in files)
        logger.info("committed %s/%s (%d bytes)", self.url, job.folder, size)
        epoch, tag = self.lease.epoch, self.tag  # the full rank: rotation tells this writer's newest by it
        info = CheckpointInfo(job.step, epoch, job.folder, size, committed=True, valid=True, manifest=manifest, tag=tag)
        self._committed = {job.folder: info}  # the newest only: an older one may have been rotated out
        return info
