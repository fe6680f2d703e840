"""Manifest and lineage models: round trips, every kind of bad input is a ManifestError, newer
formats are refused clearly, the committed schema matches the models, and docs/FORMAT.md's reader
reads a real checkpoint."""

from __future__ import annotations

import builtins
import json
import math
import random
import re
import struct
import subprocess
import sys
from collections import Counter, OrderedDict, defaultdict, deque
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pytest
import safetensors.torch
import torch
import xxhash
from pydantic import ValidationError, create_model

from ckptsdk.errors import ConfigError, ManifestError
from ckptsdk.format.codec import encode
from ckptsdk.format.document import Document, parse_document, seal
from ckptsdk.format.environment import Environment
from ckptsdk.format.manifest import (
    PLAIN_FORMAT,
    CustomRuleRecord,
    FileEntry,
    KeepBestRecord,
    KeepLastRecord,
    LineageRecord,
    Manifest,
    Position,
    Writer,
    json_schema,
    parse_lineage,
    parse_manifest,
    schema_text,
)
from ckptsdk.format.userfield import user_fields

DOCS = Path(__file__).resolve().parents[2] / "docs"


KEEP = [
    KeepLastRecord(rule="keep_last", n=3),
    KeepBestRecord(rule="keep_best", metric="loss", k=2, mode="min"),
    CustomRuleRecord(rule="custom", name="milestone"),
]


def make_manifest(**overrides):
    _, skeleton = encode({"w": torch.ones(2), "t": (1, float("nan"))})
    fields = dict(
        step=5700,
        position=Position(epoch=3, batch_idx=17, extra={"sampler": {"seed": 1, "order": [3, 1]}}),
        writer=Writer(run_id="run-1", attempt=2, lease_epoch=2, host="vm", pid=42, resumed_from_step=4600),
        files=[FileEntry(name="tensors.safetensors", size=1234, digest="0f" * 16, algorithm="xxh3-128")],
        tree=skeleton,
        metrics={
            "loss": 0.25,
            "nan": float("nan"),
            "inf": -math.inf,
            "zero": -0.0,
            "n": 3,
            "best": True,
            "phase": "warmup",
            "none": None,
            "np": np.float32(0.5),
        },
        environment=Environment.current(),
        tags={"git": "abc"},
        keep=KEEP,
    )
    fields.update(overrides)
    return Manifest(**fields)


def test_manifest_round_trips_through_strict_json():
    manifest = make_manifest()
    data = manifest.to_json()
    json.loads(data, parse_constant=lambda name: pytest.fail(f"non-standard token {name}"))
    back = parse_manifest(data, key="step-0000005700.e2/manifest.json")
    assert back.to_json() == data
    # Without shared files it is written as 1.2 (nothing in it is newer), so 1.x readers read it.
    assert json.loads(data)["format"] == PLAIN_FORMAT == "ckptsdk.checkpoint/1.2"
    assert back.step == 5700 and back.position.batch_idx == 17
    assert math.isnan(back.metrics["nan"]) and back.metrics["inf"] == -math.inf
    assert math.copysign(1.0, back.metrics["zero"]) < 0
    assert type(back.metrics["n"]) is int and type(back.metrics["best"]) is bool
    assert back.metrics["np"] == 0.5 and {f.name: f for f in back.files}["tensors.safetensors"].size == 1234
    assert back.created_at.endswith("Z")


def test_models_are_frozen_and_forbid_extra_fields():
    manifest = make_manifest()
    with pytest.raises(ValidationError):
        manifest.step = 1  # type: ignore[misc]
    with pytest.raises(ValidationError, match="extra"):
        Position(epoch=1, bogus=2)
    # extra follows the metrics' rule (issue 13): nan is kept, tagged as in the skeleton.
    nan_extra = Position(extra={"x": float("nan"), "y": [-0.0]})
    assert nan_extra.model_dump(mode="json")["extra"] == {"x": {"$float": "nan"}, "y": [{"$float": "-0.0"}]}
    back = Position.model_validate(nan_extra.model_dump(mode="json"), strict=True).extra
    assert math.isnan(back["x"]) and math.copysign(1, back["y"][0]) == -1
    with pytest.raises(ValidationError, match="tree.a holds nan"):
        make_manifest(tree={"a": float("nan")})  # the codec tags nan; pydantic would write null


