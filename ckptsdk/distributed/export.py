"""One consolidated safetensors file from a distributed checkpoint, for inspection or export.

Reads a checkpoint that :class:`~ckptsdk.distributed.DistributedCheckpointManager` committed (any
number of ranks), in one process, verified, and writes every tensor at its full (unsharded)
size. ``ckptsdk export`` (through :func:`ckptsdk.porting.export.export_safetensors`) calls this; the CLI
itself lives in ``ckptsdk/cli/``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ckptsdk.backends import open_backend
from ckptsdk.backends.base import Backend
from ckptsdk.checkpoint.reading.catalog import CheckpointInfo
from ckptsdk.distributed.metadata import metadata_from_json
from ckptsdk.distributed.payload import file_table, read_payload
from ckptsdk.distributed.restoring import load_quietly
from ckptsdk.distributed.storage import CkptStorageReader
from ckptsdk.errors import NoValidCheckpointError
from ckptsdk.format import codec
from ckptsdk.format.files.tensorfile import write_tensorfile
from ckptsdk.manager import CheckpointManager

__all__ = ["export_consolidated", "load_consolidated"]


def load_consolidated(
    url: str, step: int | None = None, *, storage_options: Mapping[str, object] | None = None
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
    info = _choose(mgr, url, step)
    tensors, others = _load(mgr.backend, info, where=f"{url}/{info.key}")
    return tensors, others, info.step


def _choose(mgr: CheckpointManager, url: str, step: int | None) -> CheckpointInfo:
    good = [c for c in mgr.list() if c.valid and (step is None or c.step == step)]
    if not good:
        raise NoValidCheckpointError(
            f"no valid checkpoint{'' if step is None else f' of step {step}'} under {url}; "
            "`ckptsdk ls URL` lists the steps",
            url=url,
        )
    return max(good, key=lambda c: (c.step, c.rank))


def _load(backend: Backend, info: CheckpointInfo, *, where: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The entries of one distributed checkpoint: ``(tensors, others)`` (see load_consolidated)."""
    assert info.manifest is not None
    payload = read_payload(info.manifest.tree, where=where)
    md = metadata_from_json(payload["dcp"], where=where)
    state: dict[str, Any] = {}
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            state[fqn] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            state[fqn] = None  # filled by the planner from JSON
    reader = CkptStorageReader(backend, info.key, metadata=md, files=file_table(info.manifest))
    load_quietly(state, reader, flatten=False)  # flat names already: keys stay DCP's names
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    others = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    return tensors, others


def export_consolidated(
    url: str,
    out_path: str | os.PathLike[str],
    step: int | None = None,
    *,
    storage_options: Mapping[str, object] | None = None,
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

    Example (a root a DistributedCheckpointManager wrote; tests/distributed/test_distributed_dcp.py runs one)::

        export_consolidated("gs://bucket/run", "model.safetensors")
        safetensors.torch.load_file("model.safetensors")["app.model.weight"]
    """
    mgr = CheckpointManager(url, read_only=True, storage_options=storage_options)
    info = _choose(mgr, url, step)
    write_consolidated(mgr.backend, info, out_path, source=url)
    return info.step


def write_consolidated(
    backend: Backend, info: CheckpointInfo, out_path: str | os.PathLike[str], *, source: str
) -> None:
    """Write the distributed checkpoint ``info`` of ``backend`` as :func:`export_consolidated` does
    (``ckptsdk export`` calls this with the checkpoint it already picked)."""
    tensors, others = _load(backend, info, where=f"{source}/{info.key}")
    out = os.path.abspath(os.fspath(out_path))
    folder, name = os.path.split(out)
    os.makedirs(folder, exist_ok=True)
    _t, skeleton = codec.encode(others)
    meta = json.dumps({"step": info.step, "source": source, "others": skeleton}, allow_nan=False)
    write_tensorfile(open_backend(folder), name, tensors, metadata={"ckptsdk": meta})
