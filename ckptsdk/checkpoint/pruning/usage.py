"""What a checkpoint root costs in storage: bytes by kind, and what Drive's trash holds for it.

``usage(backend)`` classifies every checkpoint folder (committed, anchor, duplicate, uncommitted,
orphaned, invalid) from one catalog scan; the small per-writer trash ledgers written by rotation on
stores whose deletes go to a trash (Drive) give the estimated trash bytes. ``ckptsdk du`` prints it.
Deciding what to delete is rotation's business, not this module's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import Field

from ckptsdk.backends.base import Backend
from ckptsdk.checkpoint.reading.catalog import Catalog, scan
from ckptsdk.errors import BackendError, CkptError, DataError, ObjectNotFound
from ckptsdk.format.document import Document, UtcTime, parse_document, utc_now
from ckptsdk.format.layout import SHARED_PREFIX, Rank, shared_rank

logger = logging.getLogger(__name__)

__all__ = ["TRASH_DAYS", "TRASH_FORMAT", "Usage", "TrashLedger", "TrashTotal", "usage", "record_trash", "read_trash"]

TRASH_PREFIX = "trash/"
#: 1.0: the first versioned form; the previous ckptsdk wrote the same fields without "format".
TRASH_FORMAT = "ckptsdk.trash/1.0"
# Google Drive empties its trash of an item 30 days after it was trashed (Drive API guide
# "Trash or delete files and folders"); until then it counts against the owner's quota.
TRASH_DAYS = 30


def _ledger_key(rank: Rank) -> str:
    return f"{TRASH_PREFIX}epoch-{rank[0]:06d}" + (f".{rank[1]}" if rank[1] else "") + ".json"


class TrashTotal(Document):
    """``trash/epoch-NNNNNN[.tag].json``: one writer's running total of what it sent to the trash.

    No checksum: it is advice for the user (``ckptsdk du``), rewritten at every rotation.
    """

    FORMAT: ClassVar[str] = TRASH_FORMAT

    format: str = Field(default=TRASH_FORMAT, pattern=r"^ckptsdk\.trash/1(\.[0-9]+)?$")
    bytes: int = Field(ge=0)
    files: int = Field(ge=0)
    updated_at: UtcTime = Field(default_factory=utc_now)


def _parse_total(data: bytes, key: str) -> TrashTotal:
    def error(message: str, step: int | None) -> CkptError:
        return DataError(message)

    def legacy(obj: dict[str, Any]) -> dict[str, Any] | None:  # the previous ckptsdk's unversioned form
        return {**obj, "format": TRASH_FORMAT} if "format" not in obj else None

    return parse_document(data, TrashTotal, key=key, error=error, legacy=legacy)


@dataclass(frozen=True)
class TrashLedger:
    """What one writer sent to the trash: bytes, files, and the store time of its last delete."""

    key: str
    bytes: int
    files: int
    last: float | None


def record_trash(backend: Backend, rank: Rank, *, total_bytes: int, files: int) -> None:
    """Publish this writer's running trash total (one small object per writer, rewritten).

    Best effort: a failure is logged, never raised, because the count is advice for the user
    and must not fail a save that has already committed.
    """
    doc = TrashTotal(bytes=int(total_bytes), files=int(files))
    try:
        backend.write(_ledger_key(rank), doc.to_json())
    except BackendError as exc:
        logger.info("could not record the trash total under %s: %s", backend.url, exc)


def read_trash(backend: Backend) -> list[TrashLedger]:
    """Every writer's trash ledger (unreadable ones are skipped with a log line)."""
    out = []
    for obj in backend.list(TRASH_PREFIX):
        try:
            doc = _parse_total(backend.read(obj.key), obj.key)
            out.append(TrashLedger(obj.key, doc.bytes, doc.files, obj.mtime))
        except (ObjectNotFound, DataError) as exc:
            logger.info("ignoring trash ledger %s: %s", obj.key, exc)
    return out


@dataclass(frozen=True)
class Usage:
    """Bytes held under a root, by kind (each folder counted once, in the first kind it fits).

    Attributes:
        committed: the restorable checkpoint of each step (what ``keep_last`` counts).
        anchor: takeover re-commits of a resume point that are that step's restorable copy.
        duplicate: other committed copies of a step already counted (e.g. the checkpoint an
            anchor re-committed, until rotation lets the step go).
        uncommitted: folders without a manifest (a save in flight, or a killed one).
        orphaned: a superseded writer's checkpoints past a takeover's resume point.
        invalid: committed but torn or unreadable.
        shared: bytes counted above that the store holds only once (hard-linked copies).
        shared_files: bytes of the files under ``shared/`` (tensors several checkpoints refer
            to, see :mod:`ckptsdk.checkpoint.writing.sharing`), each counted once.
        folders: per kind, the folder keys.
        trash_bytes: on stores with a trash: what ckptsdk's writers recorded sending there within
            the last ``TRASH_DAYS`` days (estimated: a trash emptied by hand is not seen). None
            on stores without a trash.
        trash_files: the number of files in ``trash_bytes``.
    """

    committed: int = 0
    anchor: int = 0
    duplicate: int = 0
    uncommitted: int = 0
    orphaned: int = 0
    invalid: int = 0
    shared: int = 0
    shared_files: int = 0
    folders: dict[str, list[str]] = field(default_factory=dict)
    trash_bytes: int | None = None
    trash_files: int | None = None

    @property
    def total(self) -> int:
        """Bytes the store holds for the checkpoint folders (shared bytes counted once)."""
        return (
            self.committed
            + self.anchor
            + self.duplicate
            + self.uncommitted
            + self.orphaned
            + self.invalid
            + self.shared_files
            - self.shared
        )


