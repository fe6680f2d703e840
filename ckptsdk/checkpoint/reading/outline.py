"""Restore's view of a root: one listing, then its checkpoints judged one at a time, newest first.

:func:`~ckptsdk.checkpoint.reading.catalog.scan` reads every manifest (``ls``, gc and rotation show or
judge them all). Opening a writer needs only who writes the root, and a restore only the newest
checkpoint that reads back whole, so :class:`Outline` reads a manifest when it reaches its folder.
The rules are the catalog's, not copies of them: each checkpoint is judged by the same functions.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

from ckptsdk.backends.base import Backend
from ckptsdk.checkpoint.reading.catalog import CheckpointInfo, Judge, classify, witness, writer_points, writer_ranks
from ckptsdk.checkpoint.reading.listing import Folder, list_root, prune_memo, read_folder
from ckptsdk.format.layout import Rank, outranks, parse_folder
from ckptsdk.lease.record import LeaseRecord

__all__ = ["Outline"]


class Outline:
    """One listing of a root (folders, lineage records): its writers now, its checkpoints on demand.

    Args:
        backend: the checkpoint root.
        cache: the memo of parsed manifests and lineage records by (key, version) that
            :func:`~ckptsdk.checkpoint.reading.catalog.scan` shares (a reader's).
        judge: a writer's (:class:`~ckptsdk.checkpoint.reading.catalog.Judge`); None for a reader.

    Attributes:
        max_rank: the highest writer a full scan would report (folder names and believed
            lineage records).
        fencing_rank: what fences a writer (see :func:`~ckptsdk.checkpoint.reading.catalog.writer_ranks`).
        epoch_floor: the highest epoch any name uses; a new writer takes one above it.
        ignored_lineage: lineage records not believed, and why (as the scan says).

    Example:
        >>> import torch
        >>> from ckptsdk import CheckpointManager, open_backend
        >>> with CheckpointManager("memory://outline-doc") as mgr:
        ...     for step in (1, 2, 3):
        ...         _ = mgr.save({"w": torch.ones(1)}, step=step)
        >>> newest = next(Outline(open_backend("memory://outline-doc")).newest_first())
        >>> newest.step, newest.valid
        (3, True)
    """

    def __init__(
        self,
        backend: Backend,
        *,
        cache: MutableMapping[tuple[str, str], object] | None = None,
        judge: Judge | None = None,
    ) -> None:
        self.backend = backend
        self._memo: MutableMapping[tuple[str, str], object] = cache if cache is not None else {}
        self._exclusive = backend.capabilities.compare_and_swap
        self._lease_seen: list[LeaseRecord | None] = []
        self._witness, self._mine = witness(backend, judge)
        # Folder names now, a folder's files when its turn comes: a root of 1,000 checkpoints
        # lists one or two folders, not 1,000 (where the store names folders; see Folders).
        self.listing = list_root(backend, self._memo, lazy=True)
        if cache is not None:
            prune_memo(cache, self.listing)
        # Which records are believed needs no manifest (see catalog.writer_points): known now.
        _points, self.ignored_lineage = writer_points(
            self.listing, [], self._lease, exclusive=self._exclusive, mine=self._mine
        )
        self.max_rank, self.fencing_rank, self.epoch_floor = writer_ranks(
            self.listing, self.ignored_lineage, exclusive=self._exclusive
        )
        self._read: dict[str, Folder] = {}

    def _lease(self) -> LeaseRecord | None:
        if not self._lease_seen:  # LEASE.json is read only when a record needs vouching: rarely
            self._lease_seen.append(self._witness())
        return self._lease_seen[0]

    def _folder(self, folder: str) -> Folder:
        if folder not in self._read:
            files = self.listing.folders[folder]
            self._read[folder] = read_folder(self.backend, self._memo, folder, files, self.listing.shared)
        return self._read[folder]

    @property
    def manifests_read(self) -> int:
        """Folders whose manifest this outline has read (or found in the memo) so far."""
        return sum(1 for e in self._read.values() if e[4] is not None)

    def newest_first(self) -> Iterator[CheckpointInfo]:
        """Every checkpoint folder, newest first (higher step, then higher writer rank), judged
        as :func:`~ckptsdk.checkpoint.reading.catalog.scan` judges it: committed, manifest readable,
        files of the sizes it lists, not an orphan.

        A folder's manifest is read when the iteration reaches it. Whether it is an orphan
        depends only on the writers that outrank it (``lineage.superseded_by``), so before it is
        judged every manifest of those writers is read, which makes their resume points exactly
        the scan's. There are none when the newest checkpoint is the newest writer's, the usual
        case: a restore then reads one manifest. The ``anchor`` flag of a folder is judged from
        the manifests read so far (only listings show it).
        """
        named: list[tuple[int, Rank, str]] = []
        for folder in self.listing.folders:
            found = parse_folder(folder)
            assert found is not None  # list_root keeps only checkpoint folders
            named.append((found[0], found[1], folder))
        named.sort(reverse=True)
        points_of: dict[Rank, dict[Rank, int | None]] = {}
        for _step, rank, folder in named:
            if not self.listing.folders[folder]:
                continue  # named but empty (a lazy listing): a full listing would not show it
            entry = self._folder(folder)
            if rank not in points_of:
                for _s, other, key in named:
                    if outranks(other, rank):
                        self._folder(key)
                read = [e for e in self._read.values() if not outranks(rank, e[1])]
                points_of[rank], _ = writer_points(
                    self.listing, read, self._lease, exclusive=self._exclusive, mine=self._mine
                )
            yield classify(entry, points_of[rank])

    def newest_valid(self) -> CheckpointInfo | None:
        """The newest restorable checkpoint (sizes checked, digests not), or None."""
        return next((c for c in self.newest_first() if c.valid), None)
