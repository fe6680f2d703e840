"""Hugging Face Accelerate, checkpointed the ckptsdk way instead of ``save_state``'s pickles.

``AcceleratorCheckpoints`` gathers what ``accelerator.save_state`` would write (prepared
models, optimizers, schedulers, the grad scaler, objects from ``register_for_checkpointing``,
the step counter, every RNG state) into one TrainState and saves/restores it through a
CheckpointManager: leased, committed, verified, no pickle. The data position is the job's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ckptsdk.integrations import require

require("accelerate", "accelerate")

from ckptsdk.checkpoint.catalog import CheckpointInfo  # noqa: E402
from ckptsdk.checkpoint.retention import Rule  # noqa: E402
from ckptsdk.errors import ConfigError  # noqa: E402
from ckptsdk.manager import CheckpointManager, ResumePoint  # noqa: E402
from ckptsdk.state import TrainState  # noqa: E402

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = logging.getLogger(__name__)

__all__ = ["AcceleratorCheckpoints"]


class _Counters:
    """The accelerator's own counters: ``accelerator.step`` and each prepared loader's epoch.

    A prepared DataLoader calls ``set_epoch(self.iteration)`` on its sampler whenever an
    iterator starts, overriding the loop's own ``set_epoch``; a resumed process that did not put
    ``iteration`` back would shuffle its first epoch as epoch 0.
    """

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": int(self.accelerator.step),
            "dataloader_iterations": [int(getattr(d, "iteration", 0)) for d in self.accelerator._dataloaders],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        loaders = self.accelerator._dataloaders
        saved = list(state["dataloader_iterations"])
        if len(saved) != len(loaders):
            raise ConfigError(
                f"the checkpoint has {len(saved)} prepared dataloader(s), this run prepared "
                f"{len(loaders)}; prepare the same ones in the same order"
            )
        self.accelerator.step = int(state["step"])
        for loader, iteration in zip(loaders, saved, strict=True):
            if hasattr(loader, "iteration"):
                loader.iteration = iteration


class AcceleratorCheckpoints:
    """Save and restore an ``accelerate.Accelerator``'s training state at a ckptsdk URL.

    Call it after ``accelerator.prepare(...)`` and any ``register_for_checkpointing(...)``:
    the objects are named by their order there (``model_0``, ``optimizer_0``, ``scheduler_0``,
    ``custom_0``...), as ``save_state`` names its files, so prepare them in the same order on resume.

    Args:
        accelerator: the Accelerator (one process: see Raises).
        url: the checkpoint root; its lease keeps a zombie runtime from writing there.
        keep_last, keep_every, keep, save_every, lease_ttl, force, async_save, storage_options:
            as for :class:`~ckptsdk.CheckpointManager`.

    Raises:
        ConfigError: more than one process: each rank's RNG states would need a committer
            that gathers them (ckptsdk's distributed layer), which this wrapper is not.

    Example (a training loop, not a doctest: tests/support/_integration_jobs.py runs one)::

        model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
        ckpt = AcceleratorCheckpoints(accelerator, "gs://bucket/run", save_every=500)
        pos = ckpt.restore()    # None on a fresh run; else skip pos.batch_idx batches of pos.epoch
        ...; ckpt.save(step, epoch=epoch, batch_idx=i + 1) if ckpt.should_save(step) else None
        ckpt.close()
    """

    def __init__(
        self,
        accelerator: Accelerator,
        url: str,
        *,
        keep_last: int = 3,
        keep_every: int | None = None,
        keep: Rule | Sequence[Rule] = (),
        save_every: int | None = None,
        lease_ttl: float | None = None,
        force: bool = False,
        async_save: bool = False,
        storage_options: Mapping[str, object] | None = None,
    ) -> None:
        if accelerator.num_processes != 1:
            raise ConfigError(
                f"AcceleratorCheckpoints supports one process, this run has {accelerator.num_processes}: "
                "per-rank RNG states need a gathering committer; use accelerator.save_state for now"
            )
        self.accelerator = accelerator
        self.manager = CheckpointManager(
            url,
            keep_last=keep_last,
            keep_every=keep_every,
            keep=keep,
            save_every=save_every,
            lease_ttl=lease_ttl,
            force=force,
            async_save=async_save,
            storage_options=storage_options,
        )

    def train_state(self) -> TrainState:
        """Every object ``save_state`` would save, by name, as a :class:`~ckptsdk.TrainState`."""
        acc = self.accelerator
        objects: dict[str, Any] = {}
        # unwrap_model: the module itself, not a compiled or DDP wrapper whose keys differ.
        objects.update({f"model_{i}": acc.unwrap_model(m) for i, m in enumerate(acc._models)})
        objects.update({f"optimizer_{i}": o for i, o in enumerate(acc._optimizers)})
        objects.update({f"scheduler_{i}": s for i, s in enumerate(acc._schedulers)})
        objects.update({f"custom_{i}": c for i, c in enumerate(acc._custom_objects)})
        if acc.scaler is not None:
            objects["scaler"] = acc.scaler
        objects["accelerator"] = _Counters(acc)
        return TrainState(**objects)

    def restore(self) -> ResumePoint | None:
        """Load the newest valid checkpoint into the prepared objects and the RNGs.

        Returns:
            Where to continue (``step``, ``epoch``, ``batch_idx``), or None on a fresh root.
            Skipping the batches already done is the loop's (``accelerator.skip_first_batches``).
        """
        return self.manager.restore(self.train_state())

    def save(
        self,
        step: int,
        *,
        epoch: int | None = None,
        batch_idx: int | None = None,
        metrics: Mapping[str, object] | None = None,
        extra: Mapping[str, object] | None = None,
        tags: Mapping[str, str] | None = None,
        blocking: bool | None = None,
    ) -> CheckpointInfo:
        """Commit the state at ``step``; the rest as for :meth:`ckptsdk.CheckpointManager.save`."""
        return self.manager.save(
            self.train_state(),
            step=step,
            epoch=epoch,
            batch_idx=batch_idx,
            metrics=metrics,
            extra=extra,
            tags=tags,
            blocking=blocking,
        )

    def should_save(self, step: int) -> bool:
        """True every ``save_every`` steps."""
        return self.manager.should_save(step)

    def log_step(self, step: int, **scalars: float | torch.Tensor | np.generic) -> None:
        """Record scalars in the per-attempt step log (for ``ckptsdk audit``)."""
        self.manager.log_step(step, **scalars)

    def close(self) -> None:
        """Wait for saves, flush the log, release the lease."""
        self.manager.close()

    def __enter__(self) -> AcceleratorCheckpoints:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
