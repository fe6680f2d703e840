"""Rotation and garbage collection of checkpoints under one root: what retention lets go, and deleting it.

A writer rotates its own lineage after each commit (never while fenced, never a newer writer's),
removes folders that can never commit, and on Drive may recycle its oldest file for the next save
(no trash); ``gc`` cleans orphans, torn checkpoints, leftovers and temp files without the lease.
Which steps to keep is :mod:`ckptsdk.checkpoint.retention`'s pure decision.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

from ckptsdk.backends.base import Backend, durable_batch, rewriter
from ckptsdk.checkpoint import retention
from ckptsdk.checkpoint.pruning.shared_files import loose_files, release
from ckptsdk.checkpoint.pruning.usage import record_trash
from ckptsdk.checkpoint.reading.catalog import Catalog, CheckpointInfo
from ckptsdk.checkpoint.reading.lineage import superseded_by
from ckptsdk.checkpoint.retention import Rule
from ckptsdk.errors import ConfigError, LeaseLostError, ObjectNotFound
from ckptsdk.format.layout import MANIFEST, Rank, folder_rank, outranks, shared_rank
from ckptsdk.format.manifest import KeepRecord

if TYPE_CHECKING:  # the session is the writing room's; rotation only reads its lease, rank and resume point
    from ckptsdk.checkpoint.writing.writer import WriterSession

logger = logging.getLogger(__name__)

__all__ = [
    "GcReport",
    "Rotation",
    "RETENTION_MODES",
    "LEFTOVER_GRACE_S",
    "RetentionMode",
    "candidates",
    "check_retention_mode",
    "kept",
]

# "delete": rotated-out checkpoints are deleted. "recycle": the writer's oldest rotated-out
# checkpoint gives its tensor file to the next save (renamed, rewritten in place), so a store
# whose deletes go to a trash (Drive) receives no full-size file in the steady state.
RetentionMode = Literal["delete", "recycle"]
RETENTION_MODES: tuple[RetentionMode, ...] = get_args(RetentionMode)


def check_retention_mode(mode: str) -> RetentionMode:
    """``mode`` if it is one of ``RETENTION_MODES``: the one check of the option, wherever it comes from.

    Raises:
        ConfigError: an unknown mode (the message lists the known ones).
    """
    if mode not in RETENTION_MODES:
        raise ConfigError(f"retention_mode must be one of {RETENTION_MODES}, got {mode!r}")
    return mode


# Without compare-and-swap (Drive), an uncommitted folder of another writer may still be receiving
# an upload from a VM whose writes reach us late: it goes only once the store's own times say it
# has been silent this long.
LEFTOVER_GRACE_S = 3600.0


@dataclass(frozen=True)
class GcReport:
    """What ``gc`` removed (or would remove, with ``dry_run``), each with why."""

    deleted: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    dry_run: bool = False
    sizes: dict[str, int] = field(default_factory=dict)
    trash_bytes: int | None = None  # what these deletes send to the store's trash (Drive), else None
    spared: dict[str, str] = field(default_factory=dict)  # a newer ckptsdk's checkpoints, left alone: why


class Rotation:
    """Applies retention to one root and deletes checkpoints, manifest first.

    Args:
        backend: the checkpoint root.
        keep_last: committed steps to keep.
        keep_every: also keep every step that is a multiple of this.
        rules: more keep rules (:mod:`ckptsdk.checkpoint.retention`), kept by union with these.
        mode: one of ``RETENTION_MODES``; ``"recycle"`` acts only where the store can rewrite in
            place (``capabilities.rewrite_in_place``), else it deletes.
        leftover_grace: seconds of silence (by the store's times) after which an uncommitted
            folder of another writer goes, where the store has no compare-and-swap.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        keep_last: int,
        keep_every: int | None,
        rules: Sequence[Rule] = (),
        mode: RetentionMode = "delete",
        leftover_grace: float = LEFTOVER_GRACE_S,
    ) -> None:
        self.mode = check_retention_mode(mode)
        self.backend = backend
        self.url = backend.url
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.rules = tuple(rules)
        for rule in self.rules:
            if not isinstance(rule, Rule):
                raise ConfigError(
                    f"keep= takes keep rules (ckptsdk.checkpoint.retention.keep_best(...), keep_if(...)), "
                    f"got {rule!r} of type {type(rule).__name__}"
                )
        self.leftover_grace = leftover_grace
        self.trashed_bytes = 0  # what this writer sent to the trash (stores with one)
        self.trashed_files = 0
        self.recycled_bytes = 0  # what it rewrote in place instead
        self._trash_warned = False
        self._ledger_rank: Rank | None = None

    @property
    def late(self) -> int:
        """Saves by which retention runs late: 1 where writes reach the cloud late (Drive)."""
        return 0 if self.backend.capabilities.immediately_consistent else 1

    @property
    def recycles(self) -> bool:
        """Whether rotated-out checkpoints are recycled rather than deleted on this store."""
        return self.mode == "recycle" and rewriter(self.backend) is not None

    def rotate(self, writer: WriterSession, cat: Catalog, *, tidy: bool = True) -> set[str]:
        """Delete what retention allows, of ``writer``'s lineage only, unless fenced; the folders deleted.

        Runs after a commit, on the writer's own catalog ``cat`` (kept in memory from its
        commits, relisted now and then): the renewal right before the commit was the fence, the
        heartbeat keeps watching (``lease.check()`` before each delete), and safety does not rest
        on timing anyway: a takeover anchors its resume point under its own rank, which no
        lower-ranked writer ever deletes. ``tidy`` (when ``cat`` is a fresh listing: at the first
        save and after a failure) also removes leftovers of saves that can never commit and
        sweeps temp files of killed saves, which only a listing can see.
        """
        lease, rank = writer.lease, writer.rank
        try:
            lease.check()
        except LeaseLostError:
            logger.warning("lease lost after a commit under %s: rotation deletes nothing", self.url)
            return set()
        if outranks(cat.max_rank, rank):
            lease.fence(f"saw epoch {cat.max_epoch} under {self.url}", cat.max_epoch)
            logger.warning(
                "a newer writer (epoch %d) exists under %s: rotation deletes nothing", cat.max_epoch, self.url
            )
            return set()
        mine = _lineage(cat, rank, writer.resumed_from)
        # Drive: a rotation's small deletes can reach the cloud before the new checkpoint's tensor
        # file does: rotate one save late (the newest has a save interval to upload).
        protected = self._protected(mine, writer)
        self._ledger_rank = rank
        doomed = self.beyond_retention(mine, protected=protected)
        # Deletes need no fsync: a power cut only undoes removals (an old checkpoint back whole, or
        # garbage the next listing or gc removes); the newest was durable before rotation began.
        with durable_batch(self.backend, sync=False):
            for c in doomed:
                lease.check()
                self.delete(c, by_manifest=True)
            gone = {c.key for c in doomed}
            gone |= self.drop_copies(writer, [c for c in mine if c.key not in gone])
            if tidy:
                gone |= self._tidy(writer, cat)
            # Then the shared files no checkpoint left refers to (with a listing of them when tidying).
            exclusive, grace = self.backend.capabilities.compare_and_swap, self.leftover_grace
            loose = loose_files(self.backend, cat, gone, rank=rank, grace=grace, exclusive=exclusive, listing=tidy)
            release(self.backend, loose, check=lease.check, trashed=self._trashed)
        self._flush_ledger()
        return gone

    def _tidy(self, writer: WriterSession, cat: Catalog) -> set[str]:
        """Leftovers of saves that can never commit, and temp files of killed saves; never of a step
        above this writer's newest commit: the next save, in flight (other ranks write into it)."""
        lease, rank = writer.lease, writer.rank
        gone, top = set(), cat.newest_step(rank)
        # Under compare-and-swap no lower writer can still commit (its renewal would fail): at once.
        exclusive = self.backend.capabilities.compare_and_swap
        for c, why in cat.leftovers(rank=rank, grace=self.leftover_grace, exclusive=exclusive):
            if c.rank == rank and c.step > top:
                continue
            lease.check()
            logger.info("removing %s/%s (%s, %d bytes)", self.url, c.key, why, c.size)
            self.delete(c)
            gone.add(c.key)

        # A killed save's full-size temp file (unlisted): this lineage's by the same rule, never a higher's.
        def ours(key: str) -> bool:
            found = folder_rank(key) or shared_rank(key)
            return found is not None and not outranks(found[1], rank) and not (found[1] == rank and found[0] > top)

        lease.check()
        for key in self.backend.sweep(0.0 if exclusive else self.leftover_grace, only=ours):
            logger.info("removed %s/%s: temp file of a killed save", self.url, key)
        return gone

    def drop_copies(self, writer: WriterSession, kept: list[CheckpointInfo]) -> set[str]:
        """Keep one folder per step: a takeover's anchor replaces the folders it re-committed.

        Only where the store is immediately consistent (local disk, GCS): there an anchor is
        durable and visible the moment it is published, so the lower writers' copies of its step
        protect nothing, and restarts that die before their first save no longer stack one copy
        per restart on the resume step. Only steps older than this writer's newest: the folder an
        anchor was made from may still be being read by the restore that made it (other ranks of
        a distributed job) until this writer has saved again. On Drive the anchor may still be
        uploading when a delete of the original arrives, so copies wait for rotation to let the
        step go.
        """
        if not self.backend.capabilities.immediately_consistent:
            return set()
        lease, rank = writer.lease, writer.rank
        own = [c.step for c in kept if c.rank == rank]
        if not own:
            return set()
        gone = set()
        newest = max(own)
        by_step: dict[int, list[CheckpointInfo]] = {}
        for c in kept:
            if c.step < newest:
                by_step.setdefault(c.step, []).append(c)
        for step, folders in by_step.items():
            best = max(folders, key=lambda c: c.rank)
            for c in folders:
                if c is not best:
                    lease.check()
                    logger.info("step %d under %s: %s replaces %s", step, self.url, best.key, c.key)
                    self.delete(c, by_manifest=True)
                    gone.add(c.key)
        return gone

    def _protected(self, mine: list[CheckpointInfo], writer: WriterSession) -> list[int]:
        """The resume point stays until this writer has committed a newer step."""
        resumed_from = writer.resumed_from
        if resumed_from is None:
            return []
        newer_own = any(c.rank == writer.rank and c.step > resumed_from.step for c in mine)
        return [] if newer_own else [resumed_from.step]

    def recycle_source(self, writer: WriterSession, cat: Catalog, step: int) -> CheckpointInfo | None:
        """Make room for the save of ``step`` by recycling: which own checkpoint gives its file.

        Retention is applied as if ``step`` were committed already (one save late on Drive, so
        the same steps stay as with deletion); the oldest rotated-out step that has a folder of
        this writer's own rank loses its manifest here (it stops existing: manifest first, as
        always) and that folder is returned, its tensor file for the caller to move and rewrite.
        Only this writer's own files are recycled: a lower writer may be a zombie whose late
        delete of that file (by its Drive identity) would then hit our new checkpoint.
        Returns None when nothing is due (the caller writes a new file).
        """
        rank = writer.rank
        if not self.recycles or outranks(cat.max_rank, rank):
            return None
        writer.lease.check()
        mine = _lineage(cat, rank, writer.resumed_from)
        probe = CheckpointInfo(step=step, epoch=rank[0], tag=rank[1], key="", size=0, committed=True, valid=True)
        # The probe has no manifest yet (no metrics, no time): judged without them, the rules keep
        # a superset of the other steps (a new score can only push one out of the best k), so a
        # recycle never takes a file the rules keep once this save commits.
        doomed = self.beyond_retention(mine + [probe], protected=self._protected(mine, writer))
        own = sorted((c for c in doomed if c.rank == rank and c.step != step), key=lambda c: c.step)
        if not own:
            return None
        source = own[0]
        self._ledger_rank = rank
        try:
            self.backend.delete(f"{source.key}/{MANIFEST}")
        except ObjectNotFound:
            return None  # someone else is cleaning it: write a new file
        self._trashed(0, 1)  # the manifest: a few KB
        return source

    def recycled(self, source: CheckpointInfo, folder: str, size: int) -> None:
        """Account a recycle that went through (the save log shows what the trash was spared)."""
        self.recycled_bytes += size
        logger.info(
            "recycled %s/%s into %s by a rewrite in place: %.1f MB kept out of the trash "
            "(%.1f MB by this run so far; %.1f MB sent there)",
            self.url,
            source.key,
            folder,
            size / 1e6,
            self.recycled_bytes / 1e6,
            self.trashed_bytes / 1e6,
        )

    def retention_rules(self, keep_last: int | None = None, rules: Sequence[Rule] | None = None) -> list[Rule]:
        """The keep rules in force: ``keep_last`` and ``keep_every`` (the shorthands), then the others.

        Args:
            keep_last: instead of this rotation's ``keep_last`` (``gc --keep-last``).
            rules: instead of this rotation's other rules (``gc --keep-best ...``).
        """
        out: list[Rule] = [retention.keep_last(keep_last or self.keep_last)]
        if self.keep_every:
            out.append(retention.keep_every(self.keep_every))
        out.extend(self.rules if rules is None else rules)
        return out

    def keep_record(self) -> list[KeepRecord]:
        """The rules in force as each manifest records them (``ckptsdk gc`` and ``ls`` read them)."""
        return retention.record(self.retention_rules())

    def beyond_retention(
        self,
        checkpoints: list[CheckpointInfo],
        keep_last: int | None = None,
        protected: Sequence[int] = (),
        *,
        rules: Sequence[Rule] | None = None,
    ) -> list[CheckpointInfo]:
        """The checkpoints retention lets go; ``protected`` steps are kept. Every folder of a
        step (several writers may hold one) shares its fate.

        Args:
            checkpoints: the candidates (valid checkpoints of this lineage).
            keep_last: given, the newest this many steps over all of ``checkpoints`` (the caller
                has added any save-late margin) with this rotation's other rules; None: the
                rules of :meth:`retention_rules`, one save late where the store needs it.
            protected: steps kept whatever the rules say (the resume point).
            rules: instead of both (the rules in force, complete).
        """
        by_step: dict[int, list[CheckpointInfo]] = {}
        for c in checkpoints:
            by_step.setdefault(c.step, []).append(c)
        pinned = dict.fromkeys(protected, retention.RESUME_POINT)
        settle = 0 if keep_last is not None else self.late
        in_force = rules if rules is not None else self.retention_rules(keep_last)
        decision = retention.decide(candidates(checkpoints), in_force, pinned=pinned, settle=settle)
        return [c for step in decision.deleted for c in by_step[step]]

    def delete(self, info: CheckpointInfo, *, by_manifest: bool = False) -> None:
        """Manifest first (the checkpoint stops existing), then the data.

        ``by_manifest`` (rotation after a commit): the data is the manifest's own file list where
        the manifest is known (no listing: one round trip per file); else (gc, leftovers) what a
        listing of the folder shows. Anything else a folder
        may hold (a temp file of a killed write) is the sweep's and the leftover rule's.
        """
        if by_manifest and info.manifest is not None and info.committed:
            names = [f"{info.key}/{f.name}" for f in info.manifest.files]
        else:
            names = [o.key for o in self.backend.list(info.key + "/") if not o.key.endswith("/" + MANIFEST)]
        keys = [f"{info.key}/{MANIFEST}", *names]
        deleted = 0
        for key in keys:
            try:
                self.backend.delete(key)
                deleted += 1
            except ObjectNotFound:
                pass  # already gone (another cleaner); deletion is idempotent
        logger.info("rotated out %s/%s", self.url, info.key)
        if self.backend.capabilities.trash_on_delete and deleted:
            self._trashed(info.size, deleted)
            # Drive moves deleted files to its trash, which counts against the quota for 30 days.
            log = logger.warning if not self._trash_warned else logger.info
            self._trash_warned = True
            hint = (
                ""
                if self.recycles
                else " Use retention=Retention(mode='recycle') (see docs/DRIVE.md), empty the "
                "Drive trash, or raise save_every / lower keep_last"
            )
            log(
                "%s keeps deleted checkpoints in its trash for 30 days, counting against your quota: "
                "%.1f MB sent there by this run so far.%s",
                self.url,
                self.trashed_bytes / 1e6,
                hint,
            )

    def _trashed(self, size: int, files: int) -> None:
        if self.backend.capabilities.trash_on_delete:
            self.trashed_bytes += size
            self.trashed_files += files

    def _flush_ledger(self) -> None:
        """Publish this writer's trash total where ``ckptsdk du`` finds it (Drive only)."""
        if self.backend.capabilities.trash_on_delete and self._ledger_rank is not None and self.trashed_files:
            record_trash(self.backend, self._ledger_rank, total_bytes=self.trashed_bytes, files=self.trashed_files)

    def gc(
        self,
        cat: Catalog,
        *,
        keep_last: int | None = None,
        rules: Sequence[Rule] | None = None,
        dry_run: bool = False,
        grace: float = 3600.0,
    ) -> GcReport:
        """Remove orphans of superseded writers, torn checkpoints and rotated-out checkpoints; never
        a newer ckptsdk's (``CheckpointInfo.newer``: unreadable here), nor a shared file it may use.

        Works without the lease, so a running writer is not disturbed: orphans are never
        restorable; retention is decided from the committed manifests exactly as the writer
        decides it (:func:`kept`: the rules, the newest step, the live writer's resume point,
        one save late on Drive); uncommitted folders go once the store's own times say they have
        been silent for ``grace`` seconds (a save in progress writes all the time), and temp
        files of crashed writes are swept when older than ``grace``. Where writes reach other
        hosts late (Drive), a checkpoint that looks torn here may still be uploading from the VM
        that wrote it, so gc keeps torn checkpoints there (delete them by hand once no VM is
        writing). On a store with a trash, the report says how many bytes these deletes send there.

        Args:
            cat: a fresh scan of the root.
            keep_last: instead of this rotation's ``keep_last``.
            rules: instead of this rotation's other keep rules (``keep_every`` stays).
            dry_run: only report.
            grace: seconds of silence before a leftover goes.
        """
        in_force = self.retention_rules(keep_last, rules)
        reasons: dict[str, str] = {}
        spared = {c.key: c.reason or "" for c in cat.checkpoints if c.newer}  # loose_files keeps their shared files
        settled = self.backend.capabilities.immediately_consistent
        for c in (c for c in cat.checkpoints if not c.newer):
            if c.orphan or (c.committed and not c.valid and settled):
                reasons[c.key] = c.reason or ("orphan" if c.orphan else "invalid")
            elif c.committed and not c.valid:
                logger.info("gc keeps %s/%s (%s): it may still be uploading from another VM", self.url, c.key, c.reason)
        for c, why in cat.leftovers(rank=None, grace=grace, exclusive=False):
            reasons[c.key] = f"{why}, {c.size} bytes" + ("; and an orphan" if c.key in reasons else "")
        late = f" (+{self.late}: on this store rotation runs one save late)" if self.late else ""
        keeps = kept(cat, in_force, settle=self.late)
        for c in cat.checkpoints:
            if c.valid and c.step not in keeps:
                reasons[c.key] = _why_not(in_force) + late
        sizes = {c.key: c.size for c in cat.checkpoints if c.key in reasons}
        loose = loose_files(self.backend, cat, set(reasons), rank=None, grace=grace, exclusive=False)
        for key, (why, size) in loose.items():
            reasons[key], sizes[key] = why, size
        trash = sum(sizes.values()) if self.backend.capabilities.trash_on_delete else None
        if not dry_run:
            for c in cat.checkpoints:
                if c.key in reasons:
                    self.delete(c)
            release(self.backend, loose, check=lambda: None, trashed=lambda n, k: None)
            for key in self.backend.sweep(grace):
                reasons[key] = f"temp file of a crashed write, older than {grace:.0f} s"
        return GcReport(sorted(reasons), reasons, dry_run, sizes, trash, spared)