# Written by the ckptsdk before the dtype/user-field/skeleton split (commit d424e12), byte for byte:
# nan/-0.0/inf tags in metrics, extra and the tree, and tensor paths under nan dict keys.
_WRITTEN_BEFORE = (
    b'{"format":"ckptsdk.checkpoint/1.1","step":7,"position":{"epoch":1,"batch_idx":2,"extra":{"x":{"$float":'
    b'"inf"},"y":[{"$float":"-0.0"},1.5]}},"created_at":"2026-11-30T06:10:00.123456Z","writer":{"run_id":"r",'
    b'"attempt":1,"lease_epoch":1,"host":"h","pid":3,"resumed_from_step":null},"files":[{"name":'
    b'"tensors.safetensors","size":8,"digest":"00000000000000000000000000000000","algorithm":"xxh3-128"}],'
    b'"tree":{"w":{"$tensor":"w","dtype":"float32","shape":[2]},"t":{"$tuple":[1,{"$float":"nan"}]},"k":'
    b'{"$dict":[[{"$float":"nan"},{"$tensor":"k/#nan","dtype":"float32","shape":[1]}],[{"$float":'
    b'"fff8000000000123"},{"$tensor":"k/#fff8000000000123","dtype":"float8_e5m2","shape":[1]}],[{"$float":'
    b'"-0.0"},2]]}},"metrics":{"loss":0.25,"nan":{"$float":"nan"},"neg":{"$float":"-0.0"},"n":3,"ok":true,'
    b'"s":"a","z":null},"environment":{"python":"3.11","torch":"2","numpy":"2","ckptsdk":"0","platform":"p",'
    b'"device":"cpu","cuda":null},"tags":{},"checksum":'
    b'"sha256:3f34c2ae00160b1af41cb0600d5028947e63ad44500c173294f8db6291b2c189"}\n'
)


def test_a_manifest_written_before_is_read_and_written_the_same():
    manifest = parse_manifest(_WRITTEN_BEFORE, key="old")
    assert math.isnan(manifest.metrics["nan"]) and math.copysign(1, manifest.metrics["neg"]) == -1
    assert manifest.position.extra["x"] == math.inf
    # Written again as this format (1.2: the same fields; ``keep`` absent, not null, as unrecorded).
    assert manifest.keep is None
    assert manifest.to_json() == seal({**json.loads(_WRITTEN_BEFORE), "format": PLAIN_FORMAT})
    odd = struct.unpack(">d", bytes.fromhex("fff8000000000123"))[0]
    tree = {
        "w": torch.ones(2),
        "t": (1, float("nan")),
        "k": {float("nan"): torch.zeros(1), odd: torch.zeros(1, dtype=torch.float8_e5m2), -0.0: 2},
    }
    assert json.dumps(encode(tree)[1]) == json.dumps(manifest.tree)  # same skeleton, same tensor paths


def test_user_fields_follow_one_rule():
    metrics, extra = user_fields(
        metrics=MappingProxyType({"loss": torch.tensor(0.5), "n": np.int64(3)}),
        extra={"seen": [1, {"a": np.float32(1.5)}]},
    )
    assert metrics == {"loss": 0.5, "n": 3} and type(metrics["n"]) is int
    assert extra == {"seen": [1, {"a": 1.5}]}
    for kwargs, why in [
        ({"metrics": [1]}, "metrics must be a dict, got a list"),
        ({"metrics": {"a": [1]}}, r"metrics\['a'\] is a list"),
        ({"extra": {"$float": 1}}, "keys are str not starting with '\\$'"),
        ({"extra": {"a": (1, 2)}}, r"extra\['a'\] is a tuple"),
        ({"metrics": {"w": np.ones(2)}}, "of shape \\(2,\\)"),
    ]:
        with pytest.raises(ConfigError, match=why):
            user_fields(**kwargs)


def test_environment_current_describes_this_process():
    env = Environment.current()
    assert env.torch == torch.__version__ and env.numpy == np.__version__
    assert env.device == ("cpu" if not torch.cuda.is_initialized() else env.device)
    assert Environment.current(device=torch.device("cuda", 1)).device == "cuda:1"


def _tweak(**changes):
    doc = json.loads(make_manifest().to_json())
    for path, value in changes.items():
        node = doc
        *parents, last = path.split("__")
        for p in parents:
            node = node[p]
        if value is KeyError:
            del node[last]
        else:
            node[last] = value
    return seal(doc)  # a valid checksum, so each case reaches the check it is about


