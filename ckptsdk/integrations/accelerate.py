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
from torch.utils.data import RandomSampler

from ckptsdk.integrations import require

require("accelerate", "accelerate")
from accelerate.data_loader import SeedableRandomSampler  # noqa: E402

from ckptsdk.checkpoint.reading.catalog import CheckpointInfo  # noqa: E402
from ckptsdk.checkpoint.retention import Rule  # noqa: E402
from ckptsdk.errors import ConfigError  # noqa: E402
from ckptsdk.manager import CheckpointManager, ResumePoint  # noqa: E402
from ckptsdk.options import LeaseOptions, Retention  # noqa: E402
from ckptsdk.state import TrainState  # noqa: E402

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = logging.getLogger(__name__)

__all__ = ["AcceleratorCheckpoints"]


class _Counters:
    """The accelerator's own counters: ``accelerator.step``, each prepared loader's epoch and the
    seed of a seedable sampler.

    A prepared DataLoader calls ``set_epoch(self.iteration)`` on its sampler whenever an
    iterator starts, overriding the loop's own ``set_epoch``; a resumed process that did not put
    ``iteration`` back would shuffle its first epoch as epoch 0. The epoch recorded is the one
    being served, by the loader or by a ``skip_first_batches`` copy of it (:func:`_serving`).
    A ``SeedableRandomSampler`` orders each epoch by ``initial_seed + epoch``, its seed taken
    from torch's at ``prepare()``: a resumed process that did not seed the same would shuffle
    otherwise, so the seed is kept too.
    """

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        loaders = self.accelerator._dataloaders
        return {
            "step": int(self.accelerator.step),
            "dataloader_iterations": [int(getattr(_serving(self.accelerator, d), "iteration", 0)) for d in loaders],
            "sampler_seeds": [_seed_of(d) for d in loaders],
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
        seeds = state.get("sampler_seeds") or [None] * len(loaders)  # absent before issue 47
        for loader, seed in zip(loaders, seeds, strict=False):
            sampler = _sampler(loader)
            if seed is not None and isinstance(sampler, SeedableRandomSampler):
                sampler.initial_seed = int(seed)


def _sampler(loader: Any) -> Any:
    """The sampler that orders a prepared loader's samples (inside accelerate's batch sampler)."""
    batches = getattr(loader, "batch_sampler", None)
    for holder in (batches, getattr(batches, "batch_sampler", None)):
        sampler = getattr(holder, "sampler", None)
        if sampler is not None:
            return sampler
    return getattr(loader, "sampler", None)


def _seed_of(loader: Any) -> int | None:
    sampler = _sampler(loader)
    return int(sampler.initial_seed) if isinstance(sampler, SeedableRandomSampler) else None


def _serving(accelerator: Any, loader: Any) -> Any:
    """What serves ``loader``'s epoch now: a ``skip_first_batches`` copy of it while that copy
    iterates (the active loader: over the same dataset, not itself prepared), else ``loader``."""
    refs = accelerator.gradient_state.dataloader_references
    active = refs[-1] if refs else None
    if (
        active is not None
        and active is not loader
        and hasattr(active, "iteration")
        and getattr(active, "dataset", None) is getattr(loader, "dataset", None)
        and all(active is not d for d in accelerator._dataloaders)
    ):
        return active
    return loader


def _check_loaders(accelerator: Any) -> None:
    """Refuse a prepared loader whose order a run resumed mid-epoch cannot give back."""
    for i, loader in enumerate(accelerator._dataloaders):
        sampler = _sampler(loader)
        if isinstance(sampler, RandomSampler) and not isinstance(sampler, SeedableRandomSampler):
            raise ConfigError(
                f"prepared dataloader {i} shuffles with a RandomSampler: each epoch's order is drawn from its "
                "generator as the epoch starts, and a run resumed mid-epoch cannot draw it again. Pass "
                "Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)) (the order then "
                "follows the seed and the epoch), a sampler with set_epoch, or use ckptsdk.DataLoader registered "
                "with accelerator.register_for_checkpointing"
            )
        shuffles = isinstance(sampler, RandomSampler) or callable(getattr(sampler, "set_epoch", None))
        if shuffles and getattr(loader, "generator", None) is None:
            raise ConfigError(
                f"prepared dataloader {i} has no generator=: each epoch's iterator draws a seed from the global "
                "torch RNG as it starts, and a run resumed mid-epoch draws it where the uninterrupted run did not "
                "(dropout and every random draw after it differ). Pass "
                "generator=torch.Generator().manual_seed(SEED) to the DataLoader"
            )


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

    The wrapper owns each prepared loader's epoch: with accelerate's documented resume
    (``skip_first_batches`` for the rest of the killed epoch, then the loader itself, no
    ``set_epoch``) the epoch after the resumed one is shuffled as itself, provided the loop
    calls ``should_save``, ``log_step`` or ``save`` during the resumed epoch.

    Raises:
        ConfigError: more than one process: each rank's RNG states would need a committer
            that gathers them (ckptsdk's distributed layer), which this wrapper is not. Or a
            prepared loader a run resumed mid-epoch cannot shuffle as before: a plain
            ``shuffle=True`` (use ``use_seedable_sampler=True``), or a shuffling loader without
            ``generator=`` (its iterator draws from the global RNG as each epoch starts).

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
        _check_loaders(accelerator)  # before the root is touched
        self.accelerator = accelerator
        self.manager = CheckpointManager(
            url,
            retention=Retention(keep_last=keep_last, keep_every=keep_every, keep=keep),
            lease_options=LeaseOptions(ttl=lease_ttl, force=force),
            save_every=save_every,
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
        self._own_epochs()
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
        self._own_epochs()
        return self.manager.should_save(step)

    def log_step(self, step: int, **scalars: float | torch.Tensor | np.generic) -> None:
        """Record scalars in the per-attempt step log (for ``ckptsdk audit``)."""
        self._own_epochs()
        self.manager.log_step(step, **scalars)

    def _own_epochs(self) -> None:
        """While a ``skip_first_batches`` copy serves a prepared loader's resumed epoch, the
        loader's own next epoch is the one after: set it, so that the loop's next pass over the
        loader (accelerate's documented resume, with no ``set_epoch``) does not shuffle the
        resumed epoch's order again. Run at every step hook (``should_save``, ``log_step``,
        ``save``); a loop that calls ``set_epoch`` itself sets the same epoch."""
        for loader in self.accelerator._dataloaders:
            serving = _serving(self.accelerator, loader)
            if serving is not loader and getattr(loader, "iteration", 0) <= serving.iteration:
                loader.iteration = serving.iteration + 1

    def close(self) -> None:
        """Wait for saves, flush the log, release the lease."""
        self.manager.close()

    def __enter__(self) -> AcceleratorCheckpoints:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
