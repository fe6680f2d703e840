"""ckptsdk: checkpoints for PyTorch training on runtimes that disappear.

The curated public surface; everything else lives in submodules users do not need.
"""

from .backends import open_backend
from .errors import (
    CkptError,
    CorruptCheckpointError,
    LeaseHeldError,
    LeaseLostError,
    ManifestError,
    UnsupportedStateError,
)

__version__ = "0.1.0"

__all__ = [
    "CkptError",
    "CorruptCheckpointError",
    "LeaseHeldError",
    "LeaseLostError",
    "ManifestError",
    "UnsupportedStateError",
    "open_backend",
]
