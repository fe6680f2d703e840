"""What follows a commit of one writer: its catalog kept current, rotation, the step log.

:class:`AfterCommit` is a collaborator of the save pipeline (and of the anchor): the commit is the
pipeline's; this runs after it, off the critical path. After a blocking save it runs on the save
worker, so ``save(blocking=True)`` returns once its commit is durable, and the next save and
``close()`` wait for it. Which checkpoints go is ``rotation``'s; the catalog is the writer's.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ckptsdk.checkpoint.pruning.recycling import retire_while_listing
from ckptsdk.checkpoint.pruning.rotation import Rotation
from ckptsdk.checkpoint.reading.catalog import Catalog, CheckpointInfo
from ckptsdk.checkpoint.writing.scheduling import SaveSlots
from ckptsdk.checkpoint.writing.writer import WriterSession
from ckptsdk.errors import BackendError, DeadlineExceeded, LeaseLostError
from ckptsdk.runlog.writer import RunLog

logger = logging.getLogger(__name__)

__all__ = ["AfterCommit"]


class AfterCommit:
    """Rotation and the step log after each commit of ``writer``, and Drive's recycle choice.

    Args:
        writer: the session (its lease, rank, resume point and catalog).
        rotation: applies retention.
        runlog: the attempt's step log, flushed after each commit (None: no step log).
        slots: the save worker, which runs this after a blocking save.
    """

    def __init__(self, writer: WriterSession, rotation: Rotation, runlog: RunLog | None, slots: SaveSlots) -> None:
        self.writer = writer
        self.rotation = rotation
        self.runlog = runlog
        self._slots = slots

    def relist_and_retire(self, step: int) -> tuple[CheckpointInfo | None] | None:
        """Drive's listing before the upload; returns ``(the checkpoint retired for this save,)``
        in recycle mode when chosen here, else None (chosen later, beside the write).

        In recycle mode the checkpoint whose file this save reuses loses its manifest meanwhile
        (:func:`~ckptsdk.checkpoint.pruning.recycling.retire_while_listing`), chosen from the catalog kept
        since the last listing; at the first save and after a failure (no catalog kept) the choice
        waits for this listing, as the anchor's does."""
        known = self.writer.known
        if not self.rotation.recycles or known is None:
            self.writer.relist()
            return None
        source = retire_while_listing(self.writer.relist, lambda: self.retire(known, step))
        if source is not None:
            self.writer.forget({source.key})  # whatever the listing saw: no checkpoint any more
        return (source,)

    def retire(self, cat: Catalog, step: int) -> CheckpointInfo | None:
        """The checkpoint whose file the save of ``step`` rewrites in place (recycle mode), if any."""
        return self.rotation.recycle_source(self.writer, cat, step)

    def run(self, info: CheckpointInfo, *, on_worker: bool) -> None:
        """Off the critical path (the checkpoint is committed and durable): the catalog, rotation,
        step log; handed to the worker when ``on_worker`` (a blocking save's caller is waiting).
        Never before the commit (this is called after it); never while fenced (rotation checks
        the lease before each delete)."""
        resumed = self.writer.resumed_from
        if self.writer.known is None and resumed is not None and info.step == resumed.step:
            return  # restore's anchor: rotation waits for the first save's listing (every manifest)
        if on_worker:
            self._slots.after(lambda: self._tidy_after(info))
        else:
            self._tidy_after(info)

    def _tidy_after(self, info: CheckpointInfo) -> None:
        try:
            self._rotate_after(info)
        except BaseException as exc:
            self.writer.drop_catalog()  # whatever failed, the next save lists the root again
            if isinstance(exc, DeadlineExceeded):  # as in the save it follows: committed, rotation waits
                logger.warning("step %d is committed under %s; rotation waits: %s", info.step, self.writer.url, exc)
                return
            raise

    def _fenced_listing(self) -> tuple[Catalog, bool]:
        """(the catalog rotation judges by, whether it may rotate now), fencing on what it shows."""
        writer = self.writer
        if not writer.backend.capabilities.compare_and_swap:
            # Drive: no renewal can prove that no newer writer appeared during the upload, so
            # rotation looks at a fresh listing (as it always did there): a newer writer's name
            # in it fences this writer and rotation deletes nothing.
            cat = writer.listing()
            try:
                writer.fence_if_newer(cat.fencing_rank)  # a record not believed fences as well
            except LeaseLostError:
                pass  # fenced now: rotate() deletes nothing and says so
            return cat, True
        cat = writer.known if writer.known is not None else writer.catalog()
        # The fence for rotation's deletes (one call, after the commit): a takeover during the
        # manifest upload must not let this writer rotate its lineage under a newcomer. A stat
        # (LEASE.json still at our version) proves that as well as a renewal would, without a
        # write and its two fsyncs; a moved version renews, which judges and fences.
        try:
            writer.lease.confirm()
        except LeaseLostError:
            pass  # fenced now: rotate() deletes nothing and says so
        except BackendError as exc:
            logger.warning("lease renewal after a commit under %s failed (%s): rotating later", writer.url, exc)
            return cat, False
        return cat, True

    def _rotate_after(self, info: CheckpointInfo) -> None:
        writer = self.writer
        cat, rotate = self._fenced_listing()
        mine = [c for c in cat.checkpoints if c.key != info.key] + [info]
        current = replace(cat, checkpoints=mine, max_rank=max(cat.max_rank, writer.rank))
        writer.keep(current)
        if rotate:
            writer.forget(self.rotation.rotate(writer, current, tidy=writer.take_tidy()))
        if self.runlog is not None:
            try:
                self.runlog.flush()
            except BackendError as exc:
                # The steps stay buffered and go out with the run log's next flush.
                logger.warning("run log under %s: could not publish the steps after a commit (%s)", writer.url, exc)
