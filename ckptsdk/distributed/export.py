"""One consolidated safetensors file from a distributed checkpoint, for inspection or export.

Reads a checkpoint that :class:`~ckptsdk.distributed.DistributedCheckpointManager` committed (any
number of ranks), in one process, verified, and writes every tensor at its full (unsharded)
size. The ``ckptsdk export`` command calls this; the CLI itself lives in ``ckptsdk/cli.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .. import codec
from ..backends import open_backend
from ..errors import NoValidCheckpointError
from ..manager import CheckpointManager
from ..tensorfile import write_tensorfile
from .manager import file_table, load_quietly, read_payload
from .metadata import metadata_from_json
from .storage import CkptStorageReader

__all__ = ["export_consolidated", "load_consolidated"]


def load_consolidated(
    url: str, step: int | None = None, *, storage_options: Mapping[str, Any] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any], int]:
    """Every entry of a distributed checkpoint at full size, in this process, verified.

    Args:
        url: the checkpoint root.
        step: the step (default: the newest restorable checkpoint).
        storage_options: fsspec options for ``gs://``.

    Returns:
        ``(tensors, others, step)``: flat DCP names (``"app.model.weight"``) -> tensor; the
        non-tensor entries (optimizer ``param_groups``...) as Python values; the step read.

    Raises:
        NoValidCheckpointError: no such step, or nothing restorable.
        CorruptCheckpointError: a file fails its digest check, or it is not a distributed checkpoint.
    """
    mgr = CheckpointManager(url, read_only=True, storage_options=storage_options)
    good = [c for c in mgr.list() if c.valid and (step is None or c.step == step)]
    if not good:
        raise NoValidCheckpointError(
            f"no valid checkpoint{'' if step is None else f' of step {step}'} under {url}; "
            "`ckptsdk ls URL` lists the steps", url=url)
    info = max(good, key=lambda c: (c.step, c.rank))
    assert info.manifest is not None
    payload = read_payload(info.manifest.tree, where=f"{url}/{info.key}")
    md = metadata_from_json(payload["dcp"], where=f"{url}/{info.key}")
    state: dict[str, Any] = {}
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            state[fqn] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            state[fqn] = None  # filled by the planner from JSON
    reader = CkptStorageReader(mgr.backend, info.key, metadata=md, files=file_table(info.manifest))
    load_quietly(state, reader, flatten=False)  # flat names already: keys stay DCP's names
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    others = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    return tensors, others, info.step


def export_consolidated(
    url: str, out_path: str | os.PathLike[str], step: int | None = None, *,
    storage_options: Mapping[str, Any] | None = None,
) -> int:
    """Write a distributed checkpoint as one safetensors file at ``out_path`` (atomically).

    Tensors are stored under their flat DCP names at full size; the non-tensor entries and the
    step go, as the ckptsdk codec's JSON, into the header's ``__metadata__["ckptsdk"]``.

    Args:
        url: the checkpoint root.
        out_path: a local file path (its folder is created).
        step: the step (default: the newest restorable checkpoint).
        storage_options: fsspec options for ``gs://``.

    Returns:
        The step exported.

    Example:
        >>> # export_consolidated("gs://bucket/run", "model.safetensors")
        >>> # safetensors.torch.load_file("model.safetensors")["app.model.weight"]
    """
    tensors, others, got = load_consolidated(url, step, storage_options=storage_options)
    out = os.path.abspath(os.fspath(out_path))
    folder, name = os.path.split(out)
    os.makedirs(folder, exist_ok=True)
    _t, skeleton = codec.encode(others)
    meta = json.dumps({"step": got, "source": url, "others": skeleton}, allow_nan=False)
    write_tensorfile(open_backend(folder), name, tensors, metadata={"ckptsdk": meta})
    return got
