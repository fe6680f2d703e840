"""The state skeleton's format: its tags, its checks without the tensors, and its JSON Schema.

The vocabulary (``TAGS``, defaultdict ``FACTORIES``, ``MAX_DEPTH``, ``tag_of``) is what the codec
writes and reads; ``tensor_paths`` is what parsing a manifest runs; ``skeleton_schema`` states the
same rules for docs/manifest.schema.json (tests/format/test_schema_agreement.py keeps them in step).
Encoding and decoding belong to codec.py. No torch here: a manifest is checked without it.
"""

from __future__ import annotations

import re
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import Any

from pydantic import JsonValue

from ckptsdk.errors import ManifestError
from ckptsdk.format.document import FLOAT_FORM
from ckptsdk.format.dtype import NAMES

__all__ = ["FACTORIES", "MAX_DEPTH", "TAGS", "skeleton_schema", "tag_of", "tensor_nodes", "tensor_paths"]

#: Deepest nesting accepted; deeper trees are almost surely a mistake and would hit Python's
#: recursion limit in json as well.
MAX_DEPTH = 200
#: Every tag a skeleton node may carry (docs/FORMAT.md, "The skeleton").
TAGS = (
    "$tensor",
    "$ndarray",
    "$tuple",
    "$dict",
    "$float",
    "$int",
    "$npscalar",
    "$state_dict",
    "$ordered_dict",
    "$counter",
    "$defaultdict",
    "$deque",
)
#: The defaultdict factories a skeleton may name, by the name it stores. A factory is stored by
#: name (never pickled), so only these are known.
FACTORIES: dict[str, Callable[[], Any] | None] = {
    "None": None,
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "list": list,
    "dict": dict,
    "tuple": tuple,
    "set": set,
    "frozenset": frozenset,
    "collections.OrderedDict": OrderedDict,
    "collections.Counter": Counter,
    "collections.deque": deque,
}

# The plain fields each tag carries besides itself ($npscalar: "value" or "hex").
_TAG_FIELDS: dict[str, set[str]] = {
    "$tensor": {"dtype", "shape"},
    "$ndarray": {"dtype", "shape"},
    "$tuple": set(),
    "$dict": set(),
    "$float": set(),
    "$int": set(),
    "$npscalar": set(),
    "$state_dict": {"metadata"},
    "$ordered_dict": set(),
    "$counter": set(),
    "$defaultdict": {"factory"},
    "$deque": {"maxlen"},
}
# Forms of the string fields, shared by the parser and the JSON Schema (one home each).
_NUMPY_DTYPE = r"^[<>|=][biufc][0-9]+$"  # numpy's dtype.str of a numeric dtype
_HEX_BYTES = r"^([0-9a-f]{2})*$"
# The sizes numpy has for each numeric kind, so that parsing a manifest (every `ckptsdk ls`) needs
# no numpy. f16/c32 are long double: where a numpy build lacks them, decoding fails, as damage.
# tests/cli/test_cli_imports.py holds this table to numpy's own answer.
_NUMPY_SIZES = {"b": (1,), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8, 16), "c": (8, 16, 32)}
_SCALAR_FORMS = {"$float": FLOAT_FORM, "$int": r"^-?0x[0-9a-f]+$"}


def tag_of(node: dict[Any, Any]) -> str | None:
    """The tag of a dict node, or None for a plain mapping.

    Raises:
        ManifestError: more than one ``$`` key, or one that is not a known tag.

    Example:
        >>> tag_of({"$tuple": [1]}), tag_of({"a": 1})
        ('$tuple', None)
    """
    tags = [k for k in node if isinstance(k, str) and k.startswith("$")]
    if not tags:
        return None
    if len(tags) != 1 or tags[0] not in TAGS:
        raise ManifestError(f"state skeleton has an unknown node {sorted(map(str, node))!r}")
    return tags[0]


