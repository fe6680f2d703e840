"""One listing of a checkpoint root: its folders (files by name, a manifest read where asked) and
its lineage records, read and memoised by version. What they mean (committed, orphaned,
restorable) is catalog.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ckptsdk.backends.base import Backend, ObjectInfo, browser
from ckptsdk.backends.deadline import carried
from ckptsdk.errors import ManifestError, NewerFormatError, ObjectNotFound
from ckptsdk.format.layout import (
    CKPT_PREFIX,
    LINEAGE_PREFIX,
    MANIFEST,
    SHARED_PREFIX,
    Rank,
    lineage_rank,
    parse_folder,
)
from ckptsdk.format.manifest import LineageRecord, Manifest, parse_lineage, parse_manifest

logger = logging.getLogger(__name__)

__all__ = [
    "NEWER",
    "VANISHED",
    "Folder",
    "Folders",
    "Listing",
    "SharedObjects",
    "lineage_floor",
    "list_root",
    "prune_memo",
    "read_folder",
    "read_json_object",
]


#: How the reason of a folder whose manifest is of a newer major format begins: such a checkpoint
#: is not restorable here, and never garbage (see :attr:`CheckpointInfo.newer`).
NEWER = "written by a newer ckptsdk"


def read_json_object(backend: Backend, key: str) -> bytes | None:
    try:
        return backend.read(key)
    except ObjectNotFound:
        return None  # deleted between list and read: treat as never seen


#: One checkpoint folder as its listing and (when read) its manifest show it:
#: (step, writer rank, folder, files by name, manifest or None, why it is not valid or None).
Folder = tuple[int, Rank, str, dict[str, ObjectInfo], Manifest | None, str | None]


class Folders(Mapping[str, dict[str, ObjectInfo]]):
    """Checkpoint folders by name, named in one call; each one's files listed when first asked for.

    What a writer's open and a restore read of a root of 1,000 checkpoints: every name (who
    writes the root, which folder is newest) and the files of the one or two folders they judge.
    A folder named here and gone when its files are listed lists as empty (uncommitted), as a
    folder deleted between a full listing's steps would have.
    """

    def __init__(self, backend: Backend, names: list[str]) -> None:
        self._backend = backend
        self._names = dict.fromkeys(names)
        self._files: dict[str, dict[str, ObjectInfo]] = {}
        self._ranks: set[Rank] | None = None

    def __getitem__(self, folder: str) -> dict[str, ObjectInfo]:
        if folder not in self._names:
            raise KeyError(folder)
        files = self._files.get(folder)
        if files is None:
            files = self._files[folder] = _direct_files(self._backend.list(f"{folder}/")).get(folder, {})
        return files

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def listed(self) -> dict[str, dict[str, ObjectInfo]]:
        """The folders whose files were listed so far."""
        return dict(self._files)

    def ranks(self) -> set[Rank]:
        """Every writer rank of a folder that holds an object, as a full listing shows them (it
        sees no empty folder): per rank, its folders are listed newest first until one holds an
        object, so a writer of 1,000 checkpoints costs one listing (the one restore reads)."""
        if self._ranks is None:
            by_rank: dict[Rank, list[tuple[int, str]]] = {}
            for folder in self._names:
                named = parse_folder(folder)
                assert named is not None  # list_root names only checkpoint folders
                by_rank.setdefault(named[1], []).append((named[0], folder))
            self._ranks = {r for r, steps in by_rank.items() if any(self[f] for _s, f in sorted(steps, reverse=True))}
        return self._ranks


class SharedObjects:
    """The objects under ``shared/``, listed once, when a manifest that refers to one is first
    checked: a root without incremental saves never pays the listing. One with them pays one
    listing per scan (on Drive, where a writer lists before each upload, one more per save).

    A listing is a moment: a file it does not show (or shows with another size) is looked at
    again by itself (:meth:`fresh`) before a checkpoint is called torn for it.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._objs: dict[str, ObjectInfo] | None = None

    def get(self, key: str) -> ObjectInfo | None:
        """``key``'s object as the listing shows it (None: not listed)."""
        if self._objs is None:
            self._objs = {o.key: o for o in self._backend.list(SHARED_PREFIX)}
        return self._objs.get(key)

    def fresh(self, key: str) -> ObjectInfo | None:
        """``key``'s object now (one stat), None when it is not there."""
        try:
            obj = self._backend.stat(key)
        except ObjectNotFound:
            return None
        assert self._objs is not None  # only after get()
        self._objs[key] = obj
        return obj


