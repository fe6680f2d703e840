"""``AppState``: a model and its optimizer as one DCP ``Stateful``, for any parallelism.

It goes through ``torch.distributed.checkpoint.state_dict.get_state_dict``/``set_state_dict``,
which give fully qualified names whatever wraps the model (DDP, FSDP2 ``fully_shard``, DTensor),
so a checkpoint written by N ranks restores on M. Storage and commit live elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["AppState"]


class AppState(Stateful):
    """A model (and optionally its optimizer) as one entry of a DCP state dict.

    Args:
        model: the module (plain, DDP-wrapped or ``fully_shard``-ed).
        optimizer: its optimizer, or None.
        options: passed to ``get_state_dict``/``set_state_dict`` (e.g. ``full_state_dict``).

    Example (see DistributedCheckpointManager)::

        dm.save({"app": AppState(model, optimizer)}, step=step)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        options: StateDictOptions | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model, options=self.options)}
        model, optim = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.optimizer is None:
            set_model_state_dict(self.model, state_dict["model"], options=self.options)
            return
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
            options=self.options,
        )
