"""What follows a commit of one writer: its in-memory catalog, rotation, the step log.

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
from ckptsdk.checkpoint.rotation import Rotation
from ckptsdk.checkpoint.scheduling import SaveSlots
from ckptsdk.errors import BackendError, DeadlineExceeded, LeaseLostError
from ckptsdk.format.layout import Rank
from ckptsdk.lease.acquire import Lease
from ckptsdk.runlog.writer import RunLog

logger = logging.getLogger("ckptsdk.checkpoint.saving")  # one logger for the save pipeline

__all__ = ["AfterCommit"]


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

    @property
    @abstractmethod
    def rank(self) -> Rank: ...

    @property
    @abstractmethod
    def resumed_from(self) -> CheckpointInfo | None: ...

    @abstractmethod
    def catalog(self) -> Catalog: ...

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
