"""torchdata's StatefulDataLoader in a TrainState resumes bit for bit (in-process; the SIGKILL
cases are in test_loader_resume.py): the resumed iter()'s extra draw from torch's global RNG is
put back only when it happened, and each worker's RNGs travel in the worker's saved state."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

import ckptsdk
from ckptsdk.loader import _KeepRngOnResume, _WorkerRng

torchdata = pytest.importorskip("torchdata.stateful_dataloader")
# torchdata 0.11 calls torch.set_vital, deprecated in torch 2.14; the TrainState warns (logs) too.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


class Augmented(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2,), float(i)) + torch.rand(2) + random.random() + float(np.random.rand())


def _build(workers: int) -> tuple[ckptsdk.TrainState, object]:
    torch.manual_seed(3)
    loader = torchdata.StatefulDataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=workers)
    return ckptsdk.TrainState(loader=loader), loader


def _stream(loader, source, batches: int) -> list[torch.Tensor]:
    """The next ``batches`` batches from ``source``, then new epochs of ``loader``, each batch
    followed by a draw in the training process (where dropout would draw)."""
    out: list[torch.Tensor] = []
    while True:
        for batch in source:
            out += [batch, torch.rand(2)]
            if len(out) == 2 * batches:
                return out
        source = iter(loader)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("cut", [2, 6])  # mid-epoch; after an epoch's last batch (6 per epoch)
def test_a_restored_stateful_loader_continues_the_same_stream(workers, cut):
    state, loader = _build(workers)
    it = iter(loader)
    for _ in range(cut):
        next(it)
    saved = copy.deepcopy(state.state_dict())
    want = _stream(loader, it, 9)
    del it
    state2, loader2 = _build(workers)
    state2.load_state_dict(saved)
    got = _stream(loader2, iter(loader2), 9)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.timeout(120)
def test_without_the_worker_rngs_a_resumed_worker_augments_differently():
    """The premise of _WorkerRng: a resumed worker restarts from base_seed + id."""
    state, loader = _build(2)
    it = iter(loader)
    next(it), next(it)
    saved = copy.deepcopy(loader.state_dict())
    want = next(it)
    del it
    torch.manual_seed(3)
    bare = torchdata.StatefulDataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=2)
    bare.load_state_dict(saved)  # no TrainState: no worker hook in the resumed workers
    got = next(iter(bare))
    assert got.shape == want.shape and not torch.equal(got, want)


class _Fake:
    def __init__(self, draws: bool) -> None:
        self.draws = draws
        self.next_iter_state: dict | None = {"resumed": True}

    def _get_iterator(self) -> str:
        if self.draws:
            torch.empty((), dtype=torch.int64).random_()
            random.random()
            np.random.rand()
        return "iterator"


@pytest.mark.parametrize("draws", [True, False])
def test_the_rngs_are_put_back_only_when_the_resumed_iter_moved_them(draws):
    fake = _Fake(draws)
    keep = _KeepRngOnResume(fake)
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    assert keep() == "iterator"
    assert (torch.rand(1).item(), random.random(), np.random.rand()) == _first_draws()
    fake.next_iter_state = None  # a new epoch: its draws are the uninterrupted run's too
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    keep()
    assert ((torch.rand(1).item(), random.random(), np.random.rand()) == _first_draws()) is not draws


def _first_draws() -> tuple[float, float, float]:
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    return torch.rand(1).item(), random.random(), np.random.rand()


def test_the_worker_hook_nests_a_datasets_own_state_and_reads_older_states(monkeypatch):
    class Own(Augmented):
        position = 0

        def state_dict(self):
            return {"position": self.position}

        def load_state_dict(self, state):
            self.position = state["position"]

    ds = Own()
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: type("Info", (), {"dataset": ds, "id": 0})())
    calls = []
    _WorkerRng(calls.append)(0)
    assert calls == [0]  # the user's worker_init_fn ran first
    ds.position = 4
    saved = ds.state_dict()
    assert saved["format"] == ckptsdk.loader.WORKER_RNG_FORMAT and saved["dataset"] == {"position": 4}
    first = torch.rand(3)
    ds.position = 0
    ds.load_state_dict(saved)
    assert ds.position == 4 and torch.equal(torch.rand(3), first)  # the worker's RNG is back
    ds.load_state_dict({"position": 9})  # saved before ckptsdk carried the RNGs
    assert ds.position == 9


def test_a_trainstate_adopts_a_stateful_loader_once():
    _, loader = _build(2)
    hook = loader.worker_init_fn
    ckptsdk.TrainState(loader=loader)  # a second TrainState over the same loader
    assert loader.worker_init_fn is hook and isinstance(hook, _WorkerRng)
