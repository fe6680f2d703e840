"""The pipelined snapshot's rule, broken each way a user might: a loud failure, or a documented gap.

The rule (README, docs/GUARANTEES.md): between ``save()`` and the next ``optimizer.step()``, only
that step may change parameters and optimizer state. A break that torch's version counters see
fails the save with a ``CheckpointError`` naming the tensor, the rule and ``snapshot="copy"``,
and the previous checkpoint stays the newest. Each break is made deterministic by holding the
background copy (or the commit) until the edit is done. The breaks torch does not count
(``.data`` edits, numpy views, a fused optimizer) are shown for what they are: the checkpoint
holds the edited values; GUARANTEES says so.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState
from ckptsdk.backends.memory import MemoryBackend
from ckptsdk.checkpoint.writing import staging
from ckptsdk.errors import CheckpointError
from ckptsdk.testing import FaultyBackend

pytestmark = pytest.mark.timeout(120)

RULE = r"pipelined snapshot's rule was broken: 'objects/model/0\.weight' was changed in place"


class Job:
    """A two-layer model with SGD momentum (so the optimizer has state), stepped once."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.state = TrainState(model=self.model, optimizer=self.opt)
        self.step()

    def step(self) -> None:
        x = torch.randn(4, 8)
        self.opt.zero_grad()
        self.model(x).square().mean().backward()
        self.opt.step()

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


@pytest.fixture
def root() -> Iterator[Callable[..., CheckpointManager]]:
    made: list[str] = []

    def open_root(*, snapshot: str = "pipelined", backend: object | None = None) -> CheckpointManager:
        name = f"memory://rule-{uuid.uuid4().hex}"
        made.append(name)
        target = backend if backend is not None else name
        return CheckpointManager(
            target,
            keep_last=3,
            lease_options=LeaseOptions(ttl=30),
            save_options=SaveOptions(on_signal=False, snapshot=snapshot),
        )  # type: ignore[arg-type]

    yield open_root
    for name in made:
        MemoryBackend.discard_store(name.removeprefix("memory://"))


