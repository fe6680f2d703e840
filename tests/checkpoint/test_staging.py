"""Staging buffers: exact copies, reused across snapshots, isolated from later training steps."""

from __future__ import annotations

import threading

import pytest
import torch

from ckptsdk import open_backend
from ckptsdk.checkpoint.writing.staging import Stager
from ckptsdk.errors import CheckpointError, ConfigError
from ckptsdk.format.files.tensorfile import read_tensorfile, write_tensorfile


def _state() -> dict[str, torch.Tensor]:
    return {
        "w": torch.randn(32, 16),
        "b": torch.randn(16).to(torch.bfloat16),
        "steps": torch.tensor(3),
        "rng": torch.get_rng_state(),
        "mask": torch.rand(9) > 0.5,
        "empty": torch.zeros(0, 4),
    }


def test_snapshot_values_equal_and_plain_contiguous_cpu():
    src = _state()
    snap = Stager().snapshot(src)
    assert list(snap) == list(src)
    for name, t in src.items():
        s = snap[name]
        assert s.dtype == t.dtype and s.shape == t.shape and s.device.type == "cpu", name
        assert s.is_contiguous() and torch.equal(s, t), name
        assert s.data_ptr() != t.data_ptr() or t.numel() == 0, name


def test_later_mutation_of_source_does_not_change_snapshot():
    src = _state()
    expected = {k: v.clone() for k, v in src.items()}
    snap = Stager().snapshot(src)
    src["w"].add_(1.0)
    src["b"].mul_(-1)
    src["steps"] += 1
    src["mask"].logical_not_()
    for name in snap:
        assert torch.equal(snap[name], expected[name]), name


def test_buffers_reused_when_names_shapes_dtypes_match():
    stager = Stager()
    src = _state()
    first = stager.snapshot(src)
    ptrs = {k: v.data_ptr() for k, v in first.items()}
    allocated = stager.allocations
    assert allocated == len(src)
    src["w"].add_(5)
    second = stager.snapshot(src)
    assert {k: v.data_ptr() for k, v in second.items()} == ptrs
    assert stager.allocations == allocated
    assert torch.equal(second["w"], src["w"])
    # The documented contract: a snapshot is valid until the next one (same memory).
    assert torch.equal(first["w"], src["w"])


def test_buffers_reallocated_when_shape_or_dtype_changes_and_stale_released():
    stager = Stager()
    src = _state()
    first = stager.snapshot(src)
    keep = first["b"].data_ptr()
    changed = dict(src)
    changed["w"] = torch.randn(8, 8)  # new shape
    changed["steps"] = torch.tensor(3.0)  # new dtype
    del changed["mask"]
    second = stager.snapshot(changed)
    assert stager.allocations == len(src) + 2
    assert second["b"].data_ptr() == keep
    assert torch.equal(second["w"], changed["w"]) and second["steps"].dtype == torch.float32
    assert "mask" not in second
    assert stager.nbytes == sum(t.numel() * t.element_size() for t in changed.values())
    stager.release()
    assert stager.nbytes == 0


def _finished(stager: Stager, src: dict[str, torch.Tensor], defer: list[bool], fixed: tuple[str, ...] | None):
    pending = stager.begin_aligned(tuple(src), list(src.values()), defer, fixed=fixed)
    pending.finish()
    return pending.tensors


def test_a_fixed_layout_reuses_buffers_without_checks_and_copies_exactly():
    """The token of a sized template: its second snapshot trusts the buffers; values stay exact."""
    stager = Stager()
    src = {**_state(), "p": torch.nn.Parameter(torch.randn(300, 200))}  # big, small, deferred, grad
    names = tuple(src)
    defer = [n in ("w", "p") for n in names]
    _finished(stager, src, defer, names)
    allocated = stager.allocations
    for _ in range(2):
        with torch.no_grad():
            src["w"].add_(1)
            src["p"].mul_(2)
            src["steps"] += 1
        snap = _finished(stager, src, defer, names)
        assert stager.allocations == allocated
        for name, t in src.items():
            assert torch.equal(snap[name], t.detach()) and not snap[name].requires_grad, name


def _taken(stager: Stager, src: dict[str, torch.Tensor], defer: list[bool], fixed: tuple[str, ...]) -> dict:
    pending = stager.begin_aligned(tuple(src), list(src.values()), defer, fixed=fixed)
    watched = pending._watched
    later = [(buf.data_ptr(), s.data_ptr(), s.requires_grad) for buf, s in pending._later]
    pending.finish()
    return {
        "buffers": {n: (t.data_ptr(), t.clone()) for n, t in pending.tensors.items()},
        "later": later,
        "watched": (list(watched[0]), [t.data_ptr() for t in watched[1]], list(watched[2])),
        "device": pending.device,
    }


