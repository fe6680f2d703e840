"""What a checkpoint root holds: committed checkpoints, their validity, lineage and orphans.

Read-only and cheap (one listing plus the small JSON objects): it decides which checkpoints are
restorable without reading tensor data. Writing, leasing and digest checks of tensor files belong
to the manager.
"""

from __future__ import annotations

import logging
import re
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from .backends.base import Backend, ObjectInfo
from .errors import ManifestError, ObjectNotFound
from .manifest import LineageRecord, Manifest, parse_lineage, parse_manifest

logger = logging.getLogger(__name__)

CKPT_PREFIX = "step-"
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"
LINEAGE_PREFIX = "lineage/"
LEASE_KEY = "LEASE.json"

_DIR_RE = re.compile(r"^step-(\d{10,})\.e(\d+)$")
_LINEAGE_RE = re.compile(r"^lineage/epoch-(\d+)\.json$")


def checkpoint_dir(step: int, epoch: int) -> str:
    """The folder of one checkpoint: unique per (step, lease epoch), so two writers never collide."""
    return f"step-{step:010d}.e{epoch}"


def lineage_key(epoch: int) -> str:
    """Where the takeover record of ``epoch`` lives."""
    return f"lineage/epoch-{epoch:06d}.json"


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

    @property
    def attempt(self) -> int | None:
        return self.manifest.writer.attempt if self.manifest else None


@dataclass(frozen=True)
class Catalog:
    """A snapshot of a root: every checkpoint folder, lineage records, and the highest epoch seen."""

    checkpoints: list[CheckpointInfo]
    lineage: dict[int, LineageRecord]
    resume_points: dict[int, int | None]
    max_epoch: int

    def restorable(self) -> list[CheckpointInfo]:
        """Valid checkpoints, newest first (higher step, then higher epoch)."""
        good = [c for c in self.checkpoints if c.valid]
        return sorted(good, key=lambda c: (c.step, c.epoch), reverse=True)

    def find(self, step: int) -> list[CheckpointInfo]:
        """Every checkpoint folder of ``step`` (several epochs may have written it), newest epoch first."""
        return sorted((c for c in self.checkpoints if c.step == step), key=lambda c: -c.epoch)


def _read_json_object(backend: Backend, key: str) -> bytes | None:
    try:
        return backend.read(key)
    except ObjectNotFound:
        return None  # deleted between list and read: treat as never seen


def scan(backend: Backend, *, cache: MutableMapping[tuple[str, str], object] | None = None) -> Catalog:
    """List the root and classify every checkpoint folder.

    Args:
        backend: the checkpoint root.
        cache: optional memo of parsed manifests/lineage records keyed by (key, version); a
            manager passes one so that repeated scans read only what changed.
    """
    memo: MutableMapping[tuple[str, str], object] = cache if cache is not None else {}
    folders: dict[str, dict[str, ObjectInfo]] = {}
    for obj in backend.list(CKPT_PREFIX):
        folder, _, name = obj.key.partition("/")
        if _DIR_RE.match(folder) and name and "/" not in name:
            folders.setdefault(folder, {})[name] = obj

    lineage: dict[int, LineageRecord] = {}
    max_epoch = 0
    for obj in backend.list(LINEAGE_PREFIX):
        m = _LINEAGE_RE.match(obj.key)
        if not m:
            continue
        max_epoch = max(max_epoch, int(m.group(1)))
        record = memo.get((obj.key, obj.version))
        if record is None:
            raw = _read_json_object(backend, obj.key)
            if raw is None:
                continue
            try:
                record = parse_lineage(raw, key=obj.key)
            except ManifestError as exc:
                logger.warning("ignoring unreadable lineage record %s: %s", obj.key, exc)
                continue
            memo[(obj.key, obj.version)] = record
        lineage[record.epoch] = record  # type: ignore[union-attr]

    # First pass: manifests (commit markers) and sizes.
    parsed: list[tuple[int, int, str, dict[str, ObjectInfo], Manifest | None, str | None]] = []
    for folder, files in sorted(folders.items()):
        m = _DIR_RE.match(folder)
        assert m is not None
        step, epoch = int(m.group(1)), int(m.group(2))
        max_epoch = max(max_epoch, epoch)
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
                raw = _read_json_object(backend, key)
                if raw is None:
                    reason = "manifest vanished while listing (being deleted)"
                else:
                    try:
                        manifest = parse_manifest(raw, key=key)
                        memo[(key, mobj.version)] = manifest
                    except ManifestError as exc:
                        reason = f"bad manifest: {exc}"
            if manifest is not None:
                reason = _check_files(manifest, files, step, epoch)
        parsed.append((step, epoch, folder, files, manifest, reason))

    # Where each epoch resumed from: its lineage record, else what its manifests say (on Drive
    # the record may not have arrived yet while the manifests have).
    resume_points: dict[int, int | None] = {e: r.resumed_from_step for e, r in lineage.items()}
    for _step, epoch, _folder, _files, manifest, _reason in parsed:
        if manifest is not None and epoch not in resume_points:
            resume_points[epoch] = manifest.writer.resumed_from_step

    checkpoints = []
    for step, epoch, folder, files, manifest, reason in parsed:
        orphan_of = _superseded_by(step, epoch, resume_points)
        orphan = orphan_of is not None
        if reason is None and orphan_of is not None:
            newer, point = orphan_of
            where = "a fresh start" if point is None else f"step {point}"
            reason = (
                f"orphan: written by epoch {epoch} after epoch {newer} took over from {where}; "
                "never restored (`ckptsdk gc` removes it)"
            )
        checkpoints.append(
            CheckpointInfo(
                step=step,
                epoch=epoch,
                key=folder,
                size=sum(o.size for o in files.values()),
                committed=MANIFEST in files,
                valid=reason is None,
                reason=reason,
                orphan=orphan,
                manifest=manifest,
            )
        )
    return Catalog(checkpoints=checkpoints, lineage=lineage, resume_points=resume_points, max_epoch=max_epoch)


def _check_files(manifest: Manifest, files: dict[str, ObjectInfo], step: int, epoch: int) -> str | None:
    if manifest.step != step or manifest.writer.lease_epoch != epoch:
        return (
            f"manifest says step {manifest.step} epoch {manifest.writer.lease_epoch} but lives in "
            f"the folder of step {step} epoch {epoch}"
        )
    for entry in manifest.files:
        obj = files.get(entry.name)
        if obj is None:
            return f"torn: {entry.name} is missing"
        if obj.size != entry.size:
            return f"torn: {entry.name} has {obj.size} bytes, the manifest says {entry.size}"
    return None


def _superseded_by(step: int, epoch: int, resume_points: dict[int, int | None]) -> tuple[int, int | None] | None:
    """The newer epoch that makes (step, epoch) an orphan, and where it resumed from; else None."""
    for newer in sorted(resume_points, reverse=True):
        if newer <= epoch:
            break
        point = resume_points[newer]
        if point is None or step > point:
            return newer, point
    return None
