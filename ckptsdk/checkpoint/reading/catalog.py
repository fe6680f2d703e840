"""What a checkpoint root holds: committed checkpoints, their validity, lineage and orphans.

Read-only and cheap (one listing plus the small JSON objects): it decides which checkpoints are
restorable without reading tensor data. Writing, leasing and digest checks of tensor files belong
to the manager.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field, replace

from ckptsdk.backends.base import Backend
from ckptsdk.checkpoint.reading.lineage import superseded_by
from ckptsdk.checkpoint.reading.listing import NEWER, Folder, Listing, list_root, prune_memo, read_folder
from ckptsdk.errors import BackendError, LeaseError, ObjectNotFound
from ckptsdk.format.layout import (
    MANIFEST,
    Rank,
    lineage_key,
    outranks,
    writer_tag,
)
from ckptsdk.format.manifest import LineageRecord, Manifest
from ckptsdk.lease.record import LEASE_KEY, LeaseRecord, parse_lease

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint folder as the catalog sees it.

    Attributes:
        step: training step saved.
        epoch: the lease epoch of the writer (the ``.eN`` in the folder name).
        key: the folder, relative to the root (``step-0000005700.e1``).
        size: bytes stored in the folder.
        committed: the manifest is published (a checkpoint exists only then).
        valid: committed, readable manifest, files present with the sizes it lists, not orphaned.
            Digests are checked only when the data is read (restore, verify).
        reason: why it is not valid, or ``None``.
        orphan: written by a superseded writer past the point a newer epoch resumed from.
        manifest: the parsed manifest, when it could be read.
        tag: the writer's tag (the nonce prefix in the folder name on Drive; "" elsewhere).
        mtime: the store's time of the folder's newest object (see ``ObjectInfo.mtime``).
        anchor: the writer re-committed the checkpoint it resumed from under its own name.
        copies: the other folders of the same step (set only on :meth:`Catalog.rows`' rows).
    """

    step: int
    epoch: int
    key: str
    size: int
    committed: bool
    valid: bool
    reason: str | None = None
    orphan: bool = False
    manifest: Manifest | None = field(default=None, repr=False, compare=False)
    tag: str = ""
    mtime: float | None = field(default=None, compare=False)
    anchor: bool = False
    copies: tuple[str, ...] = ()

    @property
    def attempt(self) -> int | None:
        return self.manifest.writer.attempt if self.manifest else None

    @property
    def rank(self) -> Rank:
        """The writer's (lease epoch, tag): higher ranks supersede lower ones."""
        return (self.epoch, self.tag)

    @property
    def newer(self) -> bool:
        """Committed by a newer ckptsdk (a newer major format): unreadable here, never garbage.

        Restore refuses to fall back past it; gc and rotation leave it, and the shared files it
        may refer to, alone."""
        return self.committed and self.manifest is None and (self.reason or "").startswith(NEWER)


