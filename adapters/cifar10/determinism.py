"""The deterministic pieces of a CIFAR-10 training step: kernel mode, AMP choice, scaler, augmentation, loss.

Each is a pure function of its arguments (seeds included), so a resumed run replays the same
numbers; ``train.py`` composes them into the job. Data loading, the model, the loop and anything
that touches a checkpoint do not belong here.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ckptsdk.errors import ConfigError

__all__ = ["ScalerSlot", "augment", "cross_entropy", "derived_seed", "resolve_amp", "set_deterministic"]


def set_deterministic(device: torch.device) -> None:
    """Select deterministic kernels everywhere (and fail loudly on an op that has none).

    ``CUBLAS_WORKSPACE_CONFIG`` must be set before cuBLAS is first used in the process, which is
    why the examples call this before touching CUDA.
    """
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def resolve_amp(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``amp`` on ``device`` (None = full fp32).

    "auto" is fp16 on CUDA (the T4 of the story has fast fp16, no bf16) and **off on CPU**: bf16
    autocast only pays on CPUs with AVX512-BF16/AMX (about 2x here), is slower on common laptop
    and Colab CPUs, and the CPU path exists to prove bit-exact resume, where fp32 is the reference.

    Raises:
        ConfigError: an unknown mode, or fp16 asked for on a CPU.
    """
    modes = {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}
    if amp == "auto":
        return torch.float16 if device.type == "cuda" else None
    if amp not in modes:
        raise ConfigError(f"amp must be one of auto, off, fp16, bf16; got {amp!r}")
    if amp == "fp16" and device.type != "cuda":
        raise ConfigError("amp='fp16' needs a CUDA device; use amp='bf16' or 'off' on a CPU")
    return modes[amp]


class ScalerSlot:
    """A GradScaler with the same checkpoint layout whether it is enabled (CUDA) or not (CPU).

    A disabled GradScaler saves ``{}`` and an enabled one refuses to load ``{}``, so a run could
    not move between a CPU and a GPU; this slot always saves the five fields.
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        if self.scaler.is_enabled():
            return self.scaler.state_dict()
        # A disabled GradScaler keeps no fields; these are its constructor defaults, what an
        # enabled one saves before its first step.
        return {
            "scale": 65536.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 2000,
            "_growth_tracker": 0,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(dict(state))


def derived_seed(seed: int, purpose: str, index: int) -> int:
    # Independent streams per (purpose, index): seeding a generator with seed+index would make
    # epoch 1 of seed 0 replay epoch 0 of seed 1.
    digest = hashlib.blake2b(f"{seed}/{purpose}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def augment(images: torch.Tensor, seed: int, step: int) -> torch.Tensor:
    """Random crop (zero padding 4) and horizontal flip of a uint8 NCHW batch, on its device.

    The offsets and flips are drawn on the CPU from a generator seeded by (seed, step), so they
    do not depend on the device, on the batch's history, or on any global RNG.
    """
    n, _, h, w = images.shape
    gen = torch.Generator().manual_seed(derived_seed(seed, "augment", step))
    offsets = torch.randint(0, 9, (n, 2), generator=gen)
    flips = torch.randint(0, 2, (n,), generator=gen).bool()
    dev = images.device
    rows = (offsets[:, 0:1] + torch.arange(h)).to(dev)
    cols = offsets[:, 1:2] + torch.arange(w)
    cols = torch.where(flips[:, None], cols.flip(1), cols).to(dev)  # a flip is reversed columns
    padded = F.pad(images, (4, 4, 4, 4))
    batch = torch.arange(n, device=dev)[:, None, None, None]
    chan = torch.arange(images.shape[1], device=dev)[None, :, None, None]
    return padded[batch, chan, rows[:, None, :, None], cols[:, None, None, :]]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # F.cross_entropy goes through nll_loss, which has no deterministic CUDA kernel (and one_hot
    # through scatter); a comparison mask times log-probabilities is the same function built from
    # deterministic elementwise ops and reductions.
    logp = F.log_softmax(logits.float(), dim=1)
    mask = labels[:, None] == torch.arange(logp.shape[1], device=logp.device)
    return -(mask.to(logp.dtype) * logp).sum(dim=1).mean()
