"""RNG capture/restore and TrainState: streams resume exactly, capturing draws nothing, and a
checkpoint that does not fit the live objects is refused before anything is loaded."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import safetensors.torch
import torch

from ckptsdk.errors import ConfigError, StateMismatchError
from ckptsdk.format.codec import decode, encode
from ckptsdk.rng import capture_rng, restore_rng
from ckptsdk.state import TrainState


def through_files(tree):
    tensors, skeleton = encode(tree)
    blob = safetensors.torch.save({k: v.contiguous().clone() for k, v in tensors.items()})
    return decode(json.loads(json.dumps(skeleton, allow_nan=False)), safetensors.torch.load(blob))


def draws():
    return (
        torch.rand(3).tolist(),
        torch.randn(2, dtype=torch.float64).tolist(),
        np.random.rand(3).tolist(),
        np.random.normal(size=1).tolist(),
        [random.random() for _ in range(3)],
        random.gauss(0, 1),
    )


def test_restore_rng_replays_every_stream_exactly():
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    random.gauss(0, 1)  # leaves a cached gauss value in the state: it must survive too
    np.random.normal()
    saved = through_files(capture_rng())
    expected = draws()
    draws()  # move every stream on
    restore_rng(saved)
    assert draws() == expected


def test_capture_rng_and_state_dict_never_draw():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    state = TrainState(model=model, optimizer=opt, scheduler=sched, scaler=torch.amp.GradScaler("cpu"))

    def seed():
        torch.manual_seed(2)
        np.random.seed(2)
        random.seed(2)

    seed()
    expected = draws()
    seed()
    for _ in range(3):
        state.state_dict()
        capture_rng()
    assert draws() == expected


def test_restore_rng_with_fewer_cuda_devices_warns_and_restores_the_rest(caplog):
    if torch.cuda.is_available():
        pytest.skip("written for a machine without CUDA (the checkpoint fakes 2 devices)")
    torch.manual_seed(3)
    saved = capture_rng()
    saved["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 2
    expected = torch.rand(2)
    torch.rand(5)
    with caplog.at_level(logging.WARNING, logger="ckptsdk.state"):
        restore_rng(through_files(saved))
    assert "CUDA RNG states for 2 device(s), this machine has 0" in caplog.text
    assert torch.equal(torch.rand(2), expected)


def test_restore_rng_refuses_a_mangled_tree():
    saved = capture_rng()
    bad = dict(saved, python=list(saved["python"]))  # what plain JSON would have made of it
    with pytest.raises(StateMismatchError, match="rng/python") as info:
        restore_rng(bad)
    assert info.value.mismatches == [
        "rng/python: expected random.getstate()'s tuple (a list? then "
        "the tree went through plain JSON instead of the codec)"
    ]
    with pytest.raises(StateMismatchError, match="missing 'torch'"):
        restore_rng({"numpy": saved["numpy"], "python": saved["python"]})


class Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def _objects(width=4, classes=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, classes))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, width)).sum().backward()
    opt.step()
    return model, opt


def test_train_state_round_trip_restores_objects_and_rng():
    model, opt = _objects()
    counter = Counter()
    counter.n = 41
    tree = through_files(TrainState(model=model, optimizer=opt, counter=counter).state_dict())
    expected = torch.rand(2)
    model2, opt2 = _objects()
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    counter2 = Counter()
    TrainState(model=model2, optimizer=opt2, counter=counter2).load_state_dict(tree)
    assert counter2.n == 41
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        opt2.state_dict()["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"]
    )
    assert torch.equal(torch.rand(2), expected)


def test_model_mismatches_are_listed_and_nothing_is_loaded():
    model, opt = _objects()
    tree = through_files(TrainState(model=model, optimizer=opt).state_dict())
    other = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 5), torch.nn.Linear(5, 2)
    )
    before = {k: v.clone() for k, v in other.state_dict().items()}
    opt_other = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(StateMismatchError) as info:
        TrainState(model=other, optimizer=opt_other).load_state_dict(tree)
    found = info.value.mismatches
    assert "model: missing key '3.weight' (in the live model, not in the checkpoint)" in found
    assert "model: '2.weight' has shape [3, 8] in the checkpoint, [5, 8] in the live model" in found
    assert "optimizer: param group 0 has 6 params in the checkpoint, 8 in the live optimizer" in found
    assert len(found) == 5 and "5 mismatch(es)" in str(info.value) and "Traceback" not in str(info.value)
    for key, value in other.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} was loaded despite the mismatch"


def test_unexpected_keys_and_optimizer_state_shapes():
    model, opt = _objects()
    tree = through_files(TrainState(model=model, optimizer=opt).state_dict())
    tree["objects"]["model"]["extra.weight"] = torch.zeros(1)
    tree["objects"]["optimizer"]["state"][0]["momentum_buffer"] = torch.zeros(7)
    model2, opt2 = _objects()
    with pytest.raises(StateMismatchError) as info:
        TrainState(model=model2, optimizer=opt2).load_state_dict(tree)
    assert info.value.mismatches == [
        "model: unexpected key 'extra.weight' (in the checkpoint, not in the live model)",
        "optimizer: state[0]['momentum_buffer'] has shape [7] in the checkpoint, the live param has [8, 4]",
    ]
    # strict=False skips keys on one side only, never a shape mismatch.
    with pytest.raises(StateMismatchError) as info:
        TrainState(model=model2, optimizer=opt2).load_state_dict(tree, strict=False)
    assert len(info.value.mismatches) == 1


def test_objects_missing_or_extra_in_the_checkpoint():
    model, opt = _objects()
    tree = through_files(TrainState(model=model, optimizer=opt).state_dict())
    model2, opt2 = _objects()
    with pytest.raises(StateMismatchError) as info:
        TrainState(model=model2, scaler=torch.amp.GradScaler("cpu")).load_state_dict(tree)
    assert info.value.mismatches == [
        "objects: 'scaler' is in this TrainState but not in the checkpoint",
        "objects: 'optimizer' is in the checkpoint but not in this TrainState",
    ]
    state = TrainState(model=model2)
    state.load_state_dict(tree, strict=False)  # loads what matches
    assert torch.equal(model2[0].weight, model[0].weight)
    with pytest.raises(StateMismatchError, match="not a TrainState"):
        state.load_state_dict({"model": {}})


def test_param_group_count_and_load_failures_are_state_mismatches():
    model, opt = _objects()
    tree = through_files(TrainState(model=model, optimizer=opt).state_dict())
    model2, _ = _objects()
    two_groups = torch.optim.SGD(
        [{"params": list(model2.parameters())[:2]}, {"params": list(model2.parameters())[2:]}], lr=0.1
    )
    with pytest.raises(StateMismatchError, match="1 param group"):
        TrainState(model=model2, optimizer=two_groups).load_state_dict(tree)
    counter = Counter()
    tree["objects"] = {"counter": {"m": 1}}
    with pytest.raises(StateMismatchError, match="loading 'counter' failed") as info:
        TrainState(counter=counter).load_state_dict(tree)
    assert isinstance(info.value.__cause__, KeyError)


def test_objects_without_state_dict_are_refused_up_front():
    with pytest.raises(ConfigError, match=r"TrainState\(model=...\) got a str"):
        TrainState(model="resnet")


def test_capture_rng_never_initialises_cuda():
    was = torch.cuda.is_initialized()
    tree = capture_rng()
    assert torch.cuda.is_initialized() == was
    if not was:
        assert tree["cuda"] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rng_streams_resume_on_every_device():
    torch.cuda.manual_seed_all(5)
    torch.cuda.init()
    saved = through_files(capture_rng())
    assert len(saved["cuda"]) == torch.cuda.device_count()
    expected = [torch.rand(3, device=f"cuda:{i}").tolist() for i in range(torch.cuda.device_count())]
    restore_rng(saved)
    assert [torch.rand(3, device=f"cuda:{i}").tolist() for i in range(torch.cuda.device_count())] == expected


class _OwnStateDict(torch.nn.Linear):
    """A module overriding ``state_dict`` without ``keep_vars``."""

    def state_dict(self):  # type: ignore[override]
        return {"w": self.weight.detach()}


def test_state_dict_keep_vars_hands_over_parameters_as_they_are():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    own = _OwnStateDict(2, 2)
    state = TrainState(model=model, own=own)
    kept = state.state_dict(keep_vars=True)["objects"]
    assert kept["model"]["0.weight"] is model[0].weight  # the Parameter itself, not detached
    assert kept["model"]["1.running_mean"] is model[1].running_mean
    assert list(kept["own"]) == ["w"]  # asked without keep_vars, as it was written
    plain = state.state_dict()["objects"]["model"]
    assert type(plain["0.weight"]) is torch.Tensor and not plain["0.weight"].requires_grad
    assert list(plain) == list(kept["model"]) and plain._metadata == kept["model"]._metadata
    for key, t in plain.items():
        assert torch.equal(t, kept["model"][key]) and t.data_ptr() == kept["model"][key].data_ptr(), key


def test_step_only_flags_follow_the_tensor_key_rule_by_object_and_by_pointer():
    """Flags say which tree tensors only optimizer.step() changes (a pipelined save defers their
    copy): the very objects, or another tensor at a stepped one's pointer, dtype and shape."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = TrainState(model=model, optimizer=opt)
    weight = model[0].weight
    momentum = opt.state[weight]["momentum_buffer"]
    empty = torch.nn.Parameter(torch.empty(0))
    opt.add_param_group({"params": [empty]})
    tensors = [
        weight,  # the parameter itself
        weight.detach(),  # another object, same pointer, dtype and shape
        weight.detach().view(-1),  # same pointer, another shape: changed by step(), not the same tensor
        weight.detach().view(torch.int32),  # same pointer, another dtype
        momentum,  # the optimizer's own state
        model[1].running_mean,  # changed in forward: never deferred
        weight.detach().clone(),  # a copy: its own storage
        empty,  # nothing to copy
    ]
    assert state.step_only_flags(tensors) == [True, True, False, False, True, False, False, False]
    keys = state.step_only_tensors()
    assert state.step_only_flags(tensors) == [
        t.numel() > 0 and (t.data_ptr(), t.dtype, tuple(t.shape)) in keys for t in tensors
    ]