@dataclass(frozen=True)
class Catalog:
    """A snapshot of a root: every checkpoint folder, lineage records, and the highest writer seen."""

    checkpoints: list[CheckpointInfo]
    lineage: dict[Rank, LineageRecord]
    resume_points: dict[Rank, int | None]
    max_rank: Rank
    #: lineage records not believed, and why (see ``_resume_points``)
    ignored_lineage: dict[Rank, str] = field(default_factory=dict)
    #: the highest epoch any name uses, believed or not: a new writer takes one above it
    epoch_floor: int = 0
    #: what fences a writer (see :func:`writer_ranks`): ``max_rank``, and on stores without
    #: compare-and-swap the highest rank any lineage record shows, believed or not. None: as ``max_rank``
    fence_rank: Rank | None = None
    lineage_mtimes: list[float] = field(default_factory=list, repr=False)

    @property
    def max_epoch(self) -> int:
        return self.max_rank[0]

    @property
    def fencing_rank(self) -> Rank:
        """The rank that fences a writer below it (``fence_rank``, else ``max_rank``)."""
        return self.max_rank if self.fence_rank is None else max(self.fence_rank, self.max_rank)

    def restorable(self) -> list[CheckpointInfo]:
        """Valid checkpoints, newest first (higher step, then higher writer rank)."""
        good = [c for c in self.checkpoints if c.valid]
        return sorted(good, key=lambda c: (c.step, c.rank), reverse=True)

    def rows(self) -> list[CheckpointInfo]:
        """One row per step, oldest first: the highest writer's valid folder of that step (else
        the highest writer's folder), with the other folders of the step in ``copies``.

        A takeover's anchor and the checkpoint it copies are one step, and ``keep_last`` counts
        steps, so a listing shows each step once."""
        by_step: dict[int, list[CheckpointInfo]] = {}
        for c in self.checkpoints:
            by_step.setdefault(c.step, []).append(c)
        out = []
        for step in sorted(by_step):
            folders = sorted(by_step[step], key=lambda c: (c.valid, c.rank), reverse=True)
            best = folders[0]
            out.append(replace(best, copies=tuple(c.key for c in folders[1:])))
        return out

    def store_now(self) -> float | None:
        """The newest object time listed: the store's own "now", as near as a listing tells.

        Ages of leftovers are measured against this, never against this machine's clock, so a
        drifting VM clock cannot make a fresh upload look old. It lags the true time when
        nothing was written lately, which only makes leftovers look younger (kept longer)."""
        times = [c.mtime for c in self.checkpoints if c.mtime is not None] + self.lineage_mtimes
        return max(times, default=None)

    def newest_step(self, rank: Rank | None) -> int:
        """The newest step ``rank`` committed here (-1: none): its saves below it can never commit."""
        return max((c.step for c in self.checkpoints if c.committed and c.rank == rank), default=-1)

    def leftovers(
        self,
        *,
        rank: Rank | None,
        grace: float,
        exclusive: bool,
        now: float | None = None,
        busy: Iterable[str] = (),
    ) -> list[tuple[CheckpointInfo, str]]:
        """Uncommitted folders that can never commit and may go now, each with why.

        A folder without a manifest can never commit when its writer is superseded (a lower
        rank than the live writer ``rank``) or is the live writer itself with no save of that
        folder in flight (``busy``): an earlier save of this writer that failed. The live
        writer's own may go at once (only it writes its names, from this machine). A lower
        writer's may go at once when ``exclusive`` (the caller holds a compare-and-swap lease:
        that writer's commit would fail its own renewal); otherwise only once the folder's
        newest object is ``grace`` seconds older than ``now`` (store time; default
        :meth:`store_now`), because on Drive another VM's upload of it may still be in flight.
        ``rank=None`` (gc without the lease): every uncommitted folder, after the grace only.
        A higher writer's folder is never returned.
        """
        now = self.store_now() if now is None else now
        busy = set(busy)
        out = []
        for c in self.checkpoints:
            if c.committed or c.key in busy:
                continue
            if rank is not None and outranks(c.rank, rank):
                continue
            age = None if now is None or c.mtime is None else max(0.0, now - c.mtime)
            if rank is not None and c.rank == rank:
                out.append((c, "uncommitted: this writer's own failed save"))
            elif exclusive and rank is not None:
                out.append((c, "uncommitted: a superseded writer's save that can never commit"))
            elif age is not None and age >= grace:
                who = "a superseded writer's" if rank is not None else "a save"
                out.append((c, f"uncommitted: {who} folder, silent for {age:.0f} s (grace {grace:.0f} s)"))
        return out

    def find(self, step: int) -> list[CheckpointInfo]:
        """Every checkpoint folder of ``step`` (several writers may have written it), newest writer first."""
        return sorted((c for c in self.checkpoints if c.step == step), key=lambda c: c.rank, reverse=True)


@dataclass(frozen=True)
class Judge:
    """Who judges a root's lineage records, when it is a writer.

    A writer takes its lease above every epoch it lists, a stray record's too, so its own lease
    vouches for no record: it judges them by the lease it took over from (``previous``, what
    LEASE.json said when it acquired; None on a fresh root), as a reader would have judged them
    just before. Its own record (``rank``) it always believes.
    """

    previous: LeaseRecord | None
    rank: Rank