def candidates(checkpoints: Sequence[CheckpointInfo]) -> list[retention.Candidate]:
    """One retention candidate per step: what the highest writer's readable manifest of it says.

    A folder without a manifest (a save not yet committed, as :meth:`Rotation.recycle_source`
    probes it) is a bare step: no time, no metrics, so only the step rules count it.
    """
    best: dict[int, CheckpointInfo] = {}
    for c in checkpoints:
        held = best.get(c.step)
        if held is None or (c.manifest is not None, c.rank) > (held.manifest is not None, held.rank):
            best[c.step] = c
    return [
        retention.Candidate.of(c.manifest) if c.manifest is not None else retention.Candidate(c.step)
        for _step, c in sorted(best.items())
    ]


def kept(cat: Catalog, rules: Sequence[Rule], *, settle: int = 0) -> dict[int, tuple[str, ...]]:
    """The steps retention keeps under ``cat``'s live lineage, each with why (``ckptsdk ls``, gc).

    The candidates are the valid checkpoints (a zombie's orphans are not valid, so never "best");
    the highest writer's resume point stays until it has committed a newer step, as its rotation does.
    """
    valid = [c for c in cat.checkpoints if c.valid]
    pinned: dict[int, str] = {}
    point = cat.resume_points.get(cat.max_rank)
    if point is not None and not any(c.rank == cat.max_rank and c.step > point for c in valid):
        pinned[point] = retention.RESUME_POINT
    return retention.decide(candidates(valid), rules, pinned=pinned, settle=settle).kept


def _why_not(rules: Sequence[Rule]) -> str:
    """gc's reason for a checkpoint no rule keeps."""
    if len(rules) == 1 and isinstance(rules[0], retention.KeepLast):
        return f"beyond keep_last={rules[0].n}"
    return f"no rule keeps it ({retention.describe_rules(rules)})"


def _lineage(cat: Catalog, rank: Rank, resumed_from: CheckpointInfo | None) -> list[CheckpointInfo]:
    """The valid checkpoints of this writer's lineage: its own, and lower writers' up to the step
    it resumed from (none after a fresh start).

    The catalog may have been listed before this writer's lineage record was written (its
    first save lists, then records where it started): what that record makes orphans still
    looks valid there. Judged among them, a fresh start's step 10 went before a predecessor's
    steps 40 and 50, which the record then orphaned: nothing was left to restore.
    """
    point = {rank: None if resumed_from is None else resumed_from.step}
    return [
        c
        for c in cat.checkpoints
        if c.valid and not outranks(c.rank, rank) and (c.rank == rank or superseded_by(c.step, c.rank, point) is None)
    ]
