"""What an HF Trainer ``checkpoint-N/`` folder holds, read without executing anything.

The weights come from ``model.safetensors``, from the shards ``model.safetensors.index.json``
names (each tensor from the shard the index gives it), or from ``pytorch_model.bin``; a weight
file the reading does not use is ignored and said, never merged. The ``.pt`` parts go through the
torch door torch_import.py passes in. Where the parts go is layout.py's business.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ckptsdk.errors import ConfigError
from ckptsdk.porting.source import read_json_file, regular_file

logger = logging.getLogger(__name__)

__all__ = ["TRAINER_STATE", "HFFolder", "read_hf_folder"]

TRAINER_STATE = "trainer_state.json"
_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_BIN = "pytorch_model.bin"
_PARTS = {"optimizer.pt": "optimizer", "scheduler.pt": "scheduler", "scaler.pt": "scaler"}
_RNG = "rng_state.pth"
_RNG_KEYS = ("python", "numpy", "cpu", "cuda")
_AGAIN = "copy the folder again from the run that wrote it"


class TorchLoad(Protocol):
    """The torch door (:func:`ckptsdk.porting.torch_import.load_torch_checkpoint`)."""

    def __call__(self, path: str, *, allow_numpy_rng: bool = False) -> Any: ...


@dataclass(frozen=True)
class HFFolder:
    """A folder read: the story layout's dict, and the weight files left unread (by name)."""

    saved: dict[str, Any]
    ignored: tuple[str, ...]


def _is_weight_file(name: str) -> bool:
    return (name.startswith("model") and name.endswith(".safetensors")) or name.startswith("pytorch_model")


def _damaged(path: str, exc: Exception) -> ConfigError:
    return ConfigError(f"cannot read {path} as safetensors ({exc}): it is damaged or truncated; {_AGAIN}")


def _load_safetensors(path: str) -> dict[str, torch.Tensor]:
    import safetensors.torch
    from safetensors import SafetensorError

    regular_file(path)
    try:
        return safetensors.torch.load_file(path)
    except (SafetensorError, OSError) as exc:
        raise _damaged(path, exc) from exc


def _weight_map(index_path: str) -> dict[str, str]:
    weight_map = read_json_file(index_path).get("weight_map")
    if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
        raise ConfigError(
            f"{index_path} has no weight_map from tensor names to shard files; it is damaged or not an HF index; "
            f"{_AGAIN}"
        )
    for shard in set(weight_map.values()):
        if shard in ("", ".", "..") or shard != os.path.basename(shard) or "\\" in shard:
            raise ConfigError(f"{index_path} names the shard {shard!r}, which is not a file of the folder; {_AGAIN}")
    return weight_map


