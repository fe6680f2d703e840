"""ckptsdk under torch.distributed: DCP on ckptsdk storage, one committer, no pickle.

``DistributedCheckpointManager`` (every rank) composes a :class:`ckptsdk.CheckpointManager` on
rank 0 with a ``torch.distributed.checkpoint`` storage layer (:mod:`.storage`) whose metadata is
JSON in ckptsdk's manifest. ``export_consolidated`` turns a sharded checkpoint into one file.
"""

from __future__ import annotations

from typing import Any

# Loaded on first use: importing ckptsdk.distributed.payload (the export's and the CLI's check for a
# distributed checkpoint) must not import torch.distributed.checkpoint.
_LAZY = {
    "AppState": "state",
    "CkptStorageReader": "storage",
    "CkptStorageWriter": "storage",
    "DistributedCheckpointManager": "manager",
    "JsonLoadPlanner": "storage",
    "JsonSavePlanner": "storage",
    "export_consolidated": "export",
    "load_consolidated": "export",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptsdk.distributed' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"ckptsdk.distributed.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "AppState",
    "CkptStorageReader",
    "CkptStorageWriter",
    "DistributedCheckpointManager",
    "JsonLoadPlanner",
    "JsonSavePlanner",
    "export_consolidated",
    "load_consolidated",
]