@contextmanager
def copy_held(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Hold the background copy of the deferred tensors until the event is set."""
    go = threading.Event()
    real = staging.memcpy

    def held(dst: torch.Tensor, src: torch.Tensor) -> None:
        assert go.wait(30), "the test never released the copy"
        real(dst, src)

    monkeypatch.setattr(staging, "memcpy", held)
    try:
        yield go
    finally:
        go.set()
        monkeypatch.setattr(staging, "memcpy", real)


def _write_gate() -> tuple[FaultyBackend, threading.Event, threading.Event]:
    """A memory root whose tensor file writes wait for ``go`` (``arrived`` is set on arrival):
    the snapshot's copy is done by then, the commit not yet."""
    go, at_commit = threading.Event(), threading.Event()

    def hold(op: str, key: str, _n: int) -> None:
        if op == "write" and key.endswith("tensors.safetensors") and not go.is_set():
            at_commit.set()
            assert go.wait(30), "the test never released the commit"
        return None

    inner = MemoryBackend(f"rule-gate-{uuid.uuid4().hex}")
    return FaultyBackend(inner, fail_on=hold), go, at_commit


def _saved_then_broken(
    root: Callable[..., CheckpointManager], monkeypatch: pytest.MonkeyPatch, edit: Callable[[Job], None]
) -> tuple[Job, CheckpointManager, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Commit step 1; save step 2 pipelined and ``edit`` while its copy is held; wait.

    Returns the job, the open manager, the weights of step 1 and those at save(2)."""
    job = Job()
    mgr = root()
    mgr.save(job.state, step=1, blocking=True)
    first = job.weights()
    job.step()
    at_save = job.weights()
    with copy_held(monkeypatch) as go:
        mgr.save(job.state, step=2, blocking=False)
        edit(job)
        go.set()
    return job, mgr, first, at_save


def _assert_failed_and_intact(mgr: CheckpointManager, first: dict[str, torch.Tensor]) -> None:
    with pytest.raises(CheckpointError, match=RULE) as caught:
        mgr.wait()
    message = str(caught.value)
    assert 'snapshot="copy"' in message and "the previous checkpoint is intact" in message
    assert "the save of step 2 under memory://" in message
    assert caught.value.key == "objects/model/0.weight"
    committed = [c.step for c in mgr.list() if c.committed]
    assert committed == [1], committed
    restored = mgr.load(1)["objects"]["model"]
    assert all(torch.equal(restored[k], v) for k, v in first.items())
    assert mgr.stats.failed == 1
    mgr.close()


def _no_grad(f: Callable[[Job], None]) -> Callable[[Job], None]:
    def edit(job: Job) -> None:
        with torch.no_grad():
            f(job)

    return edit


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(_no_grad(lambda j: j.model[0].weight.add_(1)), id="add_-under-no_grad"),
        pytest.param(_no_grad(lambda j: j.model[0].weight.copy_(torch.zeros(8, 8))), id="copy_"),
        pytest.param(_no_grad(lambda j: j.model[0].weight.detach().mul_(2)), id="detach-then-mul_"),
        pytest.param(_no_grad(lambda j: j.model[0].weight[0].fill_(3)), id="a-slice-fill_"),
        pytest.param(_no_grad(lambda j: torch.nn.init.zeros_(j.model[0].weight)), id="nn.init"),
        pytest.param(_no_grad(lambda j: torch._foreach_add_(list(j.model.parameters()), 1.0)), id="foreach_add_"),
        pytest.param(_no_grad(lambda j: j.model[0].weight.set_(torch.zeros(8, 8))), id="set_"),
        pytest.param(
            lambda j: j.model.load_state_dict({k: torch.zeros_like(v) for k, v in j.model.state_dict().items()}),
            id="model.load_state_dict",
        ),
    ],
)
def test_an_edit_of_a_parameter_fails_the_save_and_keeps_the_previous(root, monkeypatch, edit):
    _job, mgr, first, _ = _saved_then_broken(root, monkeypatch, edit)
    _assert_failed_and_intact(mgr, first)


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
def test_another_optimizers_step_fails_the_save(root, monkeypatch, foreach):
    def other(job: Job) -> None:
        for p in job.model.parameters():
            p.grad = torch.ones_like(p)
        torch.optim.SGD(job.model.parameters(), lr=0.5, foreach=foreach).step()  # not in the TrainState

    _job, mgr, first, _ = _saved_then_broken(root, monkeypatch, other)
    _assert_failed_and_intact(mgr, first)


def test_an_edit_of_the_optimizer_state_fails_the_save(root, monkeypatch):
    def edit(job: Job) -> None:
        with torch.no_grad():
            job.opt.state[job.model[2].bias]["momentum_buffer"].zero_()

    _job, mgr, first, _ = _saved_then_broken(root, monkeypatch, edit)
    with pytest.raises(CheckpointError, match=r"'objects/optimizer/state/3/momentum_buffer' was changed in place"):
        mgr.wait()
    assert [c.step for c in mgr.list() if c.committed] == [1]
    mgr.close()


def test_an_edit_after_the_copy_is_caught_before_the_commit(root, monkeypatch):
    """The copy is done before the edit, but the commit waits: the first step() after save()
    finds the moved counter at its start and the commit refuses."""
    job = Job()
    backend, go, at_commit = _write_gate()
    mgr = root(backend=backend)
    go.set()
    mgr.save(job.state, step=1, blocking=True)
    first = job.weights()
    go.clear()
    job.step()
    mgr.save(job.state, step=2, blocking=False)
    assert at_commit.wait(30)  # the copy is done: the worker is at the tensor file's write
    with torch.no_grad():
        job.model[0].weight.add_(1)
    job.step()  # its pre-hook records the counters
    go.set()
    _assert_failed_and_intact(mgr, first)


def test_an_edit_after_the_commit_is_not_the_checkpoints_business(root):
    job = Job()
    mgr = root()
    job.step()
    at_save = job.weights()
    mgr.save(job.state, step=1, blocking=False)
    mgr.wait()  # committed
    with torch.no_grad():
        job.model[0].weight.add_(1)
    job.step()
    mgr.save(job.state, step=2, blocking=False)
    mgr.wait()
    restored = mgr.load(1)["objects"]["model"]
    assert all(torch.equal(restored[k], v) for k, v in at_save.items())
    mgr.close()


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(
            lambda j: setattr(j.model[0], "weight", torch.nn.Parameter(torch.zeros(8, 8))), id="new-parameter"
        ),
        pytest.param(lambda j: setattr(j.model[0].weight, "data", torch.zeros(8, 8)), id="data-assigned"),
        pytest.param(lambda j: j.opt.load_state_dict(j.opt.state_dict()), id="optimizer.load_state_dict"),
    ],
)
def test_a_replaced_storage_leaves_the_snapshot_exact(root, monkeypatch, edit):
    """Replacing a tensor (rather than editing its storage) breaks the rule without harm: the
    snapshot reads the storage the tensor had at save(), so it commits the values of save()."""
    _job, mgr, _first, at_save = _saved_then_broken(root, monkeypatch, edit)
    mgr.wait()
    restored = mgr.load(2)["objects"]["model"]
    assert all(torch.equal(restored[k], v) for k, v in at_save.items())
    mgr.close()


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda j: j.model[0].weight.data.add_(1), id="data-add_"),
        pytest.param(lambda j: j.model[0].weight.detach().numpy().__iadd__(1.0), id="numpy-view"),
        pytest.param(
            lambda j: (
                [setattr(p, "grad", torch.ones_like(p)) for p in j.model.parameters()],
                torch.optim.Adam(j.model.parameters(), lr=0.5, fused=True).step(),
            ),
            id="fused-optimizer",
        ),
    ],
)
def test_what_the_counters_do_not_see_is_committed_edited(root, monkeypatch, edit):
    """Not detectable (docs/GUARANTEES.md): torch moves no version counter for writes through
    ``.data``, numpy views or fused optimizer kernels, so the save commits the edited values."""
    _job, mgr, _first, at_save = _saved_then_broken(root, monkeypatch, edit)
    mgr.wait()
    restored = mgr.load(2)["objects"]["model"]
    assert not torch.equal(restored["0.weight"], at_save["0.weight"])  # the gap, as documented
    mgr.close()


def test_snapshot_copy_is_exact_whatever_the_edit(root):
    job = Job()
    mgr = root(snapshot="copy")
    at_save = job.weights()
    mgr.save(job.state, step=1, blocking=False)
    with torch.no_grad():
        job.model[0].weight.add_(1)
    job.model[0].weight.data.add_(1)
    mgr.wait()
    restored = mgr.load(1)["objects"]["model"]
    assert all(torch.equal(restored[k], v) for k, v in at_save.items())
    mgr.close()


def test_the_optimizer_step_itself_is_not_a_break(root):
    """Saves every step, each followed at once by the step the rule allows: all commit."""
    job = Job()
    mgr = root()
    for i in range(1, 8):
        mgr.save(job.state, step=i, blocking=False)
        job.step()
    mgr.wait()
    assert mgr.stats.failed == 0
    mgr.close()
