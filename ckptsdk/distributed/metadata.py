"""DCP's checkpoint ``Metadata`` as JSON, so that no restore path ever unpickles anything.

``torch.distributed.checkpoint`` pickles its ``Metadata`` into ``.metadata``; ckptsdk stores the
same information as a JSON document inside its own manifest: per state entry its kind, dtype,
global size and chunks; where each chunk lives (file and tensor name); and the planner's
flattening map through the ckptsdk codec (it holds tuples). Storage and commit live elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .. import codec
from ..errors import ManifestError, UnsupportedStateError

__all__ = ["FORMAT", "metadata_to_json", "metadata_from_json", "dtype_name", "dtype_of"]

#: The ``format`` of the JSON document; checked first when reading.
FORMAT = "ckptsdk.dcp/1"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: Any) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; ManifestError for anything that is not a torch dtype."""
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ManifestError(f"DCP metadata names an unknown dtype {name!r}")
    return value


def metadata_to_json(md: Metadata) -> dict[str, Any]:
    """The JSON document of a DCP ``Metadata`` whose ``storage_data`` ckptsdk's writer made.

    Raises:
        UnsupportedStateError: a storage kind this format does not know (a newer torch).
    """
    state: dict[str, Any] = {}
    for fqn, sm in md.state_dict_metadata.items():
        if isinstance(sm, TensorStorageMetadata):
            state[fqn] = {
                "kind": "tensor", "dtype": dtype_name(sm.properties.dtype), "size": list(sm.size),
                "requires_grad": bool(sm.properties.requires_grad),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in sm.chunks],
            }
        elif isinstance(sm, BytesStorageMetadata):
            state[fqn] = {"kind": "bytes"}
        else:
            raise UnsupportedStateError(
                f"DCP metadata entry {fqn!r} is a {type(sm).__name__}, which ckptsdk cannot store "
                "as JSON; upgrade ckptsdk", path=fqn, type_name=type(sm).__name__)
    storage = []
    for index, where in (md.storage_data or {}).items():
        storage.append({
            "fqn": index.fqn, "offset": None if index.offset is None else list(index.offset),
            "index": index.index, "file": where["file"], "name": where["name"],
        })
    tensors, planner = codec.encode(md.planner_data)
    if tensors:  # the default planners keep only key paths here; a custom one must too
        raise UnsupportedStateError("DCP planner_data holds tensors; ckptsdk stores it as JSON only",
                                    path="planner_data", type_name="Tensor")
    return {"format": FORMAT, "version": md.version, "state": state, "planner_data": planner,
            "storage": storage}


def metadata_from_json(doc: Any, *, where: str = "") -> Metadata:
    """Rebuild the DCP ``Metadata`` that :func:`metadata_to_json` described.

    ``storage_data`` maps each ``MetadataIndex`` to ``{"file": ..., "name": ...}``.

    Raises:
        ManifestError: not a ``ckptsdk.dcp/1`` document, or malformed (names ``where``).
    """
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ManifestError(f"{where}: DCP metadata has format {got!r}, expected {FORMAT!r}; "
                            "it was written by another ckptsdk version", key=where or None)
    try:
        state: dict[str, Any] = {}
        for fqn, entry in doc["state"].items():
            if entry["kind"] == "bytes":
                state[fqn] = BytesStorageMetadata()
                continue
            if entry["kind"] != "tensor":
                raise ValueError(f"entry {fqn!r} has unknown kind {entry['kind']!r}")
            state[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_of(entry["dtype"]),
                                            requires_grad=bool(entry["requires_grad"])),
                size=torch.Size(entry["size"]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"]))
                        for c in entry["chunks"]],
            )
        storage = {
            MetadataIndex(s["fqn"], s["offset"], s["index"]): {"file": s["file"], "name": s["name"]}
            for s in doc["storage"]
        }
        planner = codec.decode(doc["planner_data"], {})
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ManifestError(f"{where}: malformed DCP metadata ({exc!r})", key=where or None) from exc
    return Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(), version=doc.get("version"))
