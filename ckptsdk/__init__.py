"""ckptsdk: checkpoints for PyTorch training on runtimes that disappear.

The curated public surface (``__all__``, locked by tests/test_public_api.py); everything else
lives in submodules users do not need (``ckptsdk.codec``, ``ckptsdk.tensorfile``...).

Example:
    >>> mgr = ckptsdk.CheckpointManager("drive://runs/r18", keep_last=3, save_every=100)
    >>> state = ckptsdk.TrainState(model=model, optimizer=opt)
    >>> pos = mgr.restore(state)        # None on a fresh run
"""

from .backends import open_backend
from .catalog import CheckpointInfo
from .datacache import DataCache
from .errors import (
    BackendError,
    CkptError,
    CorruptCheckpointError,
    DataError,
    LeaseHeldError,
    LeaseLostError,
    ManifestError,
    NoValidCheckpointError,
    ObjectNotFound,
    PreconditionFailed,
    StateMismatchError,
    UnsupportedStateError,
)
from .manager import CheckpointManager, GcReport, ResumePoint
from .runlog import AuditReport, audit
from .state import TrainState

__version__ = "0.1.0"

__all__ = [
    "AuditReport",
    "BackendError",
    "CheckpointInfo",
    "CheckpointManager",
    "CkptError",
    "CorruptCheckpointError",
    "DataCache",
    "DataError",
    "GcReport",
    "LeaseHeldError",
    "LeaseLostError",
    "ManifestError",
    "NoValidCheckpointError",
    "ObjectNotFound",
    "PreconditionFailed",
    "ResumePoint",
    "StateMismatchError",
    "TrainState",
    "UnsupportedStateError",
    "audit",
    "open_backend",
]