def _take_from_shard(folder: str, shard: str, wanted: list[str], index_path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    path = os.path.join(folder, shard)
    if not os.path.lexists(path):
        raise ConfigError(f"{index_path} names the shard {shard}, which the folder lacks; {_AGAIN}")
    regular_file(path)
    try:
        with safe_open(path, framework="pt") as f:
            held = set(f.keys())
            missing = [name for name in wanted if name not in held]
            if missing:
                raise ConfigError(
                    f"{index_path} puts {len(missing)} tensor(s) in {shard} that it does not hold "
                    f"({', '.join(missing[:5])}): the shard is from another save, or damaged; {_AGAIN}"
                )
            tensors = {name: f.get_tensor(name) for name in wanted}
    except (SafetensorError, OSError) as exc:
        raise _damaged(path, exc) from exc
    unnamed = sorted(held - set(wanted))
    if unnamed:
        logger.warning(
            "%s holds %d tensor(s) its index assigns to another shard or to none (%s); they are ignored",
            path,
            len(unnamed),
            ", ".join(unnamed[:5]),
        )
    return tensors


def _read_indexed(folder: str, names: set[str]) -> tuple[dict[str, torch.Tensor], set[str]]:
    index_path = os.path.join(folder, _INDEX)
    weight_map = _weight_map(index_path)
    shards: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        shards.setdefault(shard, []).append(tensor)
    if _SINGLE in names and _SINGLE not in shards:
        # HF's loaders take model.safetensors over an index; the index is newer just as often.
        raise ConfigError(
            f"{folder} holds both {_SINGLE} and {_INDEX} (which does not name it): the weights of two saves, "
            f"and nothing says which is current. Remove the stale one, then import again"
        )
    loaded: dict[str, torch.Tensor] = {}
    for shard in sorted(shards):
        loaded.update(_take_from_shard(folder, shard, shards[shard], index_path))
    return {name: loaded[name] for name in weight_map}, set(shards)


def _read_model(folder: str, names: set[str], load_torch: TorchLoad) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The model's state_dict, and the weight files it was read from."""
    if _INDEX in names:
        return _read_indexed(folder, names)
    if _SINGLE in names:
        return _load_safetensors(os.path.join(folder, _SINGLE)), {_SINGLE}
    if _BIN in names:
        model = load_torch(os.path.join(folder, _BIN))
        if not (isinstance(model, Mapping) and all(isinstance(v, torch.Tensor) for v in model.values())):
            raise ConfigError(f"{folder}/{_BIN} holds a {type(model).__name__}, not a model's state_dict; {_AGAIN}")
        return dict(model), {_BIN}
    shards = sorted(n for n in names if _is_weight_file(n))
    if shards:
        raise ConfigError(
            f"{folder} holds the weight files {', '.join(shards[:3])} but no {_INDEX} (the index import "
            f"reads): which file holds which tensor is unknown; {_AGAIN}"
        )
    raise ConfigError(f"{folder} holds no {_SINGLE}, {_INDEX} or {_BIN}: not an HF Trainer checkpoint folder")


def _position(saved: dict[str, Any], trainer_state: dict[str, Any]) -> None:
    saved["step"] = trainer_state.get("global_step")  # layout.py checks it is a count
    epoch = trainer_state.get("epoch")
    # HF counts fractional epochs (1.5: half-way through the second); inf or nan is left for
    # layout.py to refuse by name.
    if isinstance(epoch, (int, float)) and math.isfinite(epoch):
        saved["epoch"] = int(epoch)
    elif epoch is not None:
        saved["epoch"] = epoch


def read_hf_folder(folder: str, *, load_torch: TorchLoad, allow_numpy_rng: bool) -> HFFolder:
    """An HF Trainer ``checkpoint-N/`` folder as the story layout's dict.

    The model (see the module docstring), the optimizer, scheduler and scaler ``.pt`` files,
    ``rng_state.pth``, and ``trainer_state.json`` (kept whole: layout.py makes it the ``trainer``
    object ``CkptsdkTrainer`` resumes from); ``training_args.bin``
    pickles a class and is never read. Only regular files are opened.

    Args:
        folder: the ``checkpoint-N/`` folder.
        load_torch: reads one ``.pt`` file without executing it.
        allow_numpy_rng: passed to ``load_torch`` for ``rng_state.pth``.

    Returns:
        The parts, and the weight files that were not read (a stale shard beside an index,
        ``pytorch_model.bin`` beside ``model.safetensors``), each also logged as a warning.

    Raises:
        ConfigError: a file that is damaged, not a regular file, or not what its name says; an
            index naming a shard that lacks its tensors; both ``model.safetensors`` and an index
            that does not name it; no model at all.
    """
    trainer_state = read_json_file(os.path.join(folder, TRAINER_STATE))
    try:
        names = set(os.listdir(folder))
    except OSError as exc:
        raise ConfigError(f"cannot list {folder}: {exc}; check the path and its permissions") from exc
    model, used = _read_model(folder, names, load_torch)
    ignored = tuple(sorted(n for n in names if _is_weight_file(n) and n not in used))
    if ignored:
        logger.warning(
            "%s: the model was read from %s; ignored %s (a leftover of an earlier save?)",
            folder,
            ", ".join(sorted(used)),
            ", ".join(ignored),
        )
    saved: dict[str, Any] = {"model": model}
    for name, part in _PARTS.items():
        if name in names:
            saved[part] = load_torch(os.path.join(folder, name))
    if _RNG in names:
        rng = load_torch(os.path.join(folder, _RNG), allow_numpy_rng=allow_numpy_rng)
        if not isinstance(rng, Mapping):
            raise ConfigError(f"{folder}/{_RNG} holds a {type(rng).__name__}, not HF's dict of RNG states; {_AGAIN}")
        saved["rng"] = {k: v for k, v in rng.items() if k in _RNG_KEYS}
    if "training_args.bin" in names:
        logger.info("%s: training_args.bin is a pickled class and is not read (TrainingArguments rebuild it)", folder)
    _position(saved, trainer_state)
    saved["trainer_state"] = trainer_state
    return HFFolder(saved=saved, ignored=ignored)
