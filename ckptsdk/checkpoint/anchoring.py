"""Where a writer's lineage starts: its lineage record, and the anchor of a takeover.

The base of :class:`ckptsdk.checkpoint.saving.SavePipeline` (which sets the attributes below).
A writer that restored re-commits the checkpoint it resumed from under its own rank (the anchor),
so no lower-ranked writer's rotation can ever delete its resume point; the shared tensor files
that checkpoint refers to are re-homed under the new rank with it (a zombie deletes only its own
rank's names). The save itself is the pipeline's.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from ckptsdk.backends.base import Backend, copier, durable_batch
from ckptsdk.checkpoint.catalog import CheckpointInfo
from ckptsdk.checkpoint.lineage import LineageWriter
from ckptsdk.checkpoint.sharing import Hints, Sharing
from ckptsdk.errors import LeaseLostError, PreconditionFailed
from ckptsdk.format import codec
from ckptsdk.format.layout import TENSORS, Rank, shared_key_for
from ckptsdk.format.manifest import LineageRecord, SharedFile
from ckptsdk.lease.acquire import Lease

logger = logging.getLogger("ckptsdk.checkpoint.saving")  # one logger for the save pipeline

__all__ = ["Anchoring"]


class Anchoring:
    """The lineage half of the save pipeline. Not used on its own."""

    backend: Backend
    url: str
    lease: Lease
    writer: LineageWriter
    sharing: Sharing
    _lineage_written: bool
    _after_commit: Callable[[CheckpointInfo], None]
    _publish: Callable[..., CheckpointInfo]
    commit: Callable[..., CheckpointInfo]

    def anchor(self, tree: Any, source: CheckpointInfo) -> None:
        """Re-commit a restored checkpoint under this writer's rank (see ``restore``).

        Where the store copies cheaply (a hard link on local disk, a server-side rewrite on GCS)
        the tensor file and the shared files are copied there and only a new manifest is written;
        elsewhere (the Drive mount has neither) the restored tensors are written again in full,
        those the source kept in shared files into one new shared file of this writer.
        """
        manifest = source.manifest
        assert manifest is not None
        folder = self.writer.folder(manifest.step)
        device = manifest.environment.device or "cpu"
        copying = copier(self.backend)
        if copying is not None:
            self.lease.check()
            with durable_batch(self.backend):
                for entry in manifest.files:  # the tensor file and any distributed ranks' files
                    copying.copy(f"{source.key}/{entry.name}", f"{folder}/{entry.name}")
                shared = [self._rehomed(f) for f in manifest.shared]
                for old, new in zip(manifest.shared, shared, strict=True):
                    if new.name != old.name:
                        copying.copy(old.name, new.name)
                info = self._publish(
                    folder,
                    manifest.step,
                    list(manifest.files),
                    manifest.tree,
                    manifest.position,
                    manifest.metrics,
                    manifest.tags,
                    device,
                    shared=shared,
                )
            assert info.manifest is not None
            self.sharing.adopt(info.manifest)
            self._after_commit(info)
            return
        # Files beyond the tensor file (distributed ranks') are copied as they are, then listed.
        extra = [f for f in manifest.files if f.name != TENSORS]
        for entry in extra:
            self.lease.check()
            self.backend.write(f"{folder}/{entry.name}", self.backend.read(f"{source.key}/{entry.name}"))
        tensors, skeleton = codec.encode(tree)
        kept_shared = {p for f in manifest.shared for p in f.tensors}
        # As a first save: what the source shared goes to one new shared file, the rest with the folder.
        hints = Hints({}, frozenset(p for p in tensors if p not in kept_shared))
        self.commit(
            folder,
            manifest.step,
            tensors,
            skeleton,
            manifest.position,
            manifest.metrics,
            manifest.tags,
            device,
            extra,
            hints=hints,
        )

    def _rehomed(self, entry: SharedFile) -> SharedFile:
        """``entry`` under this writer's name (same step and content): a zombie never deletes it."""
        name = shared_key_for(entry.name, *self.writer.rank)
        assert name is not None  # the manifest's pattern admits nothing else
        return entry.model_copy(update={"name": name})

    @property
    def lineage_written(self) -> bool:
        """This writer's lineage record is written: where its lineage starts is fixed."""
        return self._lineage_written

    def write_lineage(self, step: int | None, epoch: int | None) -> None:
        """Record, once per epoch, where this writer's lineage starts (before its first commit)."""
        if self._lineage_written:
            return
        record = LineageRecord(
            epoch=self.lease.epoch,
            attempt=self.lease.attempt,
            run_id=self.lease.run_id,
            resumed_from_step=step,
            resumed_from_epoch=epoch,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        self.lease.check()
        try:
            self.backend.create(self.writer.lineage_key, record.to_json())
        except PreconditionFailed as exc:
            # Only the holder of this epoch writes this key: someone else did -> we lost the lease.
            self.lease.fence(f"lineage record of epoch {self.lease.epoch} already exists", None)
            raise LeaseLostError(
                f"another writer already recorded epoch {self.lease.epoch} under {self.url}; "
                "this writer stops (nothing was written or deleted)",
                url=self.url,
                epoch=self.lease.epoch,
            ) from exc
        self._lineage_written = True

    def fence_if_newer(self, seen: Rank) -> None:
        """Fence this writer (and raise ``LeaseLostError``) if ``seen`` outranks it."""
        if self.writer.fenced_by(seen):
            why = f"saw a newer writer (epoch {seen[0]}) under {self.url}"
            if not self.backend.capabilities.compare_and_swap:
                # Here a lineage record alone fences (catalog.writer_ranks): say what a stray one means.
                why += (
                    "; if no writer of that epoch exists, its lineage record is stray: reopening is "
                    "safe (the next writer judges the record by the lease it takes over from)"
                )
            self.lease.fence(why, seen[0])
            self.lease.check()  # raises LeaseLostError
