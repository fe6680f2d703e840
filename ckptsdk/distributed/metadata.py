"""DCP's checkpoint ``Metadata`` as JSON, so that no restore path ever unpickles anything.

``torch.distributed.checkpoint`` pickles its ``Metadata`` into ``.metadata``; ckptsdk stores the
same information as a JSON document inside its own manifest: per state entry its kind, dtype,
global size and chunks; where each chunk lives (file and tensor name); and the planner's
flattening map through the ckptsdk codec (it holds tuples). Storage and commit live elsewhere.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import Field, JsonValue, ValidationError
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptsdk.errors import ManifestError, UnsupportedStateError
from ckptsdk.format import codec
from ckptsdk.format.document import Document, Strict, check_format

__all__ = ["FORMAT", "DcpMetadata", "metadata_to_json", "metadata_from_json", "dtype_name", "dtype_of"]

#: The ``format`` of the JSON document; checked first when reading. Written without a minor
#: version, as the first ckptsdk wrote it and reads only this exact string ("1" reads as "1.0").
FORMAT = "ckptsdk.dcp/1"


class TensorChunk(Strict):
    """One saved chunk of a tensor: where it starts in the global tensor, and its sizes."""

    offsets: list[int]
    sizes: list[int]


class TensorEntry(Strict):
    """A tensor of the state: dtype, global size, and its chunks."""

    kind: Literal["tensor"]
    dtype: str
    size: list[int]
    requires_grad: bool
    chunks: list[TensorChunk]


class BytesEntry(Strict):
    """A non-tensor entry of the state (DCP stores it as bytes)."""

    kind: Literal["bytes"]


class StorageEntry(Strict):
    """Where one chunk lives: the ``MetadataIndex`` and its (file, tensor name)."""

    fqn: str
    offset: list[int] | None
    index: int | None
    file: str
    name: str


class DcpMetadata(Document):
    """The JSON form of DCP's ``Metadata``, stored inside the manifest's tree (``payload["dcp"]``).

    No checksum of its own: the manifest holding it is sealed.
    """

    FORMAT: ClassVar[str] = FORMAT

    format: str = Field(default=FORMAT, pattern=r"^ckptsdk\.dcp/1(\.[0-9]+)?$")
    version: str | None = None
    state: dict[str, Annotated[TensorEntry | BytesEntry, Field(discriminator="kind")]]
    planner_data: JsonValue
    storage: list[StorageEntry]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: object) -> torch.dtype:
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
    state: dict[str, TensorEntry | BytesEntry] = {}
    for fqn, sm in md.state_dict_metadata.items():
        if isinstance(sm, TensorStorageMetadata):
            state[fqn] = TensorEntry(
                kind="tensor",
                dtype=dtype_name(sm.properties.dtype),
                size=list(sm.size),
                requires_grad=bool(sm.properties.requires_grad),
                chunks=[TensorChunk(offsets=list(c.offsets), sizes=list(c.sizes)) for c in sm.chunks],
            )
        elif isinstance(sm, BytesStorageMetadata):
            state[fqn] = BytesEntry(kind="bytes")
        else:
            raise UnsupportedStateError(
                f"DCP metadata entry {fqn!r} is a {type(sm).__name__}, which ckptsdk cannot store "
                "as JSON; upgrade ckptsdk",
                path=fqn,
                type_name=type(sm).__name__,
            )
    storage = [
        StorageEntry(
            fqn=index.fqn,
            offset=None if index.offset is None else list(index.offset),
            index=index.index,
            file=where["file"],
            name=where["name"],
        )
        for index, where in (md.storage_data or {}).items()
    ]
    tensors, planner = codec.encode(md.planner_data)
    if tensors:  # the default planners keep only key paths here; a custom one must too
        raise UnsupportedStateError(
            "DCP planner_data holds tensors; ckptsdk stores it as JSON only", path="planner_data", type_name="Tensor"
        )
    doc = DcpMetadata(version=md.version, state=state, planner_data=planner, storage=storage)
    return doc.model_dump(mode="json")


def metadata_from_json(doc: object, *, where: str = "") -> Metadata:
    """Rebuild the DCP ``Metadata`` that :func:`metadata_to_json` described.

    ``storage_data`` maps each ``MetadataIndex`` to ``{"file": ..., "name": ...}``. The
    document's format is checked first, by the version rule (``ckptsdk.format.document``).

    Raises:
        ManifestError: not a ``ckptsdk.dcp/1`` document (a newer major: upgrade ckptsdk), or
            malformed (names ``where``).

    Example (a document as the first ckptsdk wrote it):
        >>> md = metadata_from_json({
        ...     "format": "ckptsdk.dcp/1", "version": "1.0.0",
        ...     "state": {"w": {"kind": "tensor", "dtype": "float32", "size": [4], "requires_grad": False,
        ...                     "chunks": [{"offsets": [0], "sizes": [4]}]}, "x": {"kind": "bytes"}},
        ...     "planner_data": {"w": {"$tuple": ["w"]}},
        ...     "storage": [{"fqn": "w", "offset": [0], "index": 0, "file": "rank-00000.safetensors",
        ...                  "name": "w"}]}, where="step-1/manifest.json")
        >>> md.state_dict_metadata["w"].size, md.planner_data
        (torch.Size([4]), {'w': ('w',)})
        >>> metadata_to_json(md)["storage"][0]["file"]
        'rank-00000.safetensors'
    """
    got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
    try:
        minor = check_format(got, FORMAT)
    except ValueError as exc:
        raise ManifestError(f"{where}: DCP metadata: {exc} (expected {FORMAT!r})", key=where or None) from exc
    try:
        parsed = DcpMetadata.model_validate(doc, strict=True, context={"lenient": minor > 0})
        state: dict[str, Any] = {}
        for fqn, entry in parsed.state.items():
            if isinstance(entry, BytesEntry):
                state[fqn] = BytesStorageMetadata()
                continue
            state[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_of(entry.dtype), requires_grad=entry.requires_grad),
                size=torch.Size(entry.size),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in entry.chunks
                ],
            )
        storage = {MetadataIndex(s.fqn, s.offset, s.index): {"file": s.file, "name": s.name} for s in parsed.storage}
        planner = codec.decode(parsed.planner_data, {})
    except (ValidationError, TypeError, ValueError) as exc:
        raise ManifestError(f"{where}: malformed DCP metadata ({exc!r})", key=where or None) from exc
    return Metadata(
        state_dict_metadata=state,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(),
        version=parsed.version,
    )