@dataclass(frozen=True)
class Listing:
    """One listing of a root: its checkpoint folders and its lineage records, no manifest read.

    Lineage records are read (there is one per writer, a few hundred bytes each); manifests are
    not: :func:`read_folder` reads one, :func:`scan` reads them all. ``folders`` is a dict of
    every folder's files, or (``list_root(lazy=True)`` on a store that names folders) a
    :class:`Folders` that lists a folder's files when they are first asked for.
    """

    folders: Mapping[str, dict[str, ObjectInfo]]
    lineage: dict[Rank, LineageRecord]
    lineage_objs: list[ObjectInfo] = field(repr=False)
    lineage_mtimes: list[float] = field(repr=False)
    #: the shared files, listed when first asked for (see :class:`SharedObjects`)
    shared: SharedObjects | None = field(default=None, repr=False, compare=False)

    def used(self) -> set[Rank]:
        """Every writer rank a folder that holds an object carries."""
        if isinstance(self.folders, Folders):
            return self.folders.ranks()
        return {named[1] for f in self.folders if (named := parse_folder(f)) is not None}

    def committed(self) -> list[tuple[int, Rank]]:
        """(step, rank) of every folder whose manifest is listed."""
        return [named for f, files in self.folders.items() if MANIFEST in files and (named := parse_folder(f))]


def list_root(backend: Backend, memo: MutableMapping[tuple[str, str], object], *, lazy: bool = False) -> Listing:
    """List the root: checkpoint folders by name, and every lineage record (read, memoised).

    ``lazy``: where the store names its folders in one call (:func:`~ckptsdk.backends.base.browser`),
    only their names are listed now, and a folder's files when first asked for (:class:`Folders`).
    """
    folder_objs, lineage_objs = _list_both(backend, lazy=lazy)
    folders: Mapping[str, dict[str, ObjectInfo]]
    if isinstance(folder_objs, Folders):
        folders = folder_objs
    else:
        folders = {f: files for f, files in _direct_files(folder_objs).items() if parse_folder(f) is not None}

    lineage: dict[Rank, LineageRecord] = {}
    lineage_mtimes: list[float] = []
    for obj in lineage_objs:
        rank = lineage_rank(obj.key)
        if rank is None:
            continue
        if obj.mtime is not None:
            lineage_mtimes.append(obj.mtime)
        cached = memo.get((obj.key, obj.version))
        record = cached if isinstance(cached, LineageRecord) else None
        if record is None:
            raw = read_json_object(backend, obj.key)
            if raw is None:
                continue
            try:
                record = parse_lineage(raw, key=obj.key)
            except ManifestError as exc:
                logger.warning("ignoring unreadable lineage record %s: %s", obj.key, exc)
                continue
            memo[(obj.key, obj.version)] = record
        if record.epoch != rank[0]:
            logger.warning("ignoring lineage record %s: it says epoch %s", obj.key, record.epoch)
            continue
        lineage[rank] = record
    return Listing(
        folders=folders,
        lineage=lineage,
        lineage_objs=list(lineage_objs),
        lineage_mtimes=lineage_mtimes,
        shared=SharedObjects(backend),
    )


def _direct_files(objs: list[ObjectInfo]) -> dict[str, dict[str, ObjectInfo]]:
    """Top-level folder -> its direct files by name (files nested deeper are no checkpoint's)."""
    folders: dict[str, dict[str, ObjectInfo]] = {}
    for obj in objs:
        folder, _, name = obj.key.partition("/")
        if name and "/" not in name:
            folders.setdefault(folder, {})[name] = obj
    return folders


def lineage_floor(backend: Backend) -> int:
    """The highest epoch a lineage record's name uses (0: none), from one small listing.

    A writer records its lineage before its first commit, so a folder name of a higher epoch is
    rare (lost records, ranks' files ahead of a first commit); the caller still checks the names.
    """
    return max((rank[0] for obj in backend.list(LINEAGE_PREFIX) if (rank := lineage_rank(obj.key))), default=0)


def _list_both(backend: Backend, *, lazy: bool) -> tuple[list[ObjectInfo] | Folders, list[ObjectInfo]]:
    """The listings of the checkpoint folders (or their names, ``lazy``) and of the lineage records.

    In this order where the store is immediately consistent: a folder seen then means its
    writer's lineage record (written before its first commit) is seen too; a folder named first
    and listed later is still one whose writer's record was listed. Where another host's writes
    arrive in no order anyway (Drive), nothing can rest on that, and the two run at once: the
    listing that fences each save there is one round trip, not two.
    """
    naming = browser(backend) if lazy else None

    def folders() -> list[ObjectInfo] | Folders:
        if naming is None:
            return backend.list(CKPT_PREFIX)
        return Folders(backend, [f for f in naming.list_folders(CKPT_PREFIX) if parse_folder(f) is not None])

    if backend.capabilities.immediately_consistent:
        return folders(), backend.list(LINEAGE_PREFIX)
    # A thread per listing: a few hundred microseconds beside a mount's round trip. The deadline
    # of the save goes with it (carried); leaving the block waits for it, whatever was raised.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptsdk-list") as pool:
        lineage = pool.submit(carried(lambda: backend.list(LINEAGE_PREFIX)))
        return folders(), lineage.result()


