"""Where the parts of a foreign checkpoint go: the layouts users' files have, and a user's mapping.

Recognised: the story notebook's dict (``rng: {torch, numpy, python, cuda}``, ``args``, ...),
the top-level-keys one (``numpy_rng``, ``torch_rng``...), a bare ``state_dict``, a Lightning
``.ckpt`` and what an HF Trainer ``checkpoint-N/`` folder holds (read by hf_folder.py into
this module's input). Every leftover entry ``extra`` may hold (``save()``'s rule, nan and inf
included: userfield.py's) goes there (``restore()`` gives it back); anything else needs the
user's ``--map KEY=DEST`` or ``--drop KEY``, never a guess.
Reading files is torch_import.py's and hf_folder.py's job; committing the result torch_import.py's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptsdk.errors import ConfigError
from ckptsdk.format import limits
from ckptsdk.format.userfield import extra_value

logger = logging.getLogger(__name__)

__all__ = ["DESTINATIONS", "HF_TRAINER", "Mapped", "map_checkpoint"]

#: The layout of an HF Trainer ``checkpoint-N/`` folder (hf_folder.py reads it).
HF_TRAINER = "hf-trainer"

# First match wins; each list is short on purpose: an unknown key is reported, never guessed at.
_OBJECT_KEYS: dict[str, tuple[str, ...]] = {
    "model": ("model", "model_state_dict", "state_dict", "net"),
    "optimizer": ("optimizer", "optimizer_state_dict", "optim", "opt"),
    "scheduler": ("scheduler", "lr_scheduler", "scheduler_state_dict", "sched"),
    "scaler": ("scaler", "grad_scaler", "scaler_state_dict", "amp_scaler"),
}
_RNG_KEYS: dict[str, tuple[str, ...]] = {
    "torch": ("torch_rng", "torch_rng_state", "cpu_rng_state", "rng_state"),
    "cuda": ("cuda_rng", "cuda_rng_state"),
    "numpy": ("numpy_rng", "np_rng", "numpy_rng_state"),
    "python": ("python_rng", "py_rng", "python_rng_state", "random_state"),
}
# Inside a nested ``rng`` dict (the story's) or HF's rng_state.pth: the short names.
_NESTED_RNG = {"torch": "torch", "cpu": "torch", "cuda": "cuda", "numpy": "numpy", "np": "numpy", "python": "python"}
_POSITION_KEYS: dict[str, tuple[str, ...]] = {
    "step": ("step", "global_step"),
    "epoch": ("epoch",),
    "batch_idx": ("batch_idx", "batch", "iteration_in_epoch"),
}
# Lightning's own bookkeeping: kept in ``extra`` when JSON-able, else left out with a warning
# (Lightning rebuilds callbacks and loops; a plain loop resuming from ckptsdk does not use them).
_LIGHTNING_BOOKKEEPING = ("callbacks", "loops", "hyper_parameters", "datamodule_hyper_parameters", "hparams_name")

#: What ``--map SRC=DEST`` accepts as DEST.
DESTINATIONS = (
    "model",
    "optimizer",
    "scheduler",
    "scaler",
    "objects/NAME",
    "rng/torch",
    "rng/cuda",
    "rng/numpy",
    "rng/python",
    "step",
    "epoch",
    "batch_idx",
    "extra/NAME",
    "drop",
)


@dataclass
class Mapped:
    """A foreign checkpoint in ckptsdk's terms: ``TrainState`` objects, RNG states, position."""

    layout: str
    objects: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(("torch", "cuda", "numpy", "python")))
    position: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


_NOT_EXTRA = object()


def _extra(value: Any) -> Any:
    """``value`` as ``extra`` keeps it (tuples as lists, mappings as dicts), or ``_NOT_EXTRA``.

    The rule is ``save()``'s own (:func:`ckptsdk.format.userfield.extra_value`: nan and inf
    included); only the containers a ``torch.save`` file holds are made JSON's first.
    """
    if limits.json_depth(value) > limits.JSON_DEPTH:  # before the recursive conversion below
        return _NOT_EXTRA
    try:
        return extra_value(_as_json(value))
    except ConfigError:
        return _NOT_EXTRA


