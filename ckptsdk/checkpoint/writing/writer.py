"""One writer's session on a root: what every part of the write path shares, built once at open.

A :class:`WriterSession` holds the lease, this writer's lineage identity (epoch, tag, the step it
resumed from), its lineage record, its own catalog of the root (listed at the first save, after a
failure and every ``RELIST_S`` seconds; else kept from its own commits) and the resume point, in
one place. The save pipeline, the after-commit work, the anchor, rotation and the manager's
restore receive it instead of inheriting from each other or passing (lease, rank, resumed_from)
along. What a save writes is ``saving``'s; which checkpoints go, ``rotation``'s.

Design notes: the session is made once the lease is held and lives until close; its state changes
only through its methods (the resume point once, at the first restore; the catalog after each
listing or commit), so a reader of the write path finds every shared fact here.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import replace

from ckptsdk.backends.base import Backend
from ckptsdk.checkpoint.reading.catalog import Catalog, CheckpointInfo
from ckptsdk.checkpoint.reading.lineage import LineageWriter
from ckptsdk.checkpoint.reading.outline import Outline
from ckptsdk.errors import LeaseLostError, PreconditionFailed
from ckptsdk.format.layout import Rank
from ckptsdk.format.manifest import LineageRecord
from ckptsdk.lease.acquire import Lease

logger = logging.getLogger(__name__)

__all__ = ["RELIST_S", "WriterSession"]

#: Seconds the writer trusts its in-memory catalog before it lists the root again (to see gc).
RELIST_S = 300.0


class WriterSession:
    """The session of the lease holder of one root.

    Args:
        backend: the checkpoint root (tests may swap it for a fault injector: ``backend`` is
            read at each use).
        lease: the acquired writer lease (its epoch and nonce name this writer).
        scan: lists the root (the manager's catalog scan, which settles a save on the worker).
        memo: the scan's memo of parsed manifests, fed with each manifest this writer publishes.
        clock: monotonic time of the relist period (the lease's clock).
    """

    def __init__(
        self,
        backend: Backend,
        lease: Lease,
        *,
        scan: Callable[[], Catalog],
        memo: dict[tuple[str, str], object],
        clock: Callable[[], float],
    ) -> None:
        record = lease.record
        assert record is not None, "a WriterSession is made once the lease is held"
        self.backend = backend
        self.url = backend.url
        self.lease = lease
        self.memo = memo
        self._scan = scan
        self._clock = clock
        self.lineage = LineageWriter.of(
            epoch=lease.epoch, nonce=record.holder.nonce, compare_and_swap=backend.capabilities.compare_and_swap
        )
        self._resumed_from: CheckpointInfo | None = None
        self._lineage_written = False
        self._catalog: Catalog | None = None
        self._listed_at = 0.0
        self._tidy_due = True  # leftovers and the sweep: at the first listing and after a failure

    # ------------------------------------------------------------------ identity, resume point

    @property
    def tag(self) -> str:
        """This writer's tag in its names (see :mod:`ckptsdk.format.layout`)."""
        return self.lineage.tag

    @property
    def rank(self) -> Rank:
        """This writer's (lease epoch, tag)."""
        return self.lineage.rank

    @property
    def resumed_from(self) -> CheckpointInfo | None:
        """The checkpoint this writer resumed from (None: a fresh start, or not restored yet)."""
        return self._resumed_from

    def resume_from(self, info: CheckpointInfo) -> None:
        """Fix the resume point (the first restore's checkpoint); manifests record its step."""
        self._resumed_from = info
        self.lineage = replace(self.lineage, resumed_from=info.step)

    @property
    def lineage_written(self) -> bool:
        """This writer's lineage record is written: where its lineage starts is fixed."""
        return self._lineage_written

    def write_lineage(self, step: int | None, epoch: int | None) -> None:
        """Record, once per epoch, where this writer's lineage starts (before its first commit)."""
        if self._lineage_written:
            return
        lease = self.lease
        record = LineageRecord(
            epoch=lease.epoch,
            attempt=lease.attempt,
            run_id=lease.run_id,
            resumed_from_step=step,
            resumed_from_epoch=epoch,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        # Confirmed, not just checked (no I/O): a record says where the run goes on from (a fresh
        # start orphans every lower rank), so a writer superseded since its last renewal must not
        # leave one. One stat on stores with compare-and-swap, once per writer.
        lease.confirm()
        try:
            self.backend.create(self.lineage.lineage_key, record.to_json())
        except PreconditionFailed as exc:
            # Only the holder of this epoch writes this key: someone else did -> we lost the lease.
            lease.fence(f"lineage record of epoch {lease.epoch} already exists", None)
            raise LeaseLostError(
                f"another writer already recorded epoch {lease.epoch} under {self.url}; "
                "this writer stops (nothing was written or deleted)",
                url=self.url,
                epoch=lease.epoch,
            ) from exc
        self._lineage_written = True

    # ------------------------------------------------------------------ fencing

    def fence_if_newer(self, seen: Rank) -> None:
        """Fence this writer (and raise ``LeaseLostError``) if ``seen`` outranks it."""
        if self.lineage.fenced_by(seen):
            why = f"saw a newer writer (epoch {seen[0]}) under {self.url}"
            if not self.backend.capabilities.compare_and_swap:
                # Here a lineage record alone fences (catalog.writer_ranks): say what a stray one means.
                why += (
                    "; if no writer of that epoch exists, its lineage record is stray: reopening is "
                    "safe (the next writer judges the record by the lease it takes over from)"
                )
            self.lease.fence(why, seen[0])
            self.lease.check()  # raises LeaseLostError

    def confirm(self, outline: Callable[[], Outline]) -> None:
        """Prove this writer still holds the root (restore's result counts only then): with
        compare-and-swap the renewal is the fence; without it (Drive) a listing too."""
        self.lease.renew()
        cas = self.backend.capabilities.compare_and_swap
        self.fence_if_newer(self.rank if cas else outline().fencing_rank)

    # ------------------------------------------------------------------ the writer's catalog

    def catalog(self) -> Catalog:
        """The writer's view of the root: listed at the first save, after a failure and every
        ``RELIST_S`` seconds (fencing on a newer writer it shows), else kept from its own commits."""
        if self._catalog is None or self._clock() - self._listed_at > RELIST_S:
            self.relist()
        assert self._catalog is not None
        return self._catalog

    @property
    def known(self) -> Catalog | None:
        """The catalog kept since the last listing (None: none kept, the next use lists)."""
        return self._catalog

    def relist(self) -> Catalog:
        """List the root now, keep it, and fence on a newer writer it shows."""
        cat = self.listing()
        self._catalog = cat
        self.fence_if_newer(cat.fencing_rank)
        return cat

    def listing(self) -> Catalog:
        """A fresh listing of the root (not kept: the caller decides), counted as a listing."""
        cat = self._scan()
        self._listed_at, self._tidy_due = self._clock(), True
        return cat

    def keep(self, cat: Catalog) -> None:
        """Keep ``cat`` as the writer's view (after a commit: its own checkpoint added)."""
        self._catalog = cat

    def drop_catalog(self) -> None:
        """Forget the kept view: whatever failed, the next use lists the root again."""
        self._catalog = None

    def take_tidy(self) -> bool:
        """Whether rotation should look for leftovers now (once per listing); clears it."""
        tidy, self._tidy_due = self._tidy_due, False
        return tidy

    def forget(self, keys: set[str]) -> None:
        """Drop folders gone (or no longer committed) from the catalog and the scan's memo: with no
        listing per save nothing else prunes it, and a long run would keep every manifest it wrote."""
        if self._catalog is not None:
            kept = [c for c in self._catalog.checkpoints if c.key not in keys]
            self._catalog = replace(self._catalog, checkpoints=kept)
        for stale in [k for k in self.memo if k[0].partition("/")[0] in keys]:
            del self.memo[stale]
