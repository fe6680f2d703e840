"""The save pipeline of one writer: snapshot a state, write its tensors, commit, rotate.

It orders the writes so that every crash window leaves the previous committed checkpoint intact,
and fences a writer that lost the lease before it writes or deletes anything. Configuration, the
read API and restore belong to the manager; which checkpoints go is :mod:`ckptsdk.checkpoint.rotation`'s.

Ordering that matters (each is a crash window or a zombie window):
  - tensors first, manifest last: a checkpoint exists only once its manifest is published;
  - the lease is renewed before anything is written and again right before the commit;
  - a writer deletes only checkpoints of its own rank or lower, nothing while fenced.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptsdk.backends.base import Backend, Rewritable, copier, rewriter
from ckptsdk.checkpoint.catalog import (
    MANIFEST,
    TENSORS,
    Catalog,
    CheckpointInfo,
    Rank,
    checkpoint_dir,
    lineage_key,
)
from ckptsdk.checkpoint.rotation import Rotation
from ckptsdk.checkpoint.staging import SnapshotMode, Stager, tensor_key
from ckptsdk.errors import CheckpointError, LeaseLostError, ObjectNotFound, PreconditionFailed
from ckptsdk.format import codec
from ckptsdk.format.digest import DEFAULT as DIGEST_ALGORITHM
from ckptsdk.format.environment import Environment
from ckptsdk.format.manifest import FileEntry, LineageRecord, Manifest, Position, Writer
from ckptsdk.format.tensorfile import write_tensorfile
from ckptsdk.lease.acquire import Lease
from ckptsdk.lease.record import writer_tag
from ckptsdk.runlog.writer import RunLog

logger = logging.getLogger(__name__)

__all__ = ["SavePipeline"]


class _BackgroundSave:
    """One save at a time on a long-lived worker thread; its failure is kept until someone asks.

    The worker is started once and fed through a queue: ``Thread.start()`` would make every
    save wait for the new thread to come up and hand the interpreter lock back, a few
    milliseconds of stall on a busy machine.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def start(self, fn: Callable[[], None], name: str) -> None:
        self._idle.clear()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()
        self._jobs.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._jobs.get()
            if fn is None:
                return
            try:
                fn()
            except BaseException as exc:  # kept and re-raised on the caller's thread
                with self._lock:
                    self._error = exc
            finally:
                self._idle.set()

    def stop(self) -> None:
        """Let the worker thread end once the save in flight is done."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the save in flight; re-raise its failure here. False if still running."""
        if not self._idle.wait(timeout):
            return False
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error
        return True


@dataclass(frozen=True)
class _Job:
    """What a save commits besides its tensors (captured at ``save()``)."""

    folder: str
    step: int
    position: Position
    metrics: dict[str, Any]
    tags: dict[str, str]
    device: str
    extra_files: tuple[FileEntry, ...] = ()


