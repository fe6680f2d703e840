"""Lightning's checkpoints the ckptsdk way: a ``CheckpointIO`` plugin for ``lightning.Trainer``.

Lightning's checkpoint dict goes into a ckptsdk root (tensors in safetensors, the rest JSON,
writer lease, manifest commit, digests) together with the RNG states; at the path Lightning
names (``last.ckpt``...) the plugin leaves a small JSON pointer, so ``ModelCheckpoint`` and
``trainer.fit(ckpt_path="last")`` work unchanged (or ``ckpt_path=io.resume_path()``, from the root alone). What is
stored and when is Lightning's business.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from fsspec.implementations.local import LocalFileSystem
from pydantic import Field

from ckptsdk.integrations import require

require("lightning", "lightning")
from lightning.fabric.plugins import CheckpointIO  # noqa: E402
from lightning.fabric.utilities.cloud_io import get_filesystem  # noqa: E402
from lightning.fabric.utilities.rank_zero import rank_zero_only  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from ckptsdk.checkpoint.retention import Rule, keep_best, keep_if  # noqa: E402
from ckptsdk.errors import ConfigError, UnsupportedStateError  # noqa: E402
from ckptsdk.format.document import Document, parse_document  # noqa: E402
from ckptsdk.options import LeaseOptions, Retention  # noqa: E402
from ckptsdk.rng import capture_rng, restore_rng  # noqa: E402

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import ModelCheckpoint

logger = logging.getLogger(__name__)

__all__ = ["CkptsdkCheckpointIO", "POINTER_FORMAT", "rules_for"]

#: The ``format`` field of the JSON file left at Lightning's checkpoint path.
POINTER_FORMAT = "ckptsdk.lightning_pointer/1.0"
# What ckptsdk wrote before the pointer followed the one version rule (document.py); still read.
_LEGACY_POINTER_FORMAT = "ckptsdk-lightning-pointer/1"


class Pointer(Document):
    """What Lightning holds as a ``.ckpt`` path: a small JSON naming the ckptsdk checkpoint."""

    FORMAT: ClassVar[str] = POINTER_FORMAT
    format: str = POINTER_FORMAT
    url: str
    step: int = Field(ge=0)
    key: str


class _Captured:
    """Receives the tree ``CheckpointManager.restore`` loads (Lightning applies it itself)."""

    tree: Any = None

    def load_state_dict(self, tree: Any) -> None:
        self.tree = tree


def _plain(obj: Any) -> Any:
    # Lightning may hand over an AttributeDict (hparams), a dict subclass the codec refuses by
    # design; a plain dict with the same items is what Lightning itself reads back.
    if isinstance(obj, dict) and type(obj) not in (dict, OrderedDict):
        obj = dict(obj)
    if type(obj) is dict:
        return {k: _plain(v) for k, v in obj.items()}
    if type(obj) is list:
        return [_plain(v) for v in obj]
    return obj


class CkptsdkCheckpointIO(CheckpointIO):
    """Store Lightning checkpoints in a ckptsdk root (``drive://``, ``gs://``, a path...).

    Args:
        url: the checkpoint root. One root per run: its writer lease keeps a second runtime
            (a zombie Colab VM) from writing or rotating while this one trains.
        keep_last: committed checkpoints kept in the root (ckptsdk's retention, not
            ``ModelCheckpoint``'s: a ``best`` pointer to a step rotated away fails loudly).
        keep_every: also keep every checkpoint whose step is a multiple of this.
        keep: more keep rules (:mod:`ckptsdk.keep`), kept by union.
        model_checkpoint: the trainer's ``ModelCheckpoint``: its ``monitor``, ``save_top_k``
            and ``mode`` become ``keep_best(monitor, save_top_k, mode)`` (``save_top_k=-1``:
            keep every save), added to ``keep_last`` rather than replacing it, so the newest
            checkpoint and a resume to it are never lost. Each save records the score
            ``ModelCheckpoint`` judged it by as a manifest metric; a step saved under another
            name only (``last.ckpt``) has none, so it is never "best".
        storage_options: fsspec options for ``gs://`` (``token``, ``endpoint_url``...).
        lease_ttl: seconds before a silent writer's lease may be taken over (None: ckptsdk's default).
        force: break a live lease at once (only when the other writer is surely dead).
        restore_rng: put back torch/CUDA/numpy/Python RNG states when a checkpoint is loaded
            (Lightning's own checkpoints do not hold them; ckptsdk's resume is bit-exact with them).

    Example (a training run, not a doctest: tests/integrations/test_integration_lightning.py runs one)::

        io = CkptsdkCheckpointIO("drive://runs/r18")
        trainer = L.Trainer(plugins=[io], default_root_dir="/content/drive/MyDrive/runs/r18",
                            callbacks=[ModelCheckpoint(save_last=True)])
        trainer.fit(model, loader, ckpt_path="last")
    """

    def __init__(
        self,
        url: str,
        *,
        keep_last: int = 3,
        keep_every: int | None = None,
        keep: Sequence[Rule] = (),
        model_checkpoint: ModelCheckpoint | None = None,
        storage_options: Mapping[str, object] | None = None,
        lease_ttl: float | None = None,
        force: bool = False,
        restore_rng: bool = True,
    ) -> None:
        super().__init__()
        self.url = url
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.keep = [*keep, *(rules_for(model_checkpoint) if model_checkpoint is not None else [])]
        self.storage_options = dict(storage_options or {})
        self.lease_ttl = lease_ttl
        self.force = force
        self.restore_rng = restore_rng
        self._mgr: Any = None
        self._restored = False
        self._shadowed_by: int | None = None
        self._warned_mid_epoch = False
        self._tmpdir: str | None = None

    # ------------------------------------------------------------------ the manager

    def _manager(self) -> Any:
        from ckptsdk.manager import CheckpointManager

        if self._mgr is None:
            # Lightning saves on global rank 0 only; other ranks read, and must not take the lease.
            self._mgr = CheckpointManager(
                self.url,
                retention=Retention(keep_last=self.keep_last, keep_every=self.keep_every, keep=self.keep),
                lease_options=LeaseOptions(ttl=self.lease_ttl, force=self.force),
                storage_options=self.storage_options,
                read_only=rank_zero_only.rank != 0,
            )
            self._restored = False
        return self._mgr

    def _start(self, *, loading: bool) -> tuple[Any, Any]:
        """Open the manager; on a writer, run ``restore`` once (lineage, takeover re-commit)."""
        mgr = self._manager()
        captured = _Captured()
        if not self._restored and not mgr.read_only:
            if not loading:
                # A first save with no load before it: Lightning started this fit from scratch.
                # Over a root holding checkpoints that is the silent fresh start ckptsdk refuses
                # (checked before restore(), which would already record a lineage).
                latest = mgr.latest()
                if latest is not None:
                    raise ConfigError(
                        f"{self.url} holds checkpoints up to step {latest.step}, but this fit did not "
                        'resume from them: pass ckpt_path="last" to trainer.fit, or use a new root'
                    )
            mgr.restore(captured)
            self._restored = True
        return mgr, captured.tree

    def resume_path(self) -> str | None:
        """A pointer to the root's newest valid checkpoint, for ``trainer.fit(ckpt_path=...)``.

        Use it where ``ckpt_path="last"`` cannot find Lightning's pointers: a new VM whose
        ``default_root_dir`` was on its lost local disk, or a ``gs://`` checkpoint dirpath
        (Lightning 2.6 lists remote folders without their ``gs://`` prefix, then looks for the
        files locally). The pointer is written to a local temporary folder.

        Returns:
            The pointer's path, or None when the root holds no checkpoint (a fresh run).
        """
        from ckptsdk.manager import CheckpointManager

        with CheckpointManager(self.url, read_only=True, storage_options=self.storage_options) as mgr:
            info = mgr.latest()
        if info is None:
            return None
        if self._tmpdir is None:
            self._tmpdir = tempfile.mkdtemp(prefix="ckptsdk-lightning-")
        path = os.path.join(self._tmpdir, f"resume-{info.step}.ckpt")
        self._write_pointer(path, Pointer(url=self.url, step=info.step, key=info.key))
        return path

    def step_logger(self) -> Callback:
        """A callback that puts each optimizer step's training loss in ckptsdk's step log, so that
        ``ckptsdk audit`` compares the steps a resumed attempt runs again (without it a Lightning
        run's audit is ``unverified``): ``L.Trainer(plugins=[io], callbacks=[io.step_logger()])``.
        The loss is what ``training_step`` returned (a tensor, or a dict's ``"loss"``)."""
        return _StepLogger(self)

    # ------------------------------------------------------------------ CheckpointIO

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: object = None
    ) -> None:
        """Commit ``checkpoint`` at its ``global_step``, then leave a pointer at ``path``.

        Two names saved at one step (``epoch=1-step=16.ckpt`` and ``last.ckpt``) share one
        committed checkpoint. The pointer is written after the commit, so a crash between the
        two leaves a pointer to the previous, still valid, checkpoint.

        Raises:
            UnsupportedStateError: an entry of Lightning's dict cannot be stored without pickle
                (the message names the key; ``path`` holds the full path in the dict).
            LeaseLostError: another writer took the root over; nothing was written.
            ConfigError: the root holds checkpoints but this fit did not load one, or it loaded
                an older one than the newest and ``step`` is not past it (either would leave the
                newest, not this run, to the next resume: refused, never silently mixed in).
        """
        if storage_options is not None:
            raise ConfigError(
                "CkptsdkCheckpointIO takes no per-call storage_options; pass storage options to its constructor"
            )
        mgr, _ = self._start(loading=False)
        step = int(checkpoint.get("global_step", 0))
        if self._shadowed_by is not None and step <= self._shadowed_by:
            raise ConfigError(
                f"this fit resumed from an older checkpoint than {self.url}'s newest (step "
                f"{self._shadowed_by}); a save at step {step} would be shadowed by it on the next resume. "
                'Resume from ckpt_path="last", or train on from an older step in a new root'
            )
        unresumable = _mid_epoch_without_position(checkpoint)
        if unresumable and not self._warned_mid_epoch:
            self._warned_mid_epoch = True
            logger.warning(
                "Lightning checkpoint at step %s is %s: a resume from it will not be bit-exact. Use "
                "ckptsdk.DataLoader (Lightning saves its position), or checkpoint at epoch ends only",
                step,
                unresumable,
            )
        tree = {"lightning": _plain(checkpoint), "rng": capture_rng()}
        try:
            info = mgr.save(
                tree,
                step=step,
                epoch=checkpoint.get("epoch"),
                metrics=_scores(checkpoint, os.fspath(path)),
                tags={"framework": "lightning"},
            )
        except UnsupportedStateError as exc:
            parts = exc.path.split("/")
            key = parts[1] if len(parts) > 1 and parts[0] == "lightning" else exc.path
            raise UnsupportedStateError(
                f"Lightning checkpoint key {key!r} cannot be stored without pickle: {exc}. Return plain "
                "values there (tensors, numbers, strings, lists, dicts) from on_save_checkpoint/state_dict, "
                "or leave it out",
                path=exc.path,
                type_name=exc.type_name,
            ) from exc
        self._write_pointer(os.fspath(path), Pointer(url=self.url, step=info.step, key=info.key))
        logger.info("lightning checkpoint %s -> %s/%s", path, self.url, info.key)

    def load_checkpoint(
        self, path: str | os.PathLike[str], map_location: object = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read the checkpoint a pointer names, verified; restore the RNG states.

        Tensors come back on the CPU (Lightning moves them where its modules live), whatever
        ``map_location`` says. ``weights_only`` is moot: nothing is unpickled either way.

        Raises:
            ConfigError: ``path`` is not a pointer written by this plugin (e.g. a ``torch.save``
                ``.ckpt``: import it with ``ckptsdk import`` first).
            NoValidCheckpointError: the checkpoint it names is gone or corrupt.
        """
        pointer = self._read_pointer(os.fspath(path))
        if pointer.url != self.url:
            logger.warning(
                "%s was written for %s; reading step %s from this plugin's root %s",
                path,
                pointer.url,
                pointer.step,
                self.url,
            )
        step = pointer.step
        mgr, tree = self._start(loading=True)
        if tree is None or tree.get("lightning", {}).get("global_step") != step:
            # Not the newest checkpoint (a `best` one, or a read-only rank): read it as it is.
            if not mgr.read_only and tree is not None:
                # Saves after this would sit below the newest step, which a later restore would
                # pick instead: save_checkpoint refuses them (fine for test/validate/predict).
                self._shadowed_by = int(tree["lightning"]["global_step"])
            tree = mgr.load(step)
        if self.restore_rng:
            restore_rng(tree["rng"])
        lightning_state: dict[str, Any] = tree["lightning"]
        unresumable = _mid_epoch_without_position(lightning_state)
        if unresumable:
            logger.warning(
                "resuming Lightning from step %s, %s: this resume is NOT bit-exact. Train with "
                "ckptsdk.DataLoader(dataset, batch_size=..., shuffle=..., seed=...) (Lightning saves and "
                "restores its position), or checkpoint at epoch ends only",
                step,
                unresumable,
            )
        return lightning_state

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the pointer only: the data belong to ckptsdk's retention (``keep_last``)."""
        path = os.fspath(path)
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path)

    def teardown(self) -> None:
        """Wait for saves, flush the step log and release the lease (a later call reopens)."""
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        if self._mgr is not None:
            mgr, self._mgr = self._mgr, None
            mgr.close()

    # ------------------------------------------------------------------ pointers

    @staticmethod
    def _write_pointer(path: str, pointer: Pointer) -> None:
        data = pointer.to_json()
        fs = get_filesystem(path)
        parent = os.path.dirname(path)
        if parent:
            fs.makedirs(parent, exist_ok=True)
        if isinstance(fs, LocalFileSystem):
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:  # a reader sees the old pointer or the new one
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:  # object stores publish a single upload atomically
            fs.pipe_file(path, data)

    @staticmethod
    def _read_pointer(path: str) -> Pointer:
        fs = get_filesystem(path)
        try:
            with fs.open(path, "rb") as f:
                raw = f.read(1 << 16)
        except OSError as exc:
            raise ConfigError(f"{path} cannot be read as a checkpoint pointer ({exc})") from exc

        def error(message: str, step: int | None) -> ConfigError:
            return ConfigError(
                f"{message}; it is not a checkpoint pointer written by CkptsdkCheckpointIO, "
                "and a torch.save checkpoint can be brought in with `ckptsdk import FILE URL`"
            )

        def legacy(doc: dict[str, Any]) -> dict[str, Any] | None:
            return {**doc, "format": POINTER_FORMAT} if doc.get("format") == _LEGACY_POINTER_FORMAT else None

        return parse_document(raw, Pointer, key=path, error=error, legacy=legacy)


def rules_for(callback: ModelCheckpoint) -> list[Rule]:
    """``ModelCheckpoint(monitor=, save_top_k=, mode=)`` as keep rules (none without a monitor:
    then Lightning keeps the latest, which ``keep_last`` already does)."""
    if callback.monitor is None or callback.save_top_k == 0:
        return []
    if callback.save_top_k < 0:
        return [keep_if(lambda _c: True, "save_top_k=-1")]  # Lightning keeps every save
    return [keep_best(callback.monitor, callback.save_top_k, "max" if callback.mode == "max" else "min")]


def _mid_epoch_without_position(checkpoint: Mapping[str, Any]) -> str | None:
    """Why a resume from this checkpoint cannot be bit-exact, if Lightning took it inside an
    epoch (else None): its train loader saved no position (a resume re-reads the epoch from its
    start), or it is a torchdata ``StatefulDataLoader``, which Lightning resumes one global RNG
    draw off (measured: not adapted here, unlike in a ``TrainState``: the plugin never sees the
    loader). Read from Lightning 2.x's loop state; a layout it does not recognise says None.
    """
    loop = (checkpoint.get("loops") or {}).get("fit_loop")
    if not isinstance(loop, Mapping):
        return None
    batches = loop.get("epoch_loop.batch_progress")
    if not isinstance(batches, Mapping) or not isinstance(batches.get("current"), Mapping):
        return None
    done = batches["current"].get("processed")
    if not isinstance(done, int) or done <= 0 or batches.get("is_last_batch"):
        return None
    where = f"mid-epoch ({done} batch(es) of epoch {checkpoint.get('epoch')} done)"
    states = (loop.get("state_dict") or {}).get("combined_loader")
    if not states:
        return f"{where}, but the train loader saved no position"
    if any(isinstance(st, Mapping) and ("_num_yielded" in st or "_snapshot" in st) for st in states):
        return f"{where} with a torchdata StatefulDataLoader, which Lightning resumes one RNG draw off"
    return None  # ckptsdk.DataLoader (or another stateful loader): Lightning restores its position


def _scores(checkpoint: Mapping[str, Any], path: str) -> dict[str, float]:
    """The score each ``ModelCheckpoint`` gave the file being saved (its ``best_k_models[path]``).

    Not ``current_score``: a ``last.ckpt`` saved when the step did not make the top k would
    carry an earlier step's score. Lightning stores a NaN score as the worst value (inf), which
    is never best here either.
    """
    out: dict[str, float] = {}
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if not (isinstance(key, str) and key.startswith("ModelCheckpoint") and isinstance(state, Mapping)):
            continue
        monitor, scores = state.get("monitor"), state.get("best_k_models") or {}
        if isinstance(monitor, str) and path in scores:
            score = scores[path]
            out[monitor] = float(score.item() if hasattr(score, "item") else score)
    return out


class _StepLogger(Callback):
    """``CkptsdkCheckpointIO.step_logger()``: one step-log row per optimizer step, on rank 0."""

    def __init__(self, io: CkptsdkCheckpointIO) -> None:
        self.io = io
        self._last: int | None = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        step = int(trainer.global_step)
        if rank_zero_only.rank != 0 or loss is None or step == self._last:  # accumulating: no new step yet
            return
        # A resumed fit has loaded its checkpoint by now; a fresh one opens the root as its first
        # save would (refusing a root that holds checkpoints this fit did not resume from).
        mgr, _ = self.io._start(loading=False)
        mgr.log_step(step, loss=loss.detach() if hasattr(loss, "detach") else float(loss))
        self._last = step
