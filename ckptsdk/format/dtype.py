"""The one table of tensor dtypes a checkpoint can hold: safetensors code, torch name, file order.

The tensor file writes and reads the codes, the codec names the dtypes in the skeleton, and the
skeleton's JSON Schema lists them; all take them from here, so a dtype one of them supports the
others support too. Reading and writing files do not belong here. torch is imported only when a
torch dtype is asked for: the skeleton's checks and the manifest need the names alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["BY_CODE", "BY_NAME", "NAMES", "TABLE", "DType", "byte_view", "of_torch", "to_torch"]


@dataclass(frozen=True)
class DType:
    """One dtype a checkpoint can hold.

    Attributes:
        code: its name in a safetensors header (``"F32"``).
        name: torch's name for it, which the skeleton's ``$tensor`` nodes use (``"float32"``).
        rank: its place in the order safetensors' own writer sorts tensors (see ``TABLE``).
        itemsize: bytes per element, so that a header is checked without importing torch.
    """

    code: str
    name: str
    rank: int
    itemsize: int


# Every dtype safetensors can hold, in the order its writer sorts tensors (its Rust Dtype enum,
# descending; then by name): writing in this order makes our files byte-identical to its own.
_CODES = (
    ("U64", "uint64", 8),
    ("I64", "int64", 8),
    ("F64", "float64", 8),
    ("C64", "complex64", 8),
    ("F32", "float32", 4),
    ("U32", "uint32", 4),
    ("I32", "int32", 4),
    ("BF16", "bfloat16", 2),
    ("F16", "float16", 2),
    ("U16", "uint16", 2),
    ("I16", "int16", 2),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz", 1),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz", 1),
    ("F8_E8M0", "float8_e8m0fnu", 1),
    ("F8_E4M3", "float8_e4m3fn", 1),
    ("F8_E5M2", "float8_e5m2", 1),
    ("I8", "int8", 1),
    ("U8", "uint8", 1),
    ("BOOL", "bool", 1),
)
#: The table, in safetensors' file order. The same whatever torch is installed (the JSON Schema
#: lists every name); ``to_torch`` says whether this torch has a dtype.
TABLE: tuple[DType, ...] = tuple(DType(code, name, rank, size) for rank, (code, name, size) in enumerate(_CODES))
BY_CODE: dict[str, DType] = {d.code: d for d in TABLE}
BY_NAME: dict[str, DType] = {d.name: d for d in TABLE}
#: The torch names, as the skeleton's ``$tensor`` nodes carry them.
NAMES: tuple[str, ...] = tuple(d.name for d in TABLE)


@functools.cache
def _torch_maps() -> tuple[dict[torch.dtype, DType], dict[str, torch.dtype]]:
    import torch

    to_entry: dict[torch.dtype, DType] = {}
    to_dtype: dict[str, torch.dtype] = {}
    for d in TABLE:
        dt = getattr(torch, d.name, None)
        if isinstance(dt, torch.dtype):  # older torch builds lack some float8 and unsigned dtypes
            to_entry[dt] = d
            to_dtype[d.name] = dt
    return to_entry, to_dtype


def of_torch(dtype: torch.dtype) -> DType | None:
    """The table's entry for a torch dtype, or None if a checkpoint cannot hold it.

    Example:
        >>> import torch
        >>> of_torch(torch.bfloat16).code, of_torch(torch.complex128)
        ('BF16', None)
    """
    return _torch_maps()[0].get(dtype)


def to_torch(entry: DType) -> torch.dtype | None:
    """The torch dtype of a table entry, or None if this torch build lacks it.

    Example:
        >>> to_torch(BY_CODE["F16"])
        torch.float16
    """
    return _torch_maps()[1].get(entry.name)


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat byte view of a CPU contiguous tensor's own memory (no copy; keeps ``t`` alive).

    Raises:
        ValueError: ``t`` is not contiguous (a view of it would be a copy: bytes written into it
            would never reach ``t``).

    Example:
        >>> import torch
        >>> bytes(byte_view(torch.tensor([1], dtype=torch.int16)))
        b'\\x01\\x00'
    """
    import torch

    if not t.is_contiguous():
        raise ValueError(f"byte_view needs a contiguous tensor, got strides {t.stride()} for shape {list(t.shape)}")
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy().data.cast("B")
