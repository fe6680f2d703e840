"""A ``ckptsdk.DataLoader`` that does not fit the checkpoint is refused before any object is loaded
(issue 47, item 10): the model keeps its own weights (docs/GUARANTEES.md: a state that does not
fit leaves the live objects untouched). A seed chosen now that differs from the saved one is
refused as batch_size is; a loader built without one takes the saved seed.
"""

from __future__ import annotations

import pytest
import torch

import ckptsdk
from ckptsdk import CheckpointManager, TrainState
from ckptsdk.errors import StateMismatchError

DATA = torch.utils.data.TensorDataset(torch.arange(40.0).reshape(20, 2))
BUILT = dict(batch_size=4, shuffle=True, drop_last=False, seed=7)


def _state(**loader: object) -> tuple[TrainState, torch.nn.Linear]:
    model = torch.nn.Linear(2, 1)
    return TrainState(model=model, loader=ckptsdk.DataLoader(DATA, **loader)), model  # type: ignore[arg-type]


@pytest.fixture
def root(tmp_path) -> str:
    url = str(tmp_path / "run")
    state, model = _state(**BUILT)
    with torch.no_grad():
        model.weight.fill_(5.0)
    loader = state.objects["loader"]
    with CheckpointManager(url, keep_last=2) as mgr:
        for i, _batch in enumerate(loader):
            if i == 1:
                mgr.save(state, step=2)
                break
    return url


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"batch_size": 5}, "batch_size was 4"),
        ({"shuffle": False}, "shuffle was True"),
        ({"drop_last": True}, "drop_last was False"),
        ({"seed": 8}, "pass seed=7"),
        ({"dataset": torch.utils.data.TensorDataset(torch.zeros(21, 2))}, "samples was 20"),
    ],
)
def test_an_unfit_loader_leaves_the_model_untouched(root, change, named):
    built = {**BUILT, **change}
    data = built.pop("dataset", DATA)
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(-1.0)
    state = TrainState(model=model, loader=ckptsdk.DataLoader(data, **built))  # type: ignore[arg-type]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager(root, read_only=True) as mgr:
        with pytest.raises(StateMismatchError) as caught:
            mgr.restore(state)
    assert any(named in m for m in caught.value.mismatches), caught.value.mismatches
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} was loaded before the loader was refused"


def test_a_loader_without_a_seed_takes_the_saved_one(root):
    unseeded = {k: v for k, v in BUILT.items() if k != "seed"}
    state, model = _state(**unseeded)
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore(state).step == 2
    loader = state.objects["loader"]
    assert (loader.seed, loader.epoch, loader.batch_idx) == (7, 0, 2)
    assert torch.equal(model.weight, torch.full((1, 2), 5.0))


def test_the_same_seed_given_again_resumes(root):
    state, _ = _state(**BUILT)
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore(state).step == 2
    assert state.objects["loader"].batch_idx == 2


def test_load_state_dict_alone_refuses_another_seed():
    saved = ckptsdk.DataLoader(DATA, **BUILT).state_dict()
    with pytest.raises(StateMismatchError, match="seed was 7"):
        ckptsdk.DataLoader(DATA, **{**BUILT, "seed": 9}).load_state_dict(saved)
