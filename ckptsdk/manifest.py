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
import json
import logging
import math
import os
import platform
import re
import socket
import sys
from typing import Annotated, Any, ClassVar

from pydantic import (
    BeforeValidator,
    Field,
    JsonValue,
    WithJsonSchema,
    field_serializer,
    field_validator,
)
from pydantic.json_schema import models_json_schema

from .document import (
    CHECKSUM_FIELD,
    FLOAT_FORM,
    D,
    Document,
    Strict,
    UtcTime,
    check_format,
    check_utc,
    decode_float,
    encode_float,
    parse_document,
    seal,
    utc_now,
)
from .errors import ConfigError, ManifestError
from .skeleton import skeleton_schema, tensor_paths

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
#: The first minor version of both that always carries a checksum.
_CHECKSUM_MINOR = 1
# Rules the JSON Schema states too, one home each (tests/test_manifest.py checks that the schema
# and the parser agree): a relative file name without '.'/'..' components.
_FILE_NAME = r"^(?!\.\.?(/|$))[A-Za-z0-9_.-]+(/(?!\.\.?(/|$))[A-Za-z0-9_.-]+)*$"
_NODE_REF = "#/$defs/SkeletonNode"


_Part = Strict


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
    out: list[dict[str, Any]] = []
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


class FileEntry(_Part):
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


class Position(_Part):
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


class Writer(_Part):
    """Who wrote a checkpoint: run, attempt, lease epoch (the fencing token), host, pid."""

    run_id: str = Field(min_length=1)
    attempt: int = Field(ge=0)
    lease_epoch: int = Field(ge=0)
    host: str
    pid: int = Field(ge=0)
    resumed_from_step: int | None = Field(default=None, ge=0)


class Environment(_Part):
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


class Manifest(Document):
    """A checkpoint's manifest.json: published last, it is what makes a checkpoint exist."""

    FORMAT: ClassVar[str] = FORMAT
    CHECKSUM_SINCE: ClassVar[int | None] = _CHECKSUM_MINOR

    format: str = Field(default=FORMAT, pattern=r"^ckptsdk\.checkpoint/1(\.[0-9]+)?$")
    step: int = Field(ge=0)
    position: Position = Field(default_factory=Position)
    created_at: UtcTime = Field(default_factory=utc_now)
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
        check_format(value, FORMAT)
        return value

    @field_validator("created_at")
    @classmethod
    def _utc(cls, value: str) -> str:
        return check_utc(value)

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



class LineageRecord(Document):
    """lineage/epoch-NNNNNN.json: written once per lease takeover, says where it resumed from."""

    FORMAT: ClassVar[str] = LINEAGE_FORMAT
    CHECKSUM_SINCE: ClassVar[int | None] = _CHECKSUM_MINOR

    format: str = Field(default=LINEAGE_FORMAT, pattern=r"^ckptsdk\.lineage/1(\.[0-9]+)?$")
    epoch: int = Field(ge=0)
    attempt: int = Field(ge=0)
    run_id: str = Field(min_length=1)
    resumed_from_step: int | None = Field(default=None, ge=0)
    resumed_from_epoch: int | None = Field(default=None, ge=0)
    host: str = Field(default_factory=socket.gethostname)
    pid: int = Field(default_factory=os.getpid, ge=0)
    created_at: UtcTime = Field(default_factory=utc_now)

    @field_validator("format", mode="before")
    @classmethod
    def _format_first(cls, value: Any) -> Any:
        check_format(value, LINEAGE_FORMAT)
        return value

    @field_validator("created_at")
    @classmethod
    def _utc(cls, value: str) -> str:
        return check_utc(value)



def _parse(data: Any, model: type[D], key: str) -> D:
    return parse_document(data, model, key=key,
                          damaged="it is not used (restore falls back to an earlier checkpoint)")


def parse_manifest(data: bytes, *, key: str = "") -> Manifest:
    """Parse and validate a manifest.json.

    Args:
        data: the file's bytes.
        key: where it came from, for error messages.

    Raises:
        ManifestError: not JSON, wrong or missing fields, an unknown format (a newer major
            version says "upgrade"), or a state skeleton that is malformed. ``.key`` is ``key``.
    """
    manifest = _parse(data, Manifest, key)
    try:
        tensor_paths(manifest.tree)
    except ManifestError as exc:
        raise ManifestError(f"{key + ': ' if key else ''}{exc}", key=key or None,
                            step=manifest.step) from exc
    return manifest


def parse_lineage(data: bytes, *, key: str = "") -> LineageRecord:
    """Parse and validate a lineage record (same rules and errors as ``parse_manifest``)."""
    return _parse(data, LineageRecord, key)


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