def writer_points(
    listing: Listing,
    read: list[Folder],
    lease: Callable[[], LeaseRecord | None],
    *,
    exclusive: bool,
    mine: Rank | None = None,
) -> tuple[dict[Rank, int | None], dict[Rank, str]]:
    """Where each writer resumed from, and the lineage records not believed (see ``_resume_points``).

    ``read`` are the folders whose manifests were read: a writer's point is exact when every
    manifest of that writer is among them (``scan`` reads all; restore reads those of the
    writers that could supersede its candidate). Which records are not believed needs no
    manifest at all.
    """
    from_manifests: dict[Rank, set[int | None]] = {}
    for _step, rank, _folder, _files, manifest, _reason in read:
        if manifest is not None:
            from_manifests.setdefault(rank, set()).add(manifest.writer.resumed_from_step)
    return _resume_points(
        listing.lineage, from_manifests, listing.used(), listing.committed, lease, exclusive=exclusive, mine=mine
    )


def writer_ranks(listing: Listing, ignored: Mapping[Rank, str], *, exclusive: bool) -> tuple[Rank, Rank, int]:
    """(the highest writer seen, the rank that fences, the epoch floor).

    Only believed records count as the highest writer (rotation and restore go by it), and
    where the lease is exclusive only they fence: there the renewal fences a superseded writer
    anyway, and a stray record must not stop the live one. Without compare-and-swap (Drive) a
    genuine takeover's record can reach a zombie before the lease and the intermediate epochs
    that would make it believable, so every record fences there: a stray one costs a loud stop
    (the next writer judges it by the lease it takes over from, and ignores it). Every record's
    epoch is used up: a new writer never takes it.
    """
    ranks = [(0, "")] + sorted(listing.used())
    epoch_floor = max([ranks[-1][0], *(r[0] for r in listing.lineage)])
    believed = max([ranks[-1], *(r for r in listing.lineage if r not in ignored)])
    return believed, believed if exclusive else max([believed, *listing.lineage]), epoch_floor


def classify(entry: Folder, points: Mapping[Rank, int | None]) -> CheckpointInfo:
    """The :class:`CheckpointInfo` of one folder, an orphan if a writer in ``points`` supersedes it."""
    step, rank, folder, files, manifest, reason = entry
    orphan_of = superseded_by(step, rank, points)
    if reason is None and orphan_of is not None:
        newer, point = orphan_of
        where = "a fresh start" if point is None else f"step {point}"
        reason = (
            f"orphan: written by {_name(rank)} after {_name(newer)} took over from {where}; "
            "never restored (`ckptsdk gc` removes it)"
        )
    return CheckpointInfo(
        step=step,
        epoch=rank[0],
        tag=rank[1],
        key=folder,
        size=sum(o.size for o in files.values()),
        committed=MANIFEST in files,
        valid=reason is None,
        reason=reason,
        orphan=orphan_of is not None,
        manifest=manifest,
        mtime=max((o.mtime for o in files.values() if o.mtime is not None), default=None),
        anchor=manifest is not None and points.get(rank) == step,
    )


def lease_witness(backend: Backend) -> LeaseRecord | None:
    """LEASE.json as a vouching witness: None when absent or unreadable (it corroborates nothing)."""
    try:
        return parse_lease(backend.read(LEASE_KEY), url=backend.url)
    except (ObjectNotFound, LeaseError, BackendError):
        return None


def witness(backend: Backend, judge: Judge | None) -> tuple[Callable[[], LeaseRecord | None], Rank | None]:
    """(the lease that vouches for records, the rank always believed) of a reader or a writer."""
    if judge is None:
        return lambda: lease_witness(backend), None
    return lambda: judge.previous, judge.rank


