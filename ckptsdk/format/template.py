"""A state tree's encoding cached between saves: its structure is worked out once, a save only
checks it and collects the leaves.

What does not change from one save of a job to the next (the containers and their keys, the keys'
escaping, the tensors' paths, dtypes and shapes) is compiled from one full ``codec.encode``. A save
then walks the tree against that template (``EncodingCache.encode``: it checks and collects, on
the training thread) and the skeleton is rebuilt from what was collected (``Captured.skeleton``:
on the save worker). Any difference, however small, sends the tree through a full encode again,
which also builds the next template. What a skeleton is belongs to codec.py and skeleton.py.
Every encoding is also held to what a manifest reader parses (``limits``: the skeleton's size and
depth), exactly after a full encode and by a cheap bound through a template.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from pydantic import JsonValue

from ckptsdk.errors import UnsupportedStateError
from ckptsdk.format import codec, limits

logger = logging.getLogger(__name__)

__all__ = ["Captured", "EncodingCache", "TreeTemplate"]

_SCALARS = codec.SCALAR_TYPES
# Exact types only: a tensor subclass (a lazy module's parameter...) takes the full encode, which
# refuses it with its message.
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_PARAMETER = torch.nn.Parameter


class _Changed(Exception):
    """The tree no longer has the template's structure (never leaves this module)."""


# A compiled node: capture(obj, tensors, slots) checks ``obj`` against the template and appends
# its tensors and its leaves (scalars, tuples of scalars, skeleton fragments), in tree order;
# build(slots) takes them back in that order and returns the node's skeleton, fresh.
_Capture = Callable[[Any, list[torch.Tensor], list[Any]], None]
_Build = Callable[[Iterator[Any]], Any]
_Node = tuple[_Capture, _Build, "tuple[Any, ...] | None"]  # the third: a tensor leaf's spec


class Captured:
    """One save's encoding: the tensors (aligned with ``names``) and the leaves of its skeleton.

    Attributes:
        names: the tensors' paths, in tree order (the same tuple for every save of a template).
        tensors: the tree's tensors as found (a ``nn.Parameter`` is not detached: the staging
            copy detaches what it defers, and :meth:`tensor_dict` detaches), aligned with ``names``.
        nbytes: the tensors' bytes.
        sized: captured through a template that fixes every tensor's dtype and shape (its
            ``names`` then stand for them: the same tuple at every save of the template).
    """

    __slots__ = ("_build", "_skeleton", "_slots", "names", "nbytes", "sized", "tensors")

    def __init__(
        self,
        names: tuple[str, ...],
        tensors: list[torch.Tensor],
        slots: list[Any],
        build: _Build | None,
        skeleton: JsonValue = None,
        *,
        nbytes: int,
        sized: bool = False,
    ) -> None:
        self.names = names
        self.nbytes = nbytes
        self.sized = sized
        self.tensors = tensors
        self._slots = slots
        self._build = build
        self._skeleton = skeleton

    def skeleton(self) -> JsonValue:
        """The state's skeleton (what ``codec.encode`` returns), built once, fresh containers.

        Safe to call on another thread than the capture's: the leaves were copied at capture.
        """
        if self._build is not None:
            self._skeleton = self._build(iter(self._slots))
            self._build, self._slots = None, []
        return self._skeleton

    def tensor_dict(self) -> dict[str, torch.Tensor]:
        """name -> tensor, as ``codec.encode`` returns them (detached)."""
        return {
            n: t.detach() if t.requires_grad or type(t) is not torch.Tensor else t
            for n, t in zip(self.names, self.tensors, strict=True)
        }


