"""Pydantic models of every JSON document ckptsdk writes next to the tensors, and their parsers.

A checkpoint's manifest.json (its commit marker) and the lineage records under lineage/. The
``format`` field is checked before anything else so that a newer major version gives a clear
error, then the document's ``checksum`` (sha256 of its canonical JSON), so that no flipped byte
is ever trusted. Storage and the state codec's internals do not belong here. Regenerate
docs/manifest.schema.json with ``python -m ckptsdk.manifest --schema > docs/manifest.schema.json``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import math
import os
import platform
import re
import socket
import sys
from datetime import datetime, timezone
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic.json_schema import models_json_schema

from .codec import FLOAT_FORM, decode_float, encode_float
from .skeleton import skeleton_schema, tensor_paths
from .errors import ConfigError, ManifestError

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKSUM_FIELD", "FORMAT", "LINEAGE_FORMAT", "Environment", "FileEntry", "LineageRecord", "Manifest",
    "Position", "Writer", "json_schema", "parse_lineage", "parse_manifest", "schema_text", "seal",
    "user_fields", "utc_now",
]

#: What this code writes; it reads any ``/1.x`` (fields of a newer minor version are ignored).
#: 1.1 added the ``checksum`` field; a 1.0 document (written before it) is read with a warning.
FORMAT = "ckptsdk.checkpoint/1.1"
LINEAGE_FORMAT = "ckptsdk.lineage/1.1"
_MAJOR, _MINOR = 1, 1
#: The field holding ``"sha256:<hex>"`` of the document's canonical JSON without that field.
CHECKSUM_FIELD = "checksum"
_CHECKSUM_MINOR = 1  # the first minor version that always carries one
_FORMAT_RE = re.compile(r"(?P<kind>[a-z0-9_.]+)/(?P<major>[0-9]+)(?:\.(?P<minor>[0-9]+))?")
# Rules the JSON Schema states too, one home each (tests/test_manifest.py checks that the schema
# and the parser agree): a relative file name without '.'/'..' components; a UTC time.
_FILE_NAME = r"^(?!\.\.?(/|$))[A-Za-z0-9_.-]+(/(?!\.\.?(/|$))[A-Za-z0-9_.-]+)*$"
_UTC_TIME = (r"^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:"
             r"[0-5][0-9](\.[0-9]{1,6})?(Z|\+00:00)$")
_NODE_REF = "#/$defs/SkeletonNode"
_UTC_FIELD: dict[str, Any] = {"description": "UTC, ISO-8601: 2026-11-30T06:10:00.123456Z",
                              "json_schema_extra": {"pattern": _UTC_TIME}}


def utc_now() -> str:
    """The current time as an ISO-8601 UTC string with microseconds, e.g. ``...T06:10:00.123456Z``."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _check_format(value: Any, expected: str) -> int:
    """Return the minor version of a format string of the expected kind; raise ValueError else."""
    kind = expected.split("/")[0]
    if not isinstance(value, str):
        raise ValueError(f"'format' must be a string like {expected!r}, got {value!r}")
    match = _FORMAT_RE.fullmatch(value)
    if match is None or match["kind"] != kind:
        raise ValueError(f"format {value!r} is not a {kind} document (expected {expected!r})")
    major = int(match["major"])
    if major > _MAJOR:
        raise ValueError(f"format {value!r} was written by a newer ckptsdk (this one reads "
                         f"{kind}/{_MAJOR}.x); upgrade ckptsdk to read it")
    if major < _MAJOR:
        raise ValueError(f"format {value!r} is an older major version this ckptsdk cannot read")
    return int(match["minor"] or 0)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_newer_fields(cls, data: Any, info: ValidationInfo) -> Any:
        # A newer minor version may add fields; only then are unknown ones ignored.
        if isinstance(data, dict) and (info.context or {}).get("lenient"):
            unknown = [k for k in data if k not in cls.model_fields]
            if unknown:
                logger.debug("ignoring fields of a newer format minor version: %s", unknown)
                data = {k: v for k, v in data.items() if k in cls.model_fields}
        return data