def scan(
    backend: Backend,
    *,
    cache: MutableMapping[tuple[str, str], object] | None = None,
    judge: Judge | None = None,
) -> Catalog:
    """List the root and classify every checkpoint folder (every manifest is read: ``ls``, gc,
    rotation; restore reads only what it restores, see :mod:`ckptsdk.checkpoint.reading.outline`).

    Args:
        backend: the checkpoint root.
        cache: optional memo of parsed manifests/lineage records keyed by (key, version); a
            manager passes one so that repeated scans read only what changed.
        judge: a writer's (see :class:`Judge`); None for a reader, which goes by LEASE.json now.
    """
    memo: MutableMapping[tuple[str, str], object] = cache if cache is not None else {}
    listing = list_root(backend, memo)
    parsed = [
        read_folder(backend, memo, folder, files, listing.shared) for folder, files in sorted(listing.folders.items())
    ]

    if cache is not None:
        prune_memo(cache, listing)
    exclusive = backend.capabilities.compare_and_swap
    lease, mine = witness(backend, judge)
    points, ignored = writer_points(listing, parsed, lease, exclusive=exclusive, mine=mine)
    max_rank, fence_rank, epoch_floor = writer_ranks(listing, ignored, exclusive=exclusive)
    return Catalog(
        checkpoints=[classify(entry, points) for entry in parsed],
        lineage=listing.lineage,
        resume_points=points,
        max_rank=max_rank,
        ignored_lineage=ignored,
        epoch_floor=epoch_floor,
        fence_rank=fence_rank,
        lineage_mtimes=listing.lineage_mtimes,
    )


_TOLD: set[tuple[Rank, str]] = set()


def _resume_points(
    lineage: dict[Rank, LineageRecord],
    from_manifests: dict[Rank, set[int | None]],
    used: set[Rank],
    committed: Callable[[], list[tuple[int, Rank]]],
    lease: Callable[[], LeaseRecord | None],
    *,
    exclusive: bool,
    mine: Rank | None = None,
) -> tuple[dict[Rank, int | None], dict[Rank, str]]:
    """Where each writer resumed from, and the lineage records that are not believed (and why).

    A writer's manifests say where it resumed from; its lineage record says it first (on Drive
    the record may arrive before or after the manifests). When both exist and differ, the
    manifests win: each one is what the writer used for a commit. A record is what turns a
    lower-ranked writer's checkpoints into orphans, so one record alone must not be able to erase
    a run's progress. A record that would orphan committed checkpoints is believed only when its
    writer left a checkpoint folder (a takeover re-commits its resume point at once), or when
    LEASE.json names its writer (same epoch, attempt, run, host and pid: the writer holds the
    lease or released it last). Where the lease is only advisory (Drive: a zombie's late write
    can put an older record back), an epoch one above everything seen is believed too, and one
    above that (a chain of takeovers, each one above what it saw). Anything else
    (``epoch-000999`` next to a lease at epoch 2) is ignored, loudly. Never believed, whatever
    vouches: a folder-less record that a newer writer's resume point contradicts (its judgement
    stands), and a folder-less fresh start (its writer saved nothing; it cannot erase a run's
    progress). A writer judges by the lease it took over from, not its own (see :class:`Judge`),
    and always believes its own record (``mine``). The price: a takeover that crashed before its
    first save, taken over in turn, no longer hides the checkpoints its zombie predecessor
    committed meanwhile; those are real states of the run, and restorable.
    """
    lease_seen: list[LeaseRecord | None] = []
    # What is committed (every folder's files: a lazy listing lists them all) only for a record
    # whose writer left no folder: rare, a writer records its lineage just before its first save.
    committed_seen: list[list[tuple[int, Rank]]] = []

    def vouched(rank: Rank, record: LineageRecord) -> bool:
        """Whether the lease vouches for ``record`` (read LEASE.json only when asked: rarely)."""
        if not lease_seen:
            lease_seen.append(lease())
        held = lease_seen[0]
        if (
            held is not None
            and (held.epoch, held.attempt, held.run_id, held.holder.host, held.holder.pid)
            == (record.epoch, record.attempt, record.run_id, record.host, record.pid)
            and rank[1] in ("", writer_tag(held.holder.nonce, compare_and_swap=False))
        ):
            return True  # its writer holds (or last held) the lease
        # Where a zombie's late write can put an older lease back (Drive), the lease cannot
        # vouch; an epoch one above everything seen is then plausible, and believed, and so is
        # one above that (a chain of takeovers, each one above what it saw): not a gap.
        known = max([held.epoch if held is not None else 0, *(r[0] for r in used)])
        for epoch in sorted({r[0] for r in lineage}):
            if epoch <= known + 1:
                known = max(known, epoch)
        return not exclusive and rank[0] <= known + 1

    points: dict[Rank, int | None] = {}
    ignored: dict[Rank, str] = {}
    for rank, record in sorted(lineage.items()):
        point = record.resumed_from_step
        said = from_manifests.get(rank)
        if said is not None and said != {point}:
            logger.warning(
                "lineage record of %s says it resumed from %s but its checkpoints say %s; believing the checkpoints",
                _name(rank),
                _where(point),
                " / ".join(map(_where, said)),
            )
            continue  # taken from the manifests below
        if rank in used or rank == mine:
            points[rank] = point
            continue
        if not committed_seen:
            committed_seen.append(committed())
        erased = sorted({s for s, r in committed_seen[0] if r < rank and (point is None or s > point)})
        why = _doubt(rank, point, erased, lineage, lambda: vouched(rank, record))  # noqa: B023 (called at once)
        if why is None:
            points[rank] = point  # harmless (it orphans nothing committed), or its writer is known
            continue
        ignored[rank] = why
        if (rank, why) in _TOLD:
            continue  # every scan would say it again (a save scans): once per process is loud enough
        _TOLD.add((rank, why))
        logger.warning("ignoring lineage record %s: %s. Remove it if no such writer exists", lineage_key(*rank), why)
    for rank, said in from_manifests.items():
        if rank not in points and len(said) == 1:
            points[rank] = next(iter(said))
        elif rank not in points:  # its own manifests disagree: take the most conservative point
            points[rank] = max((p for p in said if p is not None), default=None)
    return points, ignored


