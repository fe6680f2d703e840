"""The door in: import a ``torch.save`` checkpoint (or an HF Trainer folder) into a new ckptsdk root.

The only module of the library that calls ``torch.load``, always with ``weights_only=True`` (plus,
on request, the few numpy globals an RNG state needs), and only after archive_bound.py has checked
what the zip may expand to and source.py that it is a regular file; nothing on the restore path
imports it (tests/porting/ checks). Reading an HF folder is hf_folder.py's; where the parts go is
layout.py's; where we may write is guard.py's; exporting is export.py's job.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import pickle
import random
import re
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ckptsdk.errors import ConfigError, UnsupportedStateError
from ckptsdk.porting.archive_bound import check_torch_archive
from ckptsdk.porting.guard import check_new_root_url
from ckptsdk.porting.hf_folder import TRAINER_STATE, read_hf_folder
from ckptsdk.porting.layout import HF_TRAINER, Mapped, map_checkpoint
from ckptsdk.porting.source import regular_file

logger = logging.getLogger(__name__)

__all__ = ["import_torch_checkpoint", "load_torch_checkpoint", "resume_advice"]


_GLOBAL_IN_ERROR = re.compile(r"GLOBAL ([\w.]+)")
_UNPICKLER_SAYS = "WeightsUnpickler error:"


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
        ConfigError: the file is not a regular file (a FIFO, a device: refused before it is
            opened), cannot be read as a torch checkpoint (damaged or truncated: whatever torch's
            unpickler raised is the cause), or its zip members declare more than it can honestly
            hold (checked before anything is decompressed:
            :func:`~ckptsdk.porting.archive_bound.check_torch_archive`).
    """
    path = os.fspath(path)
    regular_file(path)  # a FIFO would block torch's open() forever
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
        # "Unsupported operand 56", or a global named only because the file ends inside its
        # GLOBAL line ("collections.Ordered"): damaged bytes, not a refused global.
        if found is None or not _asks_for_global(path, found.group(1)):
            raise _unreadable(path, exc) from exc
        name = found.group(1)
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
    except MemoryError as exc:
        raise ConfigError(
            f"cannot import {path}: reading it ran out of memory; free memory or import on a machine with more"
        ) from exc
    except Exception as exc:
        # torch's weights-only unpickler trusts the opcodes it walks: damaged bytes surface as
        # whatever they trip (IndexError from an empty stack, KeyError from a missing memo entry,
        # UnicodeDecodeError, RecursionError...). Each means the same to the user.
        raise _unreadable(path, exc) from exc


def _asks_for_global(path: str, name: str) -> bool:
    """Whether the file's pickle holds a whole GLOBAL opcode (``c`` module NL name NL) for ``name``."""
    # torch's message writes builtins.x as x; the module may hold dots (collections.abc.Mapping).
    splits = [(name[:i], name[i + 1 :]) for i, ch in enumerate(name) if ch == "."]
    if "." not in name:
        splits += [("builtins", name), ("__builtin__", name)]
    needles = [b"c" + m.encode() + b"\n" + n.encode() + b"\n" for m, n in splits]
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:  # sizes already bounded by check_torch_archive
                return any(any(nd in zf.read(m) for nd in needles) for m in zf.namelist() if m.endswith(".pkl"))
        with open(path, "rb") as f:  # the legacy format: pickles and raw storages in one stream
            tail = b""
            while chunk := f.read(1 << 20):
                if any(nd in tail + chunk for nd in needles):
                    return True
                tail = chunk[-(max(map(len, needles)) - 1) :]
    except (OSError, zipfile.BadZipFile, ValueError):
        return False
    return False


def _unreadable(path: str, exc: Exception) -> ConfigError:
    text = str(exc)
    # torch wraps the unpickler's one-line reason in a page about weights_only; keep the reason.
    text = text.partition(_UNPICKLER_SAYS)[2].partition("Check the documentation")[0] or text
    detail = " ".join(text.split())[:200] or "no detail"
    return ConfigError(
        f"cannot read {path} as a torch.save checkpoint ({type(exc).__name__}: {detail}): it is damaged, "
        "truncated or not a torch.save file; copy it again from the program that wrote it"
    )


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


