"""The training thread's pause in a non-blocking distributed save: what is copied when.

At ``save()`` the DCP state dict is frozen: its containers and non-tensor values are copied, and
every tensor's bytes go to a reusable host buffer (:class:`ckptsdk.checkpoint.writing.staging.Stager`).
Parameters and optimizer state, which only ``optimizer.step()`` changes, are copied later by the
save's worker while training goes on; those optimizers' next ``step()`` waits for that copy.
Writing, the DCP planner and the commit are storage.py's and the manager's, not this module's.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckptsdk.checkpoint.writing.staging import PendingSnapshot, SnapshotMode, Stager
from ckptsdk.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["Frozen", "Snapshotter", "find_optimizers"]


def find_optimizers(state: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
    """The optimizers a DCP state dict holds: values that are optimizers, or attributes of its
    values one level down (the DCP tutorial's ``AppState.optimizer``, ckptsdk's ``AppState``)."""
    found: dict[int, torch.optim.Optimizer] = {}
    for value in state.values():
        candidates = [value, *vars(value).values()] if hasattr(value, "__dict__") else [value]
        for obj in candidates:
            if isinstance(obj, torch.optim.Optimizer):
                # A wrapper that subclasses Optimizer without its __init__ (accelerate's) has no
                # step hooks and steps the optimizer it holds (as ckptsdk.state's TrainState sees it).
                inner = getattr(obj, "optimizer", None)
                if not hasattr(obj, "_optimizer_step_pre_hooks") and isinstance(inner, torch.optim.Optimizer):
                    obj = inner
                found.setdefault(id(obj), obj)
    return list(found.values())


def _local(t: torch.Tensor) -> torch.Tensor:
    """Where a tensor's bytes on this rank live: a DTensor's local shard, else the tensor."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _stepped_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> dict[int, torch.Tensor]:
    """Data pointer -> tensor, for every parameter and state tensor of ``optimizers`` (local shards)."""
    live: dict[int, torch.Tensor] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                live[_local(p).data_ptr()] = _local(p)
        for entry in opt.state.values():
            if isinstance(entry, Mapping):
                for v in entry.values():
                    if isinstance(v, torch.Tensor):
                        live[_local(v).data_ptr()] = _local(v)
    return live


