"""The door in: import a ``torch.save`` checkpoint into a ckptsdk root.

The only module of the library that calls ``torch.load``, always with ``weights_only=True`` (plus,
on request, the few numpy globals an RNG state needs); nothing on the restore path imports it
(tests/porting/test_import_export.py checks). Exporting weights out is export.py's job; the ``ckptsdk import``
command is ckptsdk/cli/porting.py's.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ckptsdk.errors import ConfigError, UnsupportedStateError

logger = logging.getLogger(__name__)

__all__ = ["import_torch_checkpoint", "load_torch_checkpoint"]


# Where the story's (and most hand-written loops') keys go. First match wins; each list is short
# on purpose: an unknown key is reported, never guessed at.
_OBJECT_KEYS: dict[str, tuple[str, ...]] = {
    "model": ("model", "model_state_dict", "state_dict"),
    "optimizer": ("optimizer", "optimizer_state_dict", "optim"),
    "scheduler": ("scheduler", "lr_scheduler", "scheduler_state_dict"),
    "scaler": ("scaler", "grad_scaler", "scaler_state_dict"),
}
_RNG_KEYS: dict[str, tuple[str, ...]] = {
    "torch": ("torch_rng", "torch_rng_state", "cpu_rng_state", "rng_state"),
    "cuda": ("cuda_rng", "cuda_rng_state"),
    "numpy": ("numpy_rng", "np_rng", "numpy_rng_state"),
    "python": ("python_rng", "py_rng", "python_rng_state", "random_state"),
}
_POSITION_KEYS: dict[str, tuple[str, ...]] = {
    "step": ("step", "global_step"),
    "epoch": ("epoch",),
    "batch_idx": ("batch_idx",),
}

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
        ConfigError: the file cannot be read as a torch checkpoint.
    """
    path = os.fspath(path)
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
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise ConfigError(f"cannot read {path} as a torch.save checkpoint: {exc}") from exc


def _take(saved: dict[str, Any], names: Iterable[str]) -> tuple[str, Any] | None:
    for name in names:
        if name in saved:
            return name, saved.pop(name)
    return None


def _to_train_state_tree(saved: Any, source: str, drop: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Map a story-layout dict to ``TrainState.state_dict()``'s shape plus position fields."""
    if not isinstance(saved, Mapping):
        raise ConfigError(
            f"{source} holds a {type(saved).__name__}, not a dict of named parts; "
            "import expects {'model': ..., 'optimizer': ..., 'step': ...}"
        )
    rest = dict(saved)
    for key in drop:
        if rest.pop(key, None) is None and key not in saved:
            raise ConfigError(f"--drop {key}: {source} has no such key (keys: {sorted(map(str, saved))})")
    objects = {}
    for name, aliases in _OBJECT_KEYS.items():
        hit = _take(rest, aliases)
        if hit is not None:
            objects[name] = hit[1]
    if "model" not in objects:
        raise ConfigError(f"{source} has no model state (looked for {', '.join(_OBJECT_KEYS['model'])})")
    rng: dict[str, Any] = {}
    for name, aliases in _RNG_KEYS.items():
        hit = _take(rest, aliases)
        rng[name] = None if hit is None else hit[1]
    rng = _complete_rng(rng, source)
    position = {}
    for name, aliases in _POSITION_KEYS.items():
        hit = _take(rest, aliases)
        if hit is not None:
            position[name] = int(hit[1])
    extra = {}
    for key, value in list(rest.items()):
        if value is None or type(value) in (bool, int, float, str):  # harmless metadata: kept
            extra[str(key)] = rest.pop(key)
    if rest:
        raise ConfigError(
            f"{source} has entries import does not know where to put: {sorted(map(str, rest))}. Known: "
            f"{sorted(a for v in (*_OBJECT_KEYS.values(), *_RNG_KEYS.values()) for a in v)}; "
            "pass --drop KEY for each one the resumed job does not need"
        )
    return {"objects": objects, "rng": rng}, {**position, "extra": extra}


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


def import_torch_checkpoint(
    path: str | os.PathLike[str],
    url: str,
    *,
    allow_numpy_rng: bool = False,
    step: int | None = None,
    drop: Sequence[str] = (),
    storage_options: Mapping[str, Any] | None = None,
    force: bool = False,
) -> Any:
    """Commit a ``torch.save`` checkpoint as the first checkpoint of a new ckptsdk root.

    The file is read with :func:`load_torch_checkpoint`; its parts are mapped to
    ``TrainState(model=, optimizer=, scheduler=, scaler=)`` plus the RNG states, so the job
    resumes with ``mgr.restore(TrainState(...))`` as from any ckptsdk checkpoint.

    Args:
        path: the ``.pt`` file (keys like ``model``, ``optimizer``, ``scheduler``, ``scaler``,
            ``numpy_rng``, ``python_rng``, ``torch_rng``, ``step``, ``epoch``).
        url: a checkpoint root without committed checkpoints.
        allow_numpy_rng: accept the numpy globals a numpy RNG state needs.
        step: the step to record when the file has none (or to override it).
        drop: keys of the file to leave out.
        storage_options: fsspec options for ``gs://``.
        force: break a live writer lease on the root.

    Returns:
        The committed :class:`~ckptsdk.CheckpointInfo`.

    Raises:
        UnsupportedStateError: the file needs a pickle global outside the allowlist.
        ConfigError: unknown keys, no model, no step, or the root already holds checkpoints.

    Example (not a doctest: making the .pt file takes a pickle write, which the library's own
    source never holds; tests/porting/test_import_export.py runs this)::

        info = import_torch_checkpoint("ckpt_7.pt", "drive://runs/r18")  # {"model": ..., "step": 7}
        info.key  # 'step-0000000007.e1'
    """
    from ckptsdk.manager import CheckpointManager

    source = os.fspath(path)
    tree, position = _to_train_state_tree(load_torch_checkpoint(source, allow_numpy_rng=allow_numpy_rng), source, drop)
    if step is not None:
        position["step"] = step
    if "step" not in position:
        raise ConfigError(f"{source} records no step (looked for 'step', 'global_step'); pass --step N")
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
            extra=position["extra"],
            tags={"imported_from": os.path.basename(source)},
        )


class _Refuse:
    """A restore target for a root known to be empty: loading anything into it is an error."""

    def load_state_dict(self, tree: Any) -> None:
        raise ConfigError("the root gained a checkpoint while importing; import into a new root")
