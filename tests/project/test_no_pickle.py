"""Restoring never unpickles: it works with pickle and torch.load booby-trapped, and the
library's source never calls them."""

from __future__ import annotations

import pathlib
import pickle
import re

import torch

import ckptsdk
from ckptsdk import CheckpointManager, LeaseOptions, TrainState


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
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(TrainState(model=model, optimizer=opt), step=1)

    for name in ("loads", "load"):
        monkeypatch.setattr(pickle, name, _trap)
    monkeypatch.setattr(pickle, "Unpickler", _TrapUnpickler)
    monkeypatch.setattr(torch, "load", _trap)

    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        assert mgr.restore(TrainState(model=fresh, optimizer=fresh_opt)).step == 1
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(
        fresh_opt.state_dict()["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"]
    )


# The one exception: `ckptsdk import` reads torch.save files, with weights_only=True only
# (tests/porting/test_import_export.py proves nothing on the restore path imports that module).
_IMPORT_DOOR = ("porting/torch_import.py", 'torch.load(path, map_location="cpu", weights_only=True)')


def test_library_source_never_unpickles():
    root = pathlib.Path(ckptsdk.__file__).parent
    pattern = re.compile(r"\b(pickle|cloudpickle|dill)\.(loads?|Unpickler)\b|(?<!safetensors\.)\btorch\.(load|save)\(")
    hits = [
        (str(p.relative_to(root)), i, line.strip())
        for p in root.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if (pattern.search(line) or "weights_only=False" in line) and not line.strip().startswith("#")
    ]
    door = [h for h in hits if h[0] == _IMPORT_DOOR[0] and h[2].endswith(_IMPORT_DOOR[1])]
    assert len(door) == 1, hits
    offenders = [f"{f}:{i}: {line}" for f, i, line in hits if (f, i, line) not in door]
    assert offenders == [], offenders