def tensor_paths(skeleton: JsonValue) -> list[str]:
    """Every tensor path a skeleton references, in tree order (no tensors needed).

    Also checks the shape of every tagged node (its fields and their types: the rules
    ``skeleton_schema()`` states for docs/manifest.schema.json), so a malformed skeleton is
    refused when its manifest is parsed, not half-way through a restore.

    Raises:
        ManifestError: the skeleton is malformed.

    Example:
        >>> tensor_paths({"w": {"$tensor": "w", "dtype": "float32", "shape": [2]}, "t": {"$tuple": [1]}})
        ['w']
    """
    found: list[str] = []

    def bad(tag: str, why: str) -> ManifestError:
        return ManifestError(f"state skeleton has a malformed {tag} node: {why}")

    def visit(node: Any, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise ManifestError(f"state skeleton nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, list):
            for item in node:
                visit(item, depth + 1)
            return
        if not isinstance(node, dict):
            return
        tag = tag_of(node)
        if tag is None:
            for item in node.values():
                visit(item, depth + 1)
            return
        fields = _TAG_FIELDS[tag]
        if tag == "$npscalar":
            fields = {"value"} if "value" in node else {"hex"}
        if set(node) != {tag, *fields}:
            raise bad(tag, f"fields {sorted(node)} (expected {sorted({tag, *fields})})")
        value = node[tag]
        if tag in ("$tensor", "$ndarray"):
            if not isinstance(value, str):
                raise ManifestError(f"state skeleton has a {tag} node whose path is not a str")
            shape = node["shape"]
            if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
                raise bad(tag, f"shape {shape!r} is not a list of ints >= 0")
            names = NAMES if tag == "$tensor" else None
            if not _dtype_ok(node["dtype"], names):
                raise bad(tag, f"unknown dtype {node['dtype']!r}")
            found.append(value)
        elif tag in ("$tuple", "$deque"):
            if not isinstance(value, list):
                raise bad(tag, "it must hold a list")
            if tag == "$deque" and not (
                node["maxlen"] is None or (type(node["maxlen"]) is int and node["maxlen"] >= 0)
            ):
                raise bad(tag, "maxlen must be an int >= 0 or null")
            visit(value, depth + 1)
        elif tag == "$dict":
            if not (isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value)):
                raise ManifestError("state skeleton has a $dict node without [key, value] pairs")
            for pair in value:
                visit(pair, depth + 1)
        elif tag in ("$state_dict", "$ordered_dict", "$counter", "$defaultdict"):
            if not isinstance(value, dict):
                raise bad(tag, "it must hold a dict node")
            if tag == "$defaultdict" and node["factory"] not in FACTORIES:
                raise bad(tag, f"unknown factory {node['factory']!r}")
            visit(value, depth + 1)
            if tag == "$state_dict":
                visit(node["metadata"], depth + 1)
        elif tag == "$npscalar":
            if not _dtype_ok(value, None):
                raise bad(tag, f"unknown dtype {value!r}")
            if "hex" in node and not (isinstance(node["hex"], str) and re.fullmatch(_HEX_BYTES, node["hex"])):
                raise bad(tag, "hex must be an even number of lowercase hex digits")
            if "value" in node:
                visit(node["value"], depth + 1)
        else:  # $float, $int: a str of a fixed form
            if not (isinstance(value, str) and re.fullmatch(_SCALAR_FORMS[tag], value)):
                raise bad(tag, f"{value!r} is not of the form {_SCALAR_FORMS[tag]}")

    visit(skeleton, 0)
    return found


def tensor_nodes(skeleton: JsonValue) -> dict[str, dict[str, Any]]:
    """Every ``$tensor`` node of a skeleton that ``tensor_paths`` accepted, by its path.

    Example:
        >>> tensor_nodes({"w": {"$tensor": "w", "dtype": "float32", "shape": [2]}, "t": {"$tuple": [1]}})
        {'w': {'$tensor': 'w', 'dtype': 'float32', 'shape': [2]}}
    """
    found: dict[str, dict[str, Any]] = {}
    stack: list[Any] = [skeleton]
    while stack:  # depth-first; the order is not part of the answer
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if isinstance(node.get("$tensor"), str):
                found[node["$tensor"]] = node
            else:
                stack.extend(node.values())
    return found


def skeleton_schema(ref: str) -> dict[str, Any]:
    """The JSON Schema of one skeleton node, as strict as ``tensor_paths`` (which parsing runs).

    Args:
        ref: the ``$ref`` under which the caller stores this schema (it is recursive).
    """
    node = {"$ref": ref}
    shape = {"type": "array", "items": {"type": "integer", "minimum": 0}}

    def tagged(tag: str, held: Any, **fields: Any) -> dict[str, Any]:
        props = {tag: held, **fields}
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}

    mapping = {"type": "object"}  # a dict node: a plain object or a $dict
    return {
        "description": "a node of the state skeleton (docs/FORMAT.md): plain JSON, or an object "
        "with exactly one '$' tag",
        "anyOf": [
            {"type": ["null", "boolean", "number", "string"]},
            {"type": "array", "items": node},
            {"type": "object", "propertyNames": {"not": {"pattern": "^\\$"}}, "additionalProperties": node},
            tagged("$tensor", {"type": "string"}, dtype={"enum": sorted(NAMES)}, shape=shape),
            tagged("$ndarray", {"type": "string"}, dtype={"type": "string", "pattern": _NUMPY_DTYPE}, shape=shape),
            tagged("$tuple", {"type": "array", "items": node}),
            tagged(
                "$deque",
                {"type": "array", "items": node},
                maxlen={"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0}]},
            ),
            tagged(
                "$dict",
                {
                    "type": "array",
                    "items": {"type": "array", "prefixItems": [node, node], "minItems": 2, "maxItems": 2},
                },
            ),
            tagged("$state_dict", {**mapping, "$ref": ref}, metadata=node),
            tagged("$ordered_dict", {**mapping, "$ref": ref}),
            tagged("$counter", {**mapping, "$ref": ref}),
            tagged("$defaultdict", {**mapping, "$ref": ref}, factory={"enum": sorted(FACTORIES)}),
            tagged("$npscalar", {"type": "string", "pattern": _NUMPY_DTYPE}, value=node),
            tagged(
                "$npscalar", {"type": "string", "pattern": _NUMPY_DTYPE}, hex={"type": "string", "pattern": _HEX_BYTES}
            ),
            tagged("$float", {"type": "string", "pattern": _SCALAR_FORMS["$float"]}),
            tagged("$int", {"type": "string", "pattern": _SCALAR_FORMS["$int"]}),
        ],
    }


def _dtype_ok(text: Any, names: tuple[str, ...] | None) -> bool:
    if names is not None:
        return text in names
    if not (isinstance(text, str) and re.fullmatch(_NUMPY_DTYPE, text)):
        return False
    return int(text[2:]) in _NUMPY_SIZES[text[1]]
