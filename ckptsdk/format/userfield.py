"""The one rule for what a save's ``metrics`` and ``extra`` may hold, and how they are stored.

``user_fields`` checks them when a save is asked for; ``Metric`` and ``decode_extra`` /
``encode_extra`` are how the manifest stores them (nan and inf tagged as ``{"$float": ...}``).
The manifest's other fields and the state tree (the codec's) do not belong here.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BeforeValidator, JsonValue, PlainSerializer, WithJsonSchema

from ckptsdk.errors import ConfigError
from ckptsdk.format import limits
from ckptsdk.format.document import FLOAT_FORM, decode_float, encode_float

__all__ = ["Metric", "Scalar", "decode_extra", "encode_extra", "extra_value", "user_fields"]

#: A scalar that metrics and extra hold, as the manifest stores it.
Scalar = bool | int | float | str | None

_USER_RULE = (
    "metrics and extra hold None, bool, int, float (nan and inf included), str, and numpy "
    "scalars or 0-d tensors (kept as their Python value); extra also holds lists and "
    "str-keyed dicts of these"
)


def user_fields(
    *,
    metrics: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    tags: Mapping[str, str] | None = None,
) -> tuple[dict[str, Scalar], dict[str, JsonValue]]:
    """Check a save's ``metrics`` and ``extra`` against the one rule both follow; plain copies.

    The rule (also the manifest's): None, bool, int, float (nan and inf included: stored tagged,
    restored exactly), str; numpy scalars and 0-d tensors become their Python value; ``extra``
    may also nest lists and dicts with str keys (not starting with '$', which tags floats). What
    every reader can read back (``limits``): a metric int within a float's range (metrics are
    ranked as numbers), an int in ``extra`` of at most 4,000 digits, ``extra`` nested at most
    ``limits.JSON_DEPTH`` deep, and metrics, extra and ``tags`` (str -> str) together at most
    ``limits.USER_BYTES`` of JSON.

    Raises:
        ConfigError: a value outside the rule; names the field, the key and the type.

    Example:
        >>> import numpy as np
        >>> user_fields(metrics={"loss": np.float32(0.5)}, extra={"seen": [1, 2]})
        ({'loss': 0.5}, {'seen': [1, 2]})
    """
    out: list[dict[str, Any]] = []
    for field, values, nested in (("metrics", metrics, False), ("extra", extra, True)):
        if values is None:
            out.append({})
            continue
        if not isinstance(values, Mapping):
            raise ConfigError(f"{field} must be a dict, got a {type(values).__name__}")
        out.append({_user_key(k, field): _user_value(v, f"{field}[{k!r}]", nested) for k, v in values.items()})
    for name, value in out[0].items():
        if type(value) is int and not _FLOAT_MIN <= value <= _FLOAT_MAX:
            raise ConfigError(
                f"metrics[{name!r}] is an int of {len(str(value))} digits, beyond what a float holds: metrics "
                "are ranked as numbers (keep_best, best()); store it in extra, or as float('inf') if it means that"
            )
    _check_room(out[0], out[1], _user_tags(tags))
    return out[0], out[1]


def extra_value(value: Any, where: str = "extra") -> JsonValue:
    """One entry of ``extra`` as ``save()`` keeps it, under the same rule as :func:`user_fields`
    (nan and inf included): for a caller that sorts values before a save (``ckptsdk import``
    puts a file's leftover entries in ``extra`` when this accepts them).

    Raises:
        ConfigError: a value outside the rule, or nested deeper than ``limits.JSON_DEPTH``.

    Example:
        >>> extra_value({"best": float("nan"), "seen": [1, 2]})
        {'best': nan, 'seen': [1, 2]}
    """
    depth = limits.json_depth(value)  # iterative: measured before the recursive check below
    if depth > limits.JSON_DEPTH:
        raise ConfigError(
            f"{where} nests {depth} levels deep, more than the {limits.JSON_DEPTH} a manifest reader accepts"
        )
    checked: JsonValue = _user_value(value, where, True)
    return checked


# The largest finite float, as an int: a metric beyond it cannot be ranked with the others.
_FLOAT_MAX = int(sys.float_info.max)
_FLOAT_MIN = -_FLOAT_MAX
# Python refuses to convert ints of more than 4,300 digits to or from text (JSON included); 13,000
# bits are at most 3,914 digits.
_INT_BITS = 13_000


def _user_tags(tags: Mapping[str, str] | None) -> dict[str, str]:
    if tags is None:
        return {}
    if not isinstance(tags, Mapping):
        raise ConfigError(f"tags must be a dict of str -> str, got a {type(tags).__name__}")
    for k, v in tags.items():
        if type(k) is not str or type(v) is not str:
            raise ConfigError(f"tags[{k!r}] = {v!r:.40}: tags are str -> str (e.g. {{'data_hash': '...'}})")
    return dict(tags)


def _check_room(metrics: dict[str, Any], extra: dict[str, Any], tags: dict[str, str]) -> None:
    # The manifest must stay one a reader parses (limits.py): refused here, before anything is
    # written, rather than committed and then skipped by every restore.
    depth = limits.json_depth(extra)
    if depth > limits.JSON_DEPTH:
        raise ConfigError(
            f"extra nests {depth} levels deep, more than the {limits.JSON_DEPTH} a manifest reader accepts; "
            "flatten it, or keep it in the state (an object of your own in the TrainState)"
        )
    size = limits.json_size({"metrics": encode_extra(metrics), "extra": encode_extra(extra), "tags": tags})
    if size > limits.USER_BYTES:
        sizes = {
            name: limits.json_size(encode_extra(value))
            for name, value in (("metrics", metrics), ("extra", extra), ("tags", tags))
        }
        raise ConfigError(
            f"metrics, extra and tags take {size} bytes of JSON ({', '.join(f'{k} {v}' for k, v in sizes.items())}), "
            f"more than the {limits.USER_BYTES} a manifest holds for them (every reader refuses a manifest over "
            f"{limits.MANIFEST_BYTES} bytes). They are for a job's numbers and names; keep large data in the state "
            "(a uint8 tensor: torch.frombuffer(bytearray(data), dtype=torch.uint8)) or in a file of your own"
        )


def _user_key(key: Any, where: str) -> str:
    if type(key) is not str or key.startswith("$"):
        raise ConfigError(f"{where} has the key {key!r}: keys are str not starting with '$'; {_USER_RULE}")
    return key


def _user_value(value: Any, where: str, nested: bool) -> Any:
    if type(value) is int and value.bit_length() > _INT_BITS:
        raise ConfigError(
            f"{where} is an int of {value.bit_length()} bits: JSON readers refuse ints of more than 4,300 digits; "
            "store it as a hex str (hex(x)) or in the state"
        )
    if value is None or type(value) in (bool, int, float, str):
        return value
    shape = getattr(value, "shape", None)
    if shape is not None and tuple(shape) == () and callable(getattr(value, "item", None)):
        return _user_value(value.item(), where, False)  # np.int64(3), torch.tensor(0.5)
    if nested and type(value) is dict:
        return {_user_key(k, where): _user_value(v, f"{where}[{k!r}]", True) for k, v in value.items()}
    if nested and type(value) is list:
        return [_user_value(v, f"{where}[{i}]", True) for i, v in enumerate(value)]
    kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    size = f" of shape {tuple(shape)}" if shape is not None else ""
    raise ConfigError(
        f"{where} is a {kind}{size}: {_USER_RULE}. Convert it (x.item() for a "
        "scalar, x.tolist() for an array, list(x) for a tuple)"
    )


def decode_extra(value: object) -> object:
    """Stored ``extra`` JSON back to values: ``{"$float": ...}`` tags become floats.

    Example:
        >>> decode_extra({"x": [{"$float": "nan"}, 1]})
        {'x': [nan, 1]}
    """
    if isinstance(value, dict):
        if set(value) == {"$float"}:
            return decode_float(value)
        return {k: decode_extra(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_extra(v) for v in value]
    return value


def encode_extra(value: object) -> object:
    """``extra`` values as strict JSON: floats JSON cannot hold become ``{"$float": ...}`` tags.

    Example:
        >>> encode_extra({"x": [float("inf"), 0.5]})
        {'x': [{'$float': 'inf'}, 0.5]}
    """
    if type(value) is float:
        return encode_float(value)
    if isinstance(value, dict):
        return {k: encode_extra(v) for k, v in value.items()}
    if isinstance(value, list):
        return [encode_extra(v) for v in value]
    return value


def _metric_in(value: Any) -> Any:
    if isinstance(value, dict):
        return decode_float(value)
    # numpy scalars and 0-d tensors (a loss) are accepted as their Python value.
    if not isinstance(value, (bool, int, float, str, type(None))) and callable(getattr(value, "item", None)):
        return value.item()
    return value


def _metric_out(value: Scalar) -> Any:
    return encode_float(value) if type(value) is float else value


#: One metric value: read from a number or a ``{"$float": ...}`` tag, written as JSON can hold it.
Metric = Annotated[
    Scalar,
    BeforeValidator(_metric_in),
    PlainSerializer(_metric_out, when_used="json"),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": ["boolean", "integer", "number", "string", "null"]},
                {
                    "type": "object",
                    "properties": {"$float": {"type": "string", "pattern": FLOAT_FORM}},
                    "required": ["$float"],
                    "additionalProperties": False,
                    "description": "nan, inf, -inf, -0.0 or a nan's 16 hex digit bit pattern",
                },
            ]
        }
    ),
]
