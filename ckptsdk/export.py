"""The door out: export one checkpoint's model weights to a standard safetensors file.

Tied weights are handled as ``safetensors.torch.save_model`` does. Reads through a read-only
CheckpointManager (verified, pickle-free); importing ``torch.save`` files is legacy_import.py's job.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["MODEL_PATHS", "cmd_export", "export_safetensors"]

#: Where the model's state dict sits in the trees ckptsdk and its integrations write, in order.
MODEL_PATHS = ("objects/model", "objects/model_0", "lightning/state_dict")


def _at(tree: Any, path: str) -> Any:
    node = tree
    for part in path.split("/"):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _storage_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names of the model's state dict that are one tensor (tied), as save_model finds them."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, t in model.state_dict(keep_vars=False).items():
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            groups.setdefault(key, []).append(name)
    return [sorted(g) for g in groups.values() if len(g) > 1]


def export_safetensors(
    url: str, out: str | os.PathLike[str], *, step: int | None = None, object_path: str | None = None,
    model: torch.nn.Module | None = None, tied: Iterable[tuple[str, str]] = (),
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write one checkpoint's model weights to a standard safetensors file.

    Tied weights are written once, as ``safetensors.torch.save_model`` does: the first name of
    each tied group (sorted) is kept, the others are left out and recorded in the file's metadata
    as ``{removed: kept}``; ``safetensors.torch.load_model(model, OUT)`` restores them. Checkpoints
    do not record which weights were tied, so ties come from ``model`` (a live instance of the
    architecture) or from ``tied`` pairs; without either, every tensor is written.

    Args:
        url: the checkpoint root (opened read-only: no lease is taken).
        out: the ``.safetensors`` file to write (atomically: a temp name, then a rename).
        step: which checkpoint (the newest valid one by default).
        object_path: where the state dict sits in the tree (default: the first of
            ``objects/model``, ``objects/model_0``, ``lightning/state_dict`` that exists).
        model: a live model whose shared tensors define the tied groups.
        tied: ``(removed, kept)`` name pairs declared tied.
        storage_options: fsspec options for ``gs://``.

    Returns:
        ``{"step", "object", "tensors", "removed": {removed: kept}, "out"}``.

    Raises:
        ConfigError: no state dict at ``object_path``, or "tied" weights whose values differ.

    Example:
        >>> export_safetensors("gs://bucket/run", "model.safetensors", model=GPT2LMHeadModel(cfg))
    """
    import safetensors.torch

    from .manager import CheckpointManager

    with CheckpointManager(url, read_only=True, storage_options=storage_options) as mgr:
        info = mgr.latest() if step is None else None
        chosen = step if step is not None else (info.step if info is not None else None)
        tree = mgr.load(chosen)
    paths = (object_path,) if object_path else MODEL_PATHS
    where = next((p for p in paths if isinstance(_at(tree, p), Mapping)), None)
    if where is None:
        raise ConfigError(f"checkpoint step {chosen} of {url} has no state dict at {' or '.join(paths)}; "
                          "pass --object PATH (e.g. objects/NAME)")
    state = _at(tree, where)
    tensors = {str(k): v for k, v in state.items() if isinstance(v, torch.Tensor)}
    skipped = sorted(str(k) for k, v in state.items() if not isinstance(v, torch.Tensor))
    if skipped:
        logger.warning("not exported (not tensors): %s", ", ".join(skipped))
    pairs = [(r, k) for group in (_storage_groups(model) if model is not None else []) for r in group[1:]
             for k in group[:1]] + list(tied)
    removed: dict[str, str] = {}
    for gone, kept in pairs:
        if gone not in tensors or kept not in tensors:
            raise ConfigError(f"tied weights {gone!r} -> {kept!r}: not both in the checkpoint's state dict")
        if not torch.equal(tensors[gone], tensors[kept]):
            raise ConfigError(f"{gone!r} and {kept!r} are declared tied but differ in the checkpoint; "
                              "the model does not tie them, or the pair is wrong")
        removed[gone] = kept
    for gone in removed:
        del tensors[gone]
    out = os.fspath(out)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, tmp,
                                    metadata={"format": "pt", **removed})
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"step": chosen, "object": where, "tensors": len(tensors), "removed": removed, "out": out}



def cmd_export(args: argparse.Namespace) -> int:
    """``ckptsdk export URL[@STEP] OUT.safetensors``: see :func:`export_safetensors`."""
    from .cli import _UsageError, _emit_json, _storage_options

    url, step = args.url, None
    head, sep, tail = url.rpartition("@")
    if sep and tail.isdigit():
        url, step = head, int(tail)
    tied = []
    for pair in args.tied or ():
        gone, sep, kept = pair.partition("=")
        if not (sep and gone and kept):
            raise _UsageError(f"--tied expects REMOVED=KEPT, got {pair!r}")
        tied.append((gone, kept))
    options = _storage_options(args.storage_option)
    if _is_distributed(url, step, options):
        # A DistributedCheckpointManager's checkpoint: its tensors are sharded over rank files,
        # so the consolidating reader (ckptsdk.distributed) writes them at full size.
        if args.object or tied:
            raise _UsageError("--object and --tied do not apply to a distributed checkpoint: every "
                              "entry is exported under its DCP name")
        from .distributed.export import export_consolidated

        got = export_consolidated(url, args.out, step, storage_options=options)
        report = {"step": got, "object": "distributed (all ranks, consolidated)", "tensors": None,
                  "removed": {}, "out": os.fspath(args.out)}
    else:
        report = export_safetensors(url, args.out, step=step, object_path=args.object, tied=tied,
                                    storage_options=options)
    if args.json:
        _emit_json({"command": "export", "url": url, **report})
    else:
        count = "all" if report["tensors"] is None else report["tensors"]
        print(f"wrote {count} tensors of step {report['step']} ({report['object']}) to {args.out}"
              + (f"; tied, left out: {json.dumps(report['removed'])}" if report["removed"] else ""))
    return 0


def _is_distributed(url: str, step: int | None, storage_options: Mapping[str, Any]) -> bool:
    """Whether the checkpoint ``export`` would read was written by ckptsdk.distributed."""
    from .manager import CheckpointManager

    with CheckpointManager(url, read_only=True, storage_options=storage_options) as mgr:
        tree = mgr.load_manifest(step).tree
    # The payload's marker; kept in sync with ckptsdk.distributed.manager.PAYLOAD_FORMAT by a test.
    return isinstance(tree, Mapping) and tree.get("format") == DISTRIBUTED_FORMAT


#: The ``format`` at the top of a distributed checkpoint's manifest tree.
DISTRIBUTED_FORMAT = "ckptsdk.distributed/1"
