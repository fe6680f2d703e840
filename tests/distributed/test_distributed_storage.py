"""The DCP storage layer in one process: JSON metadata round trip, no pickle, refusals, digests.

``dcp.save``/``dcp.load`` run with ``no_dist=True`` (no process group): the storage writer and
reader, the planners and the metadata JSON are the same code the multi-process jobs use.
"""

from __future__ import annotations

import json
import pickle
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptsdk.backends import open_backend
from ckptsdk.distributed import CkptStorageReader, CkptStorageWriter, JsonLoadPlanner, JsonSavePlanner
from ckptsdk.distributed.metadata import metadata_from_json
from ckptsdk.distributed.restoring import load_quietly
from ckptsdk.distributed.storage import unwrap
from ckptsdk.errors import CorruptCheckpointError, ManifestError, StateMismatchError, UnsupportedStateError


def _refuse(*_a: Any, **_k: Any) -> Any:
    raise AssertionError("unpickling was attempted")


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16)},
        "optim": {
            "state": {"w": {"step": torch.tensor(7.0), "exp_avg": torch.randn(5, 3, generator=g)}},
            "param_groups": [{"lr": 0.01 * seed, "betas": (0.9, 0.999), "params": ["w"], "nesterov": False}],
        },
        "count": seed,
    }


def _quiet(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kwargs)


def _save(backend: Any, state: dict[str, Any], planner: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    out: dict[str, Any] = {}

    def commit(md: dict[str, Any], files: dict[str, Any]) -> None:
        # What the manager puts in the manifest must survive strict JSON.
        out["md"], out["files"] = json.loads(json.dumps(md, allow_nan=False)), files

    writer = CkptStorageWriter(backend, "ck", commit=commit)
    _quiet(dcp.save, state, storage_writer=writer, planner=planner or JsonSavePlanner(), no_dist=True)
    return out["md"], out["files"]


def test_roundtrip_through_json_metadata_with_unpickling_trapped(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = open_backend("memory://dist-roundtrip")
    saved = _state(1)
    md, files = _save(backend, saved)
    assert set(files) == {"rank-00000.safetensors"}
    assert md["state"]["model.w"]["chunks"] == [{"offsets": [0, 0], "sizes": [5, 3]}]
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, _refuse)
    monkeypatch.setattr(torch, "load", _refuse)
    target = _state(2)  # other values everywhere: every one must be overwritten
    reader = CkptStorageReader(backend, "ck", metadata=metadata_from_json(md, where="ck"), files=files)
    _quiet(dcp.load, target, storage_reader=reader, planner=JsonLoadPlanner(), no_dist=True)
    for path in (("model", "w"), ("model", "b"), ("optim", "state", "w", "exp_avg"), ("optim", "state", "w", "step")):
        a, b = saved, target
        for k in path:
            a, b = a[k], b[k]
        assert a.dtype == b.dtype and torch.equal(a, b), path
    assert target["optim"]["param_groups"] == saved["optim"]["param_groups"]  # tuple betas included
    assert type(target["optim"]["param_groups"][0]["betas"]) is tuple
    assert target["count"] == 1


def test_pickled_non_tensor_entries_are_refused_and_nothing_is_written() -> None:
    backend = open_backend("memory://dist-refuse")
    with pytest.raises(CheckpointException) as info:
        _save(backend, _state(1), planner=dcp.DefaultSavePlanner())  # torch.save's the non-tensors
    cause = unwrap(info.value)
    assert isinstance(cause, UnsupportedStateError) and "arrived pickled" in str(cause)
    assert backend.list("") == []


def test_a_corrupt_rank_file_is_refused_before_any_tensor_is_used() -> None:
    backend = open_backend("memory://dist-corrupt")
    md, files = _save(backend, _state(1))
    data = bytearray(backend.read("ck/rank-00000.safetensors"))
    data[-1] ^= 0xFF
    backend.write("ck/rank-00000.safetensors", bytes(data))
    target = _state(2)
    before = target["model"]["w"].clone()
    reader = CkptStorageReader(backend, "ck", metadata=metadata_from_json(md, where="ck"), files=files)
    with pytest.raises(CorruptCheckpointError, match="digest") as info:
        load_quietly(target, reader)
    assert info.value.key == "ck/rank-00000.safetensors"
    assert torch.equal(target["model"]["w"], before)


@pytest.mark.parametrize(
    "other", [{"extra": torch.zeros(2)}, {"model": {"w": torch.zeros(6, 3)}}], ids=["missing-key", "other-shape"]
)
def test_a_state_that_does_not_fit_is_a_state_mismatch(other: dict[str, Any]) -> None:
    backend = open_backend(f"memory://dist-mismatch-{len(other)}-{list(other)[0]}")
    md, files = _save(backend, _state(1))
    target = {**_state(2), **other}
    reader = CkptStorageReader(backend, "ck", metadata=metadata_from_json(md, where="ck"), files=files)
    with pytest.raises(StateMismatchError, match="does not fit the state") as info:
        load_quietly(target, reader)
    assert info.value.mismatches


def test_metadata_of_another_format_is_a_manifest_error() -> None:
    with pytest.raises(ManifestError, match="expected 'ckptsdk.dcp/1'"):
        metadata_from_json({"format": "ckptsdk.dcp/2"}, where="step-1/manifest.json")
    with pytest.raises(ManifestError, match="malformed"):
        metadata_from_json({"format": "ckptsdk.dcp/1", "state": {"x": {"kind": "tensor"}}}, where="m")


def test_unsupported_state_error_names_the_entry() -> None:
    planner = JsonSavePlanner()
    byte_io = __import__("torch.distributed.checkpoint.planner", fromlist=["x"]).WriteItemType.BYTE_IO
    item = type("I", (), {"type": byte_io, "index": type("X", (), {"fqn": "optim.weird"})()})()
    with pytest.raises(UnsupportedStateError) as info:
        planner.transform_object(item, {"t": torch.ones(1)})
    assert info.value.path == "optim.weird"
