"""The background re-hash of referenced tensors (issue 48): it catches edits torch's version
counter cannot see (``.data``, numpy views), a confirmation only counts passes begun after the
instant asked for, a change stays reported, and close runs one last pass and stops."""

from __future__ import annotations

import threading

import pytest
import torch

from ckptsdk.format.files import rehash
from ckptsdk.format.files.reference import hash_tensor
from ckptsdk.format.files.rehash import Rehasher


def _frozen() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"a": torch.randn(64, 64), "b": torch.randn(128)}


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {p: hash_tensor(t) for p, t in tensors.items()}


@pytest.mark.parametrize(
    ("edit", "torch_sees"),
    [
        (lambda t: t.data.add_(1.0), False),  # .data has its own version counter
        (lambda t: t.numpy().__setitem__((0, 0), 5.0), False),  # a numpy view written in place
        (lambda t: t.detach().mul_(2.0), True),  # seen by torch too: bytes tell all the same
    ],
    ids=["data", "numpy", "detach"],
)
def test_an_edit_is_found_by_the_next_pass_and_stays_reported(edit, torch_sees: bool) -> None:
    tensors = _frozen()
    with Rehasher(tensors, _digests(tensors), interval=0) as watch:
        assert watch.confirm(timeout=30) == {}
        version = tensors["a"]._version
        edit(tensors["a"])
        found = watch.confirm(timeout=30)
        assert list(found) == ["a"] and found["a"] == hash_tensor(tensors["a"])
        assert (tensors["a"]._version != version) is torch_sees
        tensors["a"].copy_(_frozen()["a"])  # changed back: still reported (checkpoints saw other bytes)
        assert list(watch.confirm(timeout=30)) == ["a"]


def test_confirm_waits_for_a_pass_that_began_after_the_instant(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = _frozen()
    gate = threading.Event()
    started = threading.Event()
    original = rehash.hash_tensor

    def slow(t: torch.Tensor, **kw):  # type: ignore[no-untyped-def]
        started.set()
        assert gate.wait(30)
        return original(t, **kw)

    monkeypatch.setattr(rehash, "hash_tensor", slow)
    clock = iter(range(1000)).__next__
    watch = Rehasher(tensors, _digests(tensors), interval=0, clock=lambda: float(clock()))
    try:
        first = threading.Thread(target=watch.confirm)  # asks for a pass: it begins and blocks
        first.start()
        assert started.wait(30)
        with pytest.raises(TimeoutError, match="no re-hash pass of 2 tensor"):
            watch.confirm(timeout=0.2)  # the pass under way began before this instant: it does not count
        gate.set()
        first.join(30)
        assert watch.confirm(timeout=30) == {}
    finally:
        gate.set()
        watch.close()


def test_background_passes_run_at_the_interval_and_close_stops_the_thread() -> None:
    tensors = _frozen()
    watch = Rehasher(tensors, _digests(tensors), interval=0.01)
    tensors["b"].numpy()[3] = 7.0
    deadline = threading.Event()
    for _ in range(3000):  # no confirm asked: the background pass finds it
        if watch.changed():
            break
        deadline.wait(0.01)
    assert list(watch.changed()) == ["b"]
    assert list(watch.close()) == ["b"]
    assert not watch._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        watch.confirm()


def test_a_failing_pass_is_raised_to_the_caller() -> None:
    meta = {"w": torch.empty(4, device="meta")}
    watch = Rehasher(meta, {"w": "00" * 16}, interval=0)
    with pytest.raises(RuntimeError, match="re-hashing the referenced tensors failed: .*meta device"):
        watch.confirm(timeout=30)
    with pytest.raises(RuntimeError, match="failed"):
        watch.close()


def test_paths_must_agree() -> None:
    with pytest.raises(ValueError, match="different paths"):
        Rehasher({"a": torch.zeros(1)}, {"b": "00"}, interval=0)
