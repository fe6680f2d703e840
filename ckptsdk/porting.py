"""Doors in and out: import a ``torch.save`` checkpoint into a root, export model weights.

The only module of the library that calls ``torch.load``, always with ``weights_only=True`` (plus,
on request, the few numpy globals an RNG state needs); nothing on the restore path imports it
(tests/test_porting.py checks). Export writes one state dict to a standard safetensors file, tied
weights handled as ``safetensors.torch.save_model`` does. The CLI's ``import``/``export`` call in.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .errors import ConfigError, UnsupportedStateError

logger = logging.getLogger(__name__)

__all__ = ["export_safetensors", "import_torch_checkpoint", "load_torch_checkpoint", "cmd_export", "cmd_import"]

# Where the story's (and most hand-written loops') keys go. First match wins; each list is short
# on purpose: an unknown key is reported, never guessed at.
_OBJECT_KEYS = {
    "model": ("model", "model_state_dict", "state_dict"),
    "optimizer": ("optimizer", "optimizer_state_dict", "optim"),
    "scheduler": ("scheduler", "lr_scheduler", "scheduler_state_dict"),
    "scaler": ("scaler", "grad_scaler", "scaler_state_dict"),
}
_RNG_KEYS = {
    "torch": ("torch_rng", "torch_rng_state", "cpu_rng_state", "rng_state"),
    "cuda": ("cuda_rng", "cuda_rng_state"),
    "numpy": ("numpy_rng", "np_rng", "numpy_rng_state"),
    "python": ("python_rng", "py_rng", "python_rng_state", "random_state"),
}
_POSITION_KEYS = {"step": ("step", "global_step"), "epoch": ("epoch",), "batch_idx": ("batch_idx",)}

_GLOBAL_IN_ERROR = re.compile(r"GLOBAL ([\w.]+)")


def _numpy_rng_globals() -> list[Any]:
    """The minimal allowlist for ``np.random.get_state()`` pickled by numpy 1.x or 2.x."""
    reconstruct = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
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
        raise ConfigError(f"importing {path} needs torch >= 2.5 (torch.serialization.safe_globals); "
                          f"this is torch {torch.__version__}")
    allowed = _numpy_rng_globals() if allow_numpy_rng else []
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _GLOBAL_IN_ERROR.search(str(exc))
        name = found.group(1) if found else "an unknown global"
        hint = ("it holds numpy RNG state: add --allow-numpy-rng (allow_numpy_rng=True) to accept "
                "the four numpy globals that needs" if name.startswith("numpy") and not allow_numpy_rng
                else "ckptsdk never unpickles code; re-save that entry as tensors or plain values "
                "(e.g. call .state_dict(), convert numpy scalars with .item()) from the program that wrote it")
        raise UnsupportedStateError(
            f"refusing to import {path}: it needs the pickle global {name}, which weights_only loading "
            f"does not allow (nothing was executed); {hint}", path=path, type_name=name) from exc
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
        raise ConfigError(f"{source} holds a {type(saved).__name__}, not a dict of named parts; "
                          "import expects {'model': ..., 'optimizer': ..., 'step': ...}")
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
            "pass --drop KEY for each one the resumed job does not need")
    return {"objects": objects, "rng": rng}, {**position, "extra": extra}


def _complete_rng(rng: dict[str, Any], source: str) -> dict[str, Any]:
    # TrainState restores every global generator; one the .pt lacks gets the state a fresh
    # process has (what continuing "by hand" from that file would have had), said loudly.
    if rng["torch"] is None:
        logger.warning("%s holds no torch RNG state: the import records a fresh generator's "
                       "(torch's default seed), as a new process that never seeds would have", source)
        rng["torch"] = torch.Generator().get_state()
    elif not (isinstance(rng["torch"], torch.Tensor) and rng["torch"].dtype == torch.uint8):
        raise ConfigError(f"{source}: the torch RNG state is not a uint8 tensor (torch.get_rng_state())")
    cuda = rng["cuda"]
    if isinstance(cuda, torch.Tensor):
        rng["cuda"] = [cuda]
    for name, fresh in (("numpy", lambda: np.random.RandomState().get_state(legacy=False)),
                        ("python", lambda: random.Random().getstate())):
        if rng[name] is None:
            logger.warning("%s holds no %s RNG state: the import records a freshly seeded one", source, name)
            rng[name] = fresh()
    if isinstance(rng["python"], list):  # a state that went through JSON on its way in
        rng["python"] = (rng["python"][0], tuple(rng["python"][1]), rng["python"][2])
    return rng


def import_torch_checkpoint(
    path: str | os.PathLike[str], url: str, *, allow_numpy_rng: bool = False, step: int | None = None,
    drop: Sequence[str] = (), storage_options: Mapping[str, Any] | None = None, force: bool = False,
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

    Example:
        >>> import_torch_checkpoint("ckpt_4650.pt", "drive://runs/r18", allow_numpy_rng=True)
    """
    from .manager import CheckpointManager

    source = os.fspath(path)
    tree, position = _to_train_state_tree(load_torch_checkpoint(source, allow_numpy_rng=allow_numpy_rng),
                                          source, drop)
    if step is not None:
        position["step"] = step
    if "step" not in position:
        raise ConfigError(f"{source} records no step (looked for 'step', 'global_step'); pass --step N")
    with CheckpointManager(url, storage_options=storage_options, force=force) as mgr:
        if mgr.latest() is not None:
            raise ConfigError(f"{url} already holds checkpoints; import into a new root so the imported "
                              "state cannot be mistaken for (or rotate away) this run's own")
        mgr.restore(_Refuse())  # starts this writer's lineage and step log on the empty root
        return mgr.save(tree, step=position["step"], epoch=position.get("epoch"),
                        batch_idx=position.get("batch_idx"), extra=position["extra"],
                        tags={"imported_from": os.path.basename(source)})


