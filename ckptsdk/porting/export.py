"""The door out: export one checkpoint's model weights to a standard safetensors file.

Tied weights are handled as ``safetensors.torch.save_model`` does. Reads through a read-only
CheckpointManager (verified, pickle-free); importing ``torch.save`` files is torch_import.py's job,
the ``ckptsdk export`` command ckptsdk/cli/porting.py's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Iterable, Mapping
from typing import Any, TypedDict

import torch

from ckptsdk.distributed.payload import is_payload
from ckptsdk.errors import BackendError, ConfigError
from ckptsdk.format.codec import path_component
from ckptsdk.porting.guard import check_output_path, publish

logger = logging.getLogger(__name__)

__all__ = ["MODEL_PATHS", "ExportReport", "export_safetensors"]


class ExportReport(TypedDict):
    """What :func:`export_safetensors` wrote."""

    step: int
    object: str
    tensors: int | None
    removed: dict[str, str]
    out: str


#: Where the model's state dict sits in the trees ckptsdk and its integrations write, in order.
MODEL_PATHS = ("objects/model", "objects/model_0", "lightning/state_dict")


def _at(tree: Any, path: str) -> Any:
    node = tree
    for part in path.split("/"):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _discard(tmp: str) -> None:
    """Remove a temp file a failed export left (an absent one is the normal case)."""
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def _storage_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names of the model's state dict that are one tensor (tied), as save_model finds them."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, t in model.state_dict(keep_vars=False).items():
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            groups.setdefault(key, []).append(name)
    return [sorted(g) for g in groups.values() if len(g) > 1]


class _Base:
    """The frozen base a referenced checkpoint's export is given, as a restore's live target: its
    tensors under every model path of the tree (the proof takes those the checkpoint references)."""

    def __init__(self, base: torch.nn.Module | str | os.PathLike[str], prefixes: Iterable[str]) -> None:
        if isinstance(base, torch.nn.Module):
            tensors = {k: v.detach() for k, v in base.state_dict().items()}
        else:
            import safetensors.torch

            tensors = safetensors.torch.load_file(os.fspath(base))
        self._tensors = {f"{p}/{path_component(k)}": t for p in prefixes for k, t in tensors.items()}

    def tensors_at(self, paths: Collection[str]) -> dict[str, torch.Tensor]:
        return {p: self._tensors[p] for p in paths if p in self._tensors}

    def live_tensors(self) -> dict[str, torch.Tensor]:
        return {}  # never read into: the export writes what it read

    def check_fit(self, tree: Any, *, strict: bool = True) -> None:
        """Nothing to fit: the base supplies referenced tensors only."""


def _referenced_read(mgr: Any, info: Any, base: Any, where: tuple[str, ...], url: str) -> Any:
    """The tree of a checkpoint that references a base, proven on ``base`` (or refused, naming
    the source and the count: never partial weights)."""
    manifest = info.manifest
    count = sum(len(g.tensors) for g in manifest.referenced)
    sources = ", ".join(sorted({g.source or "an unnamed source" for g in manifest.referenced}))
    if base is None:
        raise ConfigError(
            f"checkpoint step {info.step} of {url} records {count} tensor(s) of its frozen base by reference "
            f"(from {sources}), not their bytes: pass the base (base=a live model holding it, or a .safetensors "
            "file of its state dict; `ckptsdk export --base FILE`) and it is proven and written with the rest. "
            "Nothing was written"
        )
    return mgr.read_tree(info, into=_Base(base, where))


def export_safetensors(
    url: str,
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    object_path: str | None = None,
    model: torch.nn.Module | None = None,
    tied: Iterable[tuple[str, str]] = (),
    storage_options: Mapping[str, object] | None = None,
    force: bool = False,
    base: torch.nn.Module | str | os.PathLike[str] | None = None,
) -> ExportReport:
    """Write one checkpoint's model weights to a standard safetensors file.

    Tied weights are written once, as ``safetensors.torch.save_model`` does: the first name of
    each tied group (sorted) is kept, the others are left out and recorded in the file's metadata
    as ``{removed: kept}``; ``safetensors.torch.load_model(model, OUT)`` restores them. Checkpoints
    do not record which weights were tied, so ties come from ``model`` (a live instance of the
    architecture) or from ``tied`` pairs; without either, every tensor is written. A checkpoint
    of :mod:`ckptsdk.distributed` (sharded over rank files) is written consolidated, every entry
    at full size under its DCP name (see :func:`ckptsdk.distributed.export_consolidated`).

    Args:
        url: the checkpoint root (opened read-only: no lease is taken; listed once).
        out: the ``.safetensors`` file to write (atomically: a temp name in its folder, then a
            rename); never inside a checkpoint root (see :mod:`ckptsdk.porting.guard`).
        step: which checkpoint (the newest valid one by default).
        object_path: where the state dict sits in the tree (default: the first of
            ``objects/model``, ``objects/model_0``, ``lightning/state_dict`` that exists).
        model: a live model whose shared tensors define the tied groups.
        tied: ``(removed, kept)`` name pairs declared tied.
        storage_options: fsspec options for ``gs://``.
        force: replace ``out`` if it exists (an ordinary file outside every checkpoint root).
        base: for a checkpoint that records its frozen base by reference
            (``SaveOptions(frozen="reference")``): a live model holding that base, or a
            ``.safetensors`` file of its state dict (names as the model's ``state_dict()``). It
            is proven (digests) before anything is written; another base raises
            ``StateMismatchError``. Ignored for a checkpoint that stores every byte.

    Returns:
        ``{"step", "object", "tensors", "removed": {removed: kept}, "out"}`` (``tensors`` is None
        for a distributed checkpoint: all of them).

    Raises:
        StateMismatchError: ``base`` is not the base the checkpoint references.
        ConfigError: a checkpoint referencing a base and no ``base`` given (nothing is written),
            no state dict at ``object_path``, "tied" weights whose values differ,
            ``object_path``/``model``/``tied`` given for a distributed checkpoint, or an ``out``
            inside a checkpoint root, in a missing folder, or existing without ``force``.
        BackendError: writing ``out`` failed (disk full, permissions); nothing was left there.
        NoValidCheckpointError: no such step, or nothing restorable.

    Example:
        >>> import os, tempfile, torch
        >>> from ckptsdk import CheckpointManager, TrainState
        >>> with CheckpointManager("memory://to-export") as mgr:
        ...     _ = mgr.save(TrainState(model=torch.nn.Linear(2, 2)), step=5)
        >>> out = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> report = export_safetensors("memory://to-export", out)
        >>> report["step"], report["object"], report["tensors"]
        (5, 'objects/model', 2)
    """
    import safetensors.torch

    from ckptsdk.manager import CheckpointManager

    tied = list(tied)
    out = check_output_path(out, force=force)  # before anything is read: a slip costs nothing
    tmp = os.path.join(os.path.dirname(os.path.abspath(out)), f".{os.path.basename(out)}.tmp-{os.getpid()}")
    with CheckpointManager(url, read_only=True, storage_options=storage_options) as mgr:
        info = mgr.pick(step)
        assert info.manifest is not None  # pick() returns only checkpoints whose manifest reads
        chosen = info.step
        if is_payload(info.manifest.tree):
            if object_path or tied or model is not None:
                raise ConfigError(
                    "object_path, model and tied (--object, --tied) do not apply to a "
                    "distributed checkpoint: every entry is exported under its DCP name"
                )
            from ckptsdk.distributed.export import write_consolidated

            try:
                write_consolidated(mgr.backend, info, tmp, source=url)
                publish(tmp, out, force=force)
            finally:
                _discard(tmp)
            return {
                "step": chosen,
                "object": "distributed (all ranks, consolidated)",
                "tensors": None,
                "removed": {},
                "out": out,
            }
        paths = (object_path,) if object_path else MODEL_PATHS
        if info.manifest.referenced:
            tree = _referenced_read(mgr, info, base, paths, url)
        else:
            tree = mgr.read_tree(info)
    where = next((p for p in paths if isinstance(_at(tree, p), Mapping)), None)
    if where is None:
        raise ConfigError(
            f"checkpoint step {chosen} of {url} has no state dict at {' or '.join(paths)}; "
            "pass --object PATH (e.g. objects/NAME)"
        )
    state = _at(tree, where)
    tensors = {str(k): v for k, v in state.items() if isinstance(v, torch.Tensor)}
    skipped = sorted(str(k) for k, v in state.items() if not isinstance(v, torch.Tensor))
    if skipped:
        logger.warning("not exported (not tensors): %s", ", ".join(skipped))
    pairs = [
        (r, k) for group in (_storage_groups(model) if model is not None else []) for r in group[1:] for k in group[:1]
    ] + list(tied)
    removed: dict[str, str] = {}
    for gone, kept in pairs:
        if gone not in tensors or kept not in tensors:
            raise ConfigError(f"tied weights {gone!r} -> {kept!r}: not both in the checkpoint's state dict")
        if not torch.equal(tensors[gone], tensors[kept]):
            raise ConfigError(
                f"{gone!r} and {kept!r} are declared tied but differ in the checkpoint; "
                "the model does not tie them, or the pair is wrong"
            )
        removed[gone] = kept
    for gone in removed:
        del tensors[gone]
    try:
        try:
            safetensors.torch.save_file(
                {k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"format": "pt", **removed}
            )
        except (OSError, safetensors.SafetensorError) as exc:
            raise BackendError(f"could not write {out} (through {tmp}): {exc}; check the disk and the folder") from exc
        publish(tmp, out, force=force)
    finally:
        _discard(tmp)
    return {"step": chosen, "object": where, "tensors": len(tensors), "removed": removed, "out": out}
