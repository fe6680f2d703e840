"""The CIFAR-10 ResNet-18 training job, resumable bit-for-bit through a CheckpointManager.

What makes a killed-and-resumed run equal an uninterrupted one (DESIGN.md, "Determinism
contract"): the shuffle comes from a generator seeded by (seed, epoch), the augmentation from one
seeded by (seed, global step), kernels are deterministic, and every stateful object (model,
optimizer, scheduler, grad scaler, RNGs) is in the checkpoint. The loop uses only the manager's
public API. Data fetching lives in ``data.py``/``synthetic.py``, the seeded step pieces (kernels,
AMP, scaler, augmentation, loss) in ``determinism.py``, storage in ``ckptsdk``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

import ckptsdk
from ckptsdk import LeaseOptions, SaveOptions
from ckptsdk.errors import ConfigError, DatasetMismatchError

from .determinism import ScalerSlot, augment, cross_entropy, derived_seed, resolve_amp, set_deterministic
from .model import build_model

logger = logging.getLogger(__name__)

__all__ = ["TrainConfig", "PRESETS", "JobResult", "run_job", "describe_audit"]

# Per-channel statistics of the CIFAR-10 training set (the usual published figures).
_MEAN = (0.4914, 0.4822, 0.4465)
_STD = (0.2470, 0.2435, 0.2616)

# Fields that shape the trajectory: a resume with any of them changed would silently train a
# different run, so it is refused. max_steps, save_every, keep_last may change between attempts.
_TRAJECTORY_FIELDS = (
    "epochs",
    "batch_size",
    "lr",
    "momentum",
    "nesterov",
    "weight_decay",
    "width",
    "seed",
    "pct_start",
)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines one training run.

    Attributes:
        epochs: passes over the training set; the one-cycle schedule spans all of them.
        batch_size: images per step; an epoch is ``n_train // batch_size`` steps (last partial
            batch dropped, so every epoch has the same number of steps).
        lr: the one-cycle peak learning rate.
        momentum, nesterov, weight_decay: SGD settings.
        pct_start: fraction of the steps spent warming the LR up.
        width: channels of the first ResNet stage (64 = ResNet-18 proper).
        seed: seeds model init, the shuffle of each epoch and the augmentation of each step.
        save_every: checkpoint every this many steps (and always at each epoch end).
        keep_last: committed checkpoints kept on storage.
        max_steps: stop after this global step (with a checkpoint), None = all epochs.
        amp: "auto" (fp16 + GradScaler on CUDA, off on CPU), "off", "fp16" (CUDA only), "bf16".
        eval_batch_size: images per evaluation batch.
        n_train, n_test: sizes of the synthetic data set when the job runs on synthetic data.
    """

    epochs: int = 40
    batch_size: int = 256
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4
    pct_start: float = 0.25
    width: int = 64
    seed: int = 0
    save_every: int = 100
    keep_last: int = 3
    max_steps: int | None = None
    amp: str = "auto"
    eval_batch_size: int = 1000
    n_train: int = 50_000
    n_test: int = 10_000

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` applied (None values are ignored, for CLI wiring)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def trajectory(self) -> dict[str, Any]:
        """The fields that must not change across a resume, as JSON."""
        return {name: getattr(self, name) for name in _TRAJECTORY_FIELDS}


PRESETS: dict[str, TrainConfig] = {
    # The job of the story: 40 epochs x 195 steps = 7,800 steps of 256 images.
    "full": TrainConfig(),
    # A few seconds per epoch on 2 CPU cores: a 16-wide ResNet-18 on 640 synthetic images, 5
    # epochs of 10 steps; same code path and checkpoint layout as the full job, only smaller.
    "quick": TrainConfig(
        epochs=5,
        batch_size=64,
        lr=0.05,
        width=16,
        save_every=4,
        n_train=640,
        n_test=250,
        eval_batch_size=250,
    ),
}


@dataclass
class JobResult:
    """What one attempt of the job did.

    Attributes:
        start_step: the step it resumed from (0 on a fresh run).
        final_step: the global step it stopped at.
        resumed_key: the checkpoint folder it restored, or None.
        lease_seconds: time to open the manager, i.e. to take the writer lease.
        restore_seconds: time spent in ``restore()`` (reading + verifying + loading).
        save_seconds: duration of each ``save()`` of this attempt.
        train_seconds: wall time of the training loop (steps, evaluations and saves).
        last_loss: the loss of the last step this attempt ran (nan if none).
        test_accuracy: ``{epoch: accuracy}`` for the epochs this attempt finished.
        audit: the manager's audit report at the end (``.verdict``), or None.
    """

    start_step: int = 0
    final_step: int = 0
    resumed_key: str | None = None
    lease_seconds: float = 0.0
    restore_seconds: float = 0.0
    save_seconds: list[float] = field(default_factory=list)
    train_seconds: float = 0.0
    last_loss: float = math.nan
    test_accuracy: dict[int, float] = field(default_factory=dict)
    audit: Any = None


class _DeviceData:
    """The data set on the training device: uint8 NCHW images, int64 labels."""

    def __init__(self, data: Any, device: torch.device) -> None:
        def nchw(x: torch.Tensor) -> torch.Tensor:
            return x.permute(0, 3, 1, 2).contiguous().to(device)

        self.train_x = nchw(data.train_images)
        self.train_y = data.train_labels.to(device=device, dtype=torch.int64)
        self.test_x = nchw(data.test_images)
        self.test_y = data.test_labels.to(device=device, dtype=torch.int64)
        self.mean = torch.tensor(_MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(_STD, device=device).view(1, 3, 1, 1)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float().div_(255.0) - self.mean) / self.std


def _evaluate(model: nn.Module, dd: _DeviceData, cfg: TrainConfig, amp_dtype: torch.dtype | None) -> float:
    model.eval()
    correct = 0
    with (
        torch.no_grad(),
        torch.autocast(dd.test_x.device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None),
    ):
        for i in range(0, dd.test_x.shape[0], cfg.eval_batch_size):
            logits = model(dd.normalise(dd.test_x[i : i + cfg.eval_batch_size]))
            correct += int((logits.argmax(dim=1) == dd.test_y[i : i + cfg.eval_batch_size]).sum())
    model.train()
    return correct / max(1, dd.test_x.shape[0])


def _check_resume(pos: Any, cfg: TrainConfig, data_hash: str, steps_per_epoch: int, url: str) -> None:
    """Refuse a resume that would silently continue a different run."""
    saved_hash = (getattr(pos, "tags", None) or {}).get("data_hash") or pos.extra.get("data_hash")
    if saved_hash and saved_hash != data_hash:
        raise DatasetMismatchError(
            f"the checkpoint at {url} (step {pos.step}) was trained on data with tensor hash "
            f"{saved_hash}, but the data loaded now hashes to {data_hash}: resuming would train on "
            "different data. Load the same data set (same source/seed), or start a new run under "
            "another --ckpt root.",
            source=url,
            expected=saved_hash,
            actual=data_hash,
        )
    saved = pos.extra.get("config") or {}
    diff = {k: (saved[k], v) for k, v in cfg.trajectory().items() if k in saved and saved[k] != v}
    if diff:
        listed = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise ConfigError(
            f"the checkpoint at {url} (step {pos.step}) belongs to a run with other settings "
            f"({listed}); resume with the same settings, or start a new run under another --ckpt root"
        )
    if (pos.epoch, pos.batch_idx) != divmod(pos.step, steps_per_epoch):
        raise ConfigError(
            f"the checkpoint at {url} says step {pos.step} is epoch {pos.epoch} batch "
            f"{pos.batch_idx}, but with {steps_per_epoch} steps per epoch it would be "
            f"{divmod(pos.step, steps_per_epoch)}: the data size or batch size changed"
        )


def run_job(
    cfg: TrainConfig,
    data: Any,
    ckpt_url: str,
    *,
    device: str | torch.device = "cpu",
    lease_ttl: float | None = None,
    force: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    echo: Callable[[str], None] = logger.info,
    progress: bool = False,
    on_event: Callable[[str, int], None] | None = None,
    save_on_signal: bool | None = None,
) -> JobResult:
    """Train (or resume) the CIFAR-10 job under ``ckpt_url`` until ``cfg.max_steps`` or the end.

    Args:
        cfg: the run's settings (see :data:`PRESETS`).
        data: a ``CifarData`` (uint8 N x 32 x 32 x 3 images, int64 labels, ``tensor_hash``).
        ckpt_url: checkpoint root, any backend URL (``/path``, ``drive://...``, ``gs://...``).
        device: where to train; the data is copied there once, as uint8.
        lease_ttl: seconds before a silent previous writer's lease may be taken over (None: the
            library's default, 60 s on local disk and GCS, 300 s on Drive).
        force: break a live lease at once (only when the previous writer is known dead).
        storage_options: fsspec options for ``gs://`` roots.
        echo: where the human-readable lines go (the examples pass ``tqdm.write``).
        progress: show a tqdm bar over the steps.
        on_event: called as ``on_event(name, step)`` at "step" (after each step is logged),
            "saving" (just before a save) and "saved"; test harnesses kill the job on these.
        save_on_signal: on SIGTERM (a spot VM's preemption) or SIGINT (a notebook's stop), save
            at the next step and exit as the signal asked (see ``CheckpointManager``). None: on
            when the job runs in the main thread.

    Returns:
        A :class:`JobResult`, with the audit of every attempt so far.

    Raises:
        DatasetMismatchError: the checkpoint was trained on data with another tensor hash.
        ConfigError: the checkpoint belongs to a run with other settings, or a bad option.
        LeaseHeldError: another live writer holds ``ckpt_url``.

    Example:
        >>> from adapters.cifar10.synthetic import synthetic_cifar10
        >>> cfg = PRESETS["quick"].replace(max_steps=3)
        >>> data = synthetic_cifar10(n_train=cfg.n_train, n_test=cfg.n_test, seed=0)
        >>> run_job(cfg, data, "memory://doc-job").final_step
        3
    """
    dev = torch.device(device)
    set_deterministic(dev)
    amp_dtype = resolve_amp(cfg.amp, dev)
    n_train = int(data.train_images.shape[0])
    steps_per_epoch = n_train // cfg.batch_size
    if steps_per_epoch < 1:
        raise ConfigError(f"batch_size {cfg.batch_size} is larger than the {n_train} training images")
    total_steps = cfg.epochs * steps_per_epoch
    end_step = min(total_steps, cfg.max_steps) if cfg.max_steps is not None else total_steps
    data_hash = str(data.tensor_hash)
    emit = on_event or (lambda _name, _step: None)

    # Every global RNG from the run's seed (torch's draws the model init): a fresh run is then a
    # pure function of the config, and a resume overwrites all of them from the checkpoint.
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = build_model(width=cfg.width).to(dev)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        weight_decay=cfg.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=cfg.lr,
        total_steps=total_steps,
        pct_start=cfg.pct_start,
    )
    # Enabled only for fp16 on CUDA (bf16 has fp32's range); in the state either way.
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16 and dev.type == "cuda")
    state = ckptsdk.TrainState(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=ScalerSlot(scaler),
    )
    dd = _DeviceData(data, dev)
    result = JobResult()
    extra = {"data_hash": data_hash, "config": cfg.trajectory()}
    tags = {"data_hash": data_hash}

    t0 = time.perf_counter()
    with ckptsdk.CheckpointManager(
        ckpt_url,
        keep_last=cfg.keep_last,
        lease_options=LeaseOptions(ttl=lease_ttl, force=force),
        save_options=SaveOptions(every=cfg.save_every, on_signal=save_on_signal),
        storage_options=storage_options,
    ) as mgr:
        # Opening takes the writer lease: after a crash that means waiting out the dead
        # writer's ttl, which is why it is timed apart from the restore itself.
        result.lease_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        pos = mgr.restore(state)
        result.restore_seconds = time.perf_counter() - t0
        if pos is None:
            echo(f"fresh run under {ckpt_url}: {end_step} steps ({steps_per_epoch} per epoch)")
        else:
            _check_resume(pos, cfg, data_hash, steps_per_epoch, ckpt_url)
            result.start_step, result.resumed_key = pos.step, pos.key
            echo(
                f"resumed from step {pos.step} (epoch {pos.epoch}, batch {pos.batch_idx}) of "
                f"{ckpt_url}: loaded in {result.restore_seconds:.2f} s "
                f"(lease taken in {result.lease_seconds:.1f} s)"
            )
        step = result.start_step

        def save(epoch: int, batch_idx: int, metrics: dict[str, float]) -> None:
            emit("saving", step)
            t = time.perf_counter()
            mgr.save(state, step=step, epoch=epoch, batch_idx=batch_idx, metrics=metrics, extra=extra, tags=tags)
            result.save_seconds.append(time.perf_counter() - t)
            emit("saved", step)

        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=end_step, initial=step, unit="step", dynamic_ncols=True)
        epoch, batch_idx = divmod(step, steps_per_epoch)
        t_train = time.perf_counter()
        try:
            while step < end_step:
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                t_epoch, epoch_steps = time.perf_counter(), 0
                loss_sum = torch.zeros((), device=dev)
                shuffle = torch.Generator().manual_seed(derived_seed(cfg.seed, "shuffle", epoch))
                order = torch.randperm(n_train, generator=shuffle).to(dev)
                while batch_idx < steps_per_epoch and step < end_step:
                    idx = order[batch_idx * cfg.batch_size : (batch_idx + 1) * cfg.batch_size]
                    x = dd.normalise(augment(dd.train_x[idx], cfg.seed, step + 1))
                    lr = scheduler.get_last_lr()[0]
                    with torch.autocast(dev.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                        loss = cross_entropy(model(x), dd.train_y[idx])
                    optimizer.zero_grad(set_to_none=True)
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
                    with warnings.catch_warnings():
                        # GradScaler skips the optimizer step on an fp16 overflow; the schedule
                        # still advances, as it should, and torch warns about exactly that.
                        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
                        scheduler.step()
                    step += 1
                    batch_idx += 1
                    epoch_steps += 1
                    loss = loss.detach()
                    loss_sum += loss
                    # A 0-d tensor: the run log reads it back at its next flush, so a GPU step
                    # costs no host sync here.
                    mgr.log_step(step, loss=loss, lr=lr)
                    if bar is not None:
                        bar.update(1)
                        if step % 10 == 0 or step == end_step:
                            bar.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}", refresh=False)
                    emit("step", step)
                    if batch_idx < steps_per_epoch and (mgr.should_save(step) or step == end_step):
                        result.last_loss = float(loss)
                        save(epoch, batch_idx, {"loss": result.last_loss})
                if batch_idx < steps_per_epoch:
                    break  # stopped mid-epoch at max_steps; saved above
                result.last_loss = float(loss)
                mean_loss = float(loss_sum) / max(1, epoch_steps)
                acc = _evaluate(model, dd, cfg, amp_dtype)
                result.test_accuracy[epoch] = acc
                peak = (
                    f", peak GPU memory {torch.cuda.max_memory_allocated(dev) / 2**30:.2f} GiB"
                    if dev.type == "cuda"
                    else ""
                )
                echo(
                    f"epoch {epoch + 1}/{cfg.epochs}: steps {step - epoch_steps + 1}-{step}, "
                    f"{time.perf_counter() - t_epoch:.1f} s, loss {mean_loss:.4f}, "
                    f"test accuracy {acc:.2%}{peak}"
                )
                epoch, batch_idx = epoch + 1, 0
                # The epoch-end checkpoint records the next batch to run: (next epoch, 0).
                save(epoch, 0, {"loss": mean_loss, "test_accuracy": acc})
        finally:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            result.train_seconds = time.perf_counter() - t_train
            if bar is not None:
                bar.close()
        result.final_step = step
        result.audit = mgr.audit()
    if result.save_seconds:
        echo(
            f"{len(result.save_seconds)} checkpoints saved, "
            f"{sum(result.save_seconds) / len(result.save_seconds):.3f} s each on average"
        )
    echo(f"audit: {describe_audit(result.audit)}")
    return result


def describe_audit(report: Any) -> str:
    """One line from an :class:`~ckptsdk.runlog.audit.AuditReport`: verdict, attempts, overlap, max diff."""
    loss = report.scalars.get("loss")
    diff = f", max |loss diff| {loss.max_abs_diff:g}" if loss is not None and report.overlap_steps else ""
    return f"{report.verdict}: {len(report.attempts)} attempts, {report.overlap_steps} steps run by more than one{diff}"
