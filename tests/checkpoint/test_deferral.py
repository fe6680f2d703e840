"""The deferral flags kept between saves are the flags worked out afresh, whatever changed.

A pipelined save copies a flagged tensor after ``save()`` returns, holding the next optimizer
step for it; ``Deferral`` keeps what it looked up for the next save. A kept flag that a change
made stale would defer a tensor the forward pass changes (a failed save) or, worse, copy too
late: each change a job makes between saves is checked against a fresh ``Deferral``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from ckptsdk import TrainState
from ckptsdk.checkpoint.writing.deferral import Deferral, step_only_keys


class _Job:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.state = TrainState(model=self.model, optimizer=self.opt)

    def step(self) -> None:
        self.opt.zero_grad()
        self.model(torch.randn(5, 3)).sum().backward()
        self.opt.step()

    def tensors(self) -> list[torch.Tensor]:
        """What a save's capture hands over: the tree's tensors (keep_vars), RNG keys fresh."""
        tree = self.state.state_dict(keep_vars=True)
        model = list(tree["objects"]["model"].values())
        opt = [v for entry in tree["objects"]["optimizer"]["state"].values() for v in entry.values()]
        return [*model, *opt, tree["rng"]["torch"]]


def _fresh(job: _Job, tensors: list[torch.Tensor]) -> list[bool]:
    return Deferral().flags(job.state.optimizers(), tensors)


def _by_rule(job: _Job, tensors: list[torch.Tensor]) -> list[bool]:
    keys = step_only_keys(job.state.optimizers())
    return [t.numel() > 0 and (t.data_ptr(), t.dtype, tuple(t.shape)) in keys for t in tensors]


def _replace_param(job: _Job) -> None:
    old = job.model[0].weight
    new = torch.nn.Parameter(old.detach().clone())
    job.model[0].weight = new
    params = job.opt.param_groups[0]["params"]
    for i, p in enumerate(params):
        if p is old:  # the optimizer steps the new one, not the old
            params[i] = new
            if old in job.opt.state:
                job.opt.state[new] = job.opt.state.pop(old)


def _reset_momentum(job: _Job) -> None:
    weight = job.model[2].weight
    if any(p is weight for g in job.opt.param_groups for p in g["params"]):
        job.opt.state[weight]["momentum_buffer"] = torch.zeros_like(weight)


def _freeze_first(job: _Job) -> None:
    group = job.opt.param_groups[0]
    for p in group["params"][:2]:
        job.opt.state.pop(p, None)
    group["params"] = group["params"][2:]  # the first two are no longer stepped


def _forget_state(job: _Job) -> None:
    job.opt.state.clear()


def _new_group(job: _Job) -> None:
    extra = torch.nn.Parameter(torch.ones(3))
    job.model.register_parameter("extra", extra)
    job.opt.add_param_group({"params": [extra]})


def _alias_buffer(job: _Job) -> None:
    # A buffer that is the weight's memory under another object: deferred by the pointer rule.
    job.model[1].register_buffer("alias", job.model[2].weight.detach())


def _buffer_becomes_alias(job: _Job) -> None:
    # The same names and count, another object at one place, whose answer differs: the kept
    # answer of the object it replaces must not be reused.
    job.model[1].running_mean = job.model[1].weight.detach()


def _new_buffer_object(job: _Job) -> None:
    job.model[1].running_mean = job.model[1].running_mean.clone()


CHANGES: dict[str, Callable[[_Job], None]] = {
    "nothing": lambda job: None,
    "a training step (momentum buffers appear)": _Job.step,
    "a parameter replaced": _replace_param,
    "a momentum buffer replaced": _reset_momentum,
    "parameters no longer stepped": _freeze_first,
    "optimizer state cleared": _forget_state,
    "a param group added": _new_group,
    "a buffer aliasing a parameter": _alias_buffer,
    "a buffer replaced by a new object": _new_buffer_object,
    "a buffer replaced by an alias of a parameter": _buffer_becomes_alias,
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_kept_flags_are_the_fresh_flags_after_each_change(change):
    job = _Job()
    first = job.tensors()
    assert job.state.step_only_flags(first) == _fresh(job, first)
    job.step()
    before = job.tensors()
    assert job.state.step_only_flags(before) == _fresh(job, before) == _by_rule(job, before)
    CHANGES[change](job)
    after = job.tensors()
    assert job.state.step_only_flags(after) == _fresh(job, after) == _by_rule(job, after)
    again = job.tensors()  # and the save after it, kept from this one
    assert job.state.step_only_flags(again) == _fresh(job, again) == _by_rule(job, again)


def test_changes_in_random_order_keep_the_fresh_flags():
    rng = random.Random(7)
    job = _Job()
    job.step()
    names = [n for n in CHANGES if n != "a param group added"]  # (once: its name is taken after)
    for _ in range(60):
        name = rng.choice(names)
        CHANGES[name](job)
        tensors = job.tensors()
        assert job.state.step_only_flags(tensors) == _fresh(job, tensors), name


def test_a_save_of_the_same_objects_looks_nothing_up_again(monkeypatch):
    """The point of keeping them: the same tree again costs no lookup per tensor."""
    job = _Job()
    job.step()
    tensors = job.tensors()
    want = job.state.step_only_flags(tensors)
    looked: list[torch.Tensor] = []
    from ckptsdk.checkpoint.writing import deferral

    real = deferral._Held.flag

    def counting(self: deferral._Held, t: torch.Tensor) -> bool:
        looked.append(t)
        return real(self, t)

    monkeypatch.setattr(deferral._Held, "flag", counting)
    tensors[-1] = job.tensors()[-1]  # the RNG key: a new object at each save
    assert job.state.step_only_flags(tensors) == want
    assert looked == [tensors[-1]]  # only the new object was looked up
