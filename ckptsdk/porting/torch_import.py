"""The door in: import a ``torch.save`` checkpoint (or an HF Trainer folder) into a new ckptsdk root.

The only module of the library that calls ``torch.load``, always with ``weights_only=True`` (plus,
on request, the few numpy globals an RNG state needs), and only after archive_bound.py has checked
what the zip may expand to; nothing on the restore path imports it (tests/porting/ checks). Where
the parts go is layout.py's; where we may write is guard.py's; exporting is export.py's job.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import pickle
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ckptsdk.errors import ConfigError, UnsupportedStateError
from ckptsdk.porting.archive_bound import check_torch_archive
from ckptsdk.porting.guard import check_new_root_url
from ckptsdk.porting.layout import Mapped, map_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["import_torch_checkpoint", "load_torch_checkpoint"]


_GLOBAL_IN_ERROR = re.compile(r"GLOBAL ([\w.]+)")


def _numpy_rng_globals() -> list[Any]:
    """The minimal allowlist for ``np.random.get_state()`` pickled by numpy 1.x or 2.x."""
    # numpy 2 moved numpy.core to numpy._core; its stubs no longer have the old path.
    multiarray = importlib.import_module("numpy._core.multiarray" if hasattr(np, "_core") else "numpy.core.multiarray")
    reconstruct = multiarray._reconstruct
    allowed: list[Any] = [
        reconstruct,
        (reconstruct, "numpy.core.multiarray._reconstruct"),  # the name numpy 1.x pickles under
        np.ndarray,
        np.dtype,
    ]
    uint32_dtype = getattr(getattr(np, "dtypes", None), "UInt32DType", None)  # numpy >= 1.25 pickles it
    if uint32_dtype is not None:
        allowed.append(uint32_dtype)
    return allowed


def load_torch_checkpoint(path: str | os.PathLike[str], *, allow_numpy_rng: bool = False) -> Any:
    """Read a ``torch.save`` file without running any code it carries.

    ``torch.load`` with ``weights_only=True``: tensors, containers and plain scalars only; any other
    global (a class, a function such as ``os.system``) is refused before it is called.

    Args:
        path: the ``.pt`` file.
        allow_numpy_rng: also accept the four numpy globals ``np.random.get_state()`` needs
            (``_reconstruct``, ``ndarray``, ``dtype``, ``UInt32DType``) and nothing more.

    Returns:
        What was saved, with tensors on the CPU.

    Raises:
        UnsupportedStateError: the file names a global outside the allowlist (``type_name``
            holds it); nothing of the file was executed.
        ConfigError: the file cannot be read as a torch checkpoint, or its zip members declare
            more than it can honestly hold (checked before anything is decompressed:
            :func:`~ckptsdk.porting.archive_bound.check_torch_archive`).
    """
    path = os.fspath(path)
    try:
        check_torch_archive(path)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}; check the path") from exc
    if not hasattr(torch.serialization, "safe_globals"):
        raise ConfigError(
            f"importing {path} needs torch >= 2.5 (torch.serialization.safe_globals); this is torch {torch.__version__}"
        )
    allowed = _numpy_rng_globals() if allow_numpy_rng else []
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _GLOBAL_IN_ERROR.search(str(exc))
        name = found.group(1) if found else "an unknown global"
        hint = (
            "it holds numpy RNG state: add --allow-numpy-rng (allow_numpy_rng=True) to accept "
            "the four numpy globals that needs"
            if name.startswith("numpy") and not allow_numpy_rng
            else "ckptsdk never unpickles code; re-save that entry as tensors or plain values "
            "(e.g. call .state_dict(), convert numpy scalars with .item()) from the program that wrote it"
        )
        raise UnsupportedStateError(
            f"refusing to import {path}: it needs the pickle global {name}, which weights_only loading "
            f"does not allow (nothing was executed); {hint}",
            path=path,
            type_name=name,
        ) from exc
    except (OSError, RuntimeError, EOFError, ValueError, MemoryError) as exc:
        raise ConfigError(f"cannot read {path} as a torch.save checkpoint: {exc}") from exc


def _complete_rng(rng: dict[str, Any], source: str) -> dict[str, Any]:
    # TrainState restores every global generator; one the .pt lacks gets the state a fresh
    # process has (what continuing "by hand" from that file would have had), said loudly.
    if rng["torch"] is None:
        logger.warning(
            "%s holds no torch RNG state: the import records a fresh generator's "
            "(torch's default seed), as a new process that never seeds would have",
            source,
        )
        rng["torch"] = torch.Generator().get_state()
    elif not (isinstance(rng["torch"], torch.Tensor) and rng["torch"].dtype == torch.uint8):
        raise ConfigError(f"{source}: the torch RNG state is not a uint8 tensor (torch.get_rng_state())")
    cuda = rng["cuda"]
    if isinstance(cuda, torch.Tensor):
        rng["cuda"] = [cuda]
    for name, fresh in (
        ("numpy", lambda: np.random.RandomState().get_state(legacy=False)),
        ("python", lambda: random.Random().getstate()),
    ):
        if rng[name] is None:
            logger.warning("%s holds no %s RNG state: the import records a freshly seeded one", source, name)
            rng[name] = fresh()
    if isinstance(rng["python"], list):  # a state that went through JSON on its way in
        rng["python"] = (rng["python"][0], tuple(rng["python"][1]), rng["python"][2])
    return rng


_HF_TRAINER_STATE = "trainer_state.json"
_HF_MODEL_FILES = ("model.safetensors", "pytorch_model.bin")
_HF_PARTS = {"optimizer.pt": "optimizer", "scheduler.pt": "scheduler", "scaler.pt": "scaler"}


def _read_hf_folder(folder: str, *, allow_numpy_rng: bool) -> dict[str, Any]:
    """An HF Trainer ``checkpoint-N/`` folder as the story layout's dict (nothing is executed).

    The model from ``model.safetensors`` (or its shards, or ``pytorch_model.bin``), the optimizer,
    scheduler and scaler ``.pt`` files, ``rng_state.pth``, and ``trainer_state.json`` (kept whole
    in ``extra``); ``training_args.bin`` pickles a class and is never read.
    """
    import safetensors.torch

    with open(os.path.join(folder, _HF_TRAINER_STATE), encoding="utf-8") as f:
        try:
            trainer_state = json.load(f)
        except ValueError as exc:
            raise ConfigError(f"{folder}/{_HF_TRAINER_STATE} is not JSON ({exc})") from exc
    names = sorted(os.listdir(folder))
    shards = [n for n in names if n.startswith("model-") and n.endswith(".safetensors")]
    model: dict[str, Any] = {}
    if shards or _HF_MODEL_FILES[0] in names:
        for name in shards or [_HF_MODEL_FILES[0]]:
            model.update(safetensors.torch.load_file(os.path.join(folder, name)))
    elif _HF_MODEL_FILES[1] in names:
        model = load_torch_checkpoint(os.path.join(folder, _HF_MODEL_FILES[1]))
    else:
        raise ConfigError(f"{folder} holds no {' or '.join(_HF_MODEL_FILES)}: not an HF Trainer checkpoint folder")
    saved: dict[str, Any] = {"model": model}
    for name, part in _HF_PARTS.items():
        if name in names:
            saved[part] = load_torch_checkpoint(os.path.join(folder, name))
    if "rng_state.pth" in names:
        rng = load_torch_checkpoint(os.path.join(folder, "rng_state.pth"), allow_numpy_rng=allow_numpy_rng)
        saved["rng"] = {k: v for k, v in rng.items() if k in ("python", "numpy", "cpu", "cuda")}
    if "training_args.bin" in names:
        logger.info("%s: training_args.bin is a pickled class and is not read (TrainingArguments rebuild it)", folder)
    saved["step"] = trainer_state.get("global_step")
    epoch = trainer_state.get("epoch")
    if isinstance(epoch, (int, float)):  # HF counts fractional epochs (1.5: half-way through the second)
        saved["epoch"] = int(epoch)
    saved["trainer_state"] = trainer_state
    return saved


def _load_any(source: str, *, allow_numpy_rng: bool) -> tuple[Any, str]:
    """What ``source`` holds, and its layout when the reading already tells (a folder)."""
    if os.path.isdir(source):
        if not os.path.exists(os.path.join(source, _HF_TRAINER_STATE)):
            raise ConfigError(
                f"{source} is a folder without {_HF_TRAINER_STATE}: the folders import reads are HF Trainer "
                "checkpoint-N/ folders; for a .pt file, name the file"
            )
        return _read_hf_folder(source, allow_numpy_rng=allow_numpy_rng), "hf-trainer"
    if not os.path.isfile(source):
        raise ConfigError(f"{source} does not exist or is not a file; check the path")
    return load_torch_checkpoint(source, allow_numpy_rng=allow_numpy_rng), ""


def _train_state_tree(mapped: Mapped, source: str) -> dict[str, Any]:
    return {"objects": mapped.objects, "rng": _complete_rng(dict(mapped.rng), source)}


def import_torch_checkpoint(
    path: str | os.PathLike[str],
    url: str,
    *,
    allow_numpy_rng: bool = False,
    step: int | None = None,
    drop: Sequence[str] = (),
    mapping: Mapping[str, str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    force: bool = False,
) -> Any:
    """Commit a foreign checkpoint as the first checkpoint of a new ckptsdk root.

    The file is read with :func:`load_torch_checkpoint` (an HF Trainer ``checkpoint-N/`` folder
    file by file); its parts are sorted by :func:`ckptsdk.porting.layout.map_checkpoint` (the
    story notebook's layout, top-level RNG keys, a bare state_dict, a Lightning ``.ckpt``, an HF
    folder) into ``TrainState`` objects (``model``, ``optimizer``, ``scheduler``, ``scaler``, or
    any name ``mapping`` gives) plus the RNG states, so the job resumes with
    ``mgr.restore(TrainState(...))`` as from any ckptsdk checkpoint; the file's other JSON-able
    entries come back in ``restore()``'s ``extra``.

    Args:
        path: the ``.pt``/``.ckpt`` file, or an HF Trainer ``checkpoint-N/`` folder.
        url: a new checkpoint root: without committed checkpoints, and not inside another root.
        allow_numpy_rng: accept the numpy globals a numpy RNG state needs.
        step: the step to record when the file has none (or to override it).
        drop: entries of the file to leave out (``a/b`` reaches into nested dicts).
        mapping: ``{entry: destination}`` for entries the layouts do not place (see
            :data:`ckptsdk.porting.layout.DESTINATIONS`).
        storage_options: fsspec options for ``gs://``.
        force: break a live writer lease on the root.

    Returns:
        The committed :class:`~ckptsdk.CheckpointInfo`.

    Raises:
        UnsupportedStateError: the file needs a pickle global outside the allowlist.
        ConfigError: unknown entries, no model, no step, a zip whose members declare more than
            the file can hold, or a root that holds checkpoints or lies inside another root.
            Nothing is written to ``url`` before the file has been read and mapped.

    Example (not a doctest: making the .pt file takes a pickle write, which the library's own
    source never holds; tests/porting/test_import_export.py runs this)::

        info = import_torch_checkpoint("ckpt_7.pt", "drive://runs/r18")  # {"model": ..., "step": 7}
        info.key  # 'step-0000000007.e1'
    """
    from ckptsdk.manager import CheckpointManager

    source = os.fspath(path)
    check_new_root_url(url, dict(storage_options or {}))
    saved, layout = _load_any(source, allow_numpy_rng=allow_numpy_rng)
    mapped = map_checkpoint(saved, source, drop=drop, mapping=mapping, layout=layout)
    tree = _train_state_tree(mapped, source)
    position = dict(mapped.position)
    if step is not None:
        position["step"] = step
    if "step" not in position:
        raise ConfigError(f"{source} records no step (looked for 'step', 'global_step'); pass --step N")
    logger.info("%s: %s layout, objects %s", source, mapped.layout, sorted(mapped.objects))
    with CheckpointManager(url, storage_options=storage_options, force=force) as mgr:
        if mgr.latest() is not None:
            raise ConfigError(
                f"{url} already holds checkpoints; import into a new root so the imported "
                "state cannot be mistaken for (or rotate away) this run's own"
            )
        mgr.restore(_Refuse())  # starts this writer's lineage and step log on the empty root
        return mgr.save(
            tree,
            step=position["step"],
            epoch=position.get("epoch"),
            batch_idx=position.get("batch_idx"),
            extra=mapped.extra,
            tags={"imported_from": os.path.basename(source.rstrip("/")), "layout": mapped.layout},
        )


class _Refuse:
    """A restore target for a root known to be empty: loading anything into it is an error."""

    def load_state_dict(self, tree: Any) -> None:
        raise ConfigError("the root gained a checkpoint while importing; import into a new root")
