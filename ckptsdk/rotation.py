"""Rotation and garbage collection of checkpoints under one root: what retention lets go, and deleting it.

A writer rotates its own lineage after each commit (never while fenced, never a newer writer's
checkpoints); ``gc`` cleans orphans, torn checkpoints and temp files without the lease. Which
steps to keep is :mod:`ckptsdk.retention`'s pure decision; saving and the lease live elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from . import retention
from .backends.base import Backend
from .catalog import MANIFEST, Catalog, CheckpointInfo, Rank
from .errors import LeaseLostError, ObjectNotFound
from .lease import Lease

logger = logging.getLogger(__name__)

__all__ = ["GcReport", "Rotation"]


@dataclass(frozen=True)
class GcReport:
    """What ``gc`` removed (or would remove, with ``dry_run``), each with why."""

    deleted: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    dry_run: bool = False


class Rotation:
    """Applies retention to one root and deletes checkpoints, manifest first.

    Args:
        backend: the checkpoint root.
        keep_last: committed steps to keep.
        keep_every: also keep every step that is a multiple of this.
    """

    def __init__(self, backend: Backend, *, keep_last: int, keep_every: int | None) -> None:
        self.backend = backend
        self.url = backend.url
        self.keep_last = keep_last
        self.keep_every = keep_every
        self._trashed_bytes = 0
        self._trash_warned = False

    def rotate(self, lease: Lease, rank: Rank, scan: Callable[[], Catalog],
               resumed_from: CheckpointInfo | None) -> None:
        """Delete what retention allows, of this lineage only, unless fenced.

        The lease was renewed just before the manifest was published (and the heartbeat keeps
        watching); a fresh listing (``scan()``) then shows any newer writer. Safety does not rest on
        this check's timing: a takeover anchors its resume point under its own rank, which no
        lower-ranked writer ever deletes.
        """
        try:
            lease.check()
        except LeaseLostError:
            logger.warning("lease lost after a commit under %s: rotation deletes nothing", self.url)
            return
        cat = scan()
        if cat.max_rank > rank:
            lease.fence(f"saw epoch {cat.max_epoch} under {self.url}", cat.max_epoch)
            logger.warning("a newer writer (epoch %d) exists under %s: rotation deletes nothing",
                           cat.max_epoch, self.url)
            return
        mine = [c for c in cat.checkpoints if c.valid and c.rank <= rank]
        # Where writes reach the cloud late and out of order (Drive), a rotation's small deletes
        # can arrive long before the new checkpoint's tensor file: rotate one save late, so the
        # newest checkpoint has a whole save interval to upload before its predecessor goes.
        late = 0 if self.backend.capabilities.immediately_consistent else 1
        protected: list[int] = []
        if resumed_from is not None:
            newer_own = any(c.rank == rank and c.step > resumed_from.step for c in mine)
            if not newer_own:
                protected.append(resumed_from.step)
        for c in self.beyond_retention(mine, self.keep_last + late, protected):
            lease.check()
            self.delete(c)

    def beyond_retention(
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

    def delete(self, info: CheckpointInfo) -> None:
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

    def gc(self, cat: Catalog, *, keep_last: int | None = None, dry_run: bool = False,
           grace: float = 3600.0) -> GcReport:
        """Remove orphans of superseded writers, torn checkpoints and rotated-out checkpoints.

        Works without the lease, so a running writer is not disturbed: orphans are never
        restorable, retention keeps the newest ``keep_last`` steps, and temp files of crashed
        writes are swept when older than ``grace`` seconds. Uncommitted folders (a save in
        progress, or one that crashed) are left alone. Where writes reach other hosts late
        (Drive), a checkpoint that looks torn here may still be uploading from the VM that wrote
        it, so gc keeps torn checkpoints there (delete them by hand once no VM is writing).
        """
        keep = keep_last or self.keep_last
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
        for c in self.beyond_retention([c for c in cat.checkpoints if c.valid], keep):
            reasons[c.key] = f"beyond keep_last={keep}"
        if not dry_run:
            for c in cat.checkpoints:
                if c.key in reasons:
                    self.delete(c)
            for key in self.backend.sweep(grace):
                reasons[key] = f"temp file of a crashed write, older than {grace:.0f} s"
        return GcReport(deleted=sorted(reasons), reasons=reasons, dry_run=dry_run)