def _stageable(t: torch.Tensor) -> bool:
    """A dense tensor the Stager can copy (not a subclass with bytes of its own elsewhere)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout is torch.strided and not t.is_meta


@dataclass
class Frozen:
    """A DCP state dict as it was at ``save()``, some of its copies still running.

    Attributes:
        tree: the state dict for ``dcp.save``: plain tensors replaced by staging buffers; DTensors
            kept (DCP plans their shards from them), their local data read from ``staged``.
        staged: ``id(DTensor in tree)`` -> the buffer holding its local shard (see
            :class:`ckptsdk.distributed.JsonSavePlanner`).
        pending: the snapshot; its deferred copies run in :meth:`PendingSnapshot.finish`.
        outer: the pipelined rule's watch of the deferred DTensors themselves (None: none).
            An in-place DTensor op moves the DTensor's version counter, not its local shard's,
            so their counters are compared too, at the same moments (no copy of its own).
        copied_bytes: bytes copied on the training thread at ``save()``.
        deferred_bytes: bytes the worker copies (parameters and optimizer state).
    """

    tree: dict[str, Any]
    staged: dict[int, torch.Tensor]
    pending: PendingSnapshot
    outer: PendingSnapshot | None = None
    copied_bytes: int = 0
    deferred_bytes: int = 0
    cloned: list[str] = field(default_factory=list)

    def verify(self) -> None:
        """Raise the snapshot's failure (its copy, or the pipelined rule broken), else return.

        Called on every rank at the end of its DCP write, before rank 0 may commit.
        """
        try:
            for watch in (self.pending, self.outer):
                if watch is not None:
                    watch.wait_finished()
                    watch.verify()
        except CheckpointError as exc:
            # PendingSnapshot names the single-process manager's option; this job has ours.
            message = str(exc).replace("CheckpointManager(", "DistributedCheckpointManager(")
            raise CheckpointError(message, url=exc.url, key=exc.key) from exc

    def finish(self) -> None:
        """On the worker: the deferred copies, then the rule's check after them. A failure is
        kept for :meth:`verify` (every rank must still reach the DCP write, where it is raised)."""
        try:
            self.pending.finish()
        except BaseException:  # noqa: S110 -- kept in pending, raised by verify()
            pass
        finally:
            if self.outer is not None:
                # The held step waits for this one too (Snapshotter._before_step): no held step
                # can have moved these counters yet.
                try:
                    self.outer.finish()
                except BaseException:  # noqa: S110 -- kept in outer, raised by verify()
                    pass

    def wait_copied(self) -> None:
        """The held step's wait: the copies and the DTensors' check done, then the counters."""
        self.pending.wait_copied()
        if self.outer is not None:
            self.outer.settle()
            self.outer.wait_copied()


class Snapshotter:
    """Freezes DCP state dicts for background saves; holds the optimizers' next step meanwhile.

    Args:
        mode: ``"pipelined"`` defers the optimizers' tensors to the worker; ``"copy"`` copies
            every tensor at ``save()``.

    Thread-safety: one snapshot in flight (the staging buffers are reused by the next one); the
    manager waits for the previous save before freezing the next state.
    """

    def __init__(self, mode: SnapshotMode) -> None:
        self.mode = mode
        self._stager = Stager()
        self._hooks: dict[int, Any] = {}
        self._hold: Frozen | None = None
        self._told = False

    def freeze(self, state: Mapping[str, Any], optimizers: Sequence[torch.optim.Optimizer], *, where: str) -> Frozen:
        """Copy ``state`` (a DCP state dict whose Stateful values were turned into state dicts).

        Args:
            state: the state dict, tensors live.
            optimizers: whose parameters and state may be copied later (ignored in "copy" mode).
            where: which save, for the rule's error message.
        """
        if self.mode == "pipelined" and not optimizers and not self._told:
            self._told = True
            logger.info(
                "%sno optimizer found in the state dict (looked into its Stateful values' attributes): "
                "every tensor is copied at save(); pass optimizers=[...] to copy parameters and "
                "optimizer state in the background",
                where,
            )
        live = _stepped_tensors(optimizers) if self.mode == "pipelined" else {}
        names: list[str] = []
        sources: list[torch.Tensor] = []
        defer: list[bool] = []
        cloned: list[str] = []
        seen: set[str] = set()
        slots: list[tuple[list[Any] | dict[Any, Any], Any, torch.Tensor]] = []

        def walk(obj: Any, path: str) -> Any:
            if isinstance(obj, torch.Tensor):
                src = _local(obj)
                if not _stageable(src):  # a ShardedTensor, a sparse or nested tensor: a plain clone
                    cloned.append(path)
                    return obj.detach().clone()
                match = live.get(src.data_ptr())
                # Names key the staging buffers: two paths that print alike (keys 1 and "1") must
                # never share one.
                names.append(path if path not in seen else f"{path}#{len(names)}")
                seen.add(names[-1])
                sources.append(src)
                defer.append(
                    match is not None and match.dtype is src.dtype and match.shape == src.shape and src.numel() > 0
                )
                return obj  # replaced below once the buffers exist
            if isinstance(obj, Mapping):
                out: dict[Any, Any] = {}
                for k, v in obj.items():
                    out[k] = walk(v, f"{path}.{k}" if path else str(k))
                    if isinstance(v, torch.Tensor) and out[k] is v:
                        slots.append((out, k, v))
                return out
            if isinstance(obj, (list, tuple)):
                items: list[Any] = []
                for i, v in enumerate(obj):
                    items.append(walk(v, f"{path}.{i}"))
                    if isinstance(v, torch.Tensor) and items[-1] is v:
                        slots.append((items, i, v))
                return items if isinstance(obj, list) else _Tuple(items, type(obj))
            return copy.deepcopy(obj)

        raw = walk(dict(state), "")
        pending = self._stager.begin_aligned(tuple(names), sources, defer, where=where)
        staged: dict[int, torch.Tensor] = {}
        outer: tuple[list[str], list[torch.Tensor], list[int]] = ([], [], [])
        for (container, key, live_tensor), name, deferred in zip(slots, names, defer, strict=True):
            buf = pending.tensors[name]
            if isinstance(live_tensor, DTensor):
                staged[id(live_tensor)] = buf
                if deferred:
                    outer[0].append(name)
                    outer[1].append(live_tensor)
                    outer[2].append(live_tensor._version)
            else:
                container[key] = buf
        tree = _untuple(raw)  # tuples last: their slots were filled in above
        sizes = [t.numel() * t.element_size() for t in sources]
        return Frozen(
            tree=tree,
            staged=staged,
            pending=pending,
            outer=PendingSnapshot({}, [], [], [], watched=outer, where=where) if outer[0] else None,
            copied_bytes=sum(n for n, d in zip(sizes, defer, strict=True) if not d),
            deferred_bytes=sum(n for n, d in zip(sizes, defer, strict=True) if d),
            cloned=cloned,
        )

    def hold(self, frozen: Frozen | None, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        """Make ``optimizers``' next ``step()`` wait for ``frozen``'s deferred copies (None: stop)."""
        for opt in optimizers:
            if id(opt) not in self._hooks:
                # One hook per optimizer for the manager's life: a hook cannot remove itself while
                # torch iterates the hooks, and an idle one costs one attribute read per step.
                self._hooks[id(opt)] = opt.register_step_pre_hook(self._before_step)
        self._hold = frozen

    def _before_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        frozen = self._hold
        if frozen is not None:
            frozen.wait_copied()

    def close(self) -> None:
        """Remove the step hooks and free the staging buffers."""
        self._hold = None
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._stager.release()


class _Tuple(list[Any]):
    """A tuple being rebuilt: its tensor slots are filled in after the buffers exist."""

    def __init__(self, items: list[Any], kind: type) -> None:
        super().__init__(items)
        self.kind = kind


def _untuple(obj: Any) -> Any:
    if isinstance(obj, _Tuple):
        return obj.kind(_untuple(v) for v in obj)
    if isinstance(obj, list):
        obj[:] = [_untuple(v) for v in obj]
        return obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _untuple(v)
        return obj
    return obj
