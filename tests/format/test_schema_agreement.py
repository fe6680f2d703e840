"""docs/manifest.schema.json is as strict as the parser: both accept the same good documents and
refuse the same bad ones (issue 13: the schema accepted a manifest without format, '../x' file
names, duplicate names, a non-UTC created_at, and any JSON as the state skeleton)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from ckptsdk.errors import ManifestError
from ckptsdk.format.manifest import LineageRecord, parse_lineage, parse_manifest
from tests.format.test_manifest import BAD, _tweak, make_manifest

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "manifest.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
FILE = {"name": "tensors.safetensors", "size": 1, "digest": "ab", "algorithm": "xxh3-128"}
T = {"$tensor": "w", "dtype": "float32", "shape": [2]}

GOOD = {
    "written by save()": make_manifest().to_json(),
    "+00:00": _tweak(created_at="2026-11-30T06:10:00+00:00"),
    "no fraction": _tweak(created_at="2026-11-30T06:10:00Z"),
    "nested files": _tweak(files=[FILE, {**FILE, "name": "shard/0.safetensors"}, {**FILE, "name": "..x"}]),
    "metric tags": _tweak(metrics={"a": {"$float": "nan"}, "b": {"$float": "7ff8000000000001"}}),
    "no keep rules": _tweak(keep=KeyError),
    "referenced tensors": _tweak(
        format="ckptsdk.checkpoint/3.0",
        referenced=[
            {
                "source": "hf:gpt2@607a30d",
                "algorithm": "xxh3-128",
                "tensors": {"w": {"dtype": "float32", "shape": [2], "size": 8, "digest": "ef" * 16}},
            }
        ],
    ),
    "every keep rule": _tweak(
        keep=[
            {"rule": "keep_last", "n": 1},
            {"rule": "keep_every", "k": 1000},
            {"rule": "keep_every_seconds", "seconds": 3600},
            {"rule": "keep_best", "metric": "val_loss", "k": 2, "mode": "max"},
            {"rule": "protect", "steps": [0, 7], "why": "resume point"},
            {"rule": "custom", "name": "milestone"},
        ]
    ),
    "extra tags": _tweak(position__extra={"x": [{"$float": "-inf"}, {"y": None}]}),
    "every node": _tweak(
        tree={
            "plain": [1, 2.5, "s", None, True],
            "t": T,
            "a": {"$ndarray": "a", "dtype": "<f4", "shape": []},
            "tu": {"$tuple": [1, {"$int": "-0x10"}]},
            "d": {"$dict": [[0, T], [None, "x"]]},
            "sd": {"$state_dict": {"w": T}, "metadata": {"$ordered_dict": {"": {"version": 1}}}},
            "c": {"$counter": {"$dict": [[2, 2]]}},
            "dd": {"$defaultdict": {"k": []}, "factory": "list"},
            "q": {"$deque": [1], "maxlen": None},
            "n": {"$npscalar": "<f4", "value": 1.5},
            "h": {"$npscalar": "<c8", "hex": "0000803f00000000"},
            "f": {"$float": "-0.0"},
        }
    ),
}

BAD_TOO = {  # beyond tests/format/test_manifest.py's BAD: what the old schema let through
    "dot component": _tweak(files=[{**FILE, "name": "a/./b"}]),
    "absolute name": _tweak(files=[{**FILE, "name": "/etc/passwd"}]),
    "duplicate names": _tweak(files=[FILE, FILE]),
    "two tensor files": _tweak(files=[FILE, {**FILE, "size": 2}]),
    "offset time": _tweak(created_at="2026-11-30T06:10:00-01:00"),
    "space time": _tweak(created_at="2026-11-30 06:10:00Z"),
    "bad month": _tweak(created_at="2026-13-30T06:10:00Z"),
    "bad metric tag": _tweak(metrics={"a": {"$float": "NaN"}}),
    "tensor without shape": _tweak(tree={"$tensor": "w", "dtype": "float32"}),
    "unknown torch dtype": _tweak(tree={**T, "dtype": "float128"}),
    "negative dim": _tweak(tree={**T, "shape": [-1]}),
    "not a numpy dtype str": _tweak(tree={"$ndarray": "a", "dtype": "float32", "shape": []}),
    "tuple of a dict": _tweak(tree={"$tuple": {"a": 1}}),
    "int in decimal": _tweak(tree={"$int": "16"}),
    "unknown factory": _tweak(tree={"$defaultdict": {}, "factory": "lambda"}),
    "deque maxlen": _tweak(tree={"$deque": [], "maxlen": -1}),
    "npscalar both": _tweak(tree={"$npscalar": "<f4", "value": 1.0, "hex": "00"}),
    "counter of a list": _tweak(tree={"$counter": [1]}),
    "extra field": _tweak(tree={**T, "device": "cpu"}),
    "unknown keep rule": _tweak(keep=[{"rule": "keep_tagged"}]),
    "keep_last 0": _tweak(keep=[{"rule": "keep_last", "n": 0}]),
    "keep_best mode": _tweak(keep=[{"rule": "keep_best", "metric": "m", "k": 1, "mode": "up"}]),
    "keep_best no metric": _tweak(keep=[{"rule": "keep_best", "metric": "", "k": 1, "mode": "min"}]),
    "keep rule field": _tweak(keep=[{"rule": "custom", "name": "x", "predicate": "lambda"}]),
    "protect negative": _tweak(keep=[{"rule": "protect", "steps": [-1], "why": ""}]),
    "referenced dtype": _tweak(
        format="ckptsdk.checkpoint/3.0",
        referenced=[
            {"algorithm": "xxh3-128", "tensors": {"w": {"dtype": "float31", "shape": [2], "size": 8, "digest": "ef"}}}
        ],
    ),
    "referenced nothing": _tweak(
        format="ckptsdk.checkpoint/3.0", referenced=[{"algorithm": "xxh3-128", "tensors": {}}]
    ),
}


def _parses(data: bytes) -> bool:
    try:
        (parse_lineage if b"ckptsdk.lineage" in data else parse_manifest)(data)
    except ManifestError:
        return False
    return True


def _schema_ok(data: bytes) -> bool:
    return VALIDATOR.is_valid(json.loads(data))


def test_the_schema_is_a_valid_draft_2020_12_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("name", list(GOOD) + ["lineage"])
def test_both_accept_the_good_documents(name):
    data = GOOD[name] if name in GOOD else LineageRecord(epoch=2, attempt=2, run_id="r").to_json()
    assert _parses(data) and _schema_ok(data), name


def _bad_json_objects():
    for name, (data, _) in {**BAD, **{k: (v, "") for k, v in BAD_TOO.items()}}.items():
        if name == "lineage given":
            continue  # a bad manifest but a good lineage record, which the schema also describes
        try:
            if isinstance(json.loads(data), dict):
                yield name
        except ValueError:
            continue  # not JSON at all: nothing for a schema to say


BAD_ALL = {**{k: v[0] for k, v in BAD.items()}, **BAD_TOO}


@pytest.mark.parametrize("name", list(_bad_json_objects()))
def test_both_refuse_the_bad_documents(name):
    data = BAD_ALL[name]
    assert not _parses(data), f"the parser accepts {name}"
    assert not _schema_ok(data), f"the schema accepts {name}"


def test_what_json_schema_cannot_say_is_left_to_the_parser():
    # Unique names in general (only "at most one tensors.safetensors" is expressible) and a
    # day that does not exist in its month: the parser refuses both, the schema cannot.
    for data in (
        _tweak(files=[{**FILE, "name": "a"}, {**FILE, "name": "a", "size": 2}]),
        _tweak(created_at="2026-02-30T06:10:00Z"),
    ):
        assert not _parses(data) and _schema_ok(data)