def read_folder(
    backend: Backend,
    memo: MutableMapping[tuple[str, str], object],
    folder: str,
    files: dict[str, ObjectInfo],
    shared: SharedObjects | None = None,
) -> Folder:
    """One folder of a listing with its manifest read (memoised by version) and its files checked,
    the shared files it refers to too (``shared``: the listing's; None: a listing of its own)."""
    named = parse_folder(folder)
    assert named is not None
    step, rank = named
    manifest: Manifest | None = None
    reason: str | None = None
    mobj = files.get(MANIFEST)
    if mobj is None:
        reason = "uncommitted: no manifest (a save in progress, or one that crashed)"
    else:
        key = f"{folder}/{MANIFEST}"
        cached = memo.get((key, mobj.version))
        if isinstance(cached, Manifest):
            manifest = cached
        else:
            raw = read_json_object(backend, key)
            if raw is None:
                reason = VANISHED
            else:
                try:
                    manifest = parse_manifest(raw, key=key)
                    memo[(key, mobj.version)] = manifest
                except NewerFormatError as exc:
                    reason = f"{NEWER} (kept; this one cannot read it): {exc}"
                except ManifestError as exc:
                    reason = f"bad manifest: {exc}"
        if manifest is not None:
            reason = _check_files(manifest, files, step, rank[0])
        if manifest is not None and reason is None and manifest.shared:
            reason = _check_shared(backend, manifest, shared or SharedObjects(backend), f"{folder}/{MANIFEST}")
    return step, rank, folder, files, manifest, reason


def prune_memo(memo: MutableMapping[tuple[str, str], object], listing: Listing) -> None:
    """Drop from ``memo`` what ``listing`` no longer shows.

    The memo holds what a root holds now, not everything it ever held: a manager that saves
    (or a reader that restores) every few seconds for days must not keep each deleted
    checkpoint's manifest alive."""
    folders = listing.folders
    # A folder named but not listed yet (a lazy listing) keeps what the memo holds of it: the
    # root still holds the folder, and bounds what is kept.
    unlisted: set[str] = set()
    if isinstance(folders, Folders):
        seen = folders.listed()
        unlisted = set(folders) - set(seen)
        folders = seen
    listed = {(f"{folder}/{name}", obj.version) for folder, files in folders.items() for name, obj in files.items()}
    listed |= {(obj.key, obj.version) for obj in listing.lineage_objs}
    for stale in [k for k in memo if k not in listed and k[0].partition("/")[0] not in unlisted]:
        del memo[stale]


#: Why a folder whose manifest was listed, and gone when looked at again, is no checkpoint: a
#: rotation or gc deleted it meanwhile (manifest first). Never damage.
VANISHED = "manifest vanished while listing (being deleted)"


def _unknown_algorithm(name: str, algorithm: str) -> str | None:
    from ckptsdk.format.digest import CHECKPOINT_ALGORITHMS as ALGORITHMS  # what a checkpoint's files may name

    if algorithm in ALGORITHMS:
        return None
    return (
        f"{name}: unknown digest algorithm {algorithm!r} (this ckptsdk knows "
        f"{', '.join(ALGORITHMS)}); written by a newer ckptsdk? upgrade to read it"
    )


def _check_shared(backend: Backend, manifest: Manifest, shared: SharedObjects, key: str) -> str | None:
    """Why the shared files ``manifest`` refers to make it no checkpoint (None: present, right sizes).

    Checked wherever a folder's own files are (listing, ``ls``, ``latest``, restore's choice,
    ``verify``): a lost or truncated shared file makes every checkpoint that uses it torn. A file
    the listing misses is stat'ed again; still missing while the manifest is gone too, the
    checkpoint was rotated away meanwhile (shared files go after the manifests), not torn.
    """
    for entry in manifest.shared:
        unknown = _unknown_algorithm(entry.name, entry.algorithm)
        if unknown is not None:
            return unknown
        obj = shared.get(entry.name)
        if obj is None or obj.size != entry.size:
            obj = shared.fresh(entry.name)  # the listing is a moment: look again before judging
        if obj is not None and obj.size == entry.size:
            continue
        if not backend.exists(key):
            return VANISHED
        if obj is None:
            return f"torn: shared file {entry.name} is missing"
        return f"torn: shared file {entry.name} has {obj.size} bytes, the manifest says {entry.size}"
    return None


def _check_files(manifest: Manifest, files: dict[str, ObjectInfo], step: int, epoch: int) -> str | None:
    if manifest.step != step or manifest.writer.lease_epoch != epoch:
        return (
            f"manifest says step {manifest.step} epoch {manifest.writer.lease_epoch} but lives in "
            f"the folder of step {step} epoch {epoch}"
        )
    for entry in manifest.files:
        unknown = _unknown_algorithm(entry.name, entry.algorithm)
        if unknown is not None:
            return unknown
        obj = files.get(entry.name)
        if obj is None:
            return f"torn: {entry.name} is missing"
        if obj.size != entry.size:
            return f"torn: {entry.name} has {obj.size} bytes, the manifest says {entry.size}"
    return None
