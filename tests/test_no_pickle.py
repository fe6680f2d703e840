"""Restoring never unpickles: it works with pickle and torch.load booby-trapped, and the
library's source never calls them."""

from __future__ import annotations

import pathlib
import pickle
import re

import pytest
import torch

import ckptsdk
from ckptsdk import CheckpointManager, TrainState


def _trap(*args, **kwargs):
    raise AssertionError("unpickling was attempted")


class _TrapUnpickler:
    def __init__(self, *a, **k):
        _trap()


def test_restore_with_pickle_and_torch_load_patched_to_raise(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    url = str(tmp_path / "r")
    with CheckpointManager(url, lease_ttl=5) as mgr:
        mgr.save(TrainState(model=model, optimizer=opt), step=1)

    for name in ("loads", "load"):
        monkeypatch.setattr(pickle, name, _trap)
    monkeypatch.setattr(pickle, "Unpickler", _TrapUnpickler)
    monkeypatch.setattr(torch, "load", _trap)

    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with CheckpointManager(url, lease_ttl=5) as mgr:
        assert mgr.restore(TrainState(model=fresh, optimizer=fresh_opt)).step == 1
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["momentum_buffer"],
                       opt.state_dict()["state"][0]["momentum_buffer"])


def test_library_source_never_unpickles():
    root = pathlib.Path(ckptsdk.__file__).parent
    pattern = re.compile(r"\b(pickle|cloudpickle|dill)\.(loads?|Unpickler)\b|(?<!safetensors\.)\btorch\.(load|save)\(")
    offenders = [
        f"{p.relative_to(root)}:{i}: {line.strip()}"
        for p in root.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line) and not line.strip().startswith("#")
    ]
    assert offenders == [], offenders