def usage(backend: Backend, *, catalog: Catalog | None = None) -> Usage:
    """Classify the bytes held under ``backend``'s root (see :class:`Usage`).

    Example:
        >>> from ckptsdk.backends import open_backend
        >>> usage(open_backend("memory://du-doc")).total
        0
    """
    cat = catalog if catalog is not None else scan(backend)
    sizes: dict[str, int] = {k: 0 for k in ("committed", "anchor", "duplicate", "uncommitted", "orphaned", "invalid")}
    folders: dict[str, list[str]] = {k: [] for k in sizes}
    seen_versions: set[str] = set()
    shared = 0
    shown = {row.key for row in cat.rows()}
    for c in cat.checkpoints:
        if not c.committed:
            kind = "uncommitted"
        elif c.orphan:
            kind = "orphaned"
        elif not c.valid:
            kind = "invalid"
        elif c.key not in shown:
            kind = "duplicate"
        else:
            kind = "anchor" if c.anchor else "committed"
        sizes[kind] += c.size
        folders[kind].append(c.key)
        # Equal version tokens are the same write: a hard-linked copy costs its bytes once.
        for obj in backend.list(c.key + "/") if c.committed and c.valid else []:
            if obj.version in seen_versions:
                shared += obj.size
            seen_versions.add(obj.version)
    held = [o for o in backend.list(SHARED_PREFIX) if shared_rank(o.key) is not None]
    folders["shared files"] = sorted(o.key for o in held)
    trash_bytes = trash_files = None
    if backend.capabilities.trash_on_delete:
        now = cat.store_now()
        recent = [t for t in read_trash(backend) if now is None or t.last is None or now - t.last < TRASH_DAYS * 86400]
        trash_bytes = sum(t.bytes for t in recent)
        trash_files = sum(t.files for t in recent)
    return Usage(
        **sizes,
        shared=shared,
        shared_files=sum(o.size for o in held),
        folders=folders,
        trash_bytes=trash_bytes,
        trash_files=trash_files,
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def as_dict(u: Usage) -> dict[str, object]:
    """A JSON-able view of ``u`` (``ckptsdk du --json``)."""
    return {
        "bytes": {
            "committed": u.committed,
            "anchor": u.anchor,
            "duplicate": u.duplicate,
            "uncommitted": u.uncommitted,
            "orphaned": u.orphaned,
            "invalid": u.invalid,
            "shared": u.shared,
            "shared_files": u.shared_files,
            "total": u.total,
        },
        "folders": u.folders,
        "trash_bytes": u.trash_bytes,
        "trash_files": u.trash_files,
    }


def render(u: Usage, url: str) -> str:
    """The table ``ckptsdk du`` prints."""
    lines = [f"{'KIND':<12} {'FOLDERS':>7}  BYTES"]
    for kind in ("committed", "anchor", "duplicate", "uncommitted", "orphaned", "invalid"):
        lines.append(f"{kind:<12} {len(u.folders.get(kind, [])):>7}  {_mib(getattr(u, kind))}")
    if u.shared_files:
        n = len(u.folders.get("shared files", []))
        lines.append(
            f"{'shared files':<12} {n:>7}  {_mib(u.shared_files)}  unchanged tensors checkpoints refer to, held once"
        )
    if u.shared:
        lines.append(f"{'(shared)':<12} {'':>7}  -{_mib(u.shared)}  hard-linked copies, held once")
    lines.append(f"{'total':<12} {'':>7}  {_mib(u.total)} under {url}")
    if u.trash_bytes is not None:
        lines.append(
            f"Drive trash (estimated): {_mib(u.trash_bytes)} in {u.trash_files} files sent there "
            f"by ckptsdk in the last {TRASH_DAYS} days; it counts against the quota until "
            "emptied (a trash emptied by hand is not seen here)"
        )
    if u.uncommitted or u.orphaned or u.invalid:
        lines.append("`ckptsdk gc --dry-run URL` shows what can go and why")
    return "\n".join(lines)


def trash_note(gc_bytes: int, backend: Backend) -> str:
    """What ``ckptsdk gc`` tells about Drive's trash: these deletes, what is there already, and
    what each retention mode sends there per 100 saves of this root's newest checkpoint."""
    cat = scan(backend)
    already = usage(backend, catalog=cat).trash_bytes or 0
    note = (
        f"Drive trash: these deletes send {_mib(gc_bytes)} there (kept {TRASH_DAYS} days, on your "
        f"quota); ckptsdk's writers already sent {_mib(already)} in the last {TRASH_DAYS} days."
    )
    newest = next(iter(cat.restorable()), None)
    if newest is not None and newest.manifest is not None:
        data = sum(f.size for f in newest.manifest.files)
        meta = max(0, newest.size - data)
        note += (
            f" Per 100 saves of this checkpoint in steady state: Retention(mode='delete') sends "
            f"{_mib(100 * newest.size)}, 'recycle' (the default on Drive) {_mib(100 * meta)} "
            "(manifests only; its rewrites in place keep old revisions, whose quota cost Google "
            "does not document: see docs/DRIVE.md)"
        )
    return note
