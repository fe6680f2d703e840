"""CkptsdkTrainer with a peft (LoRA) model: the frozen base is referenced, not stored.

A tiny GPT-2 built from a config (nothing downloaded), its 2 MiB embedding frozen under LoRA. A
run stopped at step 3 and resumed ends with an uninterrupted run's adapters, bit for bit; each
checkpoint holds about what the Trainer's own ``checkpoint-N`` holds; another base is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import torch  # noqa: E402

from ckptsdk import CheckpointManager  # noqa: E402
from ckptsdk.errors import StateMismatchError  # noqa: E402
from ckptsdk.integrations.transformers import CkptsdkTrainer  # noqa: E402

# peft asks transformers for a property transformers 5 deprecates: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _config() -> transformers.GPT2Config:
    return transformers.GPT2Config(
        vocab_size=2048, n_positions=16, n_embd=256, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )


def _model(name: str, base_seed: int = 0) -> torch.nn.Module:
    """The LoRA model on a base named ``name``: a local folder holding its config (peft looks the
    name up when saving; a hub id would reach for the network, which tests never do)."""
    torch.manual_seed(base_seed)
    config = _config()
    base = transformers.GPT2LMHeadModel(config)
    base.config.name_or_path = name
    base.name_or_path = name  # what peft records as base_model_name_or_path (from_pretrained sets it)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
    torch.manual_seed(1)
    return peft.get_peft_model(base, lora)


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 2048, (16,), generator=g) for _ in range(12)]
    return [{"input_ids": r, "labels": r} for r in rows]


def _args(out: Path, steps: int) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=2,
        save_steps=3,
        save_strategy="steps",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        logging_steps=100,
    )


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


class _StopAt(transformers.TrainerCallback):
    """Stop the run after ``step`` (saved there): a runtime that went away, the schedule unchanged."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def _train(url: str, out: Path, *, resume: bool, stop: int | None = None, base_seed: int = 0) -> torch.nn.Module:
    model = _model(str(out.parent / "tiny-gpt2-base"), base_seed)
    trainer = CkptsdkTrainer(
        model=model,
        args=_args(out, 6),
        train_dataset=_data(),
        ckpt_url=url,
        lease_ttl=5,
        callbacks=[_StopAt(stop)] if stop else None,
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    return model


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lora_run_references_its_base_and_resumes_bit_exact(tmp_path) -> None:
    name = str(tmp_path / "tiny-gpt2-base")
    _config().save_pretrained(name)
    whole = _train(str(tmp_path / "whole"), tmp_path / "o1", resume=False)
    url = str(tmp_path / "root")
    _train(url, tmp_path / "o2", resume=False, stop=3)
    resumed = _train(url, tmp_path / "o3", resume=True)
    want = _adapters(whole)
    assert want and all(torch.equal(_adapters(resumed)[k], v) for k, v in want.items())

    with CheckpointManager(url, read_only=True) as mgr:
        manifest = mgr.load_manifest()
        ours = manifest.files[0].size
    (group,) = manifest.referenced
    assert group.source == f"hf:{name}"
    assert "objects/model/base_model.model.transformer.wte.weight" in group.tensors
    assert not manifest.shared

    # The Trainer's own checkpoint of the same run: adapter, optimizer, scheduler, RNG, state.
    plain = transformers.Trainer(
        model=_model(name), args=_args(tmp_path / "hf", 6), train_dataset=_data(), callbacks=[_StopAt(3)]
    )
    plain.train()
    folder = tmp_path / "hf" / "checkpoint-3"
    theirs = sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and f.suffix != ".md")
    assert ours <= 1.2 * theirs, (ours, theirs)

    with pytest.raises(StateMismatchError, match=f"hf:{name}"):
        _train(url, tmp_path / "o4", resume=True, base_seed=5)
