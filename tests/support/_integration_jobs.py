"""Tiny training jobs for the integration tests, one per framework (run as a child process).

``python -m tests.support._integration_jobs MODE --url URL --work DIR --out FILE [--kill-at STEP]
[--storage-options JSON]``: train a small model with dropout (so the RNG states matter) on a
fixed synthetic set, checkpointing through ckptsdk, resuming from whatever the root holds; with
``--kill-at`` the process SIGKILLs itself when that optimizer step begins (mid-run, after some
checkpoints were committed). At the end the final weights go to FILE (safetensors). Not a test;
``run_job``/``weights``/``assert_same`` are the parent's side.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

import safetensors.torch
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N, BATCH, FEATURES = 48, 8, 8  # 6 steps per epoch
# Short, so the resumed run takes over the SIGKILLed writer's lease after 2 s of silence.
LEASE_TTL = 2.0


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N, FEATURES, generator=g)
    return x, (x.sum(dim=1, keepdim=True) > 0).float()


class EpochSampler(torch.utils.data.Sampler):
    """A shuffle drawn from (seed, epoch) only: the same order whether or not the run resumed."""

    def __init__(self, n: int, seed: int = 7) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())

    def __len__(self) -> int:
        return self.n


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    )


# The root whose run log a kill waits for (set by main() for the jobs that log their steps), so the
# steps run after the last save are on storage and the audit has something to compare.
_WAIT_FOR_LOG: dict[str, object] = {}


def _kill_if(step: int, kill_at: int | None) -> None:
    if kill_at is not None and step == kill_at:
        if "url" in _WAIT_FOR_LOG:
            _wait_for_logged(step - 1)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_logged(step: int) -> None:
    wait_for_logged(str(_WAIT_FOR_LOG["url"]), step, dict(_WAIT_FOR_LOG["options"]))


def wait_for_logged(url: str, step: int, options: dict[str, object] | None = None) -> None:
    """Until the run log's flusher thread has published ``step`` under ``url`` (bounded: 60 s)."""
    import threading

    from ckptsdk.backends import open_backend
    from ckptsdk.runlog.audit import read_runlog

    backend = open_backend(url, **dict(options or {}))
    pause = threading.Event()
    for _ in range(600):
        if any(step in rows for rows in read_runlog(backend)[1].values()):
            return
        pause.wait(0.1)
    raise TimeoutError(f"step {step} never reached the run log under {url}")


def run_lightning(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckptsdk.integrations.lightning import CkptsdkCheckpointIO

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"width": 32})
            self.net = _net()

        def training_step(self, batch, batch_idx):
            _kill_if(self.global_step, args.kill_at)
            x, y = batch
            return torch.nn.functional.binary_cross_entropy_with_logits(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)]

    x, y = _data()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=BATCH, sampler=EpochSampler(N)
    )
    module = Module()
    io = CkptsdkCheckpointIO(args.url, storage_options=args.storage_options, lease_ttl=LEASE_TTL)
    trainer = L.Trainer(
        max_epochs=4,
        accelerator="cpu",
        devices=1,
        default_root_dir=args.work,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[io],
        callbacks=[ModelCheckpoint(dirpath=f"{args.work}/ckpt", save_last=True, every_n_epochs=1)],
    )
    # A gs:// work dir: Lightning's "last" lookup cannot see remote pointers; resume from the root.
    trainer.fit(module, loader, ckpt_path=io.resume_path() if args.work.startswith("gs://") else "last")
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}


def run_accelerate(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    from accelerate import Accelerator

    from ckptsdk.integrations.accelerate import AcceleratorCheckpoints

    acc = Accelerator(cpu=True)
    x, y = _data()
    sampler = EpochSampler(N)
    # Its own generator: without one, starting an iterator draws from the global torch RNG, and a
    # run resumed mid-epoch would start one where the uninterrupted run did not.
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y),
        batch_size=BATCH,
        sampler=sampler,
        generator=torch.Generator().manual_seed(5),
    )
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.8)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    ema = LossEMA()
    acc.register_for_checkpointing(ema)  # saved as custom_0, without pickle
    with AcceleratorCheckpoints(
        acc, args.url, save_every=5, lease_ttl=LEASE_TTL, storage_options=args.storage_options
    ) as ckpt:
        pos = ckpt.restore()
        step, first_epoch, done = (0, 0, 0) if pos is None else (pos.step, pos.epoch, pos.batch_idx)
        for epoch in range(first_epoch, 4):
            loader.set_epoch(epoch)  # accelerate's loader forwards it to the sampler
            batches = acc.skip_first_batches(loader, done) if done else loader
            for i, (xb, yb) in enumerate(batches, start=done + 1):
                step += 1
                _kill_if(step, args.kill_at)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                ema.update(loss.detach())
                ckpt.log_step(step, loss=loss.item())
                if ckpt.should_save(step):
                    ckpt.save(step, epoch=epoch, batch_idx=i)
            done = 0
    out = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    return {**out, "custom.ema": ema.value.clone(), "custom.updates": torch.tensor(ema.updates)}