def _utc_iso(value: str) -> str:
    if not re.fullmatch(_UTC_TIME, value):
        raise ValueError(f"{value!r} is not in UTC ISO-8601 form like 2026-11-30T06:10:00.123456Z "
                         "(it must end with 'Z' or '+00:00')")
    try:
        datetime.fromisoformat(value)
    except ValueError as exc:  # Feb 30 and the like: the pattern alone cannot tell
        raise ValueError(f"{value!r} is not a valid date and time") from exc
    return value


def _check_finite_json(value: Any, where: str = "extra") -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} holds {value}; JSON has no nan/inf")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite_json(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite_json(v, f"{where}[{i}]")
    return value


_USER_RULE = ("metrics and extra hold None, bool, int, float (nan and inf included), str, and numpy "
              "scalars or 0-d tensors (kept as their Python value); extra also holds lists and "
              "str-keyed dicts of these")


def user_fields(
    *, metrics: Any = None, extra: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Check a save's ``metrics`` and ``extra`` against the one rule both follow; plain copies.

    The rule (also the manifest's): None, bool, int, float (nan and inf included: stored tagged,
    restored exactly), str; numpy scalars and 0-d tensors become their Python value; ``extra``
    may also nest lists and dicts with str keys (not starting with '$', which tags floats).

    Raises:
        ConfigError: a value outside the rule; names the field, the key and the type.
    """
    out = []
    for field, values, nested in (("metrics", metrics, False), ("extra", extra, True)):
        if values is None:
            out.append({})
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{field} must be a dict, got a {type(values).__name__}")
        out.append({_user_key(k, field): _user_value(v, f"{field}[{k!r}]", nested)
                    for k, v in values.items()})
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
    raise ConfigError(f"{where} is a {kind}{size}: {_USER_RULE}. Convert it (x.item() for a "
                      "scalar, x.tolist() for an array, list(x) for a tuple)")


def _extra_in(value: Any) -> Any:
    # The manifest's nan/inf tags ({"$float": ...}) back to floats; '$' keys are otherwise refused.
    if isinstance(value, dict):
        if set(value) == {"$float"}:
            return decode_float(value)
        return {k: _extra_in(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_extra_in(v) for v in value]
    return value


def _extra_out(value: Any) -> Any:
    if type(value) is float:
        return encode_float(value)
    if isinstance(value, dict):
        return {k: _extra_out(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_extra_out(v) for v in value]
    return value


def _metric_in(value: Any) -> Any:
    if isinstance(value, dict):
        return decode_float(value)
    # numpy scalars and 0-d tensors (a loss) are accepted as their Python value.
    if not isinstance(value, (bool, int, float, str, type(None))) and callable(getattr(value, "item", None)):
        return value.item()
    return value


Metric = Annotated[
    bool | int | float | str | None,
    BeforeValidator(_metric_in),
    WithJsonSchema({
        "anyOf": [
            {"type": ["boolean", "integer", "number", "string", "null"]},
            {"type": "object", "properties": {"$float": {"type": "string", "pattern": FLOAT_FORM}},
             "required": ["$float"], "additionalProperties": False,
             "description": "nan, inf, -inf, -0.0 or a nan's 16 hex digit bit pattern"},
        ]
    }),
]


class FileEntry(_Model):
    """One file of a checkpoint, with what a reader verifies before using it."""

    name: str = Field(json_schema_extra={"pattern": _FILE_NAME},
                      description="relative to the checkpoint folder; no '.' or '..' component")
    size: int = Field(ge=0)
    digest: str = Field(pattern=r"^[0-9a-f]+$", description="lowercase hex")
    algorithm: str = Field(min_length=1, description='e.g. "xxh3-128"')

    @field_validator("name")
    @classmethod
    def _no_dot_dirs(cls, value: str) -> str:
        if not re.fullmatch(_FILE_NAME, value):
            raise ValueError(f"file name {value!r} is not a relative name of [A-Za-z0-9_.-] parts "
                             "without '.' or '..' components")
        return value


class Position(_Model):
    """Where in the data the job was: epoch, batch index, and anything the job adds."""

    epoch: int | None = Field(default=None, ge=0)
    batch_idx: int | None = Field(default=None, ge=0)
    extra: dict[str, JsonValue] = Field(
        default_factory=dict,
        description="JSON; a non-finite or negative-zero float is {\"$float\": ...} as in metrics")

    @field_validator("extra", mode="before")
    @classmethod
    def _tagged_floats(cls, value: Any) -> Any:
        return _extra_in(value)

    @field_serializer("extra", when_used="json")
    def _extra_json(self, value: dict[str, Any]) -> dict[str, Any]:
        return _extra_out(value)


class Writer(_Model):
    """Who wrote a checkpoint: run, attempt, lease epoch (the fencing token), host, pid."""

    run_id: str = Field(min_length=1)
    attempt: int = Field(ge=0)
    lease_epoch: int = Field(ge=0)
    host: str
    pid: int = Field(ge=0)
    resumed_from_step: int | None = Field(default=None, ge=0)


class Environment(_Model):
    """Versions and device of the process that wrote a checkpoint (informational)."""

    python: str
    torch: str
    numpy: str
    ckptsdk: str
    platform: str
    device: str
    cuda: str | None = Field(description="the CUDA version torch was built with, if any")

    @classmethod
    def current(cls, device: Any = None) -> Environment:
        """Describe this process. Never initialises CUDA.

        Args:
            device: the training device (``torch.device`` or str); default: the current CUDA
                device when this process initialised CUDA, else ``"cpu"``.
        """
        import numpy
        import torch

        import ckptsdk  # late: ckptsdk/__init__ may be importing this module right now

        if device is None:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                index = torch.cuda.current_device()
                device = f"cuda:{index} ({torch.cuda.get_device_name(index)})"
            else:
                device = "cpu"
        return cls(
            python=platform.python_version(), torch=torch.__version__, numpy=numpy.__version__,
            ckptsdk=ckptsdk.__version__, platform=_platform(), device=str(device),
            cuda=torch.version.cuda,
        )


@functools.lru_cache(maxsize=1)
def _platform() -> str:
    return platform.platform()  # reads the interpreter binary to find libc: once is enough


class Manifest(_Model):
    """A checkpoint's manifest.json: published last, it is what makes a checkpoint exist."""

    format: str = Field(default=FORMAT, pattern=r"^ckptsdk\.checkpoint/1(\.[0-9]+)?$")
    step: int = Field(ge=0)
    position: Position = Field(default_factory=Position)
    created_at: str = Field(default_factory=utc_now, **_UTC_FIELD)
    writer: Writer
    files: list[FileEntry] = Field(json_schema_extra={
        "description": "unique names (JSON Schema cannot say so in general: readers check); at "
                       "most one tensors.safetensors",
        "uniqueItems": True,
        "contains": {"properties": {"name": {"const": "tensors.safetensors"}}, "required": ["name"]},
        "minContains": 0, "maxContains": 1,
    })
    tree: JsonValue = Field(description="the codec skeleton of the state tree (docs/FORMAT.md)")
    metrics: dict[str, Metric] = Field(default_factory=dict)
    environment: Environment
    tags: dict[str, str] = Field(default_factory=dict)

    @field_validator("format", mode="before")
    @classmethod
    def _format_first(cls, value: Any) -> Any:
        _check_format(value, FORMAT)
        return value

    @field_validator("created_at")
    @classmethod
    def _utc(cls, value: str) -> str:
        return _utc_iso(value)

    @field_validator("tree")
    @classmethod
    def _finite_tree(cls, value: Any) -> Any:
        # pydantic would write a bare nan as null; the codec tags them, so one here is a bug.
        return _check_finite_json(value, "tree")

    @field_validator("files")
    @classmethod
    def _unique_names(cls, value: list[FileEntry]) -> list[FileEntry]:
        names = [f.name for f in value]
        if len(set(names)) != len(names):
            raise ValueError(f"file names repeat: {names}")
        return value

    @field_serializer("metrics", when_used="json")
    def _metrics_json(self, value: dict[str, Any]) -> dict[str, Any]:
        return {k: encode_float(v) if type(v) is float else v for k, v in value.items()}

    def file(self, name: str) -> FileEntry:
        """The entry of file ``name``.

        Raises:
            ManifestError: the manifest lists no such file.
        """
        for entry in self.files:
            if entry.name == name:
                return entry
        raise ManifestError(f"checkpoint step {self.step}: the manifest lists no file {name!r} "
                            f"(it has {[f.name for f in self.files]})", step=self.step)

    def to_json(self) -> bytes:
        """The manifest as strict JSON (no NaN/Infinity tokens), UTF-8, ending in a newline.

        Always written as the current format, with its checksum (a parsed older or newer
        minor version is re-written as this one).
        """
        return seal({**self.model_dump(mode="json"), "format": FORMAT})


class LineageRecord(_Model):
    """lineage/epoch-NNNNNN.json: written once per lease takeover, says where it resumed from."""

    format: str = Field(default=LINEAGE_FORMAT, pattern=r"^ckptsdk\.lineage/1(\.[0-9]+)?$")
    epoch: int = Field(ge=0)
    attempt: int = Field(ge=0)
    run_id: str = Field(min_length=1)
    resumed_from_step: int | None = Field(default=None, ge=0)
    resumed_from_epoch: int | None = Field(default=None, ge=0)
    host: str = Field(default_factory=socket.gethostname)
    pid: int = Field(default_factory=os.getpid, ge=0)
    created_at: str = Field(default_factory=utc_now, **_UTC_FIELD)

    @field_validator("format", mode="before")
    @classmethod
    def _format_first(cls, value: Any) -> Any:
        _check_format(value, LINEAGE_FORMAT)
        return value

    @field_validator("created_at")
    @classmethod
    def _utc(cls, value: str) -> str:
        return _utc_iso(value)

    def to_json(self) -> bytes:
        """The record as strict JSON, UTF-8, ending in a newline, with its checksum."""
        return seal({**self.model_dump(mode="json"), "format": LINEAGE_FORMAT})


def _dumps(obj: Any) -> bytes:
    return (json.dumps(obj, allow_nan=False, separators=(",", ":")) + "\n").encode("utf-8")


def _checksum(body: dict[str, Any]) -> str:
    # Canonical form: sorted keys, no spaces, ASCII escapes, Python's shortest float repr. It is
    # computed from the parsed value, so it does not depend on how the bytes were laid out, and
    # json.loads/dumps round-trips every value a model dumps (ints of any size, floats exactly).
    canonical = json.dumps(body, allow_nan=False, sort_keys=True, separators=(",", ":"),
                           ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()


def seal(doc: dict[str, Any]) -> bytes:
    """``doc`` as strict JSON with its ``checksum`` field (re)computed (for writers and tests).

    Example:
        >>> b'"checksum":"sha256:' in seal({"format": LINEAGE_FORMAT, "epoch": 1})
        True
    """
    body = {k: v for k, v in doc.items() if k != CHECKSUM_FIELD}
    return _dumps({**body, CHECKSUM_FIELD: _checksum(body)})


def _check_checksum(obj: dict[str, Any], minor: int, expected: str, where: str) -> str | None:
    """Pop and verify ``obj``'s checksum; return why it fails, or None."""
    given = obj.pop(CHECKSUM_FIELD, None)
    if minor < _CHECKSUM_MINOR:
        if given is not None:
            # A 1.0 writer never wrote one: the format field itself was altered (one bit turns
            # "1.1" into "1.0"), so nothing in this document can be trusted.
            return (f"it says format {obj.get('format')!r}, which has no checksum, but carries "
                    "one: the document was altered")
        logger.warning("%s is a %s document from before checksums (format %r): its content "
                       "cannot be verified; re-save it with this ckptsdk", where.rstrip(": ") or
                       "a document", expected, obj.get("format"))
        return None
    if given is None:
        return f"no {CHECKSUM_FIELD!r} field, which every {expected}.{_CHECKSUM_MINOR}+ document has"
    if not isinstance(given, str) or not given.startswith("sha256:"):
        return f"{CHECKSUM_FIELD!r} is {given!r}, not 'sha256:<hex>'"
    try:
        actual = _checksum(obj)
    except (ValueError, RecursionError) as exc:
        return f"its content cannot be put in canonical form ({exc})"
    if actual != given:
        return f"its checksum is {given} but its content hashes to {actual}"
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON token {name}")


def _parse(data: Any, model: type[_Model], expected: str, key: str) -> Any:
    where = f"{key}: " if key else ""
    if not isinstance(data, (bytes, bytearray, memoryview, str)):
        raise ManifestError(f"{where}expected bytes, got {type(data).__name__}", key=key or None)
    try:
        obj = json.loads(bytes(data) if not isinstance(data, str) else data,
                         parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError included
        raise ManifestError(f"{where}not valid JSON ({exc}); the file is torn or is not a "
                            f"{expected} document", key=key or None) from exc
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}expected a JSON object, got {type(obj).__name__}",
                            key=key or None)
    step = obj.get("step") if type(obj.get("step")) is int else None
    if "format" not in obj:
        raise ManifestError(f"{where}no 'format' field; not a {expected} document",
                            key=key or None, step=step)
    try:
        minor = _check_format(obj["format"], expected)  # first: newer majors may differ in all
    except ValueError as exc:
        raise ManifestError(f"{where}{exc}", key=key or None, step=step) from exc
    # Second: nothing else in the document is looked at before its checksum holds.
    problem = _check_checksum(obj, minor, expected, where)
    if problem is not None:
        raise ManifestError(f"{where}integrity check failed: {problem}. The file was damaged or "
                            "edited; it is not used (restore falls back to an earlier checkpoint)",
                            key=key or None, step=step)
    try:
        return model.model_validate(obj, strict=True, context={"lenient": minor > _MINOR})
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors()]
        listed = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise ManifestError(f"{where}invalid {expected} document: {listed}",
                            key=key or None, step=step) from exc