class TreeTemplate:
    """The compiled structure of one state tree; :meth:`capture` checks a tree against it.

    Example:
        >>> tree = {"w": torch.ones(2), "step": 3}
        >>> template, first = TreeTemplate.of(tree)
        >>> tree["step"] = 4
        >>> template.capture(tree).skeleton() == codec.encode(tree)[1]
        True
        >>> tree["w"] = torch.ones(3)  # another shape: the template no longer fits
        >>> template.capture(tree) is None
        True
    """

    def __init__(self, names: tuple[str, ...], node: _Node, nbytes: int, *, sized: bool, base: int = 0) -> None:
        self.names = names
        self._capture, self._build, _ = node
        #: bytes of the tensors (fixed when ``sized``: dtypes and shapes are part of the template,
        #: except those of nodes encoded in full at each save)
        self.nbytes = nbytes
        self._sized = sized
        # JSON bytes of the skeleton the template was compiled from: with a bound on what each
        # save's leaves add, a bound on its skeleton's (see ``check_room``).
        self._base = base

    @classmethod
    def of(cls, tree: object) -> tuple[TreeTemplate | None, Captured]:
        """Encode ``tree`` in full (every check the codec makes) and compile its template.

        Returns:
            ``(template, captured)``: the template is None when the tree cannot be cached (its
            capture would not reproduce the full encode exactly: a tensor with a lazy conjugate
            bit, nan dict keys...); such a tree is encoded in full at every save.

        Raises:
            UnsupportedStateError: what ``codec.encode`` raises.
        """
        tensors, skeleton = codec.encode(tree)
        names = tuple(tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        first = Captured(names, list(tensors.values()), [], None, skeleton, nbytes=nbytes)
        base = check_room(skeleton)
        if limits.json_depth(skeleton) + 1 > limits.JSON_DEPTH:
            # At the limit: a leaf tagged later (nan, a big int) nests one level deeper; every
            # save of such a tree is encoded, and checked, in full.
            return None, first
        opaque: list[str] = []  # the tensors of nodes encoded in full at each save
        template = cls(names, _compile(tree, skeleton, (), opaque), nbytes, sized=not opaque, base=base)
        # The template proves itself once against the full encode: a capture that would differ
        # (a bug here, or a tree this module does not model) costs speed, never a wrong skeleton.
        again = template.capture(tree)
        if again is None or again.skeleton() != skeleton or not _same_tensors(again.tensors, first.tensors):
            logger.debug("state tree not cacheable; it is encoded in full at every save")
            return None, first
        return template, first

    def capture(self, tree: object) -> Captured | None:
        """Check ``tree`` against the template and collect its tensors and leaves (None: it
        changed: a key, a container, a tensor's dtype, shape or kind differ).

        Raises:
            UnsupportedStateError: a part of the tree encoded in full (numpy leaves, Counters...)
                holds what the codec refuses.
        """
        tensors: list[torch.Tensor] = []
        slots: list[Any] = []
        try:
            self._capture(tree, tensors, slots)
        except _Changed:
            return None
        if len(tensors) != len(self.names):
            return None
        nbytes = self.nbytes if self._sized else sum(t.numel() * t.element_size() for t in tensors)
        captured = Captured(self.names, tensors, slots, self._build, nbytes=nbytes, sized=self._sized)
        # The leaves' bound is a few hundred slots' len(); only a save whose strings could
        # outgrow the manifest builds its skeleton here to measure it exactly.
        if self._base + sum(map(_leaf_bound, slots)) > limits.TREE_BYTES:
            check_room(captured.skeleton())
        return captured


class EncodingCache:
    """``codec.encode`` for the saves of one writer, through the template of the last tree seen.

    Example:
        >>> cache = EncodingCache()
        >>> cache.encode({"w": torch.zeros(1)}).names
        ('w',)
    """

    def __init__(self) -> None:
        self._template: TreeTemplate | None = None
        self.rebuilds = 0  # full encodes so far (a check for tests and benchmarks)

    @property
    def template(self) -> TreeTemplate | None:
        """The template the next save is checked against (None before the first)."""
        return self._template

    def encode(self, tree: object) -> Captured:
        """The encoding of ``tree``: captured through the template when it still fits, else
        encoded in full (and the template rebuilt).

        Raises:
            UnsupportedStateError: a leaf or key the codec cannot store.
        """
        if self._template is not None:
            captured = self._template.capture(tree)
            if captured is not None:
                return captured
        self.rebuilds += 1
        self._template, captured = TreeTemplate.of(tree)
        return captured


def check_room(skeleton: JsonValue) -> int:
    """Refuse a skeleton no manifest reader would parse (``limits``); its JSON bytes.

    Raises:
        UnsupportedStateError: deeper than ``limits.JSON_DEPTH`` or larger than
            ``limits.TREE_BYTES``; names the largest string leaf and what to do.
    """
    depth = limits.json_depth(skeleton)
    if depth > limits.JSON_DEPTH:
        raise UnsupportedStateError(
            f"the state's skeleton nests {depth} JSON levels deep (tuples and int-keyed dicts take two or "
            f"three each), more than the {limits.JSON_DEPTH} a manifest reader accepts; flatten the state",
            path="<root>",
            type_name="dict",
        )
    size = limits.json_size(skeleton)
    if size > limits.TREE_BYTES:
        where, length = _largest_str(skeleton)
        raise UnsupportedStateError(
            f"the state's non-tensor values take {size} bytes of JSON, more than the {limits.TREE_BYTES} a manifest "
            f"holds for them (every reader refuses a manifest over {limits.MANIFEST_BYTES} bytes); the largest is "
            f"a str of {length} characters at {where!r}. Store large data as a tensor (a str s: "
            "torch.frombuffer(bytearray(s.encode()), dtype=torch.uint8)) or in a file of your own",
            path=where,
            type_name="str",
        )
    return size


def _largest_str(skeleton: Any) -> tuple[str, int]:
    best: tuple[str, int] = ("<root>", 0)
    stack: list[tuple[Any, str]] = [(skeleton, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if len(k) > best[1]:
                    best = (f"{path}/{k[:40]}", len(k))
                stack.append((v, f"{path}/{k[:40]}"))
        elif isinstance(node, list):
            stack.extend((v, f"{path}/{i}") for i, v in enumerate(node))
        elif isinstance(node, str) and len(node) > best[1]:
            best = (path or "<root>", len(node))
    return best


def _leaf_bound(leaf: Any) -> int:
    """At least the JSON bytes a captured leaf adds to the template's skeleton: a str escapes
    to at most 12 bytes a character (a non-BMP one as two \\u escapes), an int beyond int64 is
    a hex string, a fragment of a node encoded in full is measured."""
    kind = type(leaf)
    if kind is str:
        return 12 * len(leaf) + 2
    if kind is int:
        return int(leaf.bit_length()) // 3 + 24
    if kind is tuple:
        return sum(map(_leaf_bound, leaf)) + len(leaf) + 16
    if kind is dict or kind is list:
        return limits.json_size(leaf)
    return 40  # None, bool, a float (a tagged one included)


def _same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.data_ptr() == y.data_ptr() and x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
        for x, y in zip(a, b, strict=True)
    )


# --- compiling --------------------------------------------------------------------------------


def _compile(obj: Any, node: Any, path: tuple[str, ...], opaque: list[str]) -> _Node:
    kind = type(obj)
    if kind in _SCALARS:
        return _scalar, _build_scalar, None
    if kind in _TENSORS and isinstance(node, dict) and "$tensor" in node:
        return _tensor(obj, node)
    if kind is np.ndarray and isinstance(node, dict) and "$ndarray" in node:
        return _ndarray(obj, node)
    if kind in (list, tuple):
        if all(type(v) in _SCALARS for v in obj):
            return _scalar_seq(kind)
        return _seq(kind, obj, node, path, opaque)
    if kind is dict or kind is OrderedDict:
        if kind is OrderedDict and hasattr(obj, "_metadata") and isinstance(node, dict) and "$state_dict" in node:
            return _state_dict(obj, node, path, opaque)
        inner = node["$ordered_dict"] if kind is OrderedDict and isinstance(node, dict) else node
        mapped = _mapping(kind, obj, inner, path, opaque)
        if mapped is not None:
            if kind is dict:
                return mapped
            cap, build, _ = mapped
            return _has_no_metadata(cap), (lambda it: {"$ordered_dict": build(it)}), None
    return _opaque(obj, path, opaque)


def _scalar(o: Any, _tensors: list[torch.Tensor], slots: list[Any]) -> None:
    if type(o) not in _SCALARS:
        raise _Changed
    slots.append(o)


def _build_scalar(it: Iterator[Any]) -> Any:
    return codec.encode_scalar(next(it))


def _tensor_ok(o: Any, dtype: torch.dtype, shape: torch.Size) -> bool:
    return (
        type(o) in _TENSORS
        and o.dtype is dtype
        and o.shape == shape
        and o.layout is _STRIDED
        and not o.is_meta
        and not o.is_conj()
        and not o.is_neg()
    )


def _tensor(obj: torch.Tensor, node: dict[str, Any]) -> _Node:
    spec = (obj.dtype, obj.shape, node["$tensor"], node["dtype"], tuple(node["shape"]))

    def cap(o: Any, tensors: list[torch.Tensor], _slots: list[Any]) -> None:
        if not _tensor_ok(o, spec[0], spec[1]):
            raise _Changed
        tensors.append(o)  # as found: see Captured.tensors

    return cap, lambda _it: _tensor_node(spec), spec


def _tensor_node(spec: tuple[Any, ...]) -> dict[str, Any]:
    return {"$tensor": spec[2], "dtype": spec[3], "shape": list(spec[4])}


def _ndarray(obj: np.ndarray, node: dict[str, Any]) -> _Node:
    """A numpy array of fixed dtype and shape: numpy's RNG key (``np.random.get_state``), in
    every TrainState. Modelled so that such a tree stays sized (see ``Captured.sized``): encoded
    in full, it cost a full encode of its subtree and every per-tensor check downstream."""
    key, dtype_str, shape = node["$ndarray"], node["dtype"], obj.shape

    def cap(o: Any, tensors: list[torch.Tensor], _slots: list[Any]) -> None:
        # Only the codec's plain case (torch.from_numpy of the array itself): an array it would
        # copy first takes the full encode.
        if type(o) is not np.ndarray or o.dtype.str != dtype_str or o.shape != shape or not codec.from_numpy_as_is(o):
            raise _Changed
        tensors.append(torch.from_numpy(o))  # shares the array's memory, as the codec's does

    # Not a tensor spec (None): a mapping of these takes the general capture, not the module loop.
    return cap, lambda _it: {"$ndarray": key, "dtype": dtype_str, "shape": list(shape)}, None


def _scalar_seq(kind: Any) -> _Node:
    def cap(o: Any, _tensors: list[torch.Tensor], slots: list[Any]) -> None:
        # Any length: the values are the leaves. tuple(): a list may change after save().
        if type(o) is not kind or not _SCALARS.issuperset(map(type, o)):
            raise _Changed
        slots.append(tuple(o))

    def build(it: Iterator[Any]) -> Any:
        items = [codec.encode_scalar(v) for v in next(it)]
        return items if kind is list else {"$tuple": items}

    return cap, build, None


def _seq(kind: Any, obj: list[Any] | tuple[Any, ...], node: Any, path: tuple[str, ...], opaque: list[str]) -> _Node:
    items = node if kind is list else node["$tuple"]
    children = [_compile(v, items[i], (*path, str(i)), opaque) for i, v in enumerate(obj)]
    caps = tuple(c for c, _, _ in children)
    builds = tuple(b for _, b, _ in children)
    n = len(obj)

    def cap(o: Any, tensors: list[torch.Tensor], slots: list[Any]) -> None:
        if type(o) is not kind or len(o) != n:
            raise _Changed
        for c, v in zip(caps, o, strict=True):
            c(v, tensors, slots)

    def build(it: Iterator[Any]) -> Any:
        out = [b(it) for b in builds]
        return out if kind is list else {"$tuple": out}

    return cap, build, None


def _mapping(kind: Any, obj: dict[Any, Any], node: Any, path: tuple[str, ...], opaque: list[str]) -> _Node | None:
    """A dict (or OrderedDict) of fixed keys: str keys (a plain JSON object) or scalar keys other
    than floats (a ``$dict``). None: not modelled (float keys: -0.0 == 0.0, nan != nan)."""
    keys = tuple(obj)
    types = tuple(type(k) for k in keys)
    plain = isinstance(node, dict) and "$dict" not in node
    if not plain and (float in types or not isinstance(node, dict)):
        return None
    children = [
        _compile(v, node[k] if plain else node["$dict"][i][1], (*path, codec.path_component(k)), opaque)
        for i, (k, v) in enumerate(obj.items())
    ]
    n = len(keys)
    specs = [spec for _, _, spec in children]
    builds = tuple(b for _, b, _ in children)
    if n and all(s is not None for s in specs):
        cap = _tensor_values(kind, keys, types, tuple(specs))  # a module's state: one loop, no calls
    elif n and all(type(v) in _SCALARS for v in obj.values()):
        cap = _scalar_values(kind, keys, types)  # e.g. {"version": 1}: one slot for the values
        scalar_build = _build_scalars(keys, plain)
        return cap, scalar_build, None
    else:
        caps = tuple(c for c, _, _ in children)

        def cap(o: Any, tensors: list[torch.Tensor], slots: list[Any]) -> None:
            if type(o) is not kind or len(o) != n or tuple(o) != keys or tuple(map(type, o)) != types:
                raise _Changed
            for c, v in zip(caps, o.values(), strict=True):
                c(v, tensors, slots)

    if plain:
        pairs = tuple(zip(keys, builds, strict=True))
        return cap, (lambda it: {k: b(it) for k, b in pairs}), None
    pairs = tuple(zip(keys, builds, strict=True))
    return cap, (lambda it: {"$dict": [[codec.encode_scalar(k), b(it)] for k, b in pairs]}), None


def _tensor_values(kind: Any, keys: tuple[Any, ...], types: tuple[type, ...], specs: tuple[Any, ...]) -> _Capture:
    n = len(keys)
    plain = torch.Tensor

    def cap(o: Any, tensors: list[torch.Tensor], _slots: list[Any]) -> None:
        if type(o) is not kind or len(o) != n or tuple(o) != keys or tuple(map(type, o)) != types:
            raise _Changed
        append = tensors.append
        for v, spec in zip(o.values(), specs, strict=True):
            # _tensor_ok() inline: this loop runs over every tensor of a module's state.
            kind_v = type(v)
            if (
                (kind_v is not plain and kind_v is not _PARAMETER)
                or v.dtype is not spec[0]
                or v.shape != spec[1]
                or v.layout is not _STRIDED
                or v.is_meta
                or v.is_conj()
                or v.is_neg()
            ):
                raise _Changed
            append(v)  # as found (no detach per parameter): see Captured.tensors

    return cap


def _scalar_values(kind: Any, keys: tuple[Any, ...], types: tuple[type, ...]) -> _Capture:
    n = len(keys)

    def cap(o: Any, _tensors: list[torch.Tensor], slots: list[Any]) -> None:
        if type(o) is not kind or len(o) != n or tuple(o) != keys or tuple(map(type, o)) != types:
            raise _Changed
        values = tuple(o.values())
        if not _SCALARS.issuperset(map(type, values)):
            raise _Changed
        slots.append(values)

    return cap


def _build_scalars(keys: tuple[Any, ...], plain: bool) -> _Build:
    enc = codec.encode_scalar

    def build(it: Iterator[Any]) -> Any:
        values = next(it)
        if plain:
            return {k: enc(v) for k, v in zip(keys, values, strict=True)}
        return {"$dict": [[enc(k), enc(v)] for k, v in zip(keys, values, strict=True)]}

    return build


def _has_no_metadata(inner: _Capture) -> _Capture:
    def cap(o: Any, tensors: list[torch.Tensor], slots: list[Any]) -> None:
        if hasattr(o, "_metadata"):
            raise _Changed
        inner(o, tensors, slots)

    return cap


def _state_dict(obj: OrderedDict[Any, Any], node: dict[str, Any], path: tuple[str, ...], opaque: list[str]) -> _Node:
    mapped = _mapping(OrderedDict, obj, node["$state_dict"], path, opaque)
    if mapped is None:
        return _opaque(obj, path, opaque)
    inner_cap, inner_build, _ = mapped
    meta_cap, meta_build, _ = _compile(obj._metadata, node["metadata"], (*path, "#_metadata"), opaque)  # type: ignore[attr-defined]

    def cap(o: Any, tensors: list[torch.Tensor], slots: list[Any]) -> None:
        meta = getattr(o, "_metadata", _Changed)
        if meta is _Changed:
            raise _Changed
        inner_cap(o, tensors, slots)
        meta_cap(meta, tensors, slots)

    def build(it: Iterator[Any]) -> Any:
        inner = inner_build(it)
        return {"$state_dict": inner, "metadata": meta_build(it)}

    return cap, build, None


def _opaque(obj: Any, path: tuple[str, ...], opaque: list[str]) -> _Node:
    """A node this module does not model (numpy scalars, Counters, deques...): encoded in full at
    every save, its tensors' paths checked against the template's."""
    first, fragment0 = codec.encode_subtree(obj, path)
    names = tuple(first)
    depth = limits.json_depth(fragment0) + 1  # a leaf tagged later nests one level deeper
    opaque.extend(names)

    def cap(o: Any, tensors: list[torch.Tensor], slots: list[Any]) -> None:
        found, fragment = codec.encode_subtree(o, path)
        # A deeper fragment takes the full encode, which measures the whole skeleton's depth.
        if tuple(found) != names or limits.json_depth(fragment) > depth:
            raise _Changed
        tensors.extend(found.values())
        slots.append(fragment)

    return cap, lambda it: next(it), None