class SavePipeline:
    """Saves of one lease holder: foreground snapshot, background write, commit, rotation.

    Args:
        backend: the checkpoint root.
        lease: the acquired writer lease (its epoch and nonce name this writer).
        runlog: the attempt's step log, flushed before each commit.
        rotation: applies retention after each commit.
        scan: lists the root (the manager's memoised catalog scan).
        memo: the scan's memo, fed with each manifest just written.
    """

    def __init__(
        self,
        backend: Backend,
        lease: Lease,
        *,
        runlog: RunLog | None,
        rotation: Rotation,
        scan: Callable[[], Catalog],
        memo: dict[tuple[str, str], object],
    ) -> None:
        self.backend = backend
        self.url = backend.url
        self.lease = lease
        self.runlog = runlog
        self.rotation = rotation
        self._scan = scan
        self._memo = memo
        record = lease.record
        assert record is not None
        self.tag = writer_tag(record.holder.nonce, compare_and_swap=backend.capabilities.compare_and_swap)
        self.rank: Rank = (lease.epoch, self.tag)
        self.resumed_from: CheckpointInfo | None = None
        self._bg = _BackgroundSave()
        self._stager: Stager | None = None
        self._lineage_written = False
        self._abandoned = threading.Event()
        self._committed: dict[str, CheckpointInfo] = {}

    @property
    def busy(self) -> bool:
        """A background save is in flight."""
        return self._bg.busy

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a background save; re-raise its failure. False if it is still running."""
        return self._bg.wait(timeout)

    def stop(self) -> None:
        """No more saves: let the worker thread end after the one in flight."""
        self._bg.stop()

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

        Non-blocking saves touch no storage here: the fencing check reads the flag the lease
        heartbeat keeps fresh, and everything else runs on the worker (:meth:`_store`).
        ``extra_files`` were written into the folder by others (distributed ranks) beforehand.
        """
        self._bg.wait()  # one save in flight (the staging buffers are its); its failure surfaces here
        self.lease.check()
        folder = checkpoint_dir(step, self.lease.epoch, self.tag)
        done = self._committed.get(folder)
        if done is not None:
            logger.debug("step %d already committed as %s; not saving it twice", step, folder)
            return done
        tree = state.state_dict() if hasattr(state, "state_dict") else state
        tensors, skeleton = codec.encode(tree)
        job = _Job(
            folder=folder,
            step=step,
            position=position,
            metrics=dict(metrics or {}),
            tags=dict(tags or {}),
            device=_device_of(tensors),
            extra_files=tuple(extra_files),
        )
        if blocking:
            return self._store(job, tensors, skeleton)
        defer: set[str] = set()
        if snapshot == "pipelined" and callable(getattr(state, "step_only_tensors", None)) and state.optimizers():
            keys = state.step_only_tensors()
            defer = {name for name, t in tensors.items() if tensor_key(t) in keys}
        if self._stager is None:
            self._stager = Stager()
        pending = self._stager.begin(tensors, defer)
        if defer:
            state.hold_steps(pending.wait_copied)
        # The skeleton needs no copy: codec.encode builds fresh containers of immutable leaves.

        def work() -> None:
            pending.finish()
            self._store(job, pending.tensors, skeleton)

        self._bg.start(work, name=f"ckptsdk-save-{step}")
        return CheckpointInfo(
            step=step,
            epoch=self.lease.epoch,
            key=folder,
            size=0,
            committed=False,
            valid=False,
            reason="save in progress",
        )

    @property
    def last_committed(self) -> CheckpointInfo | None:
        """The newest checkpoint this pipeline committed, if any."""
        return next(iter(self._committed.values()), None)

    def abandon(self) -> None:
        """Make the save in flight stop before its commit (preemption past its deadline).

        A publish already under way completes (it is atomic); nothing is published after it.
        """
        self._abandoned.set()

    def _store(self, job: _Job, tensors: Mapping[str, torch.Tensor], skeleton: Any) -> CheckpointInfo:
        """The storage half of a save: renew and list (fencing), lineage, step log, tensors,
        renew again, commit, rotate."""
        # Renewed before anything is written: a writer taken over (even by a newcomer that has
        # not listed anything yet) stops here, not after writing a tensor file it cannot commit.
        self.lease.renew()
        cat = self._scan()
        self.fence_if_newer(cat.max_rank)
        existing = next((c for c in cat.checkpoints if c.key == job.folder and c.committed), None)
        if existing is not None:
            logger.debug("step %d already committed as %s; not saving it twice", job.step, job.folder)
            return existing
        self.write_lineage(None, None)
        if self.runlog is not None:
            self.runlog.flush()
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
        )

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
    ) -> CheckpointInfo:
        """Write the tensor file, renew the lease, publish the manifest (the commit), rotate.

        ``extra_files`` were written into ``folder`` by others (distributed ranks) beforehand.
        """
        self.lease.check()
        key = f"{folder}/{TENSORS}"
        source = (
            self.rotation.recycle_source(self.lease, self.rank, self._scan(), step, self.resumed_from)
            if self.rotation.recycles
            else None
        )
        rewriting = self._take_file(f"{source.key}/{TENSORS}", key) if source is not None else None
        if source is not None and rewriting is not None:
            # The file this checkpoint reuses is rewritten in place (not atomic: no manifest
            # refers to it now, and a reader holding a stale one fails its digest check).
            size, digest = write_tensorfile(_InPlace(rewriting, self.url), key, tensors)  # type: ignore[arg-type]
            self.rotation.recycled(source, folder, size)
        else:
            size, digest = write_tensorfile(self.backend, key, tensors)
        files = [FileEntry(name=TENSORS, size=size, digest=digest, algorithm=DIGEST_ALGORITHM), *extra_files]
        return self._publish(folder, step, files, skeleton, position, metrics, tags, device)

    def _take_file(self, src: str, dst: str) -> Rewritable | None:
        """Move ``src`` to ``dst`` for a rewrite in place: the store to rewrite it with, or None
        (write a new file) if it cannot."""
        rewriting = rewriter(self.backend)
        if rewriting is None:
            return None
        try:
            rewriting.move(src, dst)
        except (ObjectNotFound, PreconditionFailed) as exc:
            # ``dst`` left by an earlier failed save of this step, or ``src`` gone: a new file it
            # is; the recycled folder, now uncommitted, is removed by rotation as a leftover.
            logger.info("cannot recycle %s into %s under %s (%s): writing a new file", src, dst, self.url, exc)
            return None
        return rewriting

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
    ) -> CheckpointInfo:
        """Publish the manifest of ``folder`` (the commit; its files are in place), then rotate."""
        manifest = Manifest(
            step=step,
            position=position,
            writer=Writer(
                run_id=self.lease.run_id,
                attempt=self.lease.attempt,
                lease_epoch=self.lease.epoch,
                host=socket.gethostname(),
                pid=os.getpid(),
                resumed_from_step=self.resumed_from.step if self.resumed_from else None,
            ),
            files=files,
            tree=skeleton,
            metrics=dict(metrics or {}),  # checked and converted by userfield.user_fields at save()
            environment=Environment.current(device=device),
            tags=dict(tags or {}),
        )
        # A zombie that lost the lease while writing the tensors must not commit them: renew
        # (compare-and-swap, not just check) so a takeover during the write is seen here.
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
        info = CheckpointInfo(
            step=step, epoch=self.lease.epoch, key=folder, size=size, committed=True, valid=True, manifest=manifest
        )
        self._committed = {folder: info}  # the newest only: an older one may have been rotated out
        self.rotation.rotate(self.lease, self.rank, self._scan, self.resumed_from)
        return info

    def anchor(self, tree: Any, source: CheckpointInfo) -> None:
        """Re-commit a restored checkpoint under this writer's rank (see ``restore``).

        Where the store copies cheaply (a hard link on local disk, a server-side rewrite on GCS)
        the tensor file is copied there and only a new manifest is written; elsewhere (the Drive
        mount has neither) the restored tensors are written again in full.
        """
        manifest = source.manifest
        assert manifest is not None
        folder = checkpoint_dir(manifest.step, self.lease.epoch, self.tag)
        device = manifest.environment.device or "cpu"
        copying = copier(self.backend)
        if copying is not None:
            self.lease.check()
            for entry in manifest.files:  # the tensor file and any distributed ranks' files
                copying.copy(f"{source.key}/{entry.name}", f"{folder}/{entry.name}")
            self._publish(
                folder,
                manifest.step,
                list(manifest.files),
                manifest.tree,
                manifest.position,
                manifest.metrics,
                manifest.tags,
                device,
            )
            return
        # Files beyond the tensor file (distributed ranks') are copied as they are, then listed.
        extra = [f for f in manifest.files if f.name != TENSORS]
        for entry in extra:
            self.lease.check()
            self.backend.write(f"{folder}/{entry.name}", self.backend.read(f"{source.key}/{entry.name}"))
        tensors, skeleton = codec.encode(tree)
        self.commit(
            folder, manifest.step, tensors, skeleton, manifest.position, manifest.metrics, manifest.tags, device, extra
        )

    @property
    def lineage_written(self) -> bool:
        """This writer's lineage record is written: where its lineage starts is fixed."""
        return self._lineage_written

    def write_lineage(self, step: int | None, epoch: int | None) -> None:
        """Record, once per epoch, where this writer's lineage starts (before its first commit)."""
        if self._lineage_written:
            return
        record = LineageRecord(
            epoch=self.lease.epoch,
            attempt=self.lease.attempt,
            run_id=self.lease.run_id,
            resumed_from_step=step,
            resumed_from_epoch=epoch,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        self.lease.check()
        try:
            self.backend.create(lineage_key(self.lease.epoch, self.tag), record.to_json())
        except PreconditionFailed as exc:
            # Only the holder of this epoch writes this key: someone else did -> we lost the lease.
            self.lease.fence(f"lineage record of epoch {self.lease.epoch} already exists", None)
            raise LeaseLostError(
                f"another writer already recorded epoch {self.lease.epoch} under {self.url}; "
                "this writer stops (nothing was written or deleted)",
                url=self.url,
                epoch=self.lease.epoch,
            ) from exc
        self._lineage_written = True

    def fence_if_newer(self, seen: Rank) -> None:
        """Fence this writer (and raise ``LeaseLostError``) if ``seen`` outranks it."""
        if seen > self.rank:
            self.lease.fence(f"saw a newer writer (epoch {seen[0]}) under {self.url}", seen[0])
            self.lease.check()  # raises LeaseLostError

    def confirm_writer(self) -> None:
        """Renew the lease and look for newer writers; LeaseLostError if this one is stale."""
        self.lease.renew()
        self.fence_if_newer(self._scan().max_rank)


class _InPlace:
    """The backend as ``write_tensorfile`` sees it when the file is rewritten in place."""

    def __init__(self, backend: Rewritable, url: str) -> None:
        self._backend = backend
        self.url = url

    def write(self, key: str, data: Any) -> Any:
        return self._backend.overwrite(key, data)


def _device_of(tensors: Mapping[str, torch.Tensor]) -> str:
    for t in tensors.values():
        if t.device.type != "cpu":
            return str(t.device)
    return "cpu"