def _load_any(source: str, *, allow_numpy_rng: bool) -> tuple[Any, str, tuple[str, ...]]:
    """What ``source`` holds, its layout when the reading already tells (a folder), and the
    files of a folder that were not read."""
    if os.path.isdir(source):
        if not os.path.lexists(os.path.join(source, TRAINER_STATE)):
            raise ConfigError(
                f"{source} is a folder without {TRAINER_STATE}: the folders import reads are HF Trainer "
                "checkpoint-N/ folders; for a .pt file, name the file"
            )
        folder = read_hf_folder(source, load_torch=load_torch_checkpoint, allow_numpy_rng=allow_numpy_rng)
        return folder.saved, HF_TRAINER, folder.ignored
    return load_torch_checkpoint(source, allow_numpy_rng=allow_numpy_rng), "", ()


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
    with :func:`~ckptsdk.porting.hf_folder.read_hf_folder`); its parts are sorted by
    :func:`ckptsdk.porting.layout.map_checkpoint` (the story notebook's layout, top-level RNG
    keys, a bare state_dict, a Lightning ``.ckpt``, an HF folder) into ``TrainState`` objects
    (``model``, ``optimizer``, ``scheduler``, ``scaler``, or any name ``mapping`` gives) plus the
    RNG states, so the job resumes with ``mgr.restore(TrainState(...))`` as from any ckptsdk
    checkpoint; the file's other JSON-able entries come back in ``restore()``'s ``extra``.

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
        The committed :class:`~ckptsdk.CheckpointInfo`. Its manifest's tags say where it came
        from (``imported_from``, ``layout``) and, for a folder, which weight files were not read
        (``ignored_files``, a JSON list: a stale shard beside the index, ``pytorch_model.bin``
        beside ``model.safetensors``).

    Raises:
        UnsupportedStateError: the file needs a pickle global outside the allowlist.
        ConfigError: a damaged file or folder (see :func:`load_torch_checkpoint` and
            :func:`~ckptsdk.porting.hf_folder.read_hf_folder`), unknown entries, no model, no
            step, or a root that holds checkpoints or lies inside another root. Nothing is
            written to ``url`` before the file has been read and mapped.

    Example (not a doctest: making the .pt file takes a pickle write, which the library's own
    source never holds; tests/porting/test_import_export.py runs this)::

        info = import_torch_checkpoint("ckpt_7.pt", "drive://runs/r18")  # {"model": ..., "step": 7}
        info.key  # 'step-0000000007.e1'
    """
    from ckptsdk.manager import CheckpointManager
    from ckptsdk.options import LeaseOptions

    source = os.fspath(path)
    check_new_root_url(url, dict(storage_options or {}))
    saved, layout, ignored = _load_any(source, allow_numpy_rng=allow_numpy_rng)
    mapped = map_checkpoint(saved, source, drop=drop, mapping=mapping, layout=layout)
    tree = _train_state_tree(mapped, source)
    position = dict(mapped.position)
    if step is not None:
        position["step"] = step
    if "step" not in position:
        raise ConfigError(f"{source} records no step (looked for 'step', 'global_step'); pass --step N")
    logger.info("%s: %s layout, objects %s", source, mapped.layout, sorted(mapped.objects))
    tags = {"imported_from": os.path.basename(source.rstrip("/")), "layout": mapped.layout}
    if ignored:  # said in the checkpoint too, so `ckptsdk show` tells what the import left out
        tags["ignored_files"] = json.dumps(list(ignored))  # a JSON list: a file name may hold any separator
    with CheckpointManager(url, storage_options=storage_options, lease_options=LeaseOptions(force=force)) as mgr:
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
            tags=tags,
        )


def resume_advice(url: str, info: Any) -> str:
    """How to resume from what :func:`import_torch_checkpoint` committed (``info``, its return):
    the call that restores exactly the objects it holds (``ckptsdk import`` prints it).

    An HF Trainer folder resumes through ``CkptsdkTrainer``, which reads the objects it wrote
    (``trainer``, ``scaler``: layout.py's ``_hf_trainer``); anything else through a
    ``TrainState`` naming each imported object, since a restore refuses a name on one side only.
    """
    manifest = info.manifest
    if manifest.tags.get("layout") == HF_TRAINER:
        return (
            f"CkptsdkTrainer(model=..., args=..., train_dataset=..., ckpt_url={url!r})"
            ".train(resume_from_checkpoint=True)  # from ckptsdk.integrations.transformers"
        )
    tree = manifest.tree
    names = list(tree["objects"]) if isinstance(tree, dict) and isinstance(tree.get("objects"), dict) else []
    return f"CheckpointManager({url!r}).restore(TrainState({', '.join(f'{n}=...' for n in names)}))"


class _Refuse:
    """A restore target for a root known to be empty: loading anything into it is an error."""

    def load_state_dict(self, tree: Any) -> None:
        raise ConfigError("the root gained a checkpoint while importing; import into a new root")
