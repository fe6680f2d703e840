"""The cached encoding is the full encoding, whatever changed in the tree since the last save.

``EncodingCache.encode`` must return exactly what ``codec.encode`` returns (the same skeleton,
node types included, and the same tensors under the same names) after every kind of change a
training job makes between saves; a stale template would be a silently wrong checkpoint.
"""

from __future__ import annotations

import copy
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from ckptsdk import TrainState
from ckptsdk.format import codec
from ckptsdk.format.template import EncodingCache, TreeTemplate


def _strict(a: Any, b: Any, path: str = "") -> None:
    """Equal and of the same types all the way down (``==`` alone takes True for 1, 1 for 1.0)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            _strict(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), f"{path}: lengths"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _strict(x, y, f"{path}/{i}")
    elif isinstance(a, float):
        assert a == b or (math.isnan(a) and math.isnan(b)), path
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def _same_as_full(cache: EncodingCache, tree: Any) -> None:
    got = cache.encode(tree)
    tensors, skeleton = codec.encode(tree)
    _strict(got.skeleton(), skeleton)
    assert got.names == tuple(tensors)
    for name, t, want in zip(got.names, got.tensors, tensors.values(), strict=True):
        assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want), name
    # The capture keeps a parameter as found (the staging copy detaches); the dict is detached.
    assert not any(t.requires_grad for t in got.tensor_dict().values())
    assert got.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())


def _base() -> dict[str, Any]:
    model = OrderedDict([("w", torch.ones(2, 3)), ("b", torch.zeros(3))])
    model._metadata = OrderedDict([("", {"version": 1})])  # type: ignore[attr-defined]
    return {
        "model": model,
        "opt": {"state": {0: {"momentum_buffer": torch.ones(2, 3)}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
        "sched": {"last_epoch": 3, "_last_lr": [0.1], "milestones": Counter({5: 1}), "name": "cos"},
        "rng": {"python": (3, tuple(range(10)), None), "numpy": {"state": 2**100, "gauss": 0.5}},
        "extra": {"seen": deque([1, 2], maxlen=4), "arr": np.arange(3, dtype=np.int16), "x": np.float32(1.5)},
    }


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(tree: dict[str, Any]) -> None:
        node = tree
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value

    return change


def _delete(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def change(tree: dict[str, Any]) -> None:
        node = tree
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]

    return change


def _meta(tree: dict[str, Any]) -> None:
    tree["model"]._metadata[""]["version"] = 2


def _no_meta(tree: dict[str, Any]) -> None:
    del tree["model"]._metadata


def _reorder(tree: dict[str, Any]) -> None:
    tree["model"].move_to_end("w")


CHANGES = {
    "scalar value": _set(("sched", "last_epoch"), 4),
    "int to float": _set(("sched", "last_epoch"), 4.0),
    "int to bool": _set(("opt", "param_groups", 0, "params", 0), True),
    "float to nan": _set(("rng", "numpy", "gauss"), float("nan")),
    "float to -0.0": _set(("rng", "numpy", "gauss"), -0.0),
    "big int": _set(("rng", "numpy", "state"), 2**200),
    "scalar to tensor": _set(("sched", "last_epoch"), torch.ones(1)),
    "list grows": _set(("sched", "_last_lr"), [0.1, 0.2, float("inf")]),
    "list of scalars to list of tensors": _set(("sched", "_last_lr"), [torch.ones(1)]),
    "tuple to list": _set(("rng", "python"), [3, tuple(range(10)), None]),
    "new optimizer state entry": _set(("opt", "state", 1), {"momentum_buffer": torch.zeros(3)}),
    "new param group": lambda t: t["opt"]["param_groups"].append({"lr": 0.2, "params": [2]}),
    "int key to bool key": lambda t: t["opt"].__setitem__("state", {True: t["opt"]["state"][0]}),
    "int key to str key": lambda t: t["opt"].__setitem__("state", {"0": t["opt"]["state"][0]}),
    "new key": _set(("extra", "new"), {"a": 1}),
    "key removed": _delete(("sched", "name")),
    "keys reordered": _reorder,
    "tensor shape": _set(("model", "w"), torch.ones(3, 2)),
    "tensor dtype": _set(("model", "w"), torch.ones(2, 3, dtype=torch.float64)),
    "tensor to bfloat16": _set(("model", "b"), torch.zeros(3, dtype=torch.bfloat16)),
    "tensor replaced, same shape": _set(("model", "w"), torch.full((2, 3), 7.0)),
    "non-contiguous tensor": _set(("model", "w"), torch.ones(3, 2).t()),
    "tensor requiring grad": _set(("model", "w"), torch.ones(2, 3, requires_grad=True)),
    "a parameter": _set(("model", "w"), torch.nn.Parameter(torch.ones(2, 3))),
    "conjugate view": _set(("model", "b"), torch.ones(3, dtype=torch.complex64).conj()),
    "tensor to ndarray": _set(("model", "b"), np.zeros(3, dtype=np.float32)),
    "ndarray dtype": _set(("extra", "arr"), np.arange(3, dtype=np.int64)),
    "numpy scalar dtype": _set(("extra", "x"), np.float64(1.5)),
    "ndarray shape": _set(("extra", "arr"), np.arange(4, dtype=np.int16)),
    "ndarray values": _set(("extra", "arr"), np.array([7, -8, 9], dtype=np.int16)),
    "ndarray byte order": _set(("extra", "arr"), np.arange(3, dtype=">i2")),
    "read-only ndarray": lambda t: (
        t["extra"].__setitem__("arr", np.arange(3, dtype=np.int16)) or t["extra"]["arr"].setflags(write=False)
    ),
    "reversed ndarray": _set(("extra", "arr"), np.arange(3, dtype=np.int16)[::-1]),
    "strided ndarray": _set(("extra", "arr"), np.arange(6, dtype=np.int16)[::2]),
    "ndarray to tensor": _set(("extra", "arr"), torch.arange(3, dtype=torch.int16)),
    "ndarray to list": _set(("extra", "arr"), [0, 1, 2]),
    "counter values": lambda t: t["sched"]["milestones"].update({5: 1, 9: 2}),
    "deque grows": lambda t: t["extra"]["seen"].append(3),
    "dict to OrderedDict": lambda t: t.__setitem__("sched", OrderedDict(t["sched"])),
    "metadata version": _meta,
    "metadata removed": _no_meta,
    "nan key": _set(("extra", float("nan")), 1),
    "float keys 0.0 then -0.0": lambda t: t.__setitem__("fk", {0.0: 1} if "fk" not in t else {-0.0: 1}),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_every_change_between_saves_is_encoded_as_in_full(change):
    tree = _base()
    cache = EncodingCache()
    _same_as_full(cache, tree)
    _same_as_full(cache, tree)  # the template's own capture
    CHANGES[change](tree)
    _same_as_full(cache, tree)
    _same_as_full(cache, tree)  # and the template rebuilt from the changed tree
    try:
        CHANGES[change](tree)  # some changes differ the second time ("float keys", "list grows")
    except (KeyError, AttributeError):
        return  # a removal cannot be made twice
    _same_as_full(cache, tree)


def test_changes_in_sequence_each_encoded_as_in_full():
    tree = _base()
    cache = EncodingCache()
    for name, change in CHANGES.items():
        if name in ("metadata removed", "conjugate view", "int key to bool key", "int key to str key"):
            continue  # they (or what follows them) need a part of the tree the sequence changed
        change(tree)
        _same_as_full(cache, tree)


def test_an_unchanged_tree_is_captured_without_a_full_encode():
    tree = _base()
    cache = EncodingCache()
    for i in range(5):
        tree["sched"]["last_epoch"] = i
        tree["model"]["w"].add_(1)  # in place: same tensor
        _same_as_full(cache, tree)
    assert cache.rebuilds == 1


def test_a_train_states_tree_is_sized_numpy_rng_key_included():
    """Every TrainState carries numpy's RNG key (a uint32 array): modelled, the tree stays sized,
    so a save checks no tensor twice (see Captured.sized)."""
    model = torch.nn.Linear(3, 2)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    cache = EncodingCache()
    cache.encode(state.state_dict(keep_vars=True))
    for _ in range(3):
        np.random.rand()  # the key moves; its dtype and shape do not
        tree = state.state_dict(keep_vars=True)
        assert cache.encode(tree).sized
        _same_as_full(cache, tree)
    assert cache.rebuilds == 1


def test_a_tree_that_cannot_be_cached_is_encoded_in_full_every_time():
    tree = {"z": torch.ones(2, dtype=torch.complex64).conj()}  # resolve_conj() copies: not cached
    template, first = TreeTemplate.of(tree)
    assert template is None
    _strict(first.skeleton(), codec.encode(tree)[1])


def test_the_leaves_are_taken_at_capture_not_when_the_skeleton_is_built():
    """The skeleton is built on the save worker, after training went on: what it holds must be
    the values at capture."""
    tree = _base()
    cache = EncodingCache()
    cache.encode(tree)
    captured = cache.encode(tree)
    want = copy.deepcopy(codec.encode(tree)[1])
    tree["sched"]["_last_lr"].append(9.0)  # a live list, changed after save()
    tree["sched"]["last_epoch"] = 99
    tree["rng"]["numpy"]["gauss"] = 7.0
    tree["extra"]["seen"].append(5)
    _strict(captured.skeleton(), want)


def test_a_refused_leaf_is_refused_as_by_the_full_encode():
    tree = _base()
    cache = EncodingCache()
    cache.encode(tree)
    tree["sched"]["fn"] = lambda: 0
    with pytest.raises(codec.UnsupportedStateError, match="sched/fn"):
        cache.encode(tree)
    del tree["sched"]["fn"]
    tree["extra"]["seen"].append(object())  # inside a node encoded in full at each save
    with pytest.raises(codec.UnsupportedStateError, match="extra/seen/2"):
        cache.encode(tree)
