"""Restore reads a module's tensors straight into the live ones, and never at the cost of a wrong state.

Every header is read and the tree decoded and checked against the live state before a data byte
is read: a tree that does not fit is refused with the live objects untouched. A file that fails
after its bytes began to arrive leaves the live tensors NaN, never half a checkpoint: a fallback
overwrites them all, else the error says so. Local roots (a real file, damaged as a disk would).
"""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState
from ckptsdk.checkpoint.reading.reader import CheckpointReader
from ckptsdk.errors import NoValidCheckpointError, StateMismatchError
from ckptsdk.format.codec import encode
from ckptsdk.format.decoding import decode_before_values


def _job(seed: int, width: int = 8) -> tuple[torch.nn.Module, torch.optim.Optimizer, TrainState]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(6, 4)).sum().backward()
    opt.step()
    return model, opt, TrainState(model=model, optimizer=opt)


def _values(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"opt/{i}/{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _save(root: Path, steps: dict[int, int]) -> dict[int, dict[str, torch.Tensor]]:
    """Step -> seed: each step saves another job's state; returns what each step holds."""
    held = {}
    with CheckpointManager(
        str(root),
        keep_last=10,
        lease_options=LeaseOptions(ttl=30),
        save_options=SaveOptions(on_signal=False, incremental=False),
    ) as mgr:
        for step, seed in steps.items():
            model, opt, state = _job(seed)
            mgr.save(state, step=step)
            held[step] = _values(model, opt)
    return held


def _damage_the_end(root: Path, step: int) -> None:
    """Flip the last byte of a tensor file: the module's tensors (first in the file) read whole,
    the digest fails only at the end."""
    (path,) = root.glob(f"step-{step:010d}.*/tensors.safetensors")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_module_tensors_are_read_straight_into_the_live_ones(tmp_path: Path) -> None:
    held = _save(tmp_path, {1: 0})
    model, opt, state = _job(5)
    live = state.live_tensors()
    assert {p.split("/")[-1] for p in live} >= {"0.weight", "1.running_mean", "2.bias"}
    assert not any(p.endswith("num_batches_tracked") for p in live)  # not floating point: copied in
    reader = CheckpointReader(CheckpointManager(str(tmp_path), read_only=True).backend)
    tree = reader.read_tree(reader.pick(None), state)
    for key, t in model.state_dict(keep_vars=True).items():
        if t.is_floating_point():
            assert tree["objects"]["model"][key].data_ptr() == t.data_ptr(), key  # its memory, no copy
    state.load_state_dict(tree)
    _same(_values(model, opt), held[1])


def test_a_tree_that_does_not_fit_is_refused_before_a_data_byte_is_read(tmp_path: Path) -> None:
    """The optimizer half does not fit (another momentum setting's param groups fit; a missing
    object does not): refused with the module untouched, though its bytes would fit."""
    _save(tmp_path, {1: 0})
    _damage_the_end(tmp_path, 1)  # read, the data would fail its digest: it is never read
    model, opt, _ = _job(5)
    before = _values(model, opt)
    state = TrainState(model=model, optimizer=opt, extra=torch.nn.Linear(1, 1))
    with CheckpointManager(str(tmp_path), read_only=True) as mgr, pytest.raises(StateMismatchError) as err:
        mgr.restore(state)
    assert "'extra' is in this TrainState but not in the checkpoint" in str(err.value)
    assert "NaN" not in str(err.value)
    _same(_values(model, opt), before)


class _ReadCounting:
    """The root's backend, counting the bytes read through the files it opens."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.read_bytes = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def open(self, key: str) -> Any:
        f, outer = self.inner.open(key), self

        class Counted(io.RawIOBase):
            def readinto(self, b: Any) -> int:
                n = f.readinto(b)
                outer.read_bytes += n
                return n

            def read(self, n: int = -1) -> bytes:
                data = f.read(n)
                outer.read_bytes += len(data)
                return data

            def fileno(self) -> int:
                return f.fileno()

            def close(self) -> None:
                f.close()
                super().close()

        return Counted()


def test_a_tree_that_does_not_fit_costs_only_the_headers(tmp_path: Path) -> None:
    _save(tmp_path, {1: 0})
    (path,) = tmp_path.glob("step-*/tensors.safetensors")
    header = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    model, opt, _ = _job(5, width=16)  # every shape differs from the checkpoint's
    backend = _ReadCounting(CheckpointManager(str(tmp_path), read_only=True).backend)
    reader = CheckpointReader(backend)  # type: ignore[arg-type]
    info = reader.pick(None)
    backend.read_bytes = 0
    with pytest.raises(StateMismatchError, match="has shape"):
        reader.read_tree(info, TrainState(model=model, optimizer=opt))
    assert backend.read_bytes == header < path.stat().st_size  # the header, no data byte


def test_a_damaged_newest_is_skipped_and_the_older_one_fills_the_live_tensors_exactly(tmp_path: Path) -> None:
    held = _save(tmp_path, {1: 0, 2: 1})
    _damage_the_end(tmp_path, 2)
    model, opt, state = _job(5)
    with CheckpointManager(str(tmp_path), read_only=True) as mgr:
        assert mgr.restore(state).step == 1  # type: ignore[union-attr]
    _same(_values(model, opt), held[1])


def test_when_no_checkpoint_restores_the_half_filled_live_tensors_are_nan_and_the_error_says_so(
    tmp_path: Path,
) -> None:
    _save(tmp_path, {1: 0})
    _damage_the_end(tmp_path, 1)
    model, opt, state = _job(5)
    with CheckpointManager(str(tmp_path), read_only=True) as mgr, pytest.raises(NoValidCheckpointError) as err:
        mgr.restore(state)
    assert "set to NaN: build the model again" in str(err.value)
    assert list(err.value.tried) == [next(tmp_path.glob("step-*")).name]
    for key, t in model.state_dict().items():
        if t.is_floating_point():
            assert torch.isnan(t).all(), key  # never half of a checkpoint, trained on as fresh
    # Nothing was lost: the damaged checkpoint is still there, untouched by the failed restore.
    assert len(list(tmp_path.glob("step-*/tensors.safetensors"))) == 1


class _Transposed(torch.nn.Linear):
    """Stores its weight transposed and transposes it back at load: loading reads what it is
    given while writing its own weight, so that must not be the same memory."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = destination[prefix + "weight"].t().contiguous()

    def _load_from_state_dict(self, state_dict, prefix, *args):  # type: ignore[no-untyped-def]
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"].t()
        super()._load_from_state_dict(state_dict, prefix, *args)


def test_a_module_that_transforms_what_it_loads_is_copied_in_as_before(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = _Transposed(6, 6)
    with CheckpointManager(
        str(tmp_path), lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        mgr.save(TrainState(model=saved), step=1)
    torch.manual_seed(1)
    fresh = _Transposed(6, 6)
    state = TrainState(model=fresh)
    assert state.live_tensors() == {}
    with CheckpointManager(str(tmp_path), read_only=True) as mgr:
        mgr.restore(state)
    assert torch.equal(fresh.weight, saved.weight) and torch.equal(fresh.bias, saved.bias)


def test_a_hook_on_a_submodule_keeps_the_whole_module_on_the_copy_path() -> None:
    model, _, state = _job(0)
    assert state.live_tensors()
    model[1].register_load_state_dict_post_hook(lambda module, keys: None)
    assert state.live_tensors() == {}


def test_arrays_of_another_byte_order_are_converted_once_the_bytes_are_in() -> None:
    big = np.arange(5, dtype=">f4")
    tensors, skeleton = encode({"a": big, "b": np.arange(3, dtype="<i8")})
    empty = {k: torch.empty_like(v) for k, v in tensors.items()}
    tree, complete = decode_before_values(skeleton, empty)
    for k, v in tensors.items():  # the bytes arrive after the decode
        empty[k].copy_(v)
    complete()
    assert tree["a"].dtype == np.dtype(">f4") and np.array_equal(tree["a"], big)
    assert np.array_equal(tree["b"], np.arange(3))


class _Sub(torch.Tensor):
    """A tensor subclass (as DTensor is one): its memory need not be what it shows."""


def test_a_tensor_subclass_is_copied_in_not_read_into() -> None:
    model = torch.nn.Linear(2, 2)
    model.register_buffer("odd", torch.zeros(3).as_subclass(_Sub))
    live = TrainState(model=model).live_tensors()
    assert set(live) == {"objects/model/weight", "objects/model/bias"}


def test_restore_reads_its_tensor_files_ahead_in_the_order_it_fills_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder's own file, then the shared ones (unchanged tensors since the first save), each
    handed to the read-ahead before its header is read; the restored state is the saved one."""
    from ckptsdk.format.files import readahead

    model, opt, state = _job(0, width=1 << 16)  # the first weight and its momentum: 1 MiB each
    with CheckpointManager(
        str(tmp_path), keep_last=10, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        mgr.save(state, step=1)
        model[2].bias.data.add_(1.0)  # only this tensor changes: the 1 MiB ones stay in a shared file
        mgr.save(state, step=2)
    held = _values(model, opt)
    warmed: list[list[tuple[str, int]]] = []
    real = readahead.read_ahead

    def spy(files: Any) -> Any:
        # (the files are opened from descriptors: their names are in /proc)
        names = [Path(os.readlink(f"/proc/self/fd/{f.fileno()}")) for f in files]
        warmed.append([(n.relative_to(tmp_path).as_posix(), f.tell()) for n, f in zip(names, files, strict=True)])
        return real(files)

    monkeypatch.setattr(readahead, "read_ahead", spy)
    model2, opt2, state2 = _job(5, width=1 << 16)
    with CheckpointManager(str(tmp_path), read_only=True) as mgr:
        assert mgr.restore(state2).step == 2  # type: ignore[union-attr]
    (own,) = tmp_path.glob("step-0000000002.*/tensors.safetensors")
    shared = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("shared/*.safetensors"))
    assert shared, "the unchanged tensors of step 2 live in a shared file"
    assert warmed == [[(own.relative_to(tmp_path).as_posix(), 0)] + [(s, 0) for s in shared]]
    _same(_values(model2, opt2), held)
