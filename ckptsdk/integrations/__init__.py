"""Integrations with the training frameworks people already use; each module needs its extra.

``ckptsdk.integrations.lightning`` (``pip install ckptsdk[lightning]``): a Lightning CheckpointIO.
``ckptsdk.integrations.accelerate`` (``[accelerate]``): save/restore an Accelerator's objects.
``ckptsdk.integrations.transformers`` (``[transformers]``): a Trainer that checkpoints through
ckptsdk. Importing one without its library raises MissingDependencyError naming the extra.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ckptsdk.errors import MissingDependencyError

__all__ = ["require"]


def require(module: str, extra: str) -> ModuleType:
    """Import an optional framework, or say which extra installs it.

    Raises:
        MissingDependencyError: the module is not installed (``.extra`` names the extra).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"ckptsdk's {extra} integration needs {module.split('.')[0]}, which is not installed: "
            f"pip install 'ckptsdk[{extra}]'",
            extra=extra,
        ) from exc