def _doubt(
    rank: Rank, point: int | None, erased: list[int], lineage: Mapping[Rank, LineageRecord], vouched: Callable[[], bool]
) -> str | None:
    """Why the record of ``rank``, whose writer left no checkpoint folder, is not believed (None: it is)."""
    if not erased:
        return None  # it orphans nothing committed: harmless
    steps = f"committed step(s) {erased[:5]}{' ...' if len(erased) > 5 else ''}"
    newer = _overruled_by(rank, point, lineage)
    if newer is not None:
        return (
            f"{_name(newer[0])} resumed from step {newer[1]} of epoch {newer[2]}, which it would orphan: "
            "a newer writer judged it (or never saw it), and its judgement stands"
        )
    if point is None:
        # A genuine one is a writer that restored nothing (on Drive most likely because the
        # checkpoints had not reached its VM) and died before its first save: it discarded
        # nothing of its own, and resuming the committed progress is what its run wants.
        return (
            f"it says {_name(rank)} started fresh, which would discard {steps}, but no writer of "
            f"{_name(rank)} saved anything; a fresh start that saved nothing cannot erase a run's progress"
        )
    if vouched():
        return None
    return (
        f"it says {_name(rank)} took over from {_where(point)}, which would discard {steps}, but no "
        f"writer of {_name(rank)} wrote any checkpoint and the lease does not name it; a stray or "
        "forged record cannot erase a run's progress"
    )


def _overruled_by(rank: Rank, point: int | None, lineage: Mapping[Rank, LineageRecord]) -> tuple[Rank, int, int] | None:
    """(a newer writer, the step and epoch it resumed from) where that checkpoint is one the record of
    ``rank`` would orphan: the newer writer did not believe the record (or never saw it) and its
    lineage, not the record, is the run's now. Else None."""
    for other, rec in sorted(lineage.items(), reverse=True):
        step, epoch = rec.resumed_from_step, rec.resumed_from_epoch
        if outranks(other, rank) and step is not None and epoch is not None and epoch < rank[0]:
            if point is None or step > point:
                return other, step, epoch
    return None


def _where(point: int | None) -> str:
    return "a fresh start" if point is None else f"step {point}"


def _name(rank: Rank) -> str:
    return f"epoch {rank[0]}" + (f" (writer {rank[1]})" if rank[1] else "")
