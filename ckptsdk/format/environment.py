"""What process wrote a document: its library versions and its device, described once for every document.

A checkpoint's manifest carries an :class:`Environment`; the run log's attempt record carries
:func:`versions` and :func:`describe_device`. Both draw on the functions here, so a version or a
device reads the same in either document. Neither function imports torch or initialises CUDA
(a CLI must start fast; a CPU job on a GPU machine must not pay for a CUDA context). Who wrote a
document (run, attempt, lease epoch, host) is the documents' own business, not this module's.
"""

from __future__ import annotations

import functools
import platform
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pydantic import Field

from ckptsdk._version import __version__
from ckptsdk.format.document import Strict

if TYPE_CHECKING:
    from torch import device as TorchDevice  # not "torch": Environment has a field of that name

__all__ = ["Environment", "describe_device", "device_of", "versions"]


def versions() -> dict[str, str]:
    """This process's versions: python and ckptsdk, plus torch and numpy where already imported.

    Returns:
        ``{"python": ..., "ckptsdk": ..., "torch": ..., "numpy": ...}`` in that order, without
        the libraries the process has not imported (they are never imported to be named).
    """
    out = {"python": platform.python_version(), "ckptsdk": __version__}
    for name in ("torch", "numpy"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = str(getattr(mod, "__version__", "?"))
    return out


def describe_device(device: TorchDevice | str | None = None) -> str:
    """The training device as documents record it: ``"cpu"``, ``"cuda:0 (NVIDIA H200)"``, ``"mps"``.

    A CUDA device is named (index and model) once the job itself has initialised CUDA; before
    that only its ``torch.device`` string is known, and CUDA is not asked, because
    ``current_device()`` would create a context (hundreds of MiB of GPU memory, seconds).

    Args:
        device: the training device (``torch.device`` or str). None: the current CUDA device
            when this process initialised CUDA, else ``"cpu"`` (``"cpu (cuda unusable)"`` when
            the driver fails to answer).
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return "cpu" if device is None else str(device)
    try:
        if not torch.cuda.is_initialized():
            return "cpu" if device is None else str(device)
        where = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if where.type != "cuda":
            return str(where)
        index = torch.cuda.current_device() if where.index is None else where.index
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    except (RuntimeError, AssertionError, ValueError):
        # A broken driver, or a device this machine does not have: not a reason to fail a save
        # or a step log; the document keeps what is known.
        return "cpu (cuda unusable)" if device is None else str(device)


class Environment(Strict):
    """Versions and device of the process that wrote a checkpoint (informational)."""

    python: str
    torch: str
    numpy: str
    ckptsdk: str
    platform: str
    device: str
    cuda: str | None = Field(description="the CUDA version torch was built with, if any")

    @classmethod
    def current(cls, device: TorchDevice | str | None = None) -> Environment:
        """Describe this process. Never initialises CUDA.

        Args:
            device: the training device (``torch.device`` or str), as :func:`describe_device`
                takes it.
        """
        import numpy  # noqa: F401  (a checkpoint's writer has both; versions() names them)
        import torch

        known = versions()
        return cls(
            python=known["python"],
            torch=known["torch"],
            numpy=known["numpy"],
            ckptsdk=known["ckptsdk"],
            platform=_platform(),
            device=describe_device(device),
            cuda=torch.version.cuda,
        )


@functools.lru_cache(maxsize=1)
def _platform() -> str:
    return platform.platform()  # reads the interpreter binary to find libc: once is enough


def device_of(tensors: Iterable[Any]) -> str:
    """The device a state trains on: that of its first tensor off the CPU, else ``"cpu"``.

    Example:
        >>> import torch
        >>> device_of([torch.zeros(1)])
        'cpu'
    """
    return next((str(t.device) for t in tensors if t.device.type != "cpu"), "cpu")
