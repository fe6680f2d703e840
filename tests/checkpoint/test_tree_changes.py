"""A state tree that changes between saves restores, at every save, exactly as it was saved.

The save path caches the tree's structure between saves (format/template.py); each change a
job makes to its state between two saves (a param group, the optimizer state that appears at the
first step, a tensor replaced by one of another shape, dtype or device, a key added to a user
object's state) must reach the checkpoint. Each save is pipelined and followed at once by a
training step, the way a job runs; what ``load`` returns is compared with a deep copy of the
tree taken at ``save()``.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState
from ckptsdk.backends.memory import MemoryBackend

pytestmark = pytest.mark.timeout(180)


class Notes:
    """A user object in the TrainState whose state is a dict the test changes freely."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {"seen": 0, "table": torch.arange(4)}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.data)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data = dict(state)


class Job:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.notes = Notes()
        self.state = TrainState(model=self.model, optimizer=self.opt, notes=self.notes)
        self.extra_params: list[torch.nn.Parameter] = []

    def step(self) -> None:
        x = torch.randn(8, 4)
        self.opt.zero_grad()
        loss = self.model(x).square().mean() + sum(p.square().sum() for p in self.extra_params)
        loss.backward()
        self.opt.step()


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, dict):
        out = type(x)((k, _clone(v)) for k, v in x.items())
        if hasattr(x, "_metadata"):
            out._metadata = _clone(x._metadata)
        return out
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


def _same(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        )
        assert torch.equal(a.cpu(), b.cpu()), f"{path}: values differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def _new_param_group(job: Job) -> None:
    extra = torch.nn.Parameter(torch.randn(3))
    job.extra_params.append(extra)
    job.opt.add_param_group({"params": [extra], "lr": 0.01, "momentum": 0.5})


def _bigger_table(job: Job) -> None:
    job.notes.data["table"] = torch.arange(6)


def _table_dtype(job: Job) -> None:
    job.notes.data["table"] = job.notes.data["table"].to(torch.float64)


def _new_key(job: Job) -> None:
    job.notes.data["added"] = {"when": 3, "w": torch.ones(2)}


def _buffer_added(job: Job) -> None:
    job.model[0].register_buffer("mask", torch.ones(4))


def _buffer_dtype(job: Job) -> None:
    job.model[0].register_buffer("mask", torch.ones(4, dtype=torch.int64))


def _layer_of_another_shape(job: Job) -> None:
    # A layer replaced (2 -> 3 outputs): its parameters, their optimizer state and the tree's keys.
    old = list(job.model[2].parameters())
    job.model[2] = torch.nn.Linear(4, 3)
    group = job.opt.param_groups[0]["params"]
    for p in old:
        job.opt.state.pop(p, None)
    for p, new in zip(old, job.model[2].parameters(), strict=True):
        group[next(i for i, q in enumerate(group) if q is p)] = new


CHANGES: list[tuple[str, Callable[[Job], None]]] = [
    ("nothing (before the first step: no optimizer state)", lambda job: None),
    ("a step: optimizer state appears", lambda job: None),
    ("a new param group", _new_param_group),
    ("a user key added", _new_key),
    ("a user tensor of another shape", _bigger_table),
    ("a user tensor of another dtype", _table_dtype),
    ("a module buffer added", _buffer_added),
    ("a module buffer of another dtype", _buffer_dtype),
    ("a layer of another shape", _layer_of_another_shape),
    ("an lr changed", lambda job: job.opt.param_groups[0].__setitem__("lr", 0.05)),
    ("a user key removed", lambda job: job.notes.data.pop("added")),
]


@pytest.mark.parametrize("blocking", [False, True], ids=["pipelined", "blocking"])
def test_each_change_between_saves_is_restored_exactly(blocking):
    name = f"memory://tree-changes-{uuid.uuid4().hex}"
    job = Job()
    mgr = CheckpointManager(
        name, keep_last=len(CHANGES) + 1, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    )
    saved: dict[int, Any] = {}
    try:
        for i, (what, change) in enumerate(CHANGES, start=1):
            change(job)
            if i > 1:
                job.step()
            mgr.wait()  # each save commits (a save due while one waits would replace it)
            saved[i] = (what, _clone(job.state.state_dict()))
            mgr.save(job.state, step=i, blocking=blocking, extra={"change": what, f"k{i}": i})
            job.step()  # at once, while a pipelined copy may still run
            job.notes.data["seen"] += 1  # and the user object moves on
        mgr.wait()
        assert (mgr.stats.failed, mgr.stats.replaced, mgr.stats.skipped) == (0, 0, 0)
        for i, (what, tree) in saved.items():
            loaded = mgr.load(i)
            try:
                _same(loaded, tree)
            except AssertionError as exc:
                raise AssertionError(f"save {i} ({what}): {exc}") from exc
            manifest = mgr.load_manifest(i)
            assert manifest.position.extra == {"change": what, f"k{i}": i}
    finally:
        mgr.close()
        MemoryBackend.discard_store(name.removeprefix("memory://"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_tensor_moved_to_another_device_is_restored_exactly():
    name = f"memory://tree-device-{uuid.uuid4().hex}"
    job = Job()
    mgr = CheckpointManager(
        name, keep_last=4, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    )
    try:
        job.step()
        want1 = _clone(job.state.state_dict())
        mgr.save(job.state, step=1, blocking=False)
        job.notes.data["table"] = job.notes.data["table"].cuda()
        want2 = _clone(job.state.state_dict())
        mgr.save(job.state, step=2, blocking=False)
        job.notes.data["table"] = job.notes.data["table"].cpu()
        mgr.wait()
        _same(mgr.load(1), want1)
        want2["objects"]["notes"]["table"] = want2["objects"]["notes"]["table"].cpu()
        _same(mgr.load(2), want2)
    finally:
        mgr.close()
        MemoryBackend.discard_store(name.removeprefix("memory://"))
