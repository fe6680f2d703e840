"""`ckptsdk import` (a torch.save file in the story's layout) and `ckptsdk export` (safetensors).

Import resumes bit-exact against continuing from the .pt by hand; a .pt carrying a live
code-executing pickle is refused and runs nothing; the restore path never imports the module
that calls torch.load. Export loads with plain safetensors into a fresh model, tied weights too.
"""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

from ckptsdk import CheckpointManager, LeaseOptions, TrainState, UnsupportedStateError
from ckptsdk.cli import main
from ckptsdk.errors import ConfigError
from ckptsdk.porting.export import export_safetensors
from ckptsdk.porting.torch_import import import_torch_checkpoint


def _objects(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    return model, opt, sched, scaler


def _train(model, opt, sched, scaler, steps: int) -> list[float]:
    # The story's job: augmentation from numpy, order from Python's random (so both RNGs matter).
    losses = []
    for _ in range(steps):
        x = torch.from_numpy(np.random.standard_normal((4, 8)).astype(np.float32))
        scale = 1.0 + random.random()
        loss = (model(x) * scale).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        losses.append(loss.item())
    return losses


def _story_pt(path, steps: int = 5) -> None:
    np.random.seed(1)
    random.seed(2)
    model, opt, sched, scaler = _objects(0)
    _train(model, opt, sched, scaler, steps)
    torch.save(
        {  # the story's layout: no torch RNG, numpy + Python RNG, step/epoch
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "scaler": scaler.state_dict(),
            "numpy_rng": np.random.get_state(),
            "python_rng": random.getstate(),
            "step": steps,
            "epoch": 0,
            "best_loss": 0.5,
        },
        path,
    )


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, entry in opt.state_dict()["state"].items():
        out.update({f"opt/{pid}/{k}": v.clone() for k, v in entry.items() if isinstance(v, torch.Tensor)})
    return out


def test_import_resumes_bit_exact_against_continuing_by_hand(tmp_path):
    pt = tmp_path / "ckpt_5.pt"
    _story_pt(pt)

    # By hand, as the story did before torch 2.6 (the test trusts its own file).
    model, opt, sched, scaler = _objects(7)
    saved = torch.load(pt, weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    sched.load_state_dict(saved["scheduler"])
    scaler.load_state_dict(saved["scaler"])
    np.random.set_state(saved["numpy_rng"])
    random.setstate(saved["python_rng"])
    by_hand_losses = _train(model, opt, sched, scaler, 6)
    by_hand = _snapshot(model, opt)

    url = str(tmp_path / "root")
    assert main(["import", str(pt), url, "--allow-numpy-rng"]) == 0
    model, opt, sched, scaler = _objects(8)
    np.random.seed(99)
    random.seed(99)
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        pos = mgr.restore(TrainState(model=model, optimizer=opt, scheduler=sched, scaler=scaler))
    assert (pos.step, pos.epoch, pos.extra) == (5, 0, {"best_loss": 0.5})
    assert pos.tags == {"imported_from": "ckpt_5.pt", "layout": "story"}
    assert _train(model, opt, sched, scaler, 6) == by_hand_losses
    ours = _snapshot(model, opt)
    assert ours.keys() == by_hand.keys()
    assert all(torch.equal(ours[k], by_hand[k]) for k in ours)


def test_numpy_rng_needs_the_flag_and_nothing_is_written(tmp_path, capsys):
    pt = tmp_path / "ckpt.pt"
    _story_pt(pt, steps=1)
    url = str(tmp_path / "root")
    with pytest.raises(UnsupportedStateError, match="--allow-numpy-rng") as err:
        import_torch_checkpoint(pt, url)
    assert err.value.type_name.startswith("numpy.")
    assert main(["import", str(pt), url]) == 1
    assert "allow-numpy-rng" in capsys.readouterr().err
    assert not os.path.exists(url)


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_code_executing_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    # The payload is live: plain pickle runs it.
    pickle.loads(pickle.dumps(_Payload(str(marker))))
    assert marker.exists()
    marker.unlink()

    pt = tmp_path / "evil.pt"
    torch.save({"model": torch.nn.Linear(2, 2).state_dict(), "step": 3, "note": _Payload(str(marker))}, pt)
    url = str(tmp_path / "root")
    for allow in (False, True):
        with pytest.raises(UnsupportedStateError, match="nothing was executed") as err:
            import_torch_checkpoint(pt, url, allow_numpy_rng=allow)
        assert err.value.type_name in ("posix.system", "os.system", "nt.system")
    assert not marker.exists()
    assert not os.path.exists(url)


def test_unknown_keys_are_reported_not_dropped(tmp_path):
    pt = tmp_path / "ckpt.pt"
    torch.save({"model": torch.nn.Linear(2, 2).state_dict(), "step": 1, "ema": {"w": torch.ones(2)}}, pt)
    with pytest.raises(ConfigError, match=r"\['ema'\].*--drop"):
        import_torch_checkpoint(pt, str(tmp_path / "a"))
    assert not (tmp_path / "a").exists()
    info = import_torch_checkpoint(pt, str(tmp_path / "b"), drop=["ema"])
    assert info.step == 1


def test_restore_path_never_imports_the_torch_load_module(tmp_path):
    url = str(tmp_path / "root")
    code = (
        "import sys, torch, ckptsdk, ckptsdk.cli\n"
        "from ckptsdk import CheckpointManager, LeaseOptions, TrainState\n"
        f"url = {url!r}\n"
        "m = torch.nn.Linear(2, 2)\n"
        "with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:\n"
        "    mgr.save(TrainState(model=m), step=1)\n"
        "with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:\n"
        "    assert mgr.restore(TrainState(model=torch.nn.Linear(2, 2))).step == 1\n"
        "assert ckptsdk.cli.main(['ls', url]) == 0\n"
        "print(sorted(n for n in sys.modules if n.startswith('ckptsdk')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "ckptsdk.manager" in out.stdout and "ckptsdk.porting.torch_import" not in out.stdout


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.LayerNorm(4)  # weight of ones, equal to nothing tied
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_export_tied_weights_like_save_model_and_plain_load(tmp_path):
    torch.manual_seed(0)
    model = _Tied()
    url = str(tmp_path / "root")
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(TrainState(model=model), step=4)
        at_step4 = model.emb.weight.detach().clone()
        with torch.no_grad():
            model.emb.weight.add_(1.0)
        mgr.save(TrainState(model=model), step=8)

    out = tmp_path / "model.safetensors"
    report = export_safetensors(url, out, model=_Tied())
    assert report["removed"] == {"head.weight": "emb.weight"} and report["step"] == 8
    with safetensors.safe_open(str(out), "pt") as f:
        assert f.metadata() == {"format": "pt", "head.weight": "emb.weight"}
    loaded = safetensors.torch.load_file(str(out))
    assert "head.weight" not in loaded and "norm.weight" in loaded
    fresh = _Tied()
    missing, unexpected = fresh.load_state_dict(loaded, strict=False)
    assert (missing, unexpected) == (["head.weight"], [])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True))
    other = _Tied()
    safetensors.torch.load_model(other, str(out))  # safetensors' own counterpart of save_model
    assert torch.equal(other.head.weight, model.head.weight)

    # CLI, an older step, the tie declared by name instead of taken from a live model.
    cli_out = tmp_path / "step4.safetensors"
    assert main(["export", f"{url}@4", str(cli_out), "--tied", "head.weight=emb.weight"]) == 0
    step4 = safetensors.torch.load_file(str(cli_out))
    assert torch.equal(step4["emb.weight"], at_step4) and "head.weight" not in step4
    with pytest.raises(ConfigError, match="differ"):
        export_safetensors(url, tmp_path / "x.safetensors", tied=[("norm.weight", "norm.bias")])
    assert not (tmp_path / "x.safetensors").exists()


def test_export_untied_loads_strictly_into_a_fresh_model(tmp_path):
    model, opt, sched, scaler = _objects(0)
    url = str(tmp_path / "root")
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(TrainState(model=model, optimizer=opt, scheduler=sched), step=2)
    out = tmp_path / "m.safetensors"
    assert main(["export", url, str(out), "--json"]) == 0
    fresh = _objects(5)[0]
    fresh.load_state_dict(safetensors.torch.load_file(str(out)), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True))