BAD = {
    "junk": (b"\x00\xffnot json", "not valid JSON"),
    "empty": (b"", "not valid JSON"),
    "torn": (make_manifest().to_json()[:-40], "not valid JSON"),
    "list": (b"[1, 2]", "expected a JSON object"),
    "nan token": (b'{"format": "ckptsdk.checkpoint/1", "step": NaN}', "not valid JSON"),
    "no format": (_tweak(format=KeyError), "no 'format' field"),
    "format not str": (_tweak(format=1), "'format' must be a string"),
    "lineage given": (LineageRecord(epoch=1, attempt=1, run_id="r").to_json(), "not a ckptsdk.checkpoint document"),
    "future major": (_tweak(format="ckptsdk.checkpoint/9", step="whatever"), "newer ckptsdk"),
    "old major": (_tweak(format="ckptsdk.checkpoint/0"), "older major version"),
    "step as str": (_tweak(step="5700"), "step: Input should be a valid integer"),
    "negative step": (_tweak(step=-1), "step: Input should be greater than or equal to 0"),
    "bool as int": (_tweak(writer__pid=True), "writer.pid: Input should be a valid integer"),
    "missing writer": (_tweak(writer=KeyError), "writer: Field required"),
    "unknown field": (_tweak(surprise=1), "surprise: Extra inputs are not permitted"),
    "nested unknown": (_tweak(writer__color="red"), "writer.color: Extra inputs are not permitted"),
    "bad digest": (_tweak(files=[{"name": "t", "size": 1, "digest": "XYZ", "algorithm": "x"}]), "files.0.digest"),
    "escaping name": (_tweak(files=[{"name": "../x", "size": 1, "digest": "ab", "algorithm": "x"}]), "files.0.name"),
    "local time": (_tweak(created_at="2026-11-30T06:10:00"), "not in UTC"),
    "bad metric": (_tweak(metrics={"m": [1]}), "metrics.m"),
    "bad skeleton": (_tweak(tree={"$what": 1}), "unknown node"),
    "bad $dict": (_tweak(tree={"$dict": 5}), "without [key, value] pairs"),
    "bad tensor path": (_tweak(tree=[{"$tensor": 3, "dtype": "float32", "shape": []}]), "path is not a str"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_manifests_raise_manifest_error_with_key_and_reason(name):
    data, reason = BAD[name]
    with pytest.raises(ManifestError) as info:
        parse_manifest(data, key="root/step-0000000001.e1/manifest.json")
    assert reason in str(info.value)
    assert str(info.value).startswith("root/step-0000000001.e1/manifest.json: ")
    assert info.value.key == "root/step-0000000001.e1/manifest.json"


def test_an_overflowing_float_is_refused_at_the_parse_so_the_tree_holds_finite_floats_only():
    """The one way to an inf past the refused NaN/Infinity tokens is a literal out of a float's
    range: refused by the parse, which is why the tree's nan/inf walk may skip parsed JSON (a
    JSON Schema cannot say it: this is the parser's alone). A tree built in Python is walked."""
    data = _tweak(tree={"x": 1.2345678}).replace(b"1.2345678", b"1e999")
    with pytest.raises(ManifestError, match="1e999 is out of a float's range"):
        parse_manifest(data, key="k")
    assert parse_manifest(_tweak(tree={"x": 1.2345678}), key="k").tree == {"x": 1.2345678}
    with pytest.raises(ValidationError, match="tree.x holds inf"):
        make_manifest(tree={"x": math.inf})


def test_future_major_is_refused_before_its_fields_are_looked_at():
    with pytest.raises(ManifestError, match=r"written by a newer ckptsdk .*upgrade ckptsdk") as info:
        parse_manifest(b'{"format": "ckptsdk.checkpoint/7", "everything": "different"}', key="k")
    assert "everything" not in str(info.value)


def test_newer_minor_version_is_read_and_its_new_fields_ignored():
    data = _tweak(format="ckptsdk.checkpoint/1.9", shiny_new_field={"a": 1}, writer__gpu_count=8)
    manifest = parse_manifest(data)
    assert manifest.format == "ckptsdk.checkpoint/1.9" and manifest.writer.pid == 42
    old = json.loads(_tweak(format="ckptsdk.checkpoint/1.0"))
    del old["checksum"]  # 1.0 predates checksums: read, with a warning that it is unverified
    assert parse_manifest(json.dumps(old).encode()).step == 5700


def test_the_writers_keep_rules_round_trip_and_a_newer_minors_kinds_are_named_not_judged():
    back = parse_manifest(make_manifest().to_json())
    assert back.keep == KEEP
    assert b'"keep"' not in make_manifest(keep=None).to_json()  # unrecorded: absent, not null
    assert parse_manifest(make_manifest(keep=None).to_json()).keep is None
    newer = [{"rule": "keep_tagged", "tag": "x"}, {"rule": "keep_last", "n": 2, "since": 5}]
    manifest = parse_manifest(_tweak(format="ckptsdk.checkpoint/1.9", keep=newer))
    # A kind this reader does not know is kept as a named custom rule (gc judges it as it does a
    # predicate: it lets nothing go), never a reason to refuse the checkpoint.
    assert manifest.keep == [
        CustomRuleRecord(rule="custom", name="keep_tagged (a newer ckptsdk's rule)"),
        KeepLastRecord(rule="keep_last", n=2),
    ]
    for bad, reason in [
        ([{"rule": "keep_tagged"}], "does not match any of the expected tags"),  # this minor: strict
        ([{"rule": "keep_last", "n": 0}], "greater than or equal to 1"),
        ([{"rule": "keep_best", "metric": "m", "k": 1, "mode": "up"}], "keep.0.keep_best.mode"),
        ([{"rule": "keep_every_seconds", "seconds": -1}], "greater than 0"),
        ({"rule": "keep_last", "n": 1}, "keep: Input should be a valid list"),
    ]:
        with pytest.raises(ManifestError, match=re.escape(reason)):
            parse_manifest(_tweak(keep=bad), key="k")


def _released_reader() -> type[Document]:
    """The manifest model of ckptsdk 0.1.0 (format 1.1): every field of today's but ``keep``."""
    fields = {name: (f.annotation, f) for name, f in Manifest.model_fields.items() if name != "keep"}
    released = create_model("Released", __base__=Document, **fields)  # type: ignore[call-overload]
    released.FORMAT = "ckptsdk.checkpoint/1.1"
    released.CHECKSUM_SINCE = 1
    return released


def test_a_released_reader_reads_a_manifest_with_keep_rules_because_the_minor_went_up():
    released = _released_reader()
    data = make_manifest().to_json()
    assert json.loads(data)["format"] == "ckptsdk.checkpoint/1.2"
    old = parse_document(data, released)  # a newer minor: its new field is ignored
    assert old.step == 5700 and not hasattr(old, "keep")
    # The same field under 1.1 would have made every new checkpoint unreadable to 0.1.0.
    relabelled = seal({**json.loads(data), "format": "ckptsdk.checkpoint/1.1"})
    with pytest.raises(ManifestError, match="keep: Extra inputs are not permitted"):
        parse_document(relabelled, released)


def test_every_single_bit_flip_of_a_manifest_is_refused():
    data = make_manifest().to_json()
    for i in range(0, len(data) * 8, 3):  # every third bit: ~6k flips, each one refused
        flipped = bytearray(data)
        flipped[i // 8] ^= 1 << (i % 8)
        with pytest.raises(ManifestError):
            parse_manifest(bytes(flipped), key="k")


def test_checksum_cases_are_explained():
    doc = json.loads(make_manifest().to_json())
    doc["writer"]["pid"] = 43  # an edit that keeps the old checksum
    with pytest.raises(ManifestError, match="integrity check failed: its checksum is sha256:"):
        parse_manifest(json.dumps(doc).encode(), key="k")
    del doc["checksum"]
    with pytest.raises(ManifestError, match="no 'checksum' field"):
        parse_manifest(json.dumps(doc).encode(), key="k")
    downgraded = json.loads(make_manifest().to_json())
    downgraded["format"] = "ckptsdk.checkpoint/1.0"  # one bit: '1' -> '0'
    with pytest.raises(ManifestError, match="has no checksum, but carries one"):
        parse_manifest(json.dumps(downgraded).encode(), key="k")


def test_lineage_record_round_trip_and_errors():
    record = LineageRecord(
        epoch=3,
        attempt=3,
        run_id="run-1",
        resumed_from_step=5700,
        resumed_from_epoch=2,
        host="vm",
        pid=7,
        created_at="2026-11-30T06:10:00+00:00",
    )
    data = record.to_json()
    assert parse_lineage(data, key="lineage/epoch-000003.json") == record
    fresh = LineageRecord(epoch=1, attempt=1, run_id="r")
    assert fresh.resumed_from_step is None and fresh.pid > 0
    for bad, reason in [
        (b"{", "not valid JSON"),
        (make_manifest().to_json(), "not a ckptsdk.lineage document"),
        (data.replace(b"lineage/1", b"lineage/2"), "newer ckptsdk"),
        (seal({**json.loads(data), "epoch": "3"}), "epoch: Input should be a valid integer"),
        (data.replace(b'"epoch":3', b'"epoch":4'), "integrity check failed"),
    ]:
        with pytest.raises(ManifestError, match=re.escape(reason)) as info:
            parse_lineage(bad, key="lineage/epoch-000003.json")
        assert info.value.key == "lineage/epoch-000003.json"


def test_committed_schema_matches_the_models():
    committed = (DOCS / "manifest.schema.json").read_text()
    assert committed == schema_text(), (
        "docs/manifest.schema.json is stale: python -m ckptsdk.format.manifest --schema > docs/manifest.schema.json"
    )
    schema = json_schema()
    assert set(schema["$defs"]) >= {"Manifest", "LineageRecord", "FileEntry", "Writer", "Position", "Environment"}
    assert schema["$defs"]["Manifest"]["additionalProperties"] is False


def test_reading_manifests_needs_no_torch():
    # The catalog (ckptsdk ls, lease, gc) parses manifests; the dtype names and skeleton rules
    # they check come from torch-free modules, so listing a root never pays for importing torch.
    code = (
        "import sys, ckptsdk.format.manifest, ckptsdk.checkpoint.reading.catalog, ckptsdk.format.skeleton, "
        "ckptsdk.format.dtype, ckptsdk.format.digest; "
        "print(sorted(m for m in ('torch', 'safetensors') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_schema_entry_point_prints_the_schema():
    out = subprocess.run(
        [sys.executable, "-m", "ckptsdk.format.manifest", "--schema"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out == schema_text()


def _reader_snippet() -> str:
    text = (DOCS / "FORMAT.md").read_text()
    block = text.split("<!-- reader:begin -->")[1].split("<!-- reader:end -->")[0]
    return block.split("```python\n")[1].split("```")[0]


def _no_torch_import(name, *args, **kwargs):
    if name.split(".")[0] in ("torch", "safetensors", "ckptsdk"):
        raise ImportError(f"{name} is blocked: the FORMAT.md reader must not need it")
    return builtins.__import__(name, *args, **kwargs)


def _as_numpy(node):
    """What the torch-free reader returns for a tree: tensors as numpy, bfloat16 widened."""
    if isinstance(node, torch.Tensor):
        return (node.float() if node.dtype == torch.bfloat16 else node).numpy()
    if isinstance(node, OrderedDict) and hasattr(node, "_metadata"):
        out = OrderedDict((k, _as_numpy(v)) for k, v in node.items())
        out._metadata = node._metadata
        return out
    if isinstance(node, dict):
        return _same_mapping(node, {k: _as_numpy(v) for k, v in node.items()})
    if isinstance(node, (list, tuple, deque)):
        items = [_as_numpy(v) for v in node]
        return deque(items, node.maxlen) if isinstance(node, deque) else type(node)(items)
    return node


def _same_mapping(like, items):
    if isinstance(like, defaultdict):
        return defaultdict(like.default_factory, items)
    return type(like)(items)


def _assert_identical(a, b, path="<root>"):
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        if isinstance(a, defaultdict):
            assert a.default_factory is b.default_factory, path
        for k in a:
            _assert_identical(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple, deque)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert struct.pack("<d", a) == struct.pack("<d", b), path
    else:
        assert a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b)), path


def test_format_md_reader_reads_a_checkpoint_without_torch(tmp_path):
    random.seed(3)
    np.random.seed(3)
    model = torch.nn.Linear(2, 2)
    sched = torch.optim.lr_scheduler.MultiStepLR(torch.optim.SGD(model.parameters(), lr=0.1), [3, 3, 5])
    tree = {
        "objects": {
            "net": torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3)).state_dict(),
            "model": {
                "layer1.0.conv1.weight": torch.randn(4, 3, 3, 3),
                "bn.num_batches_tracked": torch.tensor(7),
                "half": torch.randn(3).to(torch.bfloat16),
                "f16": torch.ones(2, dtype=torch.float16),
                "mask": torch.tensor([True, False]),
                "empty": torch.zeros(0, 3),
            },
            "optimizer": {
                "state": {0: {"momentum_buffer": torch.zeros(4)}},
                "param_groups": [{"lr": 0.1, "nesterov": True, "params": [0], "foreach": None}],
            },
            "scheduler": sched.state_dict(),
            "user": {
                "a/b": -0.0,
                "big": 2**80,
                "odd nan": struct_nan(),
                "np": np.float32(1.5),
                "c": np.complex64(1j),
                "$k": 1,
                "nested": [(1, 2), {None: "x"}],
                "od": OrderedDict(b=1, a=2),
                "dd": defaultdict(list, {"x": [1]}),
                "dq": deque([1, 2], maxlen=5),
            },
        },
        "rng": {
            "numpy": np.random.get_state(legacy=False),
            "python": random.getstate(),
            "be": np.arange(3, dtype=">i4"),
        },
    }
    tensors, skeleton = encode(tree)
    folder = tmp_path / "step-0000005700.e1"
    folder.mkdir()
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "tensors.safetensors")
    data = (folder / "tensors.safetensors").read_bytes()
    manifest = make_manifest(
        tree=skeleton,
        files=[
            FileEntry(
                name="tensors.safetensors", size=len(data), digest=xxhash.xxh3_128_hexdigest(data), algorithm="xxh3-128"
            )
        ],
    )
    (folder / "manifest.json").write_bytes(manifest.to_json())
    # The snippet runs with torch, safetensors and ckptsdk blocked (and ml_dtypes absent here:
    # bfloat16 comes back widened to float32, exactly).
    namespace: dict = {"__builtins__": {**vars(builtins), "__import__": _no_torch_import}}
    exec(compile(_reader_snippet(), "FORMAT.md", "exec"), namespace)  # noqa: S102 - our own doc
    assert namespace["ml_dtypes"] is None or namespace["ml_dtypes"].__name__ == "ml_dtypes"
    raw_manifest, back = namespace["read_checkpoint"](str(folder))
    assert raw_manifest["step"] == 5700 and raw_manifest["format"] == "ckptsdk.checkpoint/1.2"
    assert raw_manifest["keep"] == [r.model_dump() for r in KEEP]  # checksummed, read with the rest
    expected = _as_numpy(tree)
    _assert_identical(expected, back)
    assert back["objects"]["net"]._metadata == tree["objects"]["net"]._metadata
    assert type(back["objects"]["scheduler"]["milestones"]) is Counter
    assert back["objects"]["model"]["half"].dtype == np.float32
    random.setstate(back["rng"]["python"])  # the tuple structure survived
    (folder / "tensors.safetensors").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(AssertionError, match="corrupt"):
        namespace["read_checkpoint"](str(folder))


def struct_nan() -> float:
    import struct

    return struct.unpack(">d", bytes.fromhex("fff8000000000123"))[0]


WRITER = Writer(run_id="r", attempt=1, lease_epoch=1, host="h", pid=1)


def _odd_trees():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    yield {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state()}
    yield {
        "nan": float("nan"),
        "inf": (-math.inf, math.inf, -0.0, 1e308, 5e-324),
        "big": 2**80,
        "é/%.$x": [None, True, 1.5, "", "\u2603"],
        "kinds": (OrderedDict(a=1), Counter("aab"), defaultdict(list, b=[2]), deque([1], maxlen=3)),
        "np": (np.float16(1.5), np.int64(-3), np.arange(3, dtype=np.int16)),
        "t": torch.zeros(0, 2, dtype=torch.bfloat16),
        "deep": [[[[{"k": [1, {"v": float("nan")}]}]]]],
    }
    yield {}


@pytest.mark.parametrize("tree", list(_odd_trees()), ids=["train-state", "odd-values", "empty"])
@pytest.mark.parametrize("with_optional", [False, True], ids=["bare", "keep+metrics"])
def test_a_built_manifest_writes_the_bytes_of_a_validated_one(tree, with_optional):
    """``Manifest.built`` (the save worker's: the codec's skeleton is not validated again) and
    ``Manifest(...)`` write the same bytes, and both parse back to the same manifest."""
    _, skeleton = encode(tree)
    fields = dict(
        step=7,
        created_at="2026-12-02T01:02:03.000004Z",
        writer=WRITER,
        files=[FileEntry(name="tensors.safetensors", size=0, digest="00", algorithm="xxh3-128")],
        environment=Environment.current(),
    )
    if with_optional:
        fields.update(keep=KEEP, metrics={"loss": float("nan"), "n": 2, "np": np.float32(0.5)}, tags={"a": "b"})
    validated = Manifest(tree=skeleton, **fields)
    built = Manifest.built(tree=skeleton, **fields)
    assert built.to_json() == validated.to_json()
    assert built.model_fields_set == validated.model_fields_set
    back = parse_manifest(built.to_json(), key="k")
    assert back.tree == skeleton and back.to_json() == built.to_json()
    assert built.tensor_path_set() == validated.tensor_path_set()


def test_a_built_manifest_still_validates_every_other_field_and_refuses_a_bare_nan():
    """Only the tree is taken as is; a bare NaN in it (never the codec's: it tags them) cannot be written."""
    env = Environment.current()
    with pytest.raises(ValidationError):
        Manifest.built(tree={}, step=-1, writer=WRITER, files=[], environment=env)
    bad = Manifest.built(tree={"x": float("nan")}, step=1, writer=WRITER, files=[], environment=env)
    with pytest.raises(ValueError, match="not JSON compliant"):
        bad.to_json()


def test_format_md_reader_lists_references_and_proves_the_base_it_is_given(tmp_path):
    """A 3.0 checkpoint (issue 48): the frozen base is in no file; the reader lists it, takes it
    from the base it is given after checking its digest, and refuses a missing or different one."""
    from ckptsdk.format.files.reference import hash_tensor
    from ckptsdk.format.manifest import ReferencedBase, ReferencedTensor

    torch.manual_seed(4)
    frozen = {"base.weight": torch.randn(3, 4), "base.half": torch.randn(5).to(torch.bfloat16)}
    tree = {"objects": {"model": {**frozen, "lora.A": torch.randn(2, 2)}}}
    tensors, skeleton = encode(tree)
    held = {k: v for k, v in tensors.items() if not k.endswith(("base.weight", "base.half"))}
    folder = tmp_path / "step-0000000010.e1"
    folder.mkdir()
    safetensors.torch.save_file(held, folder / "tensors.safetensors")
    data = (folder / "tensors.safetensors").read_bytes()
    group = ReferencedBase(
        source="hf:tiny@abc",
        algorithm="xxh3-128",
        tensors={
            f"objects/model/{k}": ReferencedTensor(
                dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), size=t.nbytes, digest=hash_tensor(t)
            )
            for k, t in frozen.items()
        },
    )
    manifest = make_manifest(
        tree=skeleton,
        files=[
            FileEntry(
                name="tensors.safetensors", size=len(data), digest=xxhash.xxh3_128_hexdigest(data), algorithm="xxh3-128"
            )
        ],
        referenced=[group],
    )
    (folder / "manifest.json").write_bytes(manifest.to_json())
    namespace: dict = {"__builtins__": {**vars(builtins), "__import__": _no_torch_import}}
    exec(compile(_reader_snippet(), "FORMAT.md", "exec"), namespace)  # noqa: S102 - our own doc
    raw_manifest = json.loads((folder / "manifest.json").read_bytes())
    assert raw_manifest["format"] == "ckptsdk.checkpoint/3.0"
    assert namespace["references"](raw_manifest) == [
        ("objects/model/base.weight", "float32", [3, 4], 48, "hf:tiny@abc"),
        ("objects/model/base.half", "bfloat16", [5], 10, "hf:tiny@abc"),
    ]
    with pytest.raises(AssertionError, match=r"base.weight \(from hf:tiny@abc\) is in no file .*pass it in base"):
        namespace["read_checkpoint"](str(folder))
    # The base as a torch-free reader has it: read from its own safetensors file (bfloat16 widened
    # to float32 without ml_dtypes, narrowed back exactly to check it).
    base_file = tmp_path / "base.safetensors"
    safetensors.torch.save_file({f"objects/model/{k}": v for k, v in frozen.items()}, base_file)
    base = namespace["read_safetensors"](base_file.read_bytes())
    _, back = namespace["read_checkpoint"](str(folder), base=base)
    _assert_identical(_as_numpy(tree), back)
    other = {**base, "objects/model/base.weight": base["objects/model/base.weight"] + 1}
    with pytest.raises(AssertionError, match=r"base.weight \(from hf:tiny@abc\) differs from the recorded bytes"):
        namespace["read_checkpoint"](str(folder), base=other)
