"""ckptsdk under torch.distributed: DCP on ckptsdk storage, one committer, no pickle.

``DistributedCheckpointManager`` (every rank) composes a :class:`ckptsdk.CheckpointManager` on
rank 0 with a ``torch.distributed.checkpoint`` storage layer (:mod:`.storage`) whose metadata is
JSON in ckptsdk's manifest. ``export_consolidated`` turns a sharded checkpoint into one file.
"""

from __future__ import annotations

from .export import export_consolidated, load_consolidated
from .manager import DistributedCheckpointManager
from .state import AppState
from .storage import CkptStorageReader, CkptStorageWriter, JsonLoadPlanner, JsonSavePlanner

__all__ = [
    "AppState", "CkptStorageReader", "CkptStorageWriter", "DistributedCheckpointManager",
    "JsonLoadPlanner", "JsonSavePlanner", "export_consolidated", "load_consolidated",
]
