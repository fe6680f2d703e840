"""Decoding: a state tree rebuilt from its skeleton (a manifest's ``tree``) and its tensors.

The other half of codec.py (``codec.decode`` is this module's ``decode``); the skeleton format
is documented in docs/FORMAT.md, and a malformed skeleton raises ``ManifestError``, a skeleton
that disagrees with its tensors ``CorruptCheckpointError``.
"""

from __future__ import annotations

import math
import re
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any

import numpy as np
import torch
from pydantic import JsonValue

from ckptsdk.errors import CorruptCheckpointError, ManifestError
from ckptsdk.format.document import decode_float
from ckptsdk.format.dtype import BY_NAME, to_torch
from ckptsdk.format.skeleton import FACTORIES, MAX_DEPTH, tag_of

__all__ = ["decode", "decode_before_values"]


def decode(skeleton: JsonValue, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild the state tree from a skeleton and the tensors it references.

    Tensors are used as given (not copied); numpy leaves share memory with them (CPU tensors).
    Tensors the skeleton does not reference are ignored.

    Args:
        skeleton: what ``encode`` returned (after any JSON round trip).
        tensors: path -> tensor, e.g. from ``safetensors.torch.load_file``.

    Returns:
        The tree, equal to the encoded one in types, dtypes, shapes and values.

    Raises:
        ManifestError: the skeleton is malformed (unknown tag, wrong field types).
        CorruptCheckpointError: a referenced tensor is missing or has another dtype or shape.

    Example:
        >>> from ckptsdk.format.codec import encode
        >>> tensors, skel = encode({"w": torch.zeros(2), "t": (1, float("nan"))})
        >>> decode(skel, tensors)
        {'w': tensor([0., 0.]), 't': (1, nan)}
    """
    try:
        return _decode(skeleton, tensors, 0)
    except RecursionError as exc:
        raise ManifestError("state skeleton nests too deeply to decode") from exc


# Set by decode_before_values: where conversions that need the values wait for them.
_LATER: ContextVar[list[tuple[np.ndarray, np.ndarray]] | None] = ContextVar("_LATER", default=None)


def decode_before_values(skeleton: JsonValue, tensors: Mapping[str, torch.Tensor]) -> tuple[Any, Callable[[], None]]:
    """``decode`` for tensors whose bytes have not arrived yet (allocated from a file's header):
    the tree now, and ``complete`` to call once the bytes are in.

    Restore checks that the tree fits the live state before it reads a data byte. Tensors and
    numpy leaves share memory with the tensors given, so they fill in place; only a numpy
    array of another byte order, which ``decode`` converts (a copy), is converted by ``complete``.
    """
    later: list[tuple[np.ndarray, np.ndarray]] = []
    token = _LATER.set(later)
    try:
        tree = decode(skeleton, tensors)
    finally:
        _LATER.reset(token)

    def complete() -> None:
        for out, src in later:
            out[...] = src

    return tree, complete


def _decode(node: Any, tensors: Mapping[str, torch.Tensor], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ManifestError(f"state skeleton nests deeper than {MAX_DEPTH} levels")
    if node is None or isinstance(node, (bool, str, int)):
        return node
    if isinstance(node, float):
        if not math.isfinite(node):
            raise ManifestError("state skeleton holds a bare nan/inf; expected {'$float': ...}")
        return node
    if isinstance(node, list):
        return [_decode(v, tensors, depth + 1) for v in node]
    if not isinstance(node, dict):
        raise ManifestError(f"state skeleton holds a {type(node).__name__}, not a JSON value")
    tag = tag_of(node)
    if tag is None:
        return {k: _decode(v, tensors, depth + 1) for k, v in node.items()}
    try:
        return _decode_tagged(tag, node, tensors, depth)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        # ManifestError and CorruptCheckpointError (raised on purpose below) are none of these
        # builtins: they pass through as they are.
        raise ManifestError(f"state skeleton has a malformed {tag} node: {exc}") from exc


def _decode_tagged(tag: str, node: dict[str, Any], tensors: Mapping[str, torch.Tensor], depth: int) -> Any:
    value = node[tag]
    if tag == "$tuple":
        _expect_keys(node, {tag})
        if not isinstance(value, list):
            raise ValueError("$tuple must hold a list")
        return tuple(_decode(v, tensors, depth + 1) for v in value)
    if tag == "$dict":
        _expect_keys(node, {tag})
        out: dict[Any, Any] = {}
        for pair in value:
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError("$dict must hold [key, value] pairs")
            key = _decode(pair[0], tensors, depth + 1)
            if not (key is None or type(key) in (str, int, bool, float)):
                raise ValueError(f"dict key {key!r} is not a scalar")
            out[key] = _decode(pair[1], tensors, depth + 1)
        return out
    if tag == "$state_dict":
        _expect_keys(node, {tag, "metadata"})
        items = _decode(value, tensors, depth + 1)
        if not isinstance(items, dict):
            raise ValueError("$state_dict must hold a dict")
        result = OrderedDict(items)
        result._metadata = _decode(node["metadata"], tensors, depth + 1)  # type: ignore[attr-defined]
        return result
    if tag in ("$ordered_dict", "$counter", "$defaultdict"):
        _expect_keys(node, {tag, "factory"} if tag == "$defaultdict" else {tag})
        items = _decode(value, tensors, depth + 1)
        if not isinstance(items, dict):
            raise ValueError(f"{tag} must hold a dict")
        if tag == "$ordered_dict":
            return OrderedDict(items)
        if tag == "$counter":
            return Counter(items)
        if node["factory"] not in FACTORIES:
            raise ValueError(f"unknown defaultdict factory {node['factory']!r}")
        return defaultdict(FACTORIES[node["factory"]], items)
    if tag == "$deque":
        _expect_keys(node, {tag, "maxlen"})
        maxlen = node["maxlen"]
        if not isinstance(value, list) or not (maxlen is None or (type(maxlen) is int and maxlen >= 0)):
            raise ValueError("$deque must hold a list and a maxlen (int >= 0 or null)")
        return deque((_decode(v, tensors, depth + 1) for v in value), maxlen)
    if tag == "$float":
        return decode_float(node)
    if tag == "$int":
        _expect_keys(node, {tag})
        if not isinstance(value, str) or not re.fullmatch(r"-?0x[0-9a-f]+", value):
            raise ValueError(f"$int must be a hex string, got {value!r}")
        return int(value, 16)
    if tag == "$npscalar":
        dt = _numeric_dtype(value)
        if "hex" in node:
            _expect_keys(node, {tag, "hex"})
            raw = bytes.fromhex(node["hex"])
            if len(raw) != dt.itemsize:
                raise ValueError(f"{len(raw)} bytes for a {dt} scalar")
            return np.frombuffer(raw, dtype=dt)[0]
        _expect_keys(node, {tag, "value"})
        raw_value = _decode(node["value"], tensors, depth + 1)
        return np.array(raw_value, dtype=dt)[()]
    # $tensor / $ndarray
    _expect_keys(node, {tag, "dtype", "shape"})
    if not isinstance(value, str):
        raise ValueError("tensor path must be a str")
    try:
        t = tensors[value]
    except KeyError:
        raise CorruptCheckpointError(
            f"the tensor file has no tensor {value!r} that the manifest's state tree needs; "
            "the checkpoint is torn or was written by another tool",
            key=value,
        ) from None
    shape = node["shape"]
    if not isinstance(shape, list) or list(t.shape) != shape:
        raise CorruptCheckpointError(
            f"tensor {value!r} has shape {list(t.shape)} in the tensor file but {shape} in the "
            "manifest; the checkpoint is inconsistent",
            key=value,
        )
    if tag == "$tensor":
        entry = BY_NAME.get(node["dtype"])
        if entry is None:
            raise ValueError(f"unknown tensor dtype {node['dtype']!r}")
        expected = to_torch(entry)
        if expected is None:
            raise ManifestError(
                f"tensor {value!r} is {entry.name}, which torch {torch.__version__} lacks; upgrade "
                "torch to restore this checkpoint"
            )
        if t.dtype != expected:
            raise CorruptCheckpointError(
                f"tensor {value!r} is {t.dtype} in the tensor file but {expected} in the "
                "manifest; the checkpoint is inconsistent",
                key=value,
            )
        return t
    dt = _numeric_dtype(node["dtype"])
    arr = t.cpu().numpy() if t.device.type != "cpu" else t.numpy()
    if arr.dtype != dt.newbyteorder("="):
        raise CorruptCheckpointError(
            f"array {value!r} is {arr.dtype} in the tensor file but {dt} in the manifest; the "
            "checkpoint is inconsistent",
            key=value,
        )
    if arr.dtype.str == dt.str:
        return arr
    later = _LATER.get()
    if later is None:
        return arr.astype(dt)
    converted = np.empty(arr.shape, dt)  # once the bytes are in (decode_before_values)
    later.append((converted, arr))
    return converted


def _numeric_dtype(text: Any) -> np.dtype:
    if not isinstance(text, str):
        raise ValueError(f"numpy dtype must be a str, got {text!r}")
    dt = np.dtype(text)
    if dt.kind not in "biufc":
        raise ValueError(f"numpy dtype {text!r} is not numeric")
    return dt


def _expect_keys(node: dict[str, Any], keys: set[str]) -> None:
    if set(node) != keys:
        raise ValueError(f"fields {sorted(node)} (expected {sorted(keys)})")
