"""Hugging Face Accelerate and Trainer through ckptsdk: a tiny model (dropout on, built from a
config, nothing downloaded) SIGKILLed mid-run and resumed ends with an uninterrupted run's weights."""

from __future__ import annotations

import importlib
import sys

import pytest

from ckptsdk import CheckpointManager, LeaseOptions
from ckptsdk.errors import MissingDependencyError
from tests.support._integration_jobs import assert_same, run_job, weights


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "mode,kill_at,saved,last",
    [
        # accelerate: save_every=5, 6 steps per epoch, 24 steps; killed as step 14 begins (mid epoch 2)
        ("accelerate", 14, [5, 10], 20),
        # the same through ckptsdk.DataLoader(shuffle=True), registered for checkpointing
        ("accelerate_loader", 14, [5, 10], 20),
        # Trainer: save_steps=5 and at the end, 18 steps; killed as step 13 begins
        ("transformers", 13, [5, 10], 18),
    ],
)
def test_sigkilled_run_resumes_bit_exact(mode, kill_at, saved, last, tmp_path):
    pytest.importorskip(mode.split("_")[0])
    run_job(mode, str(tmp_path / "ref-root"), tmp_path / "ref", tmp_path / "ref.safetensors")
    url = str(tmp_path / "root")
    run_job(mode, url, tmp_path / "w", tmp_path / "a.safetensors", kill_at=kill_at)
    with CheckpointManager(url, read_only=True) as mgr:
        assert [c.step for c in mgr.list() if c.valid] == saved
    run_job(mode, url, tmp_path / "w", tmp_path / "b.safetensors")
    assert_same(weights(tmp_path / "b.safetensors"), weights(tmp_path / "ref.safetensors"))
    with CheckpointManager(url, read_only=True) as mgr:
        assert mgr.latest().step == last
        report = mgr.audit()
        attempts = report.attempts
    assert [a.resumed_from_step for a in attempts] == [None, saved[-1]]
    # The killed attempt's steps after its last save reached the log (the flusher thread): they
    # were run again and compared.
    assert report.verdict == "bit-exact" and report.overlap_steps == kill_at - 1 - saved[-1], report
    if mode == "accelerate_loader":
        assert report.data_compared == {"data/custom_0": report.overlap_steps}
    if mode == "transformers":  # GPT-2 ties lm_head to wte: exported once, as save_model would
        _export_tied_gpt2(url, tmp_path, weights(tmp_path / "b.safetensors"))


def _export_tied_gpt2(url, tmp_path, final):
    import safetensors
    import safetensors.torch
    import torch
    from transformers import GPT2LMHeadModel

    from ckptsdk.porting.export import export_safetensors
    from tests.support._integration_jobs import tiny_gpt2_config

    out = tmp_path / "gpt2.safetensors"
    report = export_safetensors(url, out, model=GPT2LMHeadModel(tiny_gpt2_config()))
    assert report["removed"] == {"transformer.wte.weight": "lm_head.weight"}  # the sorted-first name stays
    fresh = GPT2LMHeadModel(tiny_gpt2_config())
    safetensors.torch.load_model(fresh, str(out))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in final.items())
    assert torch.equal(fresh.lm_head.weight, final["transformer.wte.weight"])
    # The same file layout as safetensors' own save_model of that model.
    reference = tmp_path / "save_model.safetensors"
    safetensors.torch.save_model(fresh, str(reference))
    with safetensors.safe_open(str(reference), "pt") as ref, safetensors.safe_open(str(out), "pt") as ours:
        assert set(ref.keys()) == set(ours.keys())
        assert ref.metadata().items() <= ours.metadata().items()
        assert all(torch.equal(ref.get_tensor(k), ours.get_tensor(k)) for k in ref.keys())


@pytest.mark.parametrize(
    "module,extra",
    [
        ("lightning", "lightning"),
        ("accelerate", "accelerate"),
        ("transformers", "transformers"),
    ],
)
def test_missing_framework_names_the_extra(module, extra, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, f"ckptsdk.integrations.{extra}", raising=False)
    with pytest.raises(MissingDependencyError, match=rf"pip install 'ckptsdk\[{extra}\]'") as err:
        importlib.import_module(f"ckptsdk.integrations.{extra}")
    assert err.value.extra == extra


def test_trainer_refuses_to_train_over_checkpoints_without_resume(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from ckptsdk import TrainState
    from ckptsdk.errors import ConfigError
    from ckptsdk.integrations.transformers import CkptsdkTrainer

    url = str(tmp_path / "root")
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(TrainState(model=torch.nn.Linear(2, 2)), step=7)
    config = transformers.GPT2Config(vocab_size=16, n_positions=4, n_embd=8, n_layer=1, n_head=2)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, disable_tqdm=True
    )
    trainer = CkptsdkTrainer(
        model=transformers.GPT2LMHeadModel(config),
        args=args,
        ckpt_url=url,
        lease_ttl=5,
        train_dataset=[{"input_ids": torch.zeros(4, dtype=torch.long)}],
    )
    for resume in (None, False):
        with pytest.raises(ConfigError, match="holds checkpoints up to step 7"):
            trainer.train(resume_from_checkpoint=resume)
    with pytest.raises(ConfigError, match="resume_from_checkpoint=True"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-7"))
    with CheckpointManager(url, read_only=True) as mgr:
        assert [(c.key, c.valid) for c in mgr.list()] == [("step-0000000007.e1", True)]


def test_trainer_keeps_the_best_and_loads_it_at_the_end(tmp_path):
    """save_total_limit=1 + load_best_model_at_end: the root keeps the newest and the best by
    eval_loss (NaN never best), and train() ends with the best checkpoint's weights."""
    transformers = pytest.importorskip("transformers")
    import math

    import torch

    from ckptsdk.integrations.transformers import CkptsdkTrainer

    scores = {2: 0.5, 4: 0.1, 6: math.nan, 8: 0.3}

    class Scripted(CkptsdkTrainer):
        def evaluate(self, *args, **kwargs):  # the evaluation's number, scripted per step
            metrics = {"eval_loss": scores[self.state.global_step]}
            self.log(metrics)
            return metrics

    url = str(tmp_path / "root")
    config = transformers.GPT2Config(vocab_size=16, n_positions=4, n_embd=8, n_layer=1, n_head=2)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        max_steps=8,
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        save_total_limit=1,
        load_best_model_at_end=True,
        learning_rate=0.1,
        per_device_train_batch_size=1,
    )
    torch.manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 16, (4,)), "labels": torch.randint(0, 16, (4,))} for _ in range(8)]
    trainer = Scripted(
        model=transformers.GPT2LMHeadModel(config),
        args=args,
        ckpt_url=url,
        lease_ttl=5,
        train_dataset=rows,
        eval_dataset=rows[:1],  # never read: evaluate() is scripted
    )
    trainer.train()
    with CheckpointManager(url, read_only=True) as mgr:
        assert [c.step for c in mgr.list()] == [4, 8]
        assert mgr.best("eval_loss").step == 4  # type: ignore[union-attr]
        best = mgr.load(step=4)["objects"]["model"]
        final = mgr.load(step=8)["objects"]["model"]
    live = trainer.model.state_dict()
    assert all(torch.equal(live[k], v) for k, v in best.items())
    assert any(not torch.equal(best[k], final[k]) for k in best)  # it really went back
