"""ckptsdk: checkpoints for PyTorch training on runtimes that disappear.

The curated public surface (``__all__``, locked by tests/project/test_public_api.py); everything else
lives in submodules users do not need (``ckptsdk.format.codec``, ``ckptsdk.format.files.tensorfile``...).

Keep rules for ``CheckpointManager(keep=[...])`` are ``ckptsdk.keep``'s (``keep.best("val_loss", 2)``).

Example (``memory://`` here; a job passes a path, ``drive://runs/r18`` or ``gs://bucket/run``):
    >>> import torch, ckptsdk
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> state = ckptsdk.TrainState(model=model, optimizer=opt)
    >>> with ckptsdk.CheckpointManager("memory://readme", keep_last=3, save_every=100) as mgr:
    ...     pos = mgr.restore(state)        # None on a fresh run
    ...     start = pos.step + 1 if pos else 1
    ...     for step in range(start, 201):
    ...         loss = model(torch.randn(8, 4)).square().mean()
    ...         opt.zero_grad(); loss.backward(); opt.step()
    ...         if mgr.should_save(step):
    ...             _ = mgr.save(state, step=step)
    >>> [c.step for c in ckptsdk.CheckpointManager("memory://readme", read_only=True).list()]
    [100, 200]
"""

from typing import TYPE_CHECKING, Any

from ckptsdk._version import __version__ as __version__  # the one home: ckptsdk/_version.py
from ckptsdk.backends import open_backend

# Every error of the tree (errors.py): whatever a public call raises can be caught as ckptsdk.X.
from ckptsdk.errors import (
    AllSourcesFailedError,
    BackendError,
    CheckpointError,
    CheckpointTooLargeError,
    CkptError,
    ConfigError,
    CorruptCheckpointError,
    DataError,
    DatasetMismatchError,
    DeadlineExceeded,
    DigestMismatchError,
    DownloadError,
    InvalidKey,
    LeaseError,
    LeaseHeldError,
    LeaseLostError,
    ManifestError,
    MissingDependencyError,
    NewerFormatError,
    NoCheckpointRootError,
    NoValidCheckpointError,
    ObjectNotFound,
    PreconditionFailed,
    PreconditionsNotHonoured,
    StateMismatchError,
    StorageUnavailable,
    UnknownSchemeError,
    UnsafeArchiveError,
    UnsupportedStateError,
)

# Names whose modules import torch are loaded on first use, so `import ckptsdk` (the CLI's
# `lease` command, child processes, storage-only users) does not pay torch's start-up.
_LAZY = {
    "AuditReport": "runlog.audit",
    "CheckpointInfo": "checkpoint.reading.catalog",
    "CheckpointManager": "manager",
    "DataCache": "data.cache",
    "DataLoader": "loader",
    "GcReport": "manager",
    "LeaseOptions": "options",
    "Retention": "options",
    "SaveOptions": "options",
    "ResumePoint": "checkpoint.reading.reader",
    "TrainState": "state",
}
#: Public submodules loaded on first use as ``ckptsdk.NAME`` (``from ckptsdk import keep`` works anyway).
_LAZY_MODULES = ("keep",)

if TYPE_CHECKING:
    from ckptsdk import keep
    from ckptsdk.checkpoint.reading.catalog import CheckpointInfo
    from ckptsdk.checkpoint.reading.reader import ResumePoint
    from ckptsdk.data.cache import DataCache
    from ckptsdk.loader import DataLoader
    from ckptsdk.manager import CheckpointManager, GcReport
    from ckptsdk.options import LeaseOptions, Retention, SaveOptions
    from ckptsdk.runlog.audit import AuditReport
    from ckptsdk.state import TrainState


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None and name not in _LAZY_MODULES:
        raise AttributeError(f"module 'ckptsdk' has no attribute {name!r}")
    import importlib

    if module is None:  # a submodule: importing it sets the attribute too
        value = importlib.import_module(f".{name}", __name__)
    else:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # The lazy names are not in globals() until first used; dir() and completion list them anyway.
    return sorted({*globals(), *_LAZY, *_LAZY_MODULES})


__all__ = [
    "AllSourcesFailedError",
    "AuditReport",
    "BackendError",
    "CheckpointError",
    "CheckpointTooLargeError",
    "CheckpointInfo",
    "CheckpointManager",
    "CkptError",
    "ConfigError",
    "CorruptCheckpointError",
    "DataCache",
    "DataError",
    "DataLoader",
    "DatasetMismatchError",
    "DeadlineExceeded",
    "DigestMismatchError",
    "DownloadError",
    "GcReport",
    "InvalidKey",
    "LeaseError",
    "LeaseHeldError",
    "LeaseLostError",
    "LeaseOptions",
    "ManifestError",
    "NewerFormatError",
    "MissingDependencyError",
    "NoCheckpointRootError",
    "NoValidCheckpointError",
    "ObjectNotFound",
    "PreconditionFailed",
    "PreconditionsNotHonoured",
    "ResumePoint",
    "Retention",
    "SaveOptions",
    "StateMismatchError",
    "StorageUnavailable",
    "TrainState",
    "UnknownSchemeError",
    "UnsafeArchiveError",
    "UnsupportedStateError",
    "keep",
    "open_backend",
]
