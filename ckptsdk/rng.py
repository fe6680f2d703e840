"""The global random number generators: capture, restore and check their states (torch CPU and CUDA,
numpy's global RandomState, Python's ``random``).

Low in the layers (it needs only torch, numpy and the errors), so that the reader can check a
saved RNG state before it trusts a checkpoint. Bundling objects into a state is ``state.py``'s.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ckptsdk.errors import CorruptCheckpointError, StateMismatchError

logger = logging.getLogger(__name__)

__all__ = ["capture_rng", "check_rng", "restore_rng", "problem_message"]


def capture_rng() -> dict[str, Any]:
    """The state of every global random number generator, as a codec-ready tree.

    Reads only: nothing is drawn, so the streams continue exactly as if this was never called.
    CUDA states are captured only when this process has initialised CUDA: an uninitialised
    device has drawn nothing yet, and initialising it here would cost seconds and GPU memory.

    Returns:
        ``{"torch": uint8 tensor, "cuda": [uint8 tensor per device] | None,
        "numpy": np.random.get_state(legacy=False), "python": random.getstate()}``.
    """
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "numpy": np.random.get_state(legacy=False),
        "python": random.getstate(),
    }


def restore_rng(tree: Mapping[str, Any]) -> None:
    """Put back the RNG states that ``capture_rng`` returned (possibly through the codec).

    CUDA states are restored for as many devices as both machines have; a different device
    count, or no CUDA here, is logged as a warning and the rest is restored.

    Raises:
        StateMismatchError: the tree is not an RNG state (missing parts, wrong types).
    """
    problems = check_rng(tree)
    if problems:
        raise StateMismatchError(
            problem_message("the saved RNG state cannot be restored", problems), mismatches=problems
        )
    # clone(): set_rng_state crashes on a view at a storage offset (a tensor read from a file
    # into a shared buffer); a fresh, contiguous copy of a few KiB is always safe.
    torch.set_rng_state(tree["torch"].cpu().clone())
    cuda = tree.get("cuda")
    if cuda:
        live = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if live != len(cuda):
            logger.warning(
                "checkpoint holds CUDA RNG states for %d device(s), this machine has %d: "
                "restoring the first %d; GPU randomness may differ from the original run",
                len(cuda),
                live,
                min(live, len(cuda)),
            )
        for i, state in enumerate(cuda[:live]):
            try:
                torch.cuda.set_rng_state(state.cpu().clone(), i)
            except RuntimeError as exc:  # checked only here: no CUDA generator to ask before
                raise CorruptCheckpointError(f"the saved CUDA RNG state of device {i} is impossible: {exc}") from exc
    np.random.set_state(tree["numpy"])
    random.setstate(tree["python"])


def check_rng(tree: Any, *, values: bool = True) -> list[str]:
    """What makes ``tree`` not an RNG state (wrong parts or types), as a list of problems.

    ``values=False`` checks the parts and types only (a restore, before the bytes are read).

    Raises:
        CorruptCheckpointError: a part has the right type but a value no generator can be in
            (a position past 624, a word >= 2**32, another bit generator, a state torch
            rejects): the checkpoint is damaged, and restore falls back to the previous one.
    """
    if not isinstance(tree, Mapping):
        return [f"rng: expected a dict, got {type(tree).__name__}"]
    problems = [f"rng: missing {k!r}" for k in ("torch", "numpy", "python") if k not in tree]
    if problems:
        return problems
    t = tree["torch"]
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        problems.append("rng/torch: expected a uint8 tensor")
    cuda = tree.get("cuda")
    if cuda is not None and not (
        isinstance(cuda, list) and all(isinstance(c, torch.Tensor) and c.dtype == torch.uint8 for c in cuda)
    ):
        problems.append("rng/cuda: expected a list of uint8 tensors or None")
    if not isinstance(tree["numpy"], (Mapping, tuple)):
        problems.append("rng/numpy: expected np.random.get_state()'s dict or tuple")
    py = tree["python"]
    if not (isinstance(py, tuple) and len(py) == 3 and isinstance(py[1], tuple)):
        problems.append(
            "rng/python: expected random.getstate()'s tuple (a list? then the tree "
            "went through plain JSON instead of the codec)"
        )
    if problems or not values:
        return problems
    impossible = _rng_values(t, cuda, tree["numpy"], py)
    if impossible:
        raise CorruptCheckpointError(
            problem_message(
                "the saved RNG state is impossible (the checkpoint is damaged; restore falls back to an earlier one)",
                impossible,
            )
        )
    return []


_MT_WORDS = 624  # MT19937's state: 624 32-bit words and a position in [0, 624]


def _rng_values(t: torch.Tensor, cuda: list[torch.Tensor] | None, npstate: Any, py: tuple[Any, ...]) -> list[str]:
    """Range checks of RNG states whose types are right; every problem found, or []."""
    problems = []
    try:
        torch.Generator().set_state(t.cpu().clone())  # a scratch generator: torch's own check
    except (RuntimeError, TypeError, ValueError) as exc:
        problems.append(f"rng/torch: {exc}")
    for i, c in enumerate(cuda or []):
        if c.dim() != 1 or not 0 < c.numel() <= 1024:
            problems.append(f"rng/cuda/{i}: {list(c.shape)} is not a CUDA generator state")
    if isinstance(npstate, Mapping):
        inner = npstate.get("state")
        name = npstate.get("bit_generator")
        key = inner.get("key") if isinstance(inner, Mapping) else None
        pos = inner.get("pos") if isinstance(inner, Mapping) else None
        gauss = (npstate.get("has_gauss"), npstate.get("gauss"))
    else:
        name, key, pos, *rest = (*npstate, None, None, None)[:5]
        gauss = tuple(rest)
    if name != "MT19937":
        problems.append(f"rng/numpy: bit generator {str(name)[:40]!r}, np.random's global one is 'MT19937'")
    if not (
        isinstance(key, np.ndarray)
        and key.dtype.kind in "iu"
        and key.shape == (_MT_WORDS,)
        and int(key.min()) >= 0
        and int(key.max()) < 2**32
    ):
        problems.append(f"rng/numpy: the key must be {_MT_WORDS} words in [0, 2**32)")
    if not (isinstance(pos, (int, np.integer)) and not isinstance(pos, bool) and 0 <= pos <= _MT_WORDS):
        problems.append(f"rng/numpy: position {str(pos)[:40]} is not in [0, {_MT_WORDS}]")
    if not (
        isinstance(gauss[0], (int, np.integer))
        and gauss[0] in (0, 1)
        and isinstance(gauss[1], (float, int, np.floating, np.integer))
    ):
        problems.append(f"rng/numpy: has_gauss/gauss {str(gauss)[:60]} are not 0|1 and a float")
    version, words, gauss_next = py
    if version != 3 or len(words) != _MT_WORDS + 1:
        problems.append(
            f"rng/python: version {str(version)[:20]} with {len(words)} words; random "
            f"uses version 3 with {_MT_WORDS + 1}"
        )
    elif not (
        all(type(w) is int and 0 <= w < 2**32 for w in words[:-1])
        and type(words[-1]) is int
        and 0 <= words[-1] <= _MT_WORDS
    ):
        problems.append(f"rng/python: words must be in [0, 2**32) and the position in [0, {_MT_WORDS}]")
    if not (gauss_next is None or type(gauss_next) is float):
        problems.append(f"rng/python: gauss_next {str(gauss_next)[:40]} is not None or a float")
    return problems


#: How many mismatches a StateMismatchError message lists (``.mismatches`` holds them all).
MAX_LISTED = 8


def problem_message(head: str, problems: list[str]) -> str:
    """``head`` and the first ``MAX_LISTED`` problems, one per line (a StateMismatchError message)."""
    listed = "\n  ".join(problems[:MAX_LISTED])
    more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    return f"{head}: {len(problems)} mismatch(es):\n  {listed}{more}"