def _as_json(value: Any) -> Any:
    """Tuples as lists, mappings as plain dicts, all the way down; the rest as it is."""
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _as_json(v) for k, v in value.items()}
    return value


def _pop_path(tree: dict[str, Any], path: str, source: str, flag: str) -> Any:
    node: Any = tree
    parts = path.split("/")
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or parts[-1] not in node:
        top = sorted(map(str, tree))
        raise ConfigError(f"{flag} {path}: {source} has no such entry (top-level keys: {top}; nest with '/')")
    return node.pop(parts[-1])


def _int(value: Any, what: str, source: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if type(value) is float and value.is_integer():
        value = int(value)
    if type(value) is not int or value < 0:
        raise ConfigError(f"{source}: {what} is {value!r}, not a non-negative integer; pass --map to place it")
    return value


def _put(mapped: Mapped, dest: str, value: Any, source: str, src: str) -> None:
    head, _, name = dest.partition("/")
    if dest in _OBJECT_KEYS:
        mapped.objects[dest] = value
    elif head == "objects" and name:
        mapped.objects[name] = value
    elif head == "rng" and name in mapped.rng:
        mapped.rng[name] = value
    elif dest in _POSITION_KEYS:
        mapped.position[dest] = _int(value, src, source)
    elif head == "extra" and name:
        kept = _extra(value)
        if kept is _NOT_EXTRA:
            raise ConfigError(f"--map {src}={dest}: {source}'s {src} is not JSON-able; map it to objects/NAME instead")
        mapped.extra[name] = kept
    elif dest != "drop":
        raise ConfigError(f"--map {src}={dest}: unknown destination; one of {', '.join(DESTINATIONS)}")


def _is_state_dict(saved: Mapping[Any, Any]) -> bool:
    return bool(saved) and all(type(k) is str and isinstance(v, torch.Tensor) for k, v in saved.items())


def _is_lightning(saved: Mapping[Any, Any]) -> bool:
    return "pytorch-lightning_version" in saved or {"state_dict", "optimizer_states"} <= saved.keys()


def _take(rest: dict[str, Any], names: Sequence[str]) -> Any:
    for name in names:
        if name in rest:
            return rest.pop(name)
    return None


def _numbered(mapped: Mapped, base: str, items: Any, source: str, key: str) -> None:
    if not isinstance(items, (list, tuple)):
        raise ConfigError(f"{source}: Lightning's {key!r} is not a list; pass --map {key}=objects/NAME")
    if len(items) == 1:
        mapped.objects[base] = items[0]
    else:
        mapped.objects.update({f"{base}_{i}": item for i, item in enumerate(items)})


def _lightning(mapped: Mapped, rest: dict[str, Any], source: str) -> None:
    mapped.objects["model"] = rest.pop("state_dict")
    _numbered(mapped, "optimizer", rest.pop("optimizer_states", []), source, "optimizer_states")
    _numbered(mapped, "scheduler", rest.pop("lr_schedulers", []), source, "lr_schedulers")
    scaler = _take(rest, ("MixedPrecision", "native_amp_scaling_state", "MixedPrecisionPlugin"))
    if scaler is not None:
        mapped.objects["scaler"] = scaler
    for name, key in (("step", "global_step"), ("epoch", "epoch")):
        if key in rest:
            mapped.position[name] = _int(rest.pop(key), key, source)
    for key in _LIGHTNING_BOOKKEEPING:
        if key in rest and _extra(rest[key]) is _NOT_EXTRA:
            logger.warning(
                "%s: Lightning's %r is not JSON-able and is left out (Lightning rebuilds it; --map it to keep it)",
                source,
                key,
            )
            del rest[key]


def _hf_trainer(mapped: Mapped, rest: dict[str, Any], source: str) -> None:
    """An HF Trainer folder (hf_folder.py's dict), in the shape ``CkptsdkTrainer`` saves and
    resumes from: its TrainerState as one JSON string (``trainer``: the JSON of
    ``trainer_state.json``, from which the Trainer's resume reads its position) and the grad
    scaler's state (``scaler``: ``{}`` without one, as the Trainer without AMP saves it)."""
    trainer_state = rest.pop("trainer_state")
    _story(mapped, rest, source)
    mapped.objects["trainer"] = {"json": json.dumps(trainer_state, sort_keys=True)}
    if mapped.objects.get("scaler") is None:
        mapped.objects["scaler"] = {}


def _story(mapped: Mapped, rest: dict[str, Any], source: str) -> None:
    for name, aliases in _OBJECT_KEYS.items():
        hit = _take(rest, aliases)
        if hit is not None:  # the story writes 'scaler': None without AMP
            mapped.objects[name] = hit
    nested = rest.get("rng")
    if isinstance(nested, Mapping) and nested and all(k in _NESTED_RNG for k in nested):
        for key, value in rest.pop("rng").items():
            mapped.rng[_NESTED_RNG[key]] = value
    for name, aliases in _RNG_KEYS.items():
        hit = _take(rest, aliases)
        if hit is not None:
            mapped.rng[name] = hit
    for name, aliases in _POSITION_KEYS.items():
        hit = _take(rest, aliases)
        if hit is not None:
            mapped.position[name] = _int(hit, name, source)


def map_checkpoint(
    saved: Any, source: str, *, drop: Sequence[str] = (), mapping: Mapping[str, str] | None = None, layout: str = ""
) -> Mapped:
    """Sort a loaded foreign checkpoint into objects, RNG states, position and ``extra``.

    Args:
        saved: what ``torch.load`` returned (or torch_import.py built from a folder).
        source: the file, for messages.
        drop: entries to leave out (``/`` reaches into nested dicts).
        mapping: ``{source entry: destination}`` for anything the layouts do not place; each
            destination is one of :data:`DESTINATIONS`. Applied first.
        layout: the layout's name when the caller already knows it (a folder it read).

    Returns:
        The :class:`Mapped` parts; ``layout`` names what was recognised.

    Raises:
        ConfigError: no model state, an entry that is neither placed nor JSON-able (listed,
            with the flags that place it), or a bad ``--map``/``--drop``.
    """
    if not isinstance(saved, Mapping):
        raise ConfigError(
            f"{source} holds a {type(saved).__name__}, not a dict of named parts or a state_dict; "
            "import expects {'model': ..., 'optimizer': ..., 'step': ...} or a model's state_dict()"
        )
    rest: dict[str, Any] = dict(saved)
    for key in drop:
        _pop_path(rest, key, source, "--drop")
    mapped = Mapped(layout=layout)
    for src, dest in (mapping or {}).items():
        _put(mapped, dest, _pop_path(rest, src, source, "--map"), source, src)
    if not layout:
        if mapped.objects.get("model") is None and _is_state_dict(rest):
            mapped.layout = "state_dict"
        elif "state_dict" in rest and _is_lightning(rest):
            mapped.layout = "lightning"
        else:
            mapped.layout = "story"
    if mapped.layout == "state_dict":
        mapped.objects["model"] = rest
        rest = {}
    elif mapped.layout == "lightning":
        _lightning(mapped, rest, source)
    elif mapped.layout == HF_TRAINER:
        _hf_trainer(mapped, rest, source)
    else:
        _story(mapped, rest, source)
    mapped.objects = {k: v for k, v in mapped.objects.items() if v is not None}
    if "model" not in mapped.objects:
        raise ConfigError(
            f"{source} has no model state (looked for {', '.join(_OBJECT_KEYS['model'])}); "
            "pass --map KEY=model for the entry that holds it"
        )
    for key in list(rest):
        kept = _extra(rest[key])
        if kept is not _NOT_EXTRA:  # metadata (args, last_loss, saved_at...): restore() gives it back
            mapped.extra[str(key)] = kept
            del rest[key]
    if rest:
        raise ConfigError(
            f"{source} ({mapped.layout} layout) has entries import does not know where to put: "
            f"{sorted(map(str, rest))} (neither a known part nor JSON-able). Pass --map KEY=DEST "
            f"(DEST one of {', '.join(DESTINATIONS)}) or --drop KEY for each"
        )
    return mapped
