"""What ``ckptsdk import`` commits resumes the way its printed advice says (issue 47, item 5).

A real HF ``Trainer`` writes its ``checkpoint-N/`` folders (a tiny GPT-2 built from a config:
tied ``lm_head``, dropout on), the real CLI imports one in a subprocess, ``CkptsdkTrainer``
resumes from the root as the CLI said, and its last checkpoint equals the uninterrupted
Trainer's (weights, optimizer, scheduler) exactly. Smaller: a tied weight the folder holds once
is filled from the live model's tie; the advice names exactly the objects imported; what
``extra`` holds follows ``save()``'s own rule (userfield.py), nan and inf included.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch

from ckptsdk import CheckpointManager, LeaseOptions, TrainState
from ckptsdk.cli import main
from ckptsdk.errors import ConfigError, StateMismatchError
from ckptsdk.format.userfield import extra_value
from ckptsdk.porting.torch_import import import_torch_checkpoint

REPO = Path(__file__).resolve().parents[2]

_GPT2 = """
import os, sys, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
torch.use_deterministic_algorithms(True)
def model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                                      resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2))
g = torch.Generator().manual_seed(3)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 32, (24, 8), generator=g)]
args = TrainingArguments(output_dir="hf", max_steps=10, save_steps=4, per_device_train_batch_size=4,
                         learning_rate=5e-3, warmup_steps=2, seed=11, report_to=[], use_cpu=True,
                         disable_tqdm=True, logging_steps=1, dataloader_num_workers=0)
"""


def _child(code: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_imported_trainer_folder_resumes_in_ckptsdk_trainer_as_the_trainer_would(tmp_path):
    pytest.importorskip("transformers")
    # The uninterrupted run: 6 steps an epoch, folders at steps 4 (mid-epoch), 8 and 10 (the end).
    _child(_GPT2 + "Trainer(model=model(), args=args, train_dataset=data).train()\n", tmp_path)
    url = str(tmp_path / "root")
    cli = subprocess.run(
        [sys.executable, "-m", "ckptsdk", "import", str(tmp_path / "hf" / "checkpoint-4"), url, "--allow-numpy-rng"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    advice = cli.stdout.strip().splitlines()[-1].strip()
    assert re.match(
        rf"CkptsdkTrainer\(.*ckpt_url={re.escape(repr(url))}\)\.train\(resume_from_checkpoint=True\)", advice
    )
    # Done as the advice says, with the run's own arguments (a fresh output_dir: no folder to read).
    _child(
        _GPT2
        + f"""
from ckptsdk.integrations.transformers import CkptsdkTrainer
args.output_dir = "resumed"
CkptsdkTrainer(model=model(), args=args, train_dataset=data, ckpt_url={url!r}).train(resume_from_checkpoint=True)
""",
        tmp_path,
    )
    final = tmp_path / "hf" / "checkpoint-10"
    with CheckpointManager(url, read_only=True) as mgr:
        assert [c.step for c in mgr.list() if c.valid] == [4, 8, 10]
        tree = mgr.load(step=10)["objects"]
    weights = safetensors.torch.load_file(str(final / "model.safetensors"))
    assert "lm_head.weight" not in weights  # tied: save_pretrained wrote it once
    model = tree["model"]
    assert all(torch.equal(model[k], v) for k, v in weights.items()), [
        k for k, v in weights.items() if not torch.equal(model[k], v)
    ]
    assert torch.equal(model["lm_head.weight"], weights["transformer.wte.weight"])
    optim = torch.load(final / "optimizer.pt", weights_only=True)
    assert tree["optimizer"]["param_groups"] == optim["param_groups"]
    assert tree["optimizer"]["state"].keys() == optim["state"].keys()
    for pid, entry in optim["state"].items():
        assert all(torch.equal(tree["optimizer"]["state"][pid][k], v) for k, v in entry.items()), pid
    assert tree["scheduler"] == torch.load(final / "scheduler.pt", weights_only=True)
    state = json.loads(tree["trainer"]["json"])
    assert state["global_step"] == 10 and [e["loss"] for e in state["log_history"] if "loss" in e] == [
        e["loss"] for e in json.loads((final / "trainer_state.json").read_text())["log_history"] if "loss" in e
    ]


class _Tied(torch.nn.Module):
    """GPT-2's tie in four lines: the output layer's weight is the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(6, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.wte.weight


def test_a_tied_weight_saved_once_is_filled_from_the_live_tie(tmp_path):
    torch.manual_seed(0)
    src = _Tied()
    pt = tmp_path / "tied.pt"
    torch.save({"model": {"wte.weight": src.wte.weight.detach().clone()}, "step": 2}, pt)  # as save_pretrained
    url = str(tmp_path / "root")
    import_torch_checkpoint(pt, url)
    live = _Tied()
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        assert mgr.restore(TrainState(model=live)).step == 2
    assert torch.equal(live.head.weight, src.wte.weight) and live.head.weight is live.wte.weight

    # A missing key the live model does not tie to a saved one is still refused, nothing loaded.
    untied = torch.nn.ModuleDict({"wte": torch.nn.Embedding(6, 4), "head": torch.nn.Linear(4, 6, bias=False)})
    before = {k: v.clone() for k, v in untied.state_dict().items()}
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        with pytest.raises(StateMismatchError, match="missing key 'head.weight'"):
            mgr.restore(TrainState(model=untied))
    assert all(torch.equal(untied.state_dict()[k], v) for k, v in before.items())


def test_the_printed_advice_names_exactly_the_objects_imported(tmp_path, capsys):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    pt = tmp_path / "a.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}, pt)
    url = str(tmp_path / "root")
    assert main(["import", str(pt), url]) == 0
    advice = capsys.readouterr().out.strip().splitlines()[-1].strip()
    assert advice == f"CheckpointManager({url!r}).restore(TrainState(model=..., optimizer=...))"
    live = torch.nn.Linear(3, 2)
    live_opt = torch.optim.SGD(live.parameters(), lr=0.1, momentum=0.9)
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        assert mgr.restore(TrainState(model=live, optimizer=live_opt)).step == 1
    assert torch.equal(
        live_opt.state_dict()["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"]
    )


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        (1.0, float("inf")),  # a tuple is kept as a list, as JSON has it
        {"best": -0.0},
        torch.tensor(0.25),  # a 0-d tensor: its Python value, as save() keeps it
        {"$float": "nan"},  # '$' keys tag floats in a manifest: refused by both
        {1: 2},
    ],
    ids=["nan", "inf-in-tuple", "negative-zero", "0d-tensor", "dollar-key", "int-key"],
)
def test_extra_takes_what_save_takes(value, tmp_path):
    """A leftover entry goes into ``extra`` exactly when ``save()`` would accept it there, and
    comes back as save() keeps it; else the import names it and writes nothing."""
    pt = tmp_path / "a.pt"
    torch.save({"model": torch.nn.Linear(2, 2).state_dict(), "step": 1, "note": value}, pt)
    url = str(tmp_path / "root")
    plain = list(value) if isinstance(value, tuple) else value
    try:
        expected = extra_value(plain)
    except ConfigError:
        with pytest.raises(ConfigError, match=r"\['note'\]"):
            import_torch_checkpoint(pt, url)
        assert not (tmp_path / "root").exists()
        return
    import_torch_checkpoint(pt, url)
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        extra = mgr.restore(TrainState(model=torch.nn.Linear(2, 2))).extra
    assert repr(extra) == repr({"note": expected})  # repr: nan == nan, -0.0 apart from 0.0
