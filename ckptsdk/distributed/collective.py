"""Small JSON messages over a torch.distributed process group, without pickle.

``torch.distributed``'s ``*_object`` collectives pickle their payloads; the decisions ckptsdk
broadcasts (fenced or not, which checkpoint to restore, what each rank wrote) are JSON, so they
travel as UTF-8 bytes in uint8 tensors. Errors cross the same way, as (type name, message).
Nothing here knows about checkpoints or storage.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ckptsdk import errors
from ckptsdk.errors import CkptError

__all__ = ["all_min", "broadcast_json", "describe_error", "gather_json", "rebuild_error"]


def _device(group: Any) -> torch.device:
    # NCCL moves only CUDA tensors; gloo only CPU ones.
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj, allow_nan=False).encode("utf-8")), dtype=torch.uint8)


def _decode(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.cpu().numpy().tobytes()).decode("utf-8"))


def broadcast_json(obj: Any, *, src: int = 0, group: Any = None) -> Any:
    """Send ``obj`` (JSON-able) from rank ``src`` to every rank of ``group``; return it everywhere.

    Args:
        obj: the value on ``src`` (ignored elsewhere).
        src: the global rank that sends.
        group: the process group (default: the world).
    """
    dev = _device(group)
    if dist.get_rank() == src:
        payload = _encode(obj).to(dev)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=dev)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.broadcast(size, src=src, group=group)
    if dist.get_rank() != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(payload, src=src, group=group)
    return obj if dist.get_rank() == src else _decode(payload)


def gather_json(obj: Any, *, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), in rank order, on every rank (an all-gather)."""
    dev = _device(group)
    world = dist.get_world_size(group)
    mine = _encode(obj).to(dev)
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[: mine.numel()] = mine
    out = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [_decode(t[: int(s.item())]) for t, s in zip(out, sizes, strict=True)]


def all_min(value: int, *, group: Any = None) -> int:
    """The smallest ``value`` over the group (1/0 flags: "did every rank succeed")."""
    t = torch.tensor([value], dtype=torch.int64, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


# Errors travel between ranks as (type name, message): a rank rebuilds the same ckptsdk error.
def describe_error(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "type": type(exc).__name__, "message": str(exc), "rank": dist.get_rank()}


def rebuild_error(outcome: Mapping[str, Any]) -> CkptError:
    cls = getattr(errors, str(outcome.get("type")), None)
    message = f"(from rank {outcome.get('rank')}) {outcome.get('message')}"
    if isinstance(cls, type) and issubclass(cls, CkptError):
        try:
            return cls(message)
        except TypeError:  # an error whose fields are required: keep the message
            pass
    return errors.CheckpointError(message)