class _Refuse:
    """A restore target for a root known to be empty: loading anything into it is an error."""

    def load_state_dict(self, tree: Any) -> None:
        raise ConfigError("the root gained a checkpoint while importing; import into a new root")


# ---------------------------------------------------------------------------- export

#: Where the model's state dict sits in the trees ckptsdk and its integrations write, in order.
MODEL_PATHS = ("objects/model", "objects/model_0", "lightning/state_dict")


def _at(tree: Any, path: str) -> Any:
    node = tree
    for part in path.split("/"):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _storage_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names of the model's state dict that are one tensor (tied), as save_model finds them."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, t in model.state_dict(keep_vars=False).items():
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            groups.setdefault(key, []).append(name)
    return [sorted(g) for g in groups.values() if len(g) > 1]


def export_safetensors(
    url: str, out: str | os.PathLike[str], *, step: int | None = None, object_path: str | None = None,
    model: torch.nn.Module | None = None, tied: Iterable[tuple[str, str]] = (),
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write one checkpoint's model weights to a standard safetensors file.

    Tied weights are written once, as ``safetensors.torch.save_model`` does: the first name of
    each tied group (sorted) is kept, the others are left out and recorded in the file's metadata
    as ``{removed: kept}``; ``safetensors.torch.load_model(model, OUT)`` restores them. Checkpoints
    do not record which weights were tied, so ties come from ``model`` (a live instance of the
    architecture) or from ``tied`` pairs; without either, every tensor is written.

    Args:
        url: the checkpoint root (opened read-only: no lease is taken).
        out: the ``.safetensors`` file to write (atomically: a temp name, then a rename).
        step: which checkpoint (the newest valid one by default).
        object_path: where the state dict sits in the tree (default: the first of
            ``objects/model``, ``objects/model_0``, ``lightning/state_dict`` that exists).
        model: a live model whose shared tensors define the tied groups.
        tied: ``(removed, kept)`` name pairs declared tied.
        storage_options: fsspec options for ``gs://``.

    Returns:
        ``{"step", "object", "tensors", "removed": {removed: kept}, "out"}``.

    Raises:
        ConfigError: no state dict at ``object_path``, or "tied" weights whose values differ.

    Example:
        >>> export_safetensors("gs://bucket/run", "model.safetensors", model=GPT2LMHeadModel(cfg))
    """
    import safetensors.torch

    from .manager import CheckpointManager

    with CheckpointManager(url, read_only=True, storage_options=storage_options) as mgr:
        info = mgr.latest() if step is None else None
        chosen = step if step is not None else (info.step if info is not None else None)
        tree = mgr.load(chosen)
    paths = (object_path,) if object_path else MODEL_PATHS
    where = next((p for p in paths if isinstance(_at(tree, p), Mapping)), None)
    if where is None:
        raise ConfigError(f"checkpoint step {chosen} of {url} has no state dict at {' or '.join(paths)}; "
                          "pass --object PATH (e.g. objects/NAME)")
    state = _at(tree, where)
    tensors = {str(k): v for k, v in state.items() if isinstance(v, torch.Tensor)}
    skipped = sorted(str(k) for k, v in state.items() if not isinstance(v, torch.Tensor))
    if skipped:
        logger.warning("not exported (not tensors): %s", ", ".join(skipped))
    pairs = [(r, k) for group in (_storage_groups(model) if model is not None else []) for r in group[1:]
             for k in group[:1]] + list(tied)
    removed: dict[str, str] = {}
    for gone, kept in pairs:
        if gone not in tensors or kept not in tensors:
            raise ConfigError(f"tied weights {gone!r} -> {kept!r}: not both in the checkpoint's state dict")
        if not torch.equal(tensors[gone], tensors[kept]):
            raise ConfigError(f"{gone!r} and {kept!r} are declared tied but differ in the checkpoint; "
                              "the model does not tie them, or the pair is wrong")
        removed[gone] = kept
    for gone in removed:
        del tensors[gone]
    out = os.fspath(out)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, tmp,
                                    metadata={"format": "pt", **removed})
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"step": chosen, "object": where, "tensors": len(tensors), "removed": removed, "out": out}


# ---------------------------------------------------------------------------- CLI commands


def cmd_import(args: argparse.Namespace) -> int:
    """``ckptsdk import FILE.pt URL``: see :func:`import_torch_checkpoint`."""
    from .cli import _emit_json, _storage_options

    info = import_torch_checkpoint(
        args.file, args.url, allow_numpy_rng=args.allow_numpy_rng, step=args.step, drop=args.drop or (),
        storage_options=_storage_options(args.storage_option), force=args.force)
    if args.json:
        _emit_json({"command": "import", "url": args.url, "file": args.file, "step": info.step, "key": info.key})
    else:
        print(f"imported {args.file} as step {info.step} ({info.key}) under {args.url}; resume with "
              "mgr.restore(TrainState(model=..., optimizer=..., scheduler=..., scaler=...))")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """``ckptsdk export URL[@STEP] OUT.safetensors``: see :func:`export_safetensors`."""
    from .cli import _UsageError, _emit_json, _storage_options

    url, step = args.url, None
    head, sep, tail = url.rpartition("@")
    if sep and tail.isdigit():
        url, step = head, int(tail)
    tied = []
    for pair in args.tied or ():
        gone, sep, kept = pair.partition("=")
        if not (sep and gone and kept):
            raise _UsageError(f"--tied expects REMOVED=KEPT, got {pair!r}")
        tied.append((gone, kept))
    report = export_safetensors(url, args.out, step=step, object_path=args.object, tied=tied,
                                storage_options=_storage_options(args.storage_option))
    if args.json:
        _emit_json({"command": "export", "url": url, **report})
    else:
        print(f"wrote {report['tensors']} tensors of step {report['step']} ({report['object']}) to {args.out}"
              + (f"; tied, left out: {json.dumps(report['removed'])}" if report["removed"] else ""))
    return 0