def run_accelerate_loader(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Accelerate with a standard shuffled map-style dataset through ``ckptsdk.DataLoader``.

    The loader is registered for checkpointing (its position goes into the checkpoint as
    ``custom_0``) instead of prepared: one process on the CPU needs no sharding, and the resume
    then skips the consumed batches by index rather than by ``skip_first_batches``.
    """
    from accelerate import Accelerator

    import ckptsdk
    from ckptsdk.integrations.accelerate import AcceleratorCheckpoints

    acc = Accelerator(cpu=True)
    x, y = _data()
    loader = ckptsdk.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True, seed=5)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.8)
    model, opt, sched = acc.prepare(model, opt, sched)
    acc.register_for_checkpointing(loader)
    with AcceleratorCheckpoints(
        acc, args.url, save_every=5, lease_ttl=LEASE_TTL, storage_options=args.storage_options
    ) as ckpt:
        pos = ckpt.restore()
        step = 0 if pos is None else pos.step
        for _epoch in range(loader.epoch, 4):
            for xb, yb in loader:
                step += 1
                _kill_if(step, args.kill_at)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                ckpt.log_step(step, loss=loss.item())
                if ckpt.should_save(step):
                    ckpt.save(step)  # epoch and batch_idx: from the loader
    return {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}


class LossEMA:
    """A user object registered for checkpointing: a running average of the loss."""

    def __init__(self) -> None:
        self.value, self.updates = torch.zeros(()), 0

    def update(self, loss: torch.Tensor) -> None:
        self.value = 0.9 * self.value + 0.1 * loss
        self.updates += 1

    def state_dict(self) -> dict:
        return {"value": self.value, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.updates = state["value"].clone(), int(state["updates"])


def tiny_gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2
    )


def run_transformers(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    from transformers import GPT2LMHeadModel, TrainerCallback, TrainingArguments

    from ckptsdk.integrations.transformers import CkptsdkTrainer

    class Kill(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kwargs):
            _kill_if(state.global_step + 1, args.kill_at)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config())  # tied input/output embeddings, dropout on
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 32, (N, 8), generator=g)]
    targs = TrainingArguments(
        output_dir=os.path.join(args.work, "out"),
        per_device_train_batch_size=BATCH,
        num_train_epochs=3,
        learning_rate=5e-3,
        warmup_steps=2,
        save_strategy="steps",
        save_steps=5,
        logging_steps=1,
        seed=11,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        max_grad_norm=1.0,
    )
    trainer = CkptsdkTrainer(
        model=model,
        args=targs,
        train_dataset=data,
        callbacks=[Kill()],
        ckpt_url=args.url,
        lease_ttl=LEASE_TTL,
        storage_options=args.storage_options,
    )
    trainer.train(resume_from_checkpoint=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}


def run_job(mode: str, url: str, work, out, *, kill_at: int | None = None, options=None, env=None):
    cmd = [
        sys.executable,
        "-m",
        "tests.support._integration_jobs",
        mode,
        "--url",
        url,
        "--work",
        str(work),
        "--out",
        str(out),
        "--storage-options",
        json.dumps(options or {}),
    ]
    if kill_at is not None:
        cmd += ["--kill-at", str(kill_at)]
    full_env = {
        **os.environ,
        "PYTHONPATH": REPO,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONWARNINGS": "ignore",
        **(env or {}),
    }
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=240)
    if kill_at is None:
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    return proc


def weights(path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(path))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    diffs = {k: (a[k] - b[k]).abs().max().item() for k in a}
    assert all(torch.equal(a[k], b[k]) for k in a), diffs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["lightning", "accelerate", "accelerate_loader", "transformers"])
    p.add_argument("--url", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--storage-options", type=json.loads, default={})
    args = p.parse_args()
    if args.mode != "lightning":  # the others log every step through ckptsdk
        _WAIT_FOR_LOG.update(url=args.url, options=args.storage_options)
    torch.use_deterministic_algorithms(True)
    weights = globals()[f"run_{args.mode}"](args)
    safetensors.torch.save_file({k: v.contiguous() for k, v in weights.items()}, args.out)


if __name__ == "__main__":
    main()
