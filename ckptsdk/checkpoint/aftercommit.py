"""What follows a commit of one writer: its in-memory catalog (and when it is listed again), rotation,
the step log.

The base of :class:`ckptsdk.checkpoint.saving.SavePipeline` (which sets the attributes below):
the commit is the pipeline's; this runs after it, off the critical path. After a blocking save it
runs on the save worker, so ``save(blocking=True)`` returns once its commit is durable, and the
next save and ``close()`` wait for it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import replace

from ckptsdk.backends.base import Backend
from ckptsdk.checkpoint.catalog import Catalog, CheckpointInfo
from ckptsdk.checkpoint.recycling import retire_while_listing
from ckptsdk.checkpoint.rotation import Rotation
from ckptsdk.checkpoint.scheduling import SaveSlots
from ckptsdk.errors import BackendError, DeadlineExceeded, LeaseLostError
from ckptsdk.format.layout import Rank
from ckptsdk.lease.acquire import Lease
from ckptsdk.runlog.writer import RunLog

logger = logging.getLogger("ckptsdk.checkpoint.saving")  # one logger for the save pipeline

__all__ = ["RELIST_S", "AfterCommit"]

#: Seconds the writer trusts its in-memory catalog before it lists the root again (to see gc).
RELIST_S = 300.0


class AfterCommit(ABC):
    """The after-commit half of the save pipeline. Not used on its own: the abstract members are
    the pipeline's (an instance without them cannot be made)."""

    backend: Backend
    url: str
    lease: Lease
    runlog: RunLog | None
    rotation: Rotation
    _scan: Callable[[], Catalog]
    _memo: dict[tuple[str, str], object]
    _clock: Callable[[], float]
    _slots: SaveSlots
    _catalog: Catalog | None
    _listed_at: float
    _tidy_due: bool
    _sync_caller: bool
    _retired: tuple[CheckpointInfo | None] | None
    fence_if_newer: Callable[[Rank], None]  # Anchoring's, the pipeline's other base

    @property
    @abstractmethod
    def rank(self) -> Rank: ...

    @property
    @abstractmethod
    def resumed_from(self) -> CheckpointInfo | None: ...

    def catalog(self) -> Catalog:
        """The writer's view of the root: listed at the first save, after a failure and every
        ``RELIST_S`` seconds (fencing on a newer writer it shows), else kept from its own commits."""
        if self._catalog is None or self._clock() - self._listed_at > RELIST_S:
            self._relist()
        assert self._catalog is not None
        return self._catalog

    def _relist(self) -> Catalog:
        cat = self._scan()
        self._catalog, self._listed_at, self._tidy_due = cat, self._clock(), True
        self.fence_if_newer(cat.fencing_rank)
        return cat

    def _relist_and_retire(self, step: int) -> None:
        """Drive's listing before the upload. In recycle mode the checkpoint whose file this save
        reuses loses its manifest meanwhile (:func:`~ckptsdk.checkpoint.recycling.retire_while_listing`),
        chosen from the catalog kept since the last listing; at the first save and after a
        failure (no catalog kept) the choice waits for this listing, as the anchor's does."""
        known = self._catalog
        if not self.rotation.recycles or known is None:
            self._relist()
            return
        source = retire_while_listing(self._relist, lambda: self._retire(known, step))
        if source is not None:
            self._forget({source.key})  # whatever the listing saw: no checkpoint any more
        self._retired = (source,)

    def _retire(self, cat: Catalog, step: int) -> CheckpointInfo | None:
        return self.rotation.recycle_source(self.lease, self.rank, cat, step, self.resumed_from)

    def _after_commit(self, info: CheckpointInfo) -> None:
        """Off the critical path (the checkpoint is committed and durable): the catalog, rotation,
        step log. After a blocking save they run on the worker (never before the commit: this is
        called after it; never while fenced: rotation checks the lease before each delete)."""
        resumed = self.resumed_from
        if self._catalog is None and resumed is not None and info.step == resumed.step:
            return  # restore's anchor: rotation waits for the first save's listing (every manifest)
        if self._sync_caller:
            self._slots.after(lambda: self._tidy_after(info))
        else:
            self._tidy_after(info)

    def _tidy_after(self, info: CheckpointInfo) -> None:
        try:
            self._rotate_after(info)
        except BaseException as exc:
            self._catalog = None  # whatever failed, the next save lists the root again
            if isinstance(exc, DeadlineExceeded):  # as in the save it follows: committed, rotation waits
                logger.warning("step %d is committed under %s; rotation waits: %s", info.step, self.url, exc)
                return
            raise

    def _rotate_after(self, info: CheckpointInfo) -> None:
        rotate = True
        if not self.backend.capabilities.compare_and_swap:
            # Drive: no renewal can prove that no newer writer appeared during the upload, so
            # rotation looks at a fresh listing (as it always did there): a newer writer's name
            # in it fences this writer and rotation deletes nothing.
            cat = self._scan()
            self._listed_at, self._tidy_due = self._clock(), True
            try:
                self.fence_if_newer(cat.fencing_rank)  # a record not believed fences as well
            except LeaseLostError:
                pass  # fenced now: rotate() deletes nothing and says so
        else:
            cat = self.catalog() if self._catalog is None else self._catalog
            # The fence for rotation's deletes (one call, after the commit): a takeover during the
            # manifest upload must not let this writer rotate its lineage under a newcomer. A stat
            # (LEASE.json still at our version) proves that as well as a renewal would, without a
            # write and its two fsyncs; a moved version renews, which judges and fences.
            try:
                self.lease.confirm()
            except LeaseLostError:
                pass  # fenced now: rotate() deletes nothing and says so
            except BackendError as exc:
                rotate = False
                logger.warning("lease renewal after a commit under %s failed (%s): rotating later", self.url, exc)
        mine = [c for c in cat.checkpoints if c.key != info.key] + [info]
        self._catalog = replace(cat, checkpoints=mine, max_rank=max(cat.max_rank, self.rank))
        if rotate:
            tidy, self._tidy_due = self._tidy_due, False
            self._forget(self.rotation.rotate(self.lease, self.rank, self._catalog, self.resumed_from, tidy=tidy))
        if self.runlog is not None:
            try:
                self.runlog.flush()
            except BackendError as exc:
                # The steps stay buffered and go out with the run log's next flush.
                logger.warning("run log under %s: could not publish the steps after a commit (%s)", self.url, exc)

    def _forget(self, keys: set[str]) -> None:
        """Drop folders gone (or no longer committed) from the catalog and the scan's memo: with no
        listing per save nothing else prunes it, and a long run would keep every manifest it wrote."""
        if self._catalog is not None:
            kept = [c for c in self._catalog.checkpoints if c.key not in keys]
            self._catalog = replace(self._catalog, checkpoints=kept)
        for stale in [k for k in self._memo if k[0].partition("/")[0] in keys]:
            del self._memo[stale]
