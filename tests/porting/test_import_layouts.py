"""`ckptsdk import` reads the layouts users' files have (issue 28.4).

The story notebook's own dict (``rng: {torch, numpy, python, cuda}``, ``args``, ``last_loss``,
``saved_at``, ``batch_idx``) resumes bit-exactly, mid-epoch, against continuing from the .pt by
hand; a bare state_dict, a real Lightning ``.ckpt`` and a real HF Trainer ``checkpoint-N/`` folder
land where ``TrainState`` restores them; what no layout places needs the user's ``--map``.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from ckptsdk import CheckpointManager, LeaseOptions, TrainState
from ckptsdk.cli import main
from ckptsdk.errors import ConfigError
from ckptsdk.porting.torch_import import import_torch_checkpoint

REPO = Path(__file__).resolve().parents[2]
_X = torch.randn(24, 8, generator=torch.Generator().manual_seed(5))
_BATCH = 4
_PER_EPOCH = len(_X) // _BATCH


def _objects(seed: int, *, scaler: bool = True):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.25), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched, torch.amp.GradScaler("cpu", init_scale=256.0) if scaler else None


def _run(model, opt, sched, scaler, epoch: int, batch_idx: int, steps: int) -> tuple[list[float], int, int]:
    """The story's loop: order from a (seed, epoch) generator, dropout from torch's global RNG,
    a scale from numpy's and a flip from Python's; resumes at (epoch, batch_idx done)."""
    losses = []
    while len(losses) < steps:
        order = torch.randperm(len(_X), generator=torch.Generator().manual_seed(100 + epoch))
        for b in range(batch_idx, _PER_EPOCH):
            x = _X[order[b * _BATCH : (b + 1) * _BATCH]]
            scale = float(np.random.uniform(0.5, 1.5)) * (-1.0 if random.random() < 0.5 else 1.0)
            loss = (model(x) * scale).pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            losses.append(loss.item())
            batch_idx = b + 1
            if len(losses) == steps:
                return losses, epoch, batch_idx
        epoch, batch_idx = epoch + 1, 0
    return losses, epoch, batch_idx


def _state(model, opt) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, entry in opt.state_dict()["state"].items():
        out.update({f"opt/{pid}/{k}": v.clone() for k, v in entry.items() if isinstance(v, torch.Tensor)})
    return out


def _story_file(path: Path) -> dict:
    """Train 8 steps (epoch 1, 2 batches done) and save exactly what the story notebook saved."""
    np.random.seed(1)
    random.seed(2)
    model, opt, sched, scaler = _objects(0)
    model.train()
    losses, epoch, batch_idx = _run(model, opt, sched, scaler, 0, 0, 8)
    assert (epoch, batch_idx) == (1, 2)  # mid-epoch
    saved = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
        "batch_idx": batch_idx,
        "step": 8,
        "last_loss": losses[-1],
        "saved_at": "2024-11-03 17:42:10",
        "args": {"lr": 0.01, "batch_size": _BATCH, "arch": "resnet18", "amp": True, "milestones": [3, 6]},
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
            "cuda": None,  # the story's CPU fallback; on Colab a list of states
        },
    }
    torch.save(saved, path)
    return saved


def test_story_layout_resumes_bit_exact_mid_epoch_against_continuing_by_hand(tmp_path):
    pt = tmp_path / "resnet18_step8.pt"
    _story_file(pt)

    # By hand, as the story did (the test trusts its own file): every RNG, then the epoch's rest.
    saved = torch.load(pt, weights_only=False)
    model, opt, sched, scaler = _objects(7)
    model.train()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    sched.load_state_dict(saved["scheduler"])
    scaler.load_state_dict(saved["scaler"])
    torch.set_rng_state(saved["rng"]["torch"])
    np.random.set_state(saved["rng"]["numpy"])
    random.setstate(saved["rng"]["python"])
    by_hand, *_ = _run(model, opt, sched, scaler, saved["epoch"], saved["batch_idx"], 7)
    by_hand_state = _state(model, opt)

    url = str(tmp_path / "root")
    # Before: "has entries import does not know where to put: ['args', 'rng']".
    assert main(["import", str(pt), url, "--allow-numpy-rng"]) == 0
    model, opt, sched, scaler = _objects(8)
    model.train()
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        pos = mgr.restore(TrainState(model=model, optimizer=opt, scheduler=sched, scaler=scaler))
    assert (pos.step, pos.epoch, pos.batch_idx) == (8, 1, 2)
    assert pos.extra == {
        "last_loss": saved["last_loss"],
        "saved_at": "2024-11-03 17:42:10",
        "args": saved["args"],
    }
    assert pos.tags["layout"] == "story"
    ours, *_ = _run(model, opt, sched, scaler, pos.epoch, pos.batch_idx, 7)
    assert ours == by_hand
    state = _state(model, opt)
    assert state.keys() == by_hand_state.keys() and all(torch.equal(state[k], by_hand_state[k]) for k in state)


def test_bare_state_dict_and_a_story_file_without_scaler(tmp_path):
    model = _objects(3)[0]
    pt = tmp_path / "weights.pt"
    torch.save(model.state_dict(), pt)
    with pytest.raises(ConfigError, match="--step"):
        import_torch_checkpoint(pt, str(tmp_path / "a"))
    info = import_torch_checkpoint(pt, str(tmp_path / "a"), step=0)
    fresh = _objects(4)[0]
    with CheckpointManager(str(tmp_path / "a"), lease_options=LeaseOptions(ttl=5)) as mgr:
        assert mgr.restore(TrainState(model=fresh)).tags["layout"] == "state_dict"
    assert info.step == 0 and all(
        torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    )

    model, opt, sched, _ = _objects(3, scaler=False)
    story = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    torch.save(
        {**story, "scaler": None, "step": 4, "epoch": 0, "batch_idx": 4, "rng": {"torch": torch.get_rng_state()}}, pt
    )
    import_torch_checkpoint(pt, str(tmp_path / "b"))
    with CheckpointManager(str(tmp_path / "b"), lease_options=LeaseOptions(ttl=5)) as mgr:
        model2, opt2, sched2, _ = _objects(5, scaler=False)
        assert mgr.restore(TrainState(model=model2, optimizer=opt2, scheduler=sched2)).batch_idx == 4


def test_what_no_layout_places_needs_a_map_and_then_restores(tmp_path):
    model, opt, _sched, _ = _objects(3)
    ema = _objects(4)[0]
    pt = tmp_path / "ema.pt"
    torch.save({"net": model.state_dict(), "ema_model": ema.state_dict(), "iteration": 12, "note": "x"}, pt)
    with pytest.raises(ConfigError, match=r"\['ema_model'\].*--map KEY=DEST"):
        import_torch_checkpoint(pt, str(tmp_path / "a"))
    assert not (tmp_path / "a").exists()
    code = main(["import", str(pt), str(tmp_path / "a"), "--map", "ema_model=objects/ema", "--map", "iteration=step"])
    assert code == 0
    live, live_ema = _objects(5)[0], _objects(6)[0]
    with CheckpointManager(str(tmp_path / "a"), lease_options=LeaseOptions(ttl=5)) as mgr:
        pos = mgr.restore(TrainState(model=live, ema=live_ema))
    assert (pos.step, pos.extra) == (12, {"note": "x"})
    assert all(
        torch.equal(a, b) for a, b in zip(live_ema.state_dict().values(), ema.state_dict().values(), strict=True)
    )
    assert main(["import", str(pt), str(tmp_path / "c"), "--map", "ema_model=somewhere"]) == 2


class _Kept:
    """An object of a TrainState that keeps what restore() gives it."""

    def __init__(self) -> None:
        self.state: dict = {}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def _child(code: str, cwd: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_lightning_ckpt_restores_into_the_module_and_its_optimizer(tmp_path):
    _child(
        """
        import torch, lightning as L
        class Lit(L.LightningModule):
            def __init__(self):
                super().__init__(); self.lin = torch.nn.Linear(4, 2)
            def training_step(self, batch, i):
                x, y = batch; return torch.nn.functional.cross_entropy(self.lin(x), y)
            def configure_optimizers(self):
                opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
                return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2)}
        torch.manual_seed(0)
        ds = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
        t = L.Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu")
        t.fit(Lit(), torch.utils.data.DataLoader(ds, batch_size=4))
        t.save_checkpoint("lit.ckpt")
        """,
        tmp_path,
    )
    saved = torch.load(tmp_path / "lit.ckpt", weights_only=True)
    url = str(tmp_path / "root")
    assert main(["import", str(tmp_path / "lit.ckpt"), url]) == 0

    class Lit(torch.nn.Module):  # the same parameters as the LightningModule's
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

    model = Lit()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        pos = mgr.restore(TrainState(model=model, optimizer=opt, scheduler=sched))
    assert (pos.step, pos.epoch, pos.tags["layout"]) == (3, saved["epoch"], "lightning")
    assert pos.extra["pytorch-lightning_version"] == saved["pytorch-lightning_version"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved["state_dict"].items())
    momentum = opt.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, saved["optimizer_states"][0]["state"][0]["momentum_buffer"])
    assert sched.state_dict()["last_epoch"] == saved["lr_schedulers"][0]["last_epoch"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_hf_trainer_folder_restores_model_optimizer_and_rng(tmp_path):
    _child(
        """
        import torch
        from transformers import Trainer, TrainingArguments
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__(); self.lin = torch.nn.Linear(4, 2)
            def forward(self, x, labels=None):
                out = self.lin(x)
                return {"loss": torch.nn.functional.cross_entropy(out, labels), "logits": out}
        class D(torch.utils.data.Dataset):
            def __len__(self): return 16
            def __getitem__(self, i):
                g = torch.Generator().manual_seed(i)
                return {"x": torch.randn(4, generator=g), "labels": torch.tensor(i % 2)}
        args = TrainingArguments(output_dir="hf", max_steps=3, save_steps=3, per_device_train_batch_size=4,
                                 report_to=[], use_cpu=True, logging_steps=100)
        Trainer(model=M(), args=args, train_dataset=D()).train()
        """,
        tmp_path,
    )
    folder = tmp_path / "hf" / "checkpoint-3"
    weights = safetensors.torch.load_file(str(folder / "model.safetensors"))
    optim = torch.load(folder / "optimizer.pt", weights_only=True)
    rng = torch.load(folder / "rng_state.pth", weights_only=False)
    url = str(tmp_path / "root")
    assert main(["import", str(folder), url, "--allow-numpy-rng"]) == 0

    model = torch.nn.Module()
    model.lin = torch.nn.Linear(4, 2)
    # HF's two groups: weights with decay, biases without.
    opt = torch.optim.AdamW([{"params": [model.lin.weight]}, {"params": [model.lin.bias], "weight_decay": 0.0}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _s: 1.0)
    # The shape CkptsdkTrainer resumes from: its TrainerState JSON, and no grad scaler's state.
    trainer, scaler = _Kept(), _Kept()
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        pos = mgr.restore(TrainState(model=model, optimizer=opt, scheduler=sched, scaler=scaler, trainer=trainer))
    assert (pos.step, pos.epoch, pos.tags["layout"]) == (3, 0, "hf-trainer")
    assert json.loads(trainer.state["json"]) == json.loads((folder / "trainer_state.json").read_text())
    assert scaler.state == {} and "trainer_state" not in pos.extra
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], optim["state"][0]["exp_avg"])
    assert torch.equal(torch.get_rng_state(), rng["cpu"]) and np.random.get_state()[2] == rng["numpy"][2]
    assert random.getstate() == rng["python"]
