"""The models of a checkpoint's manifest.json (its commit marker) and lineage records, and their parsers.

They follow document.py's rule: ``format`` checked first (a newer major version gives a clear
error), then the ``checksum``, so that no flipped byte is ever trusted. What metrics and extra may
hold is userfield.py's; the state skeleton's rules are skeleton.py's; storage does not belong
here. Regenerate the schema with
``python -m ckptsdk.format.manifest --schema > docs/manifest.schema.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import sys
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    Field,
    JsonValue,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.json_schema import models_json_schema

from ckptsdk.errors import ManifestError
from ckptsdk.format import limits
from ckptsdk.format.document import (
    CHECKSUM_FIELD,
    FINITE_JSON,
    D,
    Document,
    Strict,
    UtcTime,
    parse_document,
    utc_now,
)
from ckptsdk.format.dtype import BY_NAME, NAMES
from ckptsdk.format.environment import Environment
from ckptsdk.format.skeleton import skeleton_schema, tensor_nodes, tensor_paths
from ckptsdk.format.userfield import Metric, decode_extra, encode_extra

__all__ = [
    "FORMAT",
    "LINEAGE_FORMAT",
    "PLAIN_FORMAT",
    "SHARED_FORMAT",
    "KEEP_RULE_KINDS",
    "CustomRuleRecord",
    "FileEntry",
    "KeepBestRecord",
    "KeepEveryRecord",
    "KeepEverySecondsRecord",
    "KeepLastRecord",
    "KeepRecord",
    "LineageRecord",
    "Manifest",
    "Position",
    "ProtectRecord",
    "ReferencedBase",
    "ReferencedTensor",
    "SharedFile",
    "Writer",
    "json_schema",
    "parse_lineage",
    "parse_manifest",
    "schema_text",
]

#: What this code writes for a checkpoint that records tensors by reference (``referenced``); it
#: reads any ``/3.x``, ``/2.x`` and ``/1.x`` (fields of a newer minor version are ignored). The
#: version rule (document.py): a minor version only adds what an older reader may ignore; anything
#: it would misread is a new major.
#: 1.1 added the ``checksum`` field; a 1.0 document (written before it) is read with a warning.
#: 1.2 added ``keep``, the writer's keep rules (a 1.1 reader ignores it, as a newer minor's field).
#: 1.3 added ``shared`` (tensors kept in files outside the folder): a 1.2 reader ignored it and
#: skipped the checkpoint "as damaged", falling back to an older one, so it was a major change:
#: 2.0. 1.3 manifests (written by earlier builds before this rule) are still read.
#: 3.0 added ``referenced`` (tensors recorded by digest, never written: the restorer supplies
#: them). A 2.x reader that ignored it would find those tensors in no file and skip the
#: checkpoint as damaged (or, reading only some objects, restore without them), so it is a major
#: change: a 2.0 reader refuses it as "written by a newer ckptsdk", never falls back past it.
FORMAT = "ckptsdk.checkpoint/3.0"
#: What this code writes for a checkpoint that refers to shared files and references nothing:
#: every 2.x reader reads it right (``Manifest.format_written``).
SHARED_FORMAT = "ckptsdk.checkpoint/2.0"
#: What this code writes for a checkpoint without shared files or references: nothing in it is
#: newer than 1.2, so every 1.x reader reads it right.
PLAIN_FORMAT = "ckptsdk.checkpoint/1.2"
#: The newest version of major 1 (``shared`` in it: 1.3 manifests are read, never written).
_LAST_MAJOR_1 = "ckptsdk.checkpoint/1.3"
LINEAGE_FORMAT = "ckptsdk.lineage/1.1"
#: The first minor version of both that always carries a checksum.
_CHECKSUM_MINOR = 1
# Rules the JSON Schema states too, one home each (tests/format/test_manifest.py checks that the schema
# and the parser agree): a relative file name without '.'/'..' components.
_FILE_NAME = r"^(?!\.\.?(/|$))[A-Za-z0-9_.-]+(/(?!\.\.?(/|$))[A-Za-z0-9_.-]+)*$"
_NODE_REF = "#/$defs/SkeletonNode"


def _check_finite_json(value: Any, where: str) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} holds {value}; JSON has no nan/inf")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite_json(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite_json(v, f"{where}[{i}]")
    return value


class FileEntry(Strict):
    """One file of a checkpoint, with what a reader verifies before using it."""

    name: str = Field(
        json_schema_extra={"pattern": _FILE_NAME},
        description="relative to the checkpoint folder; no '.' or '..' component",
    )
    size: int = Field(ge=0)
    digest: str = Field(pattern=r"^[0-9a-f]+$", description="lowercase hex")
    algorithm: str = Field(min_length=1, description='e.g. "xxh3-128"')

    @field_validator("name")
    @classmethod
    def _no_dot_dirs(cls, value: str) -> str:
        if not re.fullmatch(_FILE_NAME, value):
            raise ValueError(
                f"file name {value!r} is not a relative name of [A-Za-z0-9_.-] parts without '.' or '..' components"
            )
        return value


class SharedFile(Strict):
    """A tensor file outside the checkpoint's folder holding tensors unchanged since an earlier
    save (format 2.0 on, and 1.3): immutable, named relative to the root, several checkpoints refer to it."""

    name: str = Field(
        pattern=r"^shared/[0-9]{10,}\.e[0-9]+(\.[0-9a-f]{8})?\.[0-9a-f]{16}\.safetensors$",
        description="relative to the root: shared/<step>.e<epoch>[.<tag>].<content>.safetensors",
    )
    size: int = Field(ge=0)
    digest: str = Field(pattern=r"^[0-9a-f]+$", description="of the whole file, lowercase hex")
    algorithm: str = Field(min_length=1, description='e.g. "xxh3-128"')
    tensors: dict[str, Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]] = Field(
        min_length=1,
        description="the tensor paths this checkpoint takes from the file -> each tensor's own xxh3-128 "
        "digest (of its dtype, shape and raw bytes); the file may hold more tensors, which this checkpoint "
        "does not use",
    )
    aliases: dict[str, str] = Field(
        default_factory=dict,
        description="paths of `tensors` stored in the file under another path's key (equal bytes: tied "
        "weights are stored once); a path not named here is its own key",
    )

    @model_validator(mode="after")
    def _aliases_of_taken(self) -> SharedFile:
        stray = sorted(set(self.aliases) - set(self.tensors))
        if stray:
            raise ValueError(f"aliases name tensors this checkpoint does not take from the file: {stray[:3]}")
        return self


class ReferencedTensor(Strict):
    """One tensor a checkpoint records by digest and does not hold (format 3.0 on): the live
    tensor at its path must have exactly this dtype, shape and digest before anything is restored."""

    dtype: str = Field(json_schema_extra={"enum": list(NAMES)}, description="torch's name, as the skeleton's")
    shape: list[Annotated[int, Field(ge=0)]]
    size: int = Field(ge=0, description="its raw bytes: the product of shape times the dtype's size")
    digest: str = Field(
        pattern=r"^[0-9a-f]+$",
        description='lowercase hex of the group\'s algorithm over "<dtype> [<d0>, <d1>, ...]\\n" and the raw '
        "bytes (what `shared` records per tensor)",
    )

    @model_validator(mode="after")
    def _size_of_shape(self) -> ReferencedTensor:
        entry = BY_NAME.get(self.dtype)
        if entry is None:
            raise ValueError(f"unknown dtype {self.dtype!r} (known: {', '.join(NAMES)})")
        if self.size != math.prod(self.shape) * entry.itemsize:
            raise ValueError(f"size {self.size} is not shape {self.shape} times {entry.itemsize} bytes of {self.dtype}")
        return self


class ReferencedBase(Strict):
    """Tensors a checkpoint records by dtype, shape and digest and never writes (format 3.0 on):
    a frozen base the restorer supplies (a hub model), proven by hashing before anything is loaded."""

    source: str | None = Field(
        default=None,
        max_length=1000,
        description="the user's label of where these bytes come from (e.g. 'hf:gpt2@607a30d'); null: not given. "
        "Shown when a live tensor differs; never fetched",
    )
    algorithm: str = Field(min_length=1, description='of each tensor digest, e.g. "xxh3-128"')
    tensors: dict[str, ReferencedTensor] = Field(
        min_length=1, description="tensor path (as the skeleton names it) -> what the live tensor must be"
    )


class Position(Strict):
    """Where in the data the job was: epoch, batch index, and anything the job adds."""

    epoch: int | None = Field(default=None, ge=0)
    batch_idx: int | None = Field(default=None, ge=0)
    extra: dict[str, JsonValue] = Field(
        default_factory=dict, description='JSON; a non-finite or negative-zero float is {"$float": ...} as in metrics'
    )

    @field_validator("extra", mode="before")
    @classmethod
    def _tagged_floats(cls, value: Any) -> Any:
        return decode_extra(value)

    @field_serializer("extra", when_used="json")
    def _extra_json(self, value: dict[str, Any]) -> object:
        return encode_extra(value)


class Writer(Strict):
    """Who wrote a checkpoint: run, attempt, lease epoch (the fencing token), host, pid."""

    run_id: str = Field(min_length=1)
    attempt: int = Field(ge=0)
    lease_epoch: int = Field(ge=0)
    host: str
    pid: int = Field(ge=0)
    resumed_from_step: int | None = Field(default=None, ge=0)


class KeepLastRecord(Strict):
    """``{"rule": "keep_last", "n": 3}``: the ``n`` highest steps."""

    rule: Literal["keep_last"]
    n: int = Field(ge=1)


class KeepEveryRecord(Strict):
    """``{"rule": "keep_every", "k": 1000}``: every step that is a multiple of ``k``."""

    rule: Literal["keep_every"]
    k: int = Field(ge=1)


class KeepEverySecondsRecord(Strict):
    """``{"rule": "keep_every_seconds", "seconds": 3600.0}``: checkpoints this far apart by ``created_at``."""

    rule: Literal["keep_every_seconds"]
    seconds: float = Field(gt=0, allow_inf_nan=False)


class KeepBestRecord(Strict):
    """``{"rule": "keep_best", "metric": "val_loss", "k": 2, "mode": "min"}``: the ``k`` best by a metric."""

    rule: Literal["keep_best"]
    metric: str = Field(min_length=1)
    k: int = Field(ge=1)
    mode: Literal["min", "max"]


class ProtectRecord(Strict):
    """``{"rule": "protect", "steps": [100], "why": "..."}``: these steps, whatever the others say."""

    rule: Literal["protect"]
    steps: list[Annotated[int, Field(ge=0)]]
    why: str


class CustomRuleRecord(Strict):
    """``{"rule": "custom", "name": "milestone"}``: a rule only the writer can judge (a predicate)."""

    rule: Literal["custom"]
    name: str = Field(description="a predicate (keep_if) or a user's own rule: recorded by name, judged by no reader")


#: One of the writer's keep rules as a manifest records it; what each means is
#: :mod:`ckptsdk.checkpoint.retention`'s (the format only holds them).
KeepRecord = Annotated[
    KeepLastRecord | KeepEveryRecord | KeepEverySecondsRecord | KeepBestRecord | ProtectRecord | CustomRuleRecord,
    Field(discriminator="rule"),
]
#: The ``rule`` names this ckptsdk knows (a newer minor version's others are read as custom).
KEEP_RULE_KINDS: tuple[str, ...] = tuple(
    get_args(m.model_fields["rule"].annotation)[0] for m in get_args(get_args(KeepRecord)[0])
)


class Manifest(Document):
    """A checkpoint's manifest.json: published last, it is what makes a checkpoint exist."""

    FORMAT: ClassVar[str] = FORMAT
    ALSO_READS: ClassVar[tuple[str, ...]] = (SHARED_FORMAT, _LAST_MAJOR_1)
    CHECKSUM_SINCE: ClassVar[int | None] = _CHECKSUM_MINOR
    # The skeleton grows with the tensor count (a distributed one with ranks x chunks): a few
    # MiB for the largest trees seen; the cap leaves room for ten times that. A save refuses
    # what would outgrow it (limits.py), before it writes anything.
    MAX_BYTES: ClassVar[int] = limits.MANIFEST_BYTES

    format: str = Field(default=FORMAT, pattern=r"^ckptsdk\.checkpoint/[123](\.[0-9]+)?$")
    step: int = Field(ge=0)
    position: Position = Field(default_factory=Position)
    created_at: UtcTime = Field(default_factory=utc_now)
    writer: Writer
    files: list[FileEntry] = Field(
        json_schema_extra={
            "description": "unique names (JSON Schema cannot say so in general: readers check); at "
            "most one tensors.safetensors",
            "uniqueItems": True,
            "contains": {"properties": {"name": {"const": "tensors.safetensors"}}, "required": ["name"]},
            "minContains": 0,
            "maxContains": 1,
        }
    )
    tree: JsonValue = Field(description="the codec skeleton of the state tree (docs/FORMAT.md)")
    metrics: dict[str, Metric] = Field(default_factory=dict)
    environment: Environment
    tags: dict[str, str] = Field(default_factory=dict)
    keep: list[KeepRecord] | None = Field(
        default=None,
        description="the writer's keep rules (format 1.2 on; absent: not recorded, as before 1.2). The "
        "newest checkpoint's govern `ckptsdk gc` and `ls`; a custom rule is only named",
    )

    shared: list[SharedFile] = Field(
        default_factory=list,
        description="format 2.0 on (and 1.3): tensors kept outside the folder, in files several checkpoints share "
        "(absent: every tensor is in tensors.safetensors)",
    )

    referenced: list[ReferencedBase] = Field(
        default_factory=list,
        description="format 3.0 on: tensors recorded by dtype, shape and digest and not held in any file (a frozen "
        "base the restorer supplies; absent: every tensor is in a file)",
    )

    def format_written(self) -> str:
        """The oldest version that holds what the manifest says: ``FORMAT`` (3.0) with ``referenced``,
        ``SHARED_FORMAT`` (2.0) with ``shared`` only, else ``PLAIN_FORMAT`` (1.2: 1.x readers read it)."""
        if self.referenced:
            return FORMAT
        return SHARED_FORMAT if self.shared else PLAIN_FORMAT

    def referenced_tensors(self) -> dict[str, tuple[ReferencedBase, ReferencedTensor]]:
        """Every referenced tensor path -> (its group, its entry), in the order the manifest lists them."""
        return {path: (group, entry) for group in self.referenced for path, entry in group.tensors.items()}

    @field_validator("keep", mode="before")
    @classmethod
    def _newer_rule_kinds(cls, value: Any, info: ValidationInfo) -> Any:
        # A newer minor version may add a kind of rule: it is named, never judged (gc then
        # deletes nothing by retention, as for a predicate), and never makes a checkpoint unreadable.
        if (info.context or {}).get("lenient") and isinstance(value, list):
            return [
                r
                if not isinstance(r, dict) or r.get("rule") in KEEP_RULE_KINDS
                else {"rule": "custom", "name": f"{r.get('rule')!s:.80} (a newer ckptsdk's rule)"}
                for r in value
            ]
        return value

    @model_serializer(mode="wrap")
    def _omit_unrecorded(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Absent, not null, when not recorded: an older document re-written stays what it said.
        data: dict[str, Any] = handler(self)
        if self.keep is None:
            data.pop("keep", None)
        if not self.shared:
            data.pop("shared", None)
        if not self.referenced:
            data.pop("referenced", None)
        return data

    @classmethod
    def built(cls, *, tree: JsonValue, **fields: Any) -> Manifest:
        """A manifest of ckptsdk's own making: every field validated as usual but ``tree``, taken as is.

        Only for a skeleton ``codec.encode`` just built (JSON types only, its non-finite floats
        tagged) or one a parse validated (an anchor re-commits a parsed manifest's): validating
        it again, pydantic's walk for ``JsonValue`` and the walk for finiteness, was most of a
        save worker's manifest time. A bare NaN would still fail in ``to_json`` (strict JSON),
        and tests/format/test_manifest.py holds the bytes to those of ``Manifest(...)``. A parsed
        manifest is always validated whole.
        """
        probe = cls(tree=None, **fields)
        return cls.model_construct(_fields_set=probe.model_fields_set | {"tree"}, **{**dict(probe), "tree": tree})

    def _json_body(self) -> dict[str, Any]:
        # The tree is JSON already (validated at parse, or the codec's own): pydantic's walk over
        # it, most of the dump's time, would hand it back unchanged. Field order is kept.
        dumped = self.model_dump(mode="json", exclude={"tree"})
        order = [k for k in type(self).model_fields if k == "tree" or k in dumped]
        return {k: self.tree if k == "tree" else dumped[k] for k in order}

    # The tree's tensor paths, walked once (parse checks them; restore compares them with the
    # tensors read). A private attribute, so frozen and computed lazily; no code copies a
    # manifest with another tree (``model_copy`` would carry this along).
    _paths: frozenset[str] | None = PrivateAttr(default=None)

    def tensor_path_set(self) -> frozenset[str]:
        """Every tensor path the tree references (see ``skeleton.tensor_paths``).

        Raises:
            ManifestError: the skeleton is malformed.
        """
        if self._paths is None:
            self._paths = frozenset(tensor_paths(self.tree))
        return self._paths

    @field_validator("tree")
    @classmethod
    def _finite_tree(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic would write a bare nan as null; the codec tags them, so one here is a bug. A
        # tree parsed from JSON text by parse_document holds none (a walk of ~2,000 nodes saved
        # per restore of a ResNet-18 state); one built in Python is walked.
        if info.context and info.context.get(FINITE_JSON):
            return value
        return _check_finite_json(value, "tree")

    @field_validator("files")
    @classmethod
    def _unique_names(cls, value: list[FileEntry]) -> list[FileEntry]:
        names = [f.name for f in value]
        if len(set(names)) != len(names):
            raise ValueError(f"file names repeat: {names}")
        return value

    @field_validator("shared")
    @classmethod
    def _one_source_each(cls, value: list[SharedFile]) -> list[SharedFile]:
        names = [f.name for f in value]
        if len(set(names)) != len(names):
            raise ValueError(f"shared file names repeat: {names}")
        paths = [p for f in value for p in f.tensors]
        if len(set(paths)) != len(paths):
            raise ValueError("a tensor is taken from two shared files")
        return value

    @field_validator("referenced")
    @classmethod
    def _referenced_once(cls, value: list[ReferencedBase]) -> list[ReferencedBase]:
        paths = [p for group in value for p in group.tensors]
        if len(set(paths)) != len(paths):
            raise ValueError("a tensor is referenced twice")
        return value

    @model_validator(mode="after")
    def _one_place_each(self) -> Manifest:
        both = sorted({p for f in self.shared for p in f.tensors} & {p for g in self.referenced for p in g.tensors})
        if both:
            raise ValueError(f"tensors both taken from a shared file and referenced: {both[:3]}")
        return self


class LineageRecord(Document):
    """lineage/epoch-NNNNNN.json: written once per lease takeover, says where it resumed from."""

    FORMAT: ClassVar[str] = LINEAGE_FORMAT
    CHECKSUM_SINCE: ClassVar[int | None] = _CHECKSUM_MINOR
    MAX_BYTES: ClassVar[int] = 1 << 20  # a few hundred bytes are written

    format: str = Field(default=LINEAGE_FORMAT, pattern=r"^ckptsdk\.lineage/1(\.[0-9]+)?$")
    epoch: int = Field(ge=0)
    attempt: int = Field(ge=0)
    run_id: str = Field(min_length=1)
    resumed_from_step: int | None = Field(default=None, ge=0)
    resumed_from_epoch: int | None = Field(default=None, ge=0)
    host: str = Field(default_factory=socket.gethostname)
    pid: int = Field(default_factory=os.getpid, ge=0)
    created_at: UtcTime = Field(default_factory=utc_now)


def _parse(data: bytes, model: type[D], key: str) -> D:
    return parse_document(data, model, key=key, damaged="it is not used (restore falls back to an earlier checkpoint)")


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
        paths = manifest.tensor_path_set()
    except ManifestError as exc:
        raise ManifestError(f"{key + ': ' if key else ''}{exc}", key=key or None, step=manifest.step) from exc
    stray = sorted(p for f in manifest.shared for p in f.tensors if p not in paths)
    if stray:
        raise ManifestError(
            f"{key + ': ' if key else ''}its shared files name tensors the tree never uses ({stray[:3]}); "
            "it is not used (restore falls back to an earlier checkpoint)",
            key=key or None,
            step=manifest.step,
        )
    if manifest.referenced:
        _check_referenced(manifest, key)
    return manifest


def _check_referenced(manifest: Manifest, key: str) -> None:
    """Each referenced tensor is a ``$tensor`` node of the tree with the same dtype and shape."""
    nodes = tensor_nodes(manifest.tree)
    for path, (_group, entry) in manifest.referenced_tensors().items():
        node = nodes.get(path)
        if node is not None and (node["dtype"], node["shape"]) == (entry.dtype, entry.shape):
            continue
        why = "is no tensor of the tree"
        if node is not None:
            why = f"is {entry.dtype} {entry.shape} there but {node['dtype']} {node['shape']} in the tree"
        raise ManifestError(
            f"{key + ': ' if key else ''}referenced tensor {path!r} {why}; "
            "it is not used (restore falls back to an earlier checkpoint)",
            key=key or None,
            step=manifest.step,
        )


def parse_lineage(data: bytes, *, key: str = "") -> LineageRecord:
    """Parse and validate a lineage record (same rules and errors as ``parse_manifest``)."""
    return _parse(data, LineageRecord, key)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of manifest.json and lineage records (docs/manifest.schema.json)."""
    _, top = models_json_schema(
        [(Manifest, "validation"), (LineageRecord, "validation")], title="ckptsdk manifest and lineage record"
    )
    top["$defs"]["SkeletonNode"] = skeleton_schema(_NODE_REF)
    tree = top["$defs"]["Manifest"]["properties"]["tree"]
    top["$defs"]["Manifest"]["properties"]["tree"] = {"$ref": _NODE_REF, "description": tree["description"]}
    for name in ("Manifest", "LineageRecord"):  # the parser refuses a document without one
        model = top["$defs"][name]
        model["required"] = ["format", *[f for f in model.get("required", []) if f != "format"]]
        # The checksum is not a model field (it is checked and removed before validation).
        model["properties"][CHECKSUM_FIELD] = {
            "type": "string",
            "pattern": "^sha256:[0-9a-f]{64}$",
            "description": "sha256 of the document without this field, as JSON with sorted keys, "
            "no spaces, ASCII escapes (required from minor version 1 on)",
        }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": top.pop("title"),
        "description": f"A checkpoint's manifest.json (format {FORMAT}) or a lineage "
        f"record (format {LINEAGE_FORMAT}). Generated by python -m ckptsdk.format.manifest "
        "--schema; see docs/FORMAT.md.",
        "oneOf": [{"$ref": "#/$defs/Manifest"}, {"$ref": "#/$defs/LineageRecord"}],
        **top,
    }


def schema_text() -> str:
    """``json_schema()`` as the exact text of docs/manifest.schema.json."""
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m ckptsdk.format.manifest --schema``: print the JSON Schema."""
    parser = argparse.ArgumentParser(prog="python -m ckptsdk.format.manifest", description=main.__doc__)
    parser.add_argument("--schema", action="store_true", help="print docs/manifest.schema.json")
    args = parser.parse_args(argv)
    if not args.schema:
        parser.print_help()
        return 2
    sys.stdout.write(schema_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
