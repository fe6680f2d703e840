"""CIFAR-10 for ckptsdk jobs: verified data from any source (``data``), and the training job.

``load_cifar10`` / ``synthetic_cifar10`` / ``CifarData`` / ``tensor_hash`` are re-exported lazily,
so ``python -m adapters.cifar10.data`` does not import its own module twice.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CifarData", "load_cifar10", "synthetic_cifar10", "tensor_hash"]


def __getattr__(name: str) -> Any:
    if name in ("CifarData", "load_cifar10", "tensor_hash"):
        from . import data

        return getattr(data, name)
    if name == "synthetic_cifar10":
        from .synthetic import synthetic_cifar10

        return synthetic_cifar10
    raise AttributeError(f"module 'adapters.cifar10' has no attribute {name!r}")