def parse_manifest(data: bytes, *, key: str = "") -> Manifest:
    """Parse and validate a manifest.json.

    Args:
        data: the file's bytes.
        key: where it came from, for error messages.

    Raises:
        ManifestError: not JSON, wrong or missing fields, an unknown format (a newer major
            version says "upgrade"), or a state skeleton that is malformed. ``.key`` is ``key``.
    """
    manifest = _parse(data, Manifest, FORMAT, key)
    try:
        tensor_paths(manifest.tree)
    except ManifestError as exc:
        raise ManifestError(f"{key + ': ' if key else ''}{exc}", key=key or None,
                            step=manifest.step) from exc
    return manifest


def parse_lineage(data: bytes, *, key: str = "") -> LineageRecord:
    """Parse and validate a lineage record (same rules and errors as ``parse_manifest``)."""
    return _parse(data, LineageRecord, LINEAGE_FORMAT, key)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of manifest.json and lineage records (docs/manifest.schema.json)."""
    _, top = models_json_schema([(Manifest, "validation"), (LineageRecord, "validation")],
                                title="ckptsdk manifest and lineage record")
    top["$defs"]["SkeletonNode"] = skeleton_schema(_NODE_REF)
    tree = top["$defs"]["Manifest"]["properties"]["tree"]
    top["$defs"]["Manifest"]["properties"]["tree"] = {"$ref": _NODE_REF, "description": tree["description"]}
    for name in ("Manifest", "LineageRecord"):  # the parser refuses a document without one
        model = top["$defs"][name]
        model["required"] = ["format", *[f for f in model.get("required", []) if f != "format"]]
        # The checksum is not a model field (it is checked and removed before validation).
        model["properties"][CHECKSUM_FIELD] = {
            "type": "string", "pattern": "^sha256:[0-9a-f]{64}$",
            "description": "sha256 of the document without this field, as JSON with sorted keys, "
                           "no spaces, ASCII escapes (required from minor version 1 on)"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": top.pop("title"),
        "description": "A checkpoint's manifest.json (format ckptsdk.checkpoint/1.1) or a lineage "
                       "record (format ckptsdk.lineage/1.1). Generated by python -m ckptsdk.manifest "
                       "--schema; see docs/FORMAT.md.",
        "oneOf": [{"$ref": "#/$defs/Manifest"}, {"$ref": "#/$defs/LineageRecord"}],
        **top,
    }


def schema_text() -> str:
    """``json_schema()`` as the exact text of docs/manifest.schema.json."""
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m ckptsdk.manifest --schema``: print the JSON Schema."""
    parser = argparse.ArgumentParser(prog="python -m ckptsdk.manifest", description=main.__doc__)
    parser.add_argument("--schema", action="store_true", help="print docs/manifest.schema.json")
    args = parser.parse_args(argv)
    if not args.schema:
        parser.print_help()
        return 2
    sys.stdout.write(schema_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
