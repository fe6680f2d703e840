"""Pacing: a background save's tensor writes wait while an optimizer step runs, and only briefly.

The bytes never change (the file equals an unpaced write); nothing is written while the gate is
closed; a step that never says it ended (it raised) or that waits for the save itself delays the
save by at most the budget, then the save commits and restores exactly.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, TrainState, open_backend
from ckptsdk.checkpoint.writing import pacing, saving
from ckptsdk.checkpoint.writing.pacing import Paced
from ckptsdk.format.files import tensorwriter
from ckptsdk.format.files.tensorfile import read_tensorfile, write_tensorfile
from ckptsdk.format.layout import TENSORS
from ckptsdk.testing import FaultyBackend


class _Recording:
    """A backend's ``write`` that records each chunk it is handed (and says when it got one)."""

    url = "memory://recording"

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, key: str, data: Any) -> int:
        for chunk in data:
            self.chunks.append(bytes(chunk))
        return sum(map(len, self.chunks))


class _WatchedEvent(threading.Event):
    """An Event that says when somebody starts waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(300, 100, generator=gen),  # 120,000 bytes: many slices below
        "small": torch.arange(7, dtype=torch.int16),
        "bf16": torch.randn(33, generator=gen).to(torch.bfloat16),
    }


def test_a_paced_file_is_byte_for_byte_the_unpaced_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pacing, "SLICE_BYTES", 4096)
    backend = open_backend("memory://paced-bytes")
    idle = threading.Event()
    idle.set()
    plain = write_tensorfile(backend, "plain.safetensors", _tensors())
    paced = write_tensorfile(Paced(backend, idle), "paced.safetensors", _tensors())  # type: ignore[arg-type]
    assert paced == plain  # same size, same digest
    assert backend.read("paced.safetensors") == backend.read("plain.safetensors")
    back = read_tensorfile(backend, "paced.safetensors", size=paced[0], digest=paced[1])
    for name, t in _tensors().items():
        assert torch.equal(back[name], t), name


def test_nothing_is_written_while_a_step_runs_and_all_of_it_once_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pacing, "SLICE_BYTES", 1000)
    idle = _WatchedEvent()  # cleared: a step is running
    sink = _Recording()
    paced = Paced(sink, idle, max_wait=600.0)
    data = bytes(range(256)) * 10  # 2,560 bytes: three slices
    writer = threading.Thread(target=paced.write, args=("k", [memoryview(data)]), daemon=True)
    writer.start()
    assert idle.waiting.wait(60), "the write never looked at the gate"
    assert sink.chunks == []  # it waits before its first slice
    idle.set()  # the step ended
    writer.join(60)
    assert not writer.is_alive()
    assert [len(c) for c in sink.chunks] == [1000, 1000, 560]
    assert b"".join(sink.chunks) == data


def test_the_digest_is_hashed_only_while_no_step_runs_and_is_the_unpaced_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hash after the writes (a thread of its own, zero-copy path) looks at the gate before
    each slice: a step running after the last write holds it back, and the digest is unchanged."""
    monkeypatch.setattr(tensorwriter, "_HASH_SLICE", 4096)
    backend = open_backend("memory://paced-digest")
    plain = write_tensorfile(backend, "plain.safetensors", _tensors())
    idle = threading.Event()
    idle.set()
    paced = Paced(backend, idle, max_wait=600.0)
    hashed: list[bool] = []  # per slice hashed: was the gate open?
    step_began = threading.Event()

    def pause() -> None:
        if not hashed:  # the writes are done: an optimizer step starts now
            idle.clear()
            step_began.set()
        paced.wait()
        hashed.append(idle.is_set())

    result: list[tuple[int, str]] = []
    writer = threading.Thread(
        target=lambda: result.append(write_tensorfile(paced, "paced.safetensors", _tensors(), pause=pause)),
        daemon=True,
    )
    writer.start()
    assert step_began.wait(60), "the digest thread never looked at the gate"
    assert hashed == []  # held back while the step runs
    idle.set()  # the step ended
    writer.join(60)
    assert not writer.is_alive()
    assert result == [plain]  # same size, same digest
    assert len(hashed) >= 120_000 // 4096 and all(hashed)


def test_a_gate_that_never_opens_costs_at_most_the_budget() -> None:
    sink = _Recording()
    paced = Paced(sink, threading.Event(), max_wait=0.2)  # a step that raised: never set again
    paced.write("k", [b"a" * 10, b"b" * 10, b"c" * 10])
    assert b"".join(sink.chunks) == b"a" * 10 + b"b" * 10 + b"c" * 10
    assert paced.waited >= 0.2  # the first slice waited the whole budget; the others not at all


def _job(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return TrainState(model=model, optimizer=opt)


def _train(state: TrainState) -> None:
    model, opt = state.objects["model"], state.objects["optimizer"]
    opt.zero_grad()
    model(torch.randn(8, 64)).pow(2).mean().backward()
    opt.step()


def test_steps_idle_is_clear_exactly_while_an_optimizer_step_runs() -> None:
    state = _job()
    opt = state.objects["optimizer"]
    seen: list[bool] = []
    opt.register_step_pre_hook(lambda *_: seen.append(state.steps_idle.is_set()))  # runs after TrainState's
    assert state.steps_idle.is_set()
    _train(state)
    assert seen == [False] and state.steps_idle.is_set()


def test_a_step_waiting_for_the_save_itself_still_sees_it_commit(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that waits for the background save (the gate closed meanwhile): without the
    budget a deadlock; with it the save commits, and restores the state at ``save()``."""
    made: list[Paced] = []

    class Watched(Paced):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(saving, "Paced", Watched)
    state = _job()
    _train(state)
    began = threading.Event()

    def after_the_step_began(op: str, key: str, _n: int) -> None:  # the tensor write starts in the step
        if op == "write" and key.endswith(TENSORS):
            assert began.wait(60), "the step never began"

    backend = FaultyBackend(open_backend(str(tmp_path / "root")), fail_on=after_the_step_began)

    def step_waits_for_the_save(*_: Any) -> None:
        began.set()
        waited.append(mgr.wait(timeout=120))

    with CheckpointManager(backend, lease_options=LeaseOptions(ttl=60)) as mgr:
        assert mgr.restore(state) is None
        waited: list[bool] = []
        state.objects["optimizer"].register_step_pre_hook(step_waits_for_the_save)
        mgr.save(state, step=1, blocking=False)
        expected = {k: v.clone() for k, v in state.objects["model"].state_dict().items()}
        _train(state)  # its step waits for the save, whose writes wait for the step (bounded)
        assert waited == [True]
        assert state.steps_idle.is_set()
        assert [p.waited >= pacing.MAX_WAIT_S for p in made] == [True]  # the tensor file waited, once
    fresh = _job(seed=1)
    with CheckpointManager(str(tmp_path / "root"), read_only=True) as reader:
        point = reader.restore(fresh)
    assert point is not None and point.step == 1
    for key, t in fresh.objects["model"].state_dict().items():
        assert torch.equal(t, expected[key]), key
