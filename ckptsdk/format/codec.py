"""The state codec: a state tree <-> (tensors keyed by path, a JSON skeleton), with no pickle.

A state tree is nested dicts/lists/tuples whose leaves are tensors, numpy arrays, numpy scalars or
JSON-like scalars. ``encode`` splits it into the tensors (for safetensors) and a JSON skeleton that
says where each one goes; ``decode`` puts it back together exactly. Storage, digests and the
manifest do not belong here. The skeleton format is documented in docs/FORMAT.md; checking a
skeleton without its tensors (and its JSON Schema) is skeleton.py's, and so are the tags and
defaultdict factories it uses; the dtypes it stores are dtype.py's table.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter, OrderedDict, defaultdict, deque
from typing import Any

import numpy as np
import torch
from pydantic import JsonValue

from ckptsdk.errors import UnsupportedStateError
from ckptsdk.format.decoding import decode, decode_before_values
from ckptsdk.format.document import encode_float
from ckptsdk.format.dtype import of_torch
from ckptsdk.format.skeleton import FACTORIES, MAX_DEPTH

__all__ = [
    "check",
    "decode",
    "decode_before_values",
    "encode",
    "SCALAR_TYPES",
    "encode_scalar",
    "encode_subtree",
    "from_numpy_as_is",
    "path_component",
]

# Python ints outside int64 are written as hex strings: other JSON readers lose precision on big
# numbers, and CPython refuses to print ints over 4300 decimal digits.
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1
_INTLIKE = re.compile(r"-?[0-9]+")

# The standard-library containers torch's own objects hold (MultiStepLR's milestones is a
# Counter), kept exactly.
_MAPPING_TAGS: dict[type, str] = {OrderedDict: "$ordered_dict", Counter: "$counter", defaultdict: "$defaultdict"}
_FACTORY_NAMES = {id(v): k for k, v in FACTORIES.items()}
_HINT = "convert it to a tensor or a JSON value (None, bool, int, float, str), or leave it out of state_dict()"


def encode(tree: object) -> tuple[dict[str, torch.Tensor], JsonValue]:
    """Split a state tree into its tensors, keyed by readable paths, and a JSON skeleton.

    Tensors are detached, never copied: device tensors stay on their device, non-contiguous and
    storage-sharing tensors are returned as they are (the writer copies their values). Numpy
    arrays become tensors through ``torch.from_numpy`` (sharing memory; only read-only,
    non-native byte order or negative-stride arrays are copied). Sharing between leaves is not
    preserved: two leaves that view one storage come back as two independent tensors. An
    ``OrderedDict`` carrying ``_metadata`` (``nn.Module.state_dict()``) comes back as one, with
    its metadata. ``OrderedDict``, ``Counter``, ``deque`` and ``defaultdict`` (with a factory
    of a known type: int, list, dict...) come back as themselves.

    Args:
        tree: nested dict/OrderedDict/Counter/defaultdict/list/tuple/deque; leaves ``torch.Tensor``, ``np.ndarray``,
            numpy scalars, ``None``, ``bool``, ``int``, ``float``, ``str``.

    Returns:
        ``(tensors, skeleton)``: ``skeleton`` survives ``json.dumps(allow_nan=False)``/``loads``.

    Raises:
        UnsupportedStateError: a leaf or key the codec cannot store; names the path and type.

    Example:
        >>> tensors, skel = encode({"w": torch.ones(2), "step": 3})
        >>> skel
        {'w': {'$tensor': 'w', 'dtype': 'float32', 'shape': [2]}, 'step': 3}
    """
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _Encoder(tensors).node(tree, (), set())
    return tensors, skeleton


def encode_subtree(obj: object, path: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], JsonValue]:
    """``encode`` of the subtree at ``path`` (escaped components) of a larger tree: its tensors by
    full path, and its skeleton node (``format/template.py``'s nodes it does not cache).

    Raises:
        UnsupportedStateError: as ``encode``.
    """
    tensors: dict[str, torch.Tensor] = {}
    return tensors, _Encoder(tensors).node(obj, path, set())


def check(tree: object) -> None:
    """Raise what ``encode`` would raise for ``tree``, storing and copying nothing.

    A lazy module's parameter that is not materialised yet passes: it will be by the first save.

    Raises:
        UnsupportedStateError: a leaf or key the codec cannot store; names the path and type.
    """
    _Encoder({}, preflight=True).node(tree, (), set())


# --- encoding ---------------------------------------------------------------------------------


def _show(path: tuple[str, ...]) -> str:
    return "/".join(path) if path else "<root>"


def _refuse(path: tuple[str, ...], obj: Any, why: str = "") -> UnsupportedStateError:
    type_name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if type(obj).__module__ == "builtins":
        type_name = type(obj).__qualname__
    where = _show(path)
    message = f"cannot checkpoint a {type_name} at {where!r}: {why or _HINT}"
    return UnsupportedStateError(message, path=where, type_name=type_name)


@functools.lru_cache(maxsize=8192)  # the same keys come back at every save: encoding is on the save's stall
def _escape_str_key(key: str) -> str:
    # '%' and '/' are escaped so that '/' only ever separates components; a key that could be read
    # as an int key, a '#'-prefixed special key or safetensors' reserved '__metadata__' gets its
    # first character escaped. The mapping is injective, so paths are unique.
    out = []
    for ch in key:
        if ch in "%/" or ch < " " or ch == "\x7f" or 0xD800 <= ord(ch) <= 0xDFFF:
            out.append("".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass")))
        else:
            out.append(ch)
    text = "".join(out)
    if _INTLIKE.fullmatch(text) or text.startswith("#") or text == "__metadata__":
        text = f"%{ord(text[0]):02X}{text[1:]}"
    return text


#: The exact types of the tree's JSON-like scalar leaves (bool is its own; numpy's are not these).
SCALAR_TYPES = frozenset({type(None), bool, int, float, str})


def encode_scalar(obj: None | bool | int | float | str) -> JsonValue:
    """One scalar leaf (of a type in ``SCALAR_TYPES``) as its skeleton node: ints beyond int64 as
    ``{"$int": hex}``, nan/inf/-0.0 as ``{"$float": ...}``, the rest as they are."""
    if type(obj) is int:
        return obj if _INT_MIN <= obj <= _INT_MAX else {"$int": hex(obj)}
    if type(obj) is float:
        return encode_float(obj)  # type: ignore[return-value]  # a float or a {"$float": str} dict
    return obj


def path_component(key: Any) -> str:  # a dict key as one component of a tensor's path
    if type(key) is str:
        return _escape_str_key(key)
    if type(key) is int:
        return str(key) if _INT_MIN <= key <= _INT_MAX else f"#{key:#x}"
    if key is None or type(key) is bool:
        return f"#{key}"
    if type(key) is float:
        tagged = encode_float(key)  # a nan's sign and payload: its tag, as in the skeleton
        return f"#{tagged['$float']}" if isinstance(tagged, dict) and math.isnan(key) else f"#{key!r}"
    raise AssertionError(key)  # mapping() refused every other key type already


class _Encoder:
    def __init__(self, tensors: dict[str, torch.Tensor], *, preflight: bool = False) -> None:
        self.tensors = tensors
        self.preflight = preflight

    def node(self, obj: Any, path: tuple[str, ...], active: set[int]) -> Any:
        if len(path) > MAX_DEPTH:
            raise _refuse(path, obj, f"the tree nests deeper than {MAX_DEPTH} levels")
        kind = type(obj)
        if kind in SCALAR_TYPES:
            return encode_scalar(obj)
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if kind is np.ndarray:
            return self.ndarray(obj, path)
        if isinstance(obj, np.generic):
            return _npscalar(obj, path)
        if kind in (dict, OrderedDict, list, tuple, Counter, defaultdict, deque):
            if id(obj) in active:
                raise _refuse(path, obj, "the tree contains itself (a reference cycle)")
            active.add(id(obj))
            try:
                if kind is list:
                    return [self.node(v, path + (str(i),), active) for i, v in enumerate(obj)]
                if kind is tuple:
                    return {"$tuple": [self.node(v, path + (str(i),), active) for i, v in enumerate(obj)]}
                if kind is OrderedDict and hasattr(obj, "_metadata"):
                    # nn.Module.state_dict() hangs the modules' versions on the OrderedDict;
                    # load_state_dict converts "old" layouts when they are missing.
                    meta = self.node(obj._metadata, path + ("#_metadata",), active)
                    return {"$state_dict": self.mapping(obj, path, active), "metadata": meta}
                if kind is deque:
                    items = [self.node(v, path + (str(i),), active) for i, v in enumerate(obj)]
                    return {"$deque": items, "maxlen": obj.maxlen}
                if kind is defaultdict:
                    factory = _FACTORY_NAMES.get(id(obj.default_factory))
                    if factory is None:
                        raise _refuse(
                            path,
                            obj,
                            f"its default_factory {obj.default_factory!r} is "
                            f"not one of {sorted(FACTORIES)}; convert it with dict(x)",
                        )
                    return {"$defaultdict": self.mapping(obj, path, active), "factory": factory}
                if kind in _MAPPING_TAGS:
                    return {_MAPPING_TAGS[kind]: self.mapping(obj, path, active)}
                return self.mapping(obj, path, active)
            finally:
                active.discard(id(obj))
        raise _refuse(path, obj, _hint_for(obj))

    def claim(self, path: tuple[str, ...]) -> str:
        key = "/".join(path)
        # Paths are unique by construction except for two distinct nan float keys in one dict.
        if key in self.tensors:
            raise UnsupportedStateError(
                f"two tensors map to the same path {key!r} (two nan dict keys?); use distinct str or int keys",
                path=key,
                type_name="dict",
            )
        return key

    def mapping(self, obj: dict[Any, Any], path: tuple[str, ...], active: set[int]) -> Any:
        for key in obj:
            if not (key is None or type(key) in (str, int, bool, float)):
                raise _refuse(
                    path + (repr(key)[:40],),
                    key,
                    "dict keys must be str, int, bool, float or None; convert the key (e.g. "
                    "to a str) or leave this dict out of state_dict()",
                )
        items = [(k, self.node(v, path + (path_component(k),), active)) for k, v in obj.items()]
        if all(type(k) is str and not k.startswith("$") for k in obj):
            return dict(items)
        return {"$dict": [[self.node(k, path, active), v] for k, v in items]}

    def tensor(self, t: torch.Tensor, path: tuple[str, ...]) -> Any:
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            raise _refuse(
                path, t, "tensor subclasses are not stored; convert with torch.Tensor(t) or t.as_subclass(torch.Tensor)"
            )
        # UninitializedTensorMixin is public in torch.nn.parameter but missing from its .pyi stub.
        if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):  # type: ignore[attr-defined]
            if self.preflight:
                return None
            raise _refuse(
                path, t, "a lazy module's parameter is not materialised yet; run one forward pass before saving"
            )
        if t.layout != torch.strided:
            raise _refuse(path, t, f"{t.layout} tensors are not stored; convert with .to_dense()")
        if t.is_quantized or t.device.type == "meta":
            raise _refuse(
                path, t, "quantized and meta tensors have no plain values; dequantize or materialise them first"
            )
        entry = of_torch(t.dtype)
        if entry is None:
            hint = " (e.g. torch.view_as_real(t) for complex128)" if t.is_complex() else ""
            raise _refuse(path, t, f"safetensors cannot hold dtype {t.dtype}; convert it{hint}")
        t = t.detach()
        # Conjugate/negative views carry a lazy bit that a raw byte copy would drop.
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        key = self.claim(path)
        self.tensors[key] = t
        return {"$tensor": key, "dtype": entry.name, "shape": list(t.shape)}

    def ndarray(self, a: np.ndarray, path: tuple[str, ...]) -> Any:
        dtype_str = a.dtype.str
        native = a.dtype.newbyteorder("=")
        if a.dtype.kind not in "biufc" or a.dtype.hasobject:
            raise _refuse(
                path, a, f"numpy arrays of dtype {a.dtype} are not stored; convert it to a numeric array or a list"
            )
        if not from_numpy_as_is(a):
            # from_numpy refuses these (or warns for read-only arrays): copy, the only case we do.
            a = a.astype(native, order="C", copy=True)  # (ascontiguousarray turns 0-d into 1-d)
        try:
            t = torch.from_numpy(a)
        except TypeError as exc:
            raise _refuse(path, a, f"numpy dtype {a.dtype} has no torch equivalent") from exc
        if of_torch(t.dtype) is None:
            raise _refuse(path, a, f"safetensors cannot hold numpy dtype {a.dtype}; convert it")
        key = self.claim(path)
        self.tensors[key] = t
        return {"$ndarray": key, "dtype": dtype_str, "shape": list(a.shape)}


def from_numpy_as_is(a: np.ndarray) -> bool:
    """Whether the codec stores ``a`` as ``torch.from_numpy(a)``, sharing its memory (native byte
    order, writeable, no negative strides); any other array is copied first."""
    return a.dtype.isnative and a.flags.writeable and not any(s < 0 for s in a.strides)


def _npscalar(x: np.generic, path: tuple[str, ...]) -> Any:
    dt = x.dtype
    if dt.kind not in "biufc":
        raise _refuse(path, x, f"numpy scalars of dtype {dt} are not stored; use a str or int")
    if dt.kind in "biu" or (dt.kind == "f" and dt.itemsize <= 8):
        value = x.item()
        encoded = encode_float(value) if dt.kind == "f" else value
        if type(value) is int and not (_INT_MIN <= value <= _INT_MAX):
            encoded = {"$int": hex(value)}
        # Bit-exact or nothing: a float32 nan payload may not survive the trip through float64.
        if np.array(value, dtype=dt).tobytes() == np.array(x).tobytes():
            return {"$npscalar": dt.str, "value": encoded}
    return {"$npscalar": dt.str, "hex": np.array(x).tobytes().hex()}


def _hint_for(obj: Any) -> str:
    if callable(obj):
        return (
            "functions and callables cannot be stored (no pickle); recreate it in code and leave it out of state_dict()"
        )
    if isinstance(obj, (set, frozenset)):
        return "convert the set to a sorted list"
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return (
            "convert bytes to a uint8 tensor (torch.frombuffer(bytearray(b), dtype=torch.uint8)) or to a str (b.hex())"
        )
    if isinstance(obj, (dict, list, tuple, str, int, float)):
        return (
            f"subclasses of {type(obj).__bases__[0].__name__} are not stored as such; "
            "convert it to a plain one (dict(x), list(x), tuple(x), str(x), int(x), float(x))"
        )
    if isinstance(obj, np.ndarray):
        return "numpy array subclasses are not stored; convert with np.asarray(x)"
    return _HINT
