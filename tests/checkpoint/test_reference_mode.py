"""``SaveOptions(frozen="reference")``: a frozen base recorded by digest, proven at restore.

The base is a 2 MiB frozen ``Linear`` (over ``SHARE_MIN_BYTES``), the trained part a small head
with AdamW. Each test builds the base from its "source" (a seed), as a fine-tune downloads it.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from ckptsdk import CheckpointManager, TrainState
from ckptsdk.checkpoint.reading.reader import CheckpointReader
from ckptsdk.errors import ConfigError, StateMismatchError
from ckptsdk.options import LeaseOptions, SaveOptions
from ckptsdk.porting.export import export_safetensors

SOURCE = "hf:tiny-base@rev1"
REF = SaveOptions(frozen="reference", frozen_source=SOURCE, on_signal=False)
BASE_PATH = "objects/model/0.weight"


def _job(base_seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, TrainState]:
    torch.manual_seed(base_seed)
    base = torch.nn.Linear(1024, 512)
    for p in base.parameters():
        p.requires_grad_(False)
    torch.manual_seed(100)
    model = torch.nn.Sequential(base, torch.nn.Linear(512, 4))
    opt = torch.optim.AdamW(model[1].parameters(), lr=0.01)
    return model, opt, TrainState(model=model, optimizer=opt)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    model(torch.randn(4, 1024, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(url: str, steps: range, *, blocking: bool = True, options: SaveOptions = REF) -> torch.nn.Module:
    model, opt, state = _job()
    with CheckpointManager(url, save_options=options) as mgr:
        mgr.restore(state)
        for step in steps:
            _train(model, opt, step)
            mgr.save(state, step=step, blocking=blocking)
    return model


@pytest.mark.parametrize("blocking", [True, False])
def test_the_base_is_recorded_by_digest_never_written_nor_staged(tmp_path, blocking) -> None:
    url = str(tmp_path / "root")
    model, opt, state = _job()
    with CheckpointManager(url, save_options=REF) as mgr:
        for step in (1, 2, 3):
            _train(model, opt, step)
            mgr.save(state, step=step, blocking=blocking)
        mgr.wait()
        staged = sum(b.nbytes for b in mgr._saving._slots._buffers)
        rows = mgr.list()
    base_bytes = model[0].weight.nbytes
    assert staged < base_bytes / 4  # the staging buffers hold what is saved, not the base
    for row in rows:
        manifest = row.manifest
        assert manifest is not None and manifest.format_written().endswith("/3.0")
        assert not manifest.shared
        assert sum(f.size for f in manifest.files) < base_bytes / 4
        (group,) = manifest.referenced
        assert group.source == SOURCE and list(group.tensors) == [BASE_PATH]
    assert not list((tmp_path / "root").glob("shared/*"))


def test_resume_on_the_same_base_is_bit_exact(tmp_path) -> None:
    url = str(tmp_path / "root")
    whole = _run(str(tmp_path / "whole"), range(1, 7))
    _run(url, range(1, 4))
    resumed = _run(url, range(4, 7))  # a fresh base from its source, then the checkpoint
    for k, v in _values(whole).items():
        assert torch.equal(resumed.state_dict()[k], v), k


def test_another_base_is_refused_with_every_live_object_untouched(tmp_path) -> None:
    url = str(tmp_path / "root")
    _run(url, range(1, 4))
    model, opt, state = _job(base_seed=7)  # another revision of the base
    _train(model, opt, 99)  # the optimizer holds state too: it must stay as it is
    before, opt_before = _values(model), opt.state_dict()
    with CheckpointManager(url, save_options=REF) as mgr, pytest.raises(StateMismatchError) as info:
        mgr.restore(state)
    message = str(info.value)
    assert BASE_PATH in message and SOURCE in message and "nothing was restored" in message
    assert info.value.mismatches == [BASE_PATH]
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), k
    after = opt.state_dict()
    assert all(torch.equal(after["state"][0][k], v) for k, v in opt_before["state"][0].items() if torch.is_tensor(v))


def test_a_dot_data_edit_of_the_base_is_caught_stored_in_full_and_warned(tmp_path, caplog) -> None:
    url = str(tmp_path / "root")
    model, opt, state = _job()
    with CheckpointManager(url, save_options=REF) as mgr:
        _train(model, opt, 1)
        mgr.save(state, step=1, blocking=False)
        mgr.wait()
        model[0].weight.data[0, 0] += 1.0  # torch's version counter does not see this
        _train(model, opt, 2)
        with caplog.at_level(logging.WARNING, logger="ckptsdk"):
            mgr.save(state, step=2, blocking=False)
            mgr.wait()
        assert ".data" in caplog.text and BASE_PATH in caplog.text
        newest = mgr.load_manifest()
        assert not newest.referenced  # stored, not referenced
        want = _values(model)
    model2, _, state2 = _job()
    with CheckpointManager(url, save_options=REF) as mgr:
        assert mgr.restore(state2).step == 2
    for k, v in want.items():
        assert torch.equal(model2.state_dict()[k], v), k


def test_a_numpy_edit_is_caught_and_an_edit_torch_sees_too(tmp_path, caplog) -> None:
    model, opt, state = _job()
    with CheckpointManager(str(tmp_path / "root"), save_options=REF) as mgr, caplog.at_level(logging.WARNING):
        mgr.save(state, step=1)
        view = model[0].weight.detach().numpy()
        view[1, 1] = np.float32(3.0)
        mgr.save(state, step=2)
        assert not mgr.load_manifest().referenced
        assert "numpy" in caplog.text
    model, opt, state = _job()
    caplog.clear()
    with CheckpointManager(str(tmp_path / "seen"), save_options=REF) as mgr, caplog.at_level(logging.WARNING):
        mgr.save(state, step=1)
        with torch.no_grad():
            model[0].weight.mul_(0.5)  # the version counter moves: decided at save()
        mgr.save(state, step=2)
        assert not mgr.load_manifest().referenced
        assert "version counter" in caplog.text


def test_close_warns_when_the_base_changed_after_the_newest_commit(tmp_path, caplog) -> None:
    model, opt, state = _job()
    mgr = CheckpointManager(str(tmp_path / "root"), save_options=REF)
    mgr.save(state, step=1, blocking=False)
    mgr.wait()
    model[0].weight.data.zero_()
    with caplog.at_level(logging.WARNING):
        mgr.close()
    assert "changed after the newest commit" in caplog.text


def test_partial_restore_strict_false_and_the_strict_default(tmp_path, caplog) -> None:
    url = str(tmp_path / "root")
    trained = _run(url, range(1, 4))
    model, _, _ = _job()
    with CheckpointManager(url, read_only=True) as mgr:
        with pytest.raises(StateMismatchError, match="'optimizer' is in the checkpoint"):
            mgr.restore(TrainState(model=model))
        with caplog.at_level(logging.INFO, logger="ckptsdk.manager"):
            point = mgr.restore(TrainState(model=model), strict=False)
    assert point is not None and point.step == 3 and point.unrestored == ("optimizer",)
    assert "left out" in caplog.text and "optimizer" in caplog.text
    for k, v in _values(trained).items():
        assert torch.equal(model.state_dict()[k], v), k
    # The objects outside the state are neither proven nor loaded: an optimizer alone restores
    # though no live object holds the base.
    _, opt, _ = _job()
    with CheckpointManager(url, read_only=True) as mgr:
        point = mgr.restore(TrainState(optimizer=opt), strict=False)
    assert point is not None and point.unrestored == ("model",) and opt.state_dict()["state"]


def test_verify_checks_the_files_and_says_what_it_cannot(tmp_path) -> None:
    url = str(tmp_path / "root")
    _run(url, range(1, 3))
    reader = CheckpointReader(CheckpointManager(url, read_only=True).backend)
    verdict = reader.check(reader.latest())
    assert verdict.status == "ok"
    assert verdict.unchecked == f"1 referenced tensor(s) (source {SOURCE}) not checked: no base given"


def test_load_without_a_base_says_what_it_needs(tmp_path) -> None:
    url = str(tmp_path / "root")
    _run(url, range(1, 3))
    with CheckpointManager(url, read_only=True) as mgr, pytest.raises(StateMismatchError, match="by reference"):
        mgr.load()


def test_export_with_the_base_and_refused_without(tmp_path) -> None:
    url = str(tmp_path / "root")
    trained = _run(url, range(1, 3))
    out = tmp_path / "model.safetensors"
    with pytest.raises(ConfigError, match=rf"1 tensor\(s\) of its frozen base by reference \(from {SOURCE}\)"):
        export_safetensors(url, out)
    assert not out.exists()
    wrong, _, _ = _job(base_seed=3)
    with pytest.raises(StateMismatchError):
        export_safetensors(url, out, base=wrong)
    assert not out.exists()
    base, _, _ = _job()
    report = export_safetensors(url, out, base=base)
    import safetensors.torch

    written = safetensors.torch.load_file(out)
    assert report["tensors"] == 4
    for k, v in _values(trained).items():
        assert torch.equal(written[k], v), k
    # a file of the base's state dict does as well
    base_file = tmp_path / "base.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in base.state_dict().items()}, base_file)
    export_safetensors(url, out, base=str(base_file), force=True)
    assert torch.equal(safetensors.torch.load_file(out)["0.weight"], trained[0].weight)


def test_store_mode_stays_the_default(tmp_path) -> None:
    model, opt, state = _job()
    with CheckpointManager(str(tmp_path / "root"), lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(state, step=1)
        manifest = mgr.load_manifest()
    assert not manifest.referenced and manifest.shared and manifest.format_written().endswith("/2.0")


def test_frozen_is_checked() -> None:
    with pytest.raises(ConfigError, match="frozen"):
        SaveOptions(frozen="ref")  # type: ignore[arg-type]
