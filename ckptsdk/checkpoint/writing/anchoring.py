"""The anchor of a takeover: a restored checkpoint of an earlier writer re-committed under this one's.

A writer that restored re-commits the checkpoint it resumed from under its own rank (the anchor),
so no lower-ranked writer's rotation can ever delete its resume point; the shared tensor files
that checkpoint refers to are re-homed under the new rank with it (a zombie deletes only its own
rank's names). :class:`Anchor` is a collaborator of the manager's restore; it commits through the
save pipeline it is given. Where the lineage starts (the lineage record) is the writer's.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from ckptsdk.backends.base import copier, durable_batch
from ckptsdk.checkpoint.reading.catalog import CheckpointInfo
from ckptsdk.checkpoint.writing.saving import SavePipeline, SaveRecord
from ckptsdk.checkpoint.writing.sharing import Hints
from ckptsdk.checkpoint.writing.writer import WriterSession
from ckptsdk.format import codec
from ckptsdk.format.layout import TENSORS, shared_key_for
from ckptsdk.format.manifest import SharedFile

logger = logging.getLogger(__name__)

__all__ = ["Anchor"]


class Anchor:
    """Re-commits a restored checkpoint under ``writer``'s rank, through ``pipeline``.

    Args:
        writer: the session of this writer (its rank names the anchor's folder).
        pipeline: the save pipeline whose commit (or, where the store copies, whose publish of a
            manifest) the anchor uses.
    """

    def __init__(self, writer: WriterSession, pipeline: SavePipeline) -> None:
        self.writer = writer
        self.pipeline = pipeline

    def anchor(self, tree: Any, source: CheckpointInfo) -> None:
        """Re-commit ``source`` (restored into ``tree``) under this writer's rank (see ``restore``).

        Where the store copies cheaply (a hard link on local disk, a server-side rewrite on GCS)
        the tensor file and the shared files are copied there and only a new manifest is written;
        elsewhere (the Drive mount has neither) the restored tensors are written again in full,
        those the source kept in shared files into one new shared file of this writer.
        """
        manifest = source.manifest
        assert manifest is not None
        backend = self.writer.backend
        job = SaveRecord(
            folder=self.writer.lineage.folder(manifest.step),
            step=manifest.step,
            position=manifest.position,
            metrics=dict(manifest.metrics),
            tags=dict(manifest.tags),
            device=manifest.environment.device or "cpu",
        )
        copying = copier(backend)
        if copying is not None:
            self.writer.lease.check()
            with durable_batch(backend):
                for entry in manifest.files:  # the tensor file and any distributed ranks' files
                    copying.copy(f"{source.key}/{entry.name}", f"{job.folder}/{entry.name}")
                shared = [self._rehomed(f) for f in manifest.shared]
                for old, new in zip(manifest.shared, shared, strict=True):
                    if new.name != old.name:
                        copying.copy(old.name, new.name)
                info = self.pipeline.publish(job, list(manifest.files), manifest.tree, shared, manifest.referenced)
            assert info.manifest is not None
            self.pipeline.sharing.adopt(info.manifest)
            self.pipeline.after_commit(info)
            return
        # Files beyond the tensor file (distributed ranks') are copied as they are, then listed.
        extra = [f for f in manifest.files if f.name != TENSORS]
        for entry in extra:
            self.writer.lease.check()
            backend.write(f"{job.folder}/{entry.name}", backend.read(f"{source.key}/{entry.name}"))
        tensors, skeleton = codec.encode(tree)
        kept_shared = {p for f in manifest.shared for p in f.tensors}
        referenced = frozenset(p for g in manifest.referenced for p in g.tensors)
        self.pipeline.sharing.seed(manifest)  # the restore proved these: recorded again, never written
        # As a first save: what the source shared goes to one new shared file, the rest with the folder.
        # The referenced tensors' keys as the restore left them: the next save compares against these
        # (no keys would read as "changed in place" there, and store the base in full from then on).
        keys = {p: (tensors[p].data_ptr(), tensors[p]._version) for p in referenced if p in tensors}
        hints = Hints(keys, frozenset(p for p in tensors if p not in kept_shared), referenced)
        self.pipeline.commit(replace(job, extra_files=tuple(extra), hints=hints), tensors, skeleton)

    def _rehomed(self, entry: SharedFile) -> SharedFile:
        """``entry`` under this writer's name (same step and content): a zombie never deletes it."""
        name = shared_key_for(entry.name, *self.writer.rank)
        assert name is not None  # the manifest's pattern admits nothing else
        return entry.model_copy(update={"name": name})