def test_a_fixed_layout_sorted_as_before_takes_the_same_snapshot_as_the_full_loop():
    """The snapshot of a layout sorted like the last one (deferred, small, large) skips the test
    per tensor: it must be the full loop's snapshot, the same buffers, copies, deferred sources
    (detached, same memory), watched counters, whatever changed in between."""
    src = {**_state(), "big": torch.randn(300, 200), "p": torch.nn.Parameter(torch.randn(300, 200))}
    src["small_p"] = torch.nn.Parameter(torch.randn(5))  # small, requires grad, not deferred
    names = tuple(src)
    planned, full = Stager(), Stager()
    defer = [n in ("w", "p") for n in names]
    changes = [
        lambda: src["w"].add_(1),
        lambda: src["p"].data.mul_(2),
        lambda: src.__setitem__("big", torch.randn(200, 300).t()),  # same shape, not contiguous
        lambda: defer.__setitem__(names.index("w"), False),  # sorted otherwise: the full loop
        lambda: defer.__setitem__(names.index("big"), True),
        lambda: src["steps"].add_(1),
        lambda: src.__setitem__("p", torch.nn.Parameter(torch.randn(300, 200))),  # a new object
    ]
    for change in [lambda: None, *changes, lambda: None]:
        change()
        full._plan = None  # (the full loop every time)
        got, want = _taken(planned, src, list(defer), names), _taken(full, src, list(defer), names)
        assert got["later"] == [(a, s, False) for a, s, _ in got["later"]]  # detached
        assert [s for _, s, _ in got["later"]] == [s for _, s, _ in want["later"]]
        assert got["watched"][0] == want["watched"][0] and got["watched"][1:] == want["watched"][1:]
        assert got["device"] == want["device"] == "cpu"
        assert list(got["buffers"]) == list(src)
        for name, (_, value) in got["buffers"].items():
            assert torch.equal(value, want["buffers"][name][1]) and torch.equal(value, src[name].detach()), name
    assert planned._plan is not None  # (the path under test was taken)
    assert planned.allocations == full.allocations == len(src)


def test_a_fixed_layout_sorted_as_before_still_fails_a_broken_rule():
    stager = Stager()
    src = {"p": torch.nn.Parameter(torch.randn(300, 200)), "b": torch.randn(4)}
    names, defer = tuple(src), [True, False]
    _finished(stager, src, defer, names)
    pending = stager.begin_aligned(names, list(src.values()), defer, fixed=names)
    assert stager._plan is not None
    with torch.no_grad():
        src["p"].add_(1)  # changed before its deferred copy: the rule is broken
    with pytest.raises(CheckpointError, match="pipelined snapshot's rule was broken"):
        pending.finish()


def test_a_new_token_with_equal_names_checks_every_buffer_again():
    """A template rebuilt with the same names but another shape is a new token: no stale buffer."""
    stager = Stager()
    src = _state()
    names = tuple(src)
    _finished(stager, src, [False] * len(src), names)
    changed = {**src, "w": torch.randn(64, 64)}
    again = tuple(changed)  # equal to ``names``, another object: another template's
    assert again == names and again is not names
    snap = _finished(stager, changed, [False] * len(src), again)
    assert snap["w"].shape == (64, 64) and torch.equal(snap["w"], changed["w"])
    stager.release()
    snap = _finished(stager, changed, [False] * len(src), again)  # after release: allocated anew
    assert torch.equal(snap["w"], changed["w"])


def test_noncontiguous_lazy_and_grad_sources():
    param = torch.nn.Parameter(torch.randn(10, 20))
    src = {
        "p": param,
        "t": torch.randn(30, 40).t(),
        "e": torch.randn(1, 5).expand(6, 5),
        "conj": torch.randn(4, dtype=torch.complex64).conj(),  # a lazy conjugate: not plain memory
        "neg": torch._neg_view(torch.randn(4)),  # a contiguous lazy negation
    }
    snap = Stager().snapshot(src)
    for name, t in src.items():
        assert snap[name].is_contiguous() and torch.equal(snap[name], t.detach()), name
    assert not snap["p"].requires_grad


def test_non_tensor_refused():
    with pytest.raises(ConfigError, match="cannot stage 'x'"):
        Stager().snapshot({"x": [1.0]})


def test_snapshot_written_in_background_while_training_continues(tmp_path):
    """The async-save pattern: snapshot, write in a thread, keep mutating the source."""
    backend = open_backend(str(tmp_path / "root"))
    src = {"w": torch.randn(2_000_000), "n": torch.tensor(1)}
    expected = {k: v.clone() for k, v in src.items()}
    snap = Stager().snapshot(src)
    result: dict[str, tuple[int, str]] = {}
    writer = threading.Thread(target=lambda: result.update(r=write_tensorfile(backend, "t.safetensors", snap)))
    writer.start()
    for _ in range(20):  # "training": in-place updates of the live tensors
        src["w"].mul_(1.01).add_(0.5)
        src["n"] += 1
    writer.join(timeout=60)
    assert not writer.is_alive()
    size, digest = result["r"]
    out = read_tensorfile(backend, "t.safetensors", size=size, digest=digest)
    assert torch.equal(out["w"], expected["w"]) and torch.equal(out["n"], expected["n"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sources_staged_in_pinned_memory():
    src = {"w": torch.randn(1000, device="cuda"), "i": torch.arange(7, device="cuda")}
    stager = Stager()
    snap = stager.snapshot(src)
    for name, t in src.items():
        assert snap[name].device.type == "cpu" and snap[name].is_pinned()
        assert torch.equal(snap[name], t.cpu()), name
    ptr = snap["w"].data_ptr()
    src["w"].add_(1)
    assert stager.snapshot(src)["w"].data_ptr() == ptr and stager.allocations == 2
