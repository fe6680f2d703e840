"""The one rule for what a save's ``metrics`` and ``extra`` may hold, and how they are stored.

``user_fields`` checks them when a save is asked for; ``Metric`` and ``decode_extra`` /
``encode_extra`` are how the manifest stores them (nan and inf tagged as ``{"$float": ...}``).
The manifest's other fields and the state tree (the codec's) do not belong here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BeforeValidator, JsonValue, PlainSerializer, WithJsonSchema

from ckptsdk.errors import ConfigError
from ckptsdk.format.document import FLOAT_FORM, decode_float, encode_float

__all__ = ["Metric", "Scalar", "decode_extra", "encode_extra", "user_fields"]

#: A scalar that metrics and extra hold, as the manifest stores it.
Scalar = bool | int | float | str | None

_USER_RULE = (
    "metrics and extra hold None, bool, int, float (nan and inf included), str, and numpy "
    "scalars or 0-d tensors (kept as their Python value); extra also holds lists and "
    "str-keyed dicts of these"
)


def user_fields(
    *, metrics: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None
) -> tuple[dict[str, Scalar], dict[str, JsonValue]]:
    """Check a save's ``metrics`` and ``extra`` against the one rule both follow; plain copies.

    The rule (also the manifest's): None, bool, int, float (nan and inf included: stored tagged,
    restored exactly), str; numpy scalars and 0-d tensors become their Python value; ``extra``
    may also nest lists and dicts with str keys (not starting with '$', which tags floats).

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
    return out[0], out[1]


def _user_key(key: Any, where: str) -> str:
    if type(key) is not str or key.startswith("$"):
        raise ConfigError(f"{where} has the key {key!r}: keys are str not starting with '$'; {_USER_RULE}")
    return key


def _user_value(value: Any, where: str, nested: bool) -> Any:
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
