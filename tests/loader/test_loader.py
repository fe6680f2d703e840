"""ckptsdk.DataLoader in-process: its position, the order it reproduces, what it refuses."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import ckptsdk
from ckptsdk import LeaseOptions
from ckptsdk.errors import ConfigError, StateMismatchError
from ckptsdk.loader import DataLoader, resolve_position


class Noisy(tud.Dataset):
    """Returns (index, a random draw): the draw shows which RNG state the fetch ran under."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> tuple[int, float]:
        return i, torch.rand(()).item() + random.random() + float(np.random.rand())


def epochs(loader: DataLoader, n: int) -> list[list[tuple[int, float]]]:
    out = []
    for _ in range(n):
        out.append([(int(i), float(v)) for b in loader for i, v in zip(b[0], b[1], strict=True)])
    return out


def test_a_restore_at_every_batch_continues_the_same_stream():
    ref = DataLoader(Noisy(), batch_size=3, shuffle=True, seed=5)
    full = [list(zip(b[0].tolist(), b[1].tolist(), strict=True)) for _ in range(3) for b in ref]
    assert len(full) == 12 and len(ref) == 4
    assert sorted(i for b in full[:4] for i, _ in b) == list(range(10))  # one epoch: each sample once
    assert [i for b in full[:4] for i, _ in b] != [i for b in full[4:8] for i, _ in b]  # reshuffled
    for cut in range(1, 12):
        # Walk to the cut through whole epochs, then save (the loop body's point of view).
        live = DataLoader(Noisy(), batch_size=3, shuffle=True, seed=5)
        seen = 0
        saved = None
        while saved is None:
            for _b in live:
                seen += 1
                if seen == cut:
                    saved = live.state_dict()
                    break
        again = DataLoader(Noisy(), batch_size=3, shuffle=True)  # no seed given: the saved one
        again.load_state_dict(saved)
        rest = []
        while again.epoch < 3:
            rest += [list(zip(b[0].tolist(), b[1].tolist(), strict=True)) for b in again]
        assert rest == full[cut:], cut


def test_a_save_at_an_epochs_last_batch_resumes_at_the_next_epoch():
    loader = DataLoader(Noisy(), batch_size=5, shuffle=True, seed=1)
    for _ in loader:
        state = loader.state_dict()
    assert (state["epoch"], state["batch_idx"]) == (0, 2)
    again = DataLoader(Noisy(), batch_size=5, shuffle=True, seed=1)
    again.load_state_dict(state)
    assert (again.epoch, again.batch_idx) == (1, 0)  # `for epoch in range(loader.epoch, E)` is right
    assert [b[0].tolist() for b in again] == [b[0].tolist() for b in loader]


def test_fetching_in_the_main_process_leaves_the_training_rngs_alone():
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    for _ in DataLoader(Noisy(), batch_size=4, shuffle=True, seed=2):
        pass
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()


def test_the_batch_digest_names_epoch_batch_and_indices():
    loader = DataLoader(Noisy(), batch_size=4, shuffle=True, seed=2)
    assert loader.last_batch_digest is None
    digests = []
    for _ in range(2):
        for _b in loader:
            digests.append(loader.last_batch_digest)
    assert [d.split(":")[:2] for d in digests] == [[str(e), str(b)] for e in range(2) for b in range(3)]
    assert len(set(d.split(":")[2] for d in digests)) == 6


def test_a_position_saved_over_another_loader_is_refused_and_nothing_changes():
    state = DataLoader(Noisy(), batch_size=3, shuffle=True, seed=1).state_dict()
    other = DataLoader(Noisy(), batch_size=4, shuffle=True, seed=8)
    with pytest.raises(StateMismatchError) as info:
        other.load_state_dict(state)
    assert info.value.mismatches == [
        "loader: batch_size was 3 when saved, is 4 now",
        "loader: seed was 1 when saved, is 8 now (pass seed=1, or leave seed and generator out to take the saved one)",
    ]
    assert (other.seed, other.epoch, other.batch_idx) == (8, 0, 0)
    with pytest.raises(StateMismatchError):
        other.load_state_dict({"format": "something else"})


def test_what_cannot_be_resumed_by_index_is_refused():
    class Stream(tud.IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(ConfigError, match="StatefulDataLoader"):
        DataLoader(Stream(), batch_size=2)
    with pytest.raises(ConfigError, match="sampler"):
        DataLoader(Noisy(), batch_size=2, sampler=tud.SequentialSampler(range(10)))
    with pytest.raises(ConfigError, match="ckptsdk.DataLoader"):
        ckptsdk.TrainState(loader=tud.DataLoader(Noisy(), batch_size=2))


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11 on torch 2.14
def test_a_stateful_dataloader_with_its_own_generator_is_refused():
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    with pytest.raises(ConfigError, match="generator=None"):
        ckptsdk.TrainState(
            loader=sdl.StatefulDataLoader(Noisy(), batch_size=2, shuffle=True, generator=torch.Generator())
        )
    ckptsdk.TrainState(loader=sdl.StatefulDataLoader(Noisy(), batch_size=2, shuffle=True))


def test_save_position_is_checked_against_the_loader():
    loader = DataLoader(Noisy(), batch_size=5)
    state = ckptsdk.TrainState(loader=loader)
    it = iter(loader)
    next(it)
    assert resolve_position(state, None, None) == (0, 1)
    assert resolve_position(state, 0, 1) == (0, 1)
    with pytest.raises(ConfigError, match="i \\+ 1 for"):
        resolve_position(state, 0, 0)  # enumerate's i, not i + 1
    next(it)
    assert resolve_position(state, 1, 0) == (1, 0)  # (0, 2) and (1, 0) are one position
    with ckptsdk.CheckpointManager("memory://loader-pos", lease_options=LeaseOptions(ttl=5)) as mgr:
        with pytest.raises(ConfigError):
            mgr.save(state, step=2, epoch=0, batch_idx=1)
        assert mgr.list() == []
        info = mgr.save(state, step=2)
        position = mgr.list()[0].manifest.position
        assert (info.step, position.epoch, position.batch_idx) == (2, 0, 2)


def test_a_checkpoint_round_trip_through_the_manager():
    loader = DataLoader(Noisy(), batch_size=3, shuffle=True, seed=4, num_workers=0)
    model = torch.nn.Linear(2, 2)
    state = ckptsdk.TrainState(model=model, loader=loader)
    with ckptsdk.CheckpointManager("memory://loader-rt", lease_options=LeaseOptions(ttl=5)) as mgr:
        assert mgr.restore(state) is None
        it = iter(loader)
        next(it), next(it)
        mgr.log_step(2, loss=1.0)
        mgr.save(state, step=2)
        expected = [b[0].tolist() for b in it]
    again = DataLoader(Noisy(), batch_size=3, shuffle=True)  # takes the saved seed
    with ckptsdk.CheckpointManager("memory://loader-rt", lease_options=LeaseOptions(ttl=5, force=True)) as mgr:
        pos = mgr.restore(ckptsdk.TrainState(model=torch.nn.Linear(2, 2), loader=again))
        assert (pos.epoch, pos.batch_idx, again.batch_idx) == (0, 2, 2)
        assert [b[0].tolist() for b in again] == expected
