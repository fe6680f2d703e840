"""Hugging Face ``Trainer`` checkpointing through ckptsdk: a small Trainer subclass.

A callback cannot do it: the Trainer reads a resume point from a local folder with
``torch.load`` (optimizer, scheduler, scaler, RNG). ``CkptsdkTrainer`` overrides those loads
and the save, so every checkpoint is a leased, committed, pickle-free ckptsdk one; the
Trainer's own resume logic (epochs, batches to skip, callback states) runs unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Collection, Mapping
from typing import Any

from ckptsdk.integrations import require

require("transformers", "transformers")
from transformers import Trainer  # noqa: E402
from transformers.trainer_callback import ExportableState  # noqa: E402
from transformers.trainer_utils import TrainOutput  # noqa: E402

from ckptsdk.checkpoint.retention import KeepBest, keep_best  # noqa: E402
from ckptsdk.checkpoint.writing.sharing import FrozenMode  # noqa: E402
from ckptsdk.errors import ConfigError, StateMismatchError  # noqa: E402
from ckptsdk.manager import CheckpointManager  # noqa: E402
from ckptsdk.options import LeaseOptions, Retention, SaveOptions  # noqa: E402
from ckptsdk.rng import restore_rng  # noqa: E402
from ckptsdk.state import TrainState, with_tied  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["CkptsdkTrainer"]

_TRAINER_STATE = "trainer_state.json"  # the name Trainer's resume reads its position from


class _TrainerStateJSON:
    """The Trainer's TrainerState as one JSON string (its own format: ``save_to_json``'s)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.saved: str | None = None

    def state_dict(self) -> dict[str, str]:
        return {"json": json.dumps(dataclasses.asdict(self.trainer.state), sort_keys=True)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.saved = str(state["json"])


class _Deferred:
    """Holds a saved state until the Trainer has built the object it belongs to."""

    def __init__(self, live: Any = None) -> None:
        self.live = live
        self.saved: Any = None

    def state_dict(self) -> Any:
        return self.live.state_dict() if self.live is not None else {}

    def load_state_dict(self, state: Any) -> None:
        self.saved = state


class CkptsdkTrainer(Trainer):
    """A ``transformers.Trainer`` whose checkpoints live in a ckptsdk root.

    Saves happen where the Trainer saves (``save_strategy``/``save_steps``): model, optimizer,
    scheduler, grad scaler, every RNG state and the TrainerState, committed at
    ``state.global_step``. ``train(resume_from_checkpoint=True)`` continues from the newest
    valid checkpoint (or starts fresh on an empty root); without it, a root that already holds
    checkpoints is refused rather than silently trained over.

    Args:
        *args, **kwargs: as for ``transformers.Trainer``.
        ckpt_url: the checkpoint root (``drive://``, ``gs://``, a path); its writer lease stops
            a zombie runtime from writing or rotating there while this one trains.
        keep_last: checkpoints kept (None: ``args.save_total_limit``, else 3).
        keep_every, lease_ttl, force, storage_options: as for :class:`~ckptsdk.CheckpointManager`.
        frozen: ``SaveOptions.frozen``. None: ``"reference"`` for a peft model (its frozen base
            is recorded by digest, with source ``hf:{base_model_name_or_path}@{revision}``, and
            proven at resume: a checkpoint holds the adapters, the optimizer and the rest, as
            the Trainer's own ``checkpoint-N``), else ``"store"``.

    Retention maps onto ckptsdk's keep rules, by union: ``save_total_limit`` is ``keep_last``;
    ``metric_for_best_model`` (``eval_`` prefixed as the Trainer does, ``greater_is_better``
    as its mode) adds ``keep_best(metric, 1)``, so the best checkpoint survives rotation as
    the Trainer keeps it; ``load_best_model_at_end`` loads that one's weights from the root at
    the end of ``train()`` (judged from the committed manifests: NaN never best).

    Raises:
        ConfigError: more than one process (per-rank RNG states need a gathering committer).

    Example (a training run, not a doctest: tests/integrations/test_integration_hf.py runs one)::

        trainer = CkptsdkTrainer(model=model, args=TrainingArguments("out", save_steps=500),
                                 train_dataset=ds, ckpt_url="drive://runs/gpt")
        trainer.train(resume_from_checkpoint=True)
    """

    def __init__(
        self,
        *args: Any,
        ckpt_url: str,
        keep_last: int | None = None,
        keep_every: int | None = None,
        lease_ttl: float | None = None,
        force: bool = False,
        storage_options: Mapping[str, object] | None = None,
        frozen: FrozenMode | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.args.world_size > 1:
            raise ConfigError(
                f"CkptsdkTrainer supports one process, this run has {self.args.world_size}: "
                "per-rank RNG states need a gathering committer"
            )
        self.ckpt_url = ckpt_url
        self._best = _best_rule(self.args)
        self._ckpt_options: dict[str, Any] = dict(
            retention=Retention(
                keep_last=keep_last if keep_last is not None else self.args.save_total_limit or 3,
                keep_every=keep_every,
                keep=[self._best] if self._best is not None else [],
            ),
            lease_options=LeaseOptions(ttl=lease_ttl, force=force),
            storage_options=dict(storage_options or {}),
            save_options=_save_options(self.model, frozen),
        )
        self._ckpt_mgr: CheckpointManager | None = None
        self._resume: dict[str, Any] | None = None

    # ------------------------------------------------------------------ train

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: object = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        """Train, checkpointing to ``ckpt_url``; ``resume_from_checkpoint=True`` continues.

        Raises:
            ConfigError: a path was given (use ``ckptsdk import`` for old folders), or the root
                holds checkpoints and ``resume_from_checkpoint`` is not True.
        """
        if resume_from_checkpoint not in (None, False, True):
            raise ConfigError(
                f"CkptsdkTrainer resumes from its ckpt_url, not from {resume_from_checkpoint!r}: "
                "pass resume_from_checkpoint=True"
            )
        self._ckpt_mgr = CheckpointManager(self.ckpt_url, **self._ckpt_options)  # takes the lease
        folder = None
        try:
            latest = self._ckpt_mgr.latest()
            if latest is not None and resume_from_checkpoint is not True:
                # Checked before restore(), which would already record this writer's lineage.
                raise ConfigError(
                    f"{self.ckpt_url} holds checkpoints up to step {latest.step}: pass "
                    "resume_from_checkpoint=True to continue that run, or use a new ckpt_url"
                )
            parts = {
                "model": self.model,
                "optimizer": _Deferred(),
                "scheduler": _Deferred(),
                "scaler": _Deferred(),
                "trainer": _TrainerStateJSON(self),
            }
            pos = self._ckpt_mgr.restore(_Capture(parts))
            if pos is None:
                return super().train(None, trial, ignore_keys_for_eval, **kwargs)
            self._resume = parts
            # The Trainer's resume reads its position (epoch, steps to skip, callback states)
            # from trainer_state.json in a folder: give it one holding only that JSON.
            folder = tempfile.mkdtemp(prefix="ckptsdk-resume-")
            with open(os.path.join(folder, _TRAINER_STATE), "w", encoding="utf-8") as f:
                f.write(parts["trainer"].saved or "")
            logger.info("resuming from %s/%s (step %d)", self.ckpt_url, pos.key, pos.step)
            return super().train(folder, trial, ignore_keys_for_eval, **kwargs)
        finally:
            self._resume = None
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            mgr, self._ckpt_mgr = self._ckpt_mgr, None
            mgr.close()

    # ------------------------------------------------------------------ loads (resume only)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._resume is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return None
        # restore() already loaded the weights into self.model (checked against its keys and shapes).
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._resume is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return None
        self.optimizer.load_state_dict(self._resume["optimizer"].saved)
        self.lr_scheduler.load_state_dict(self._resume["scheduler"].saved)
        return None

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._resume is None:
            super()._load_scaler(checkpoint)
            return None
        saved = self._resume["scaler"].saved
        if saved and self.accelerator.scaler is not None:
            self.accelerator.scaler.load_state_dict(saved)
        return None

    def _load_rng_state(self, checkpoint: str | None) -> None:
        # Called by the Trainer at the right moment: after skipping the batches already done.
        if self._resume is None:
            super()._load_rng_state(checkpoint)
            return None
        restore_rng(self._resume["rng"])
        return None

    # ------------------------------------------------------------------ save

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """As Trainer.log; the training loss also goes to ckptsdk's step log (``ckptsdk audit``)."""
        super().log(logs, *args, **kwargs)
        if self._ckpt_mgr is not None and isinstance(logs.get("loss"), (int, float)):
            self._ckpt_mgr.log_step(self.state.global_step, loss=logs["loss"])

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self._ckpt_mgr is None:
            raise ConfigError("CkptsdkTrainer saves only inside train()")
        # As Trainer._save_checkpoint: stateful callbacks record their state in the TrainerState.
        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb.state())
            else:
                self.state.stateful_callbacks[name] = cb.state()
        state = TrainState(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.lr_scheduler,
            scaler=_Deferred(self.accelerator.scaler),
            trainer=_TrainerStateJSON(self),
        )
        step = self.state.global_step
        self._ckpt_mgr.save(
            state,
            step=step,
            epoch=int(self.state.epoch or 0),
            metrics=_metrics_at(self.state.log_history, step),
            tags={"framework": "transformers"},
        )
        if self._best is not None and self.args.load_best_model_at_end:
            best = self._ckpt_mgr.best(self._best.metric, self._best.mode)
            if best is not None:
                # What the Trainer's end of train() looks at to call _load_best_model (below).
                self.state.best_model_checkpoint = f"{self.ckpt_url}@{best.step}"
                self.state.best_global_step = best.step

    def _load_best_model(self) -> None:
        """Load the best checkpoint's weights from the root (the Trainer calls this at the end)."""
        if self._ckpt_mgr is None or self._best is None:
            super()._load_best_model()
            return
        best = self._ckpt_mgr.best(self._best.metric, self._best.mode)
        if best is None:
            logger.warning(
                "load_best_model_at_end: no checkpoint under %s holds a finite %s; keeping the final weights",
                self.ckpt_url,
                self._best.metric,
            )
            return None
        tree = self._ckpt_mgr.load(step=best.step)
        self.model.load_state_dict(tree["objects"]["model"])
        logger.info(
            "loaded the best model (%s) from %s/%s (step %d)", self._best.metric, self.ckpt_url, best.key, best.step
        )
        return None


def _best_rule(args: Any) -> KeepBest | None:
    """``metric_for_best_model`` as a keep rule, named and directed as the Trainer judges it."""
    metric = args.metric_for_best_model
    if metric is None:
        return None
    name = metric if metric.startswith("eval_") else f"eval_{metric}"
    greater = args.greater_is_better if args.greater_is_better is not None else not name.endswith("loss")
    return keep_best(name, 1, "max" if greater else "min")


def _metrics_at(history: list[dict[str, Any]], step: int) -> dict[str, float]:
    """The numbers the Trainer logged at ``step`` (training loss, then the evaluation's)."""
    out: dict[str, float] = {}
    for entry in history:
        if entry.get("step") == step:
            out.update({k: v for k, v in entry.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def _save_options(model: Any, frozen: FrozenMode | None) -> SaveOptions:
    """Reference mode for a peft model (unless ``frozen`` says otherwise), its source from its config."""
    config = getattr(model, "peft_config", None)
    if frozen is None:
        frozen = "reference" if isinstance(config, Mapping) and config else "store"
    source = None
    if frozen == "reference" and isinstance(config, Mapping) and config:
        first = next(iter(config.values()))
        name = getattr(first, "base_model_name_or_path", None)
        revision = getattr(first, "revision", None)
        if name:
            source = f"hf:{name}" + (f"@{revision}" if revision else "")
    return SaveOptions(frozen=frozen, frozen_source=source)


class _Capture:
    """Restores the model at once and keeps the rest until the Trainer asks for it.

    A live target for restore's proof of a referenced base (its model's tensors), never read
    straight into (``live_tensors`` is empty: ``load_state_dict`` loads)."""

    def __init__(self, parts: dict[str, Any]) -> None:
        self.parts = parts

    def tensors_at(self, paths: Collection[str]) -> dict[str, Any]:
        return TrainState(model=self.parts["model"]).tensors_at(paths)

    def live_tensors(self) -> dict[str, Any]:
        return {}

    def check_fit(self, tree: Any, *, strict: bool = True) -> None:
        """Checked whole by :meth:`load_state_dict` (the Trainer's objects are built later)."""

    def load_state_dict(self, tree: Mapping[str, Any]) -> None:
        state = TrainState(**self.parts)
        problems = state.mismatches(tree)
        if problems:
            raise StateMismatchError(
                "the checkpoint does not fit this Trainer: " + "; ".join(problems[:8]), mismatches=problems
            )
        # An imported HF folder lacks a tied weight's second name (save_pretrained writes it once).
        model = self.parts["model"]
        model.load_state_dict(with_tied(model, tree["objects"]["model"]))
        for name in ("optimizer", "scheduler", "scaler", "trainer"):
            self.parts[name].load_state_dict(tree["objects"][name])
        self.parts["rng"] = tree["rng"]
