"""Restoring a distributed checkpoint: rank 0 offers, every rank loads, all agree, or all fall back.

Rank 0 walks the checkpoints newest first through its core manager, offering each (as JSON) to
every rank; each rank loads its shards through DCP, verified, and the ranks agree on the outcome.
A rank file that fails its checks anywhere drops that checkpoint on every rank together (a warning
names the file) and the next older one is offered, before rank 0's lineage is fixed. Saving is
manager.py's; the storage plugin is storage.py's.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint import state_dict_loader
from torch.distributed.checkpoint.api import CheckpointException

from ckptsdk.checkpoint.reading.catalog import CheckpointInfo
from ckptsdk.distributed.collective import all_min, describe_error, gather_json, rebuild_error
from ckptsdk.distributed.metadata import metadata_from_json
from ckptsdk.distributed.payload import file_table, local_file, read_payload
from ckptsdk.distributed.storage import CkptStorageReader, JsonLoadPlanner, unwrap
from ckptsdk.errors import CkptError, CorruptCheckpointError, StateMismatchError
from ckptsdk.format import codec
from ckptsdk.format.files.tensorfile import read_tensorfile
from ckptsdk.manager import ResumePoint
from ckptsdk.rng import restore_rng

if TYPE_CHECKING:
    from ckptsdk.distributed.manager import DistributedCheckpointManager

logger = logging.getLogger(__name__)

__all__ = ["load_quietly", "restore"]


class _Capture:
    """What the core manager's ``restore`` loads into on rank 0: the payload, nothing else.

    The core manager picks the checkpoint (skipping torn, corrupt and orphaned ones: the rank
    files are in its manifest), records the lineage, and re-commits it under the new lease epoch
    (its "anchor", copying the rank files) so a zombie cannot rotate the resume point away.
    """

    def __init__(self) -> None:
        self.payload: dict[str, Any] | None = None

    def load_state_dict(self, tree: Any) -> None:
        self.payload = read_payload(tree)


def restore(dm: DistributedCheckpointManager, state: dict[str, Any]) -> ResumePoint | None:
    """:meth:`DistributedCheckpointManager.restore` (see there), on this rank."""
    if dm.rank == 0:
        return _as_committer(dm, state)
    while True:  # the other ranks: load what rank 0 offers until it says how it ended
        offer = dm._bcast(None)
        if offer["kind"] == "try":
            try:
                _try_offer(dm, state, offer)
            except CorruptCheckpointError:
                continue  # every rank dropped it (warned): rank 0 offers the next older one
        elif offer["kind"] == "done":
            return ResumePoint(**codec.decode(offer["point"], {}))
        elif offer["kind"] == "none":
            return None
        else:
            raise rebuild_error(offer)


def _as_committer(dm: DistributedCheckpointManager, state: dict[str, Any]) -> ResumePoint | None:
    core = dm._core
    assert core is not None
    capture = _Capture()
    settled = False  # every rank already raised the same error: nothing more to send

    def accept(tree: Any, info: CheckpointInfo) -> None:
        nonlocal settled
        assert info.manifest is not None
        files = file_table(info.manifest)
        offer = {"kind": "try", "source": info.key, "payload": read_payload(tree), "files": files}
        dm._bcast(offer)
        try:
            _try_offer(dm, state, offer)
        except CorruptCheckpointError:
            raise  # every rank skips it; the core offers the next older one
        except BaseException:
            settled = True
            raise

    try:
        pos = core.restore(capture, _accept=accept)
    except CkptError as exc:
        if not settled:
            dm._bcast(describe_error(exc) | {"kind": "error"})
        raise
    if pos is None:
        dm._bcast({"kind": "none"})
        return None
    _t, point = codec.encode({k: getattr(pos, k) for k in ResumePoint.__dataclass_fields__})
    dm._bcast({"kind": "done", "point": point})
    return pos


def _try_offer(dm: DistributedCheckpointManager, state: dict[str, Any], offer: dict[str, Any]) -> None:
    """Load one offered checkpoint on this rank and agree with every rank on the outcome.

    Raises (on every rank alike): ``CorruptCheckpointError`` when every failure was a file
    failing its checks (the checkpoint is dropped by all), else the first failure.
    """
    original: Exception | None = None
    try:
        _load(dm, state, offer["payload"], offer["source"], offer["files"])
    except Exception as exc:  # any failure, on any rank, must reach every rank (none may hang)
        original = exc
    if all_min(0 if original is not None else 1, group=dm.group):
        return
    described = [d for d in gather_json(None if original is None else describe_error(original), group=dm.group) if d]
    if all(d["type"] == "CorruptCheckpointError" for d in described):
        files = "; ".join(f"rank {d['rank']}: {d['message']}" for d in described)
        logger.warning(
            "%s/%s: a rank file failed its checks (%s); every rank drops this checkpoint and the previous one is tried",
            dm.url,
            offer["source"],
            files,
        )
        raise CorruptCheckpointError(
            f"{dm.url}/{offer['source']} is not restorable on every rank: {files}",
            url=dm.url,
            key=original.key if isinstance(original, CorruptCheckpointError) else offer["source"],
        )
    if original is not None:
        raise original
    raise rebuild_error(described[0])


def _load(
    dm: DistributedCheckpointManager,
    state: dict[str, Any],
    payload: dict[str, Any],
    source: str,
    files: dict[str, dict[str, Any]],
) -> None:
    md = metadata_from_json(payload["dcp"], where=f"{dm.url}/{source}")
    reader = CkptStorageReader(dm.backend, source, metadata=md, files=files)
    load_quietly(state, reader)
    if payload["world_size"] != dm.world_size:
        logger.warning(
            "%s/%s was written by %d ranks, this job has %d: RNG states and local extras "
            "are not restored (the run continues, but not bit-for-bit)",
            dm.url,
            source,
            payload["world_size"],
            dm.world_size,
        )
        dm.local = None
        return
    name = local_file(dm.rank)
    entry = files[name]
    tensors = read_tensorfile(
        dm.backend, f"{source}/{name}", size=entry["size"], digest=entry["digest"], algorithm=entry["algorithm"]
    )
    mine = codec.decode(payload["local"][dm.rank], tensors)
    restore_rng(mine["rng"])
    dm.local = mine["local"]


def load_quietly(state: dict[str, Any], reader: CkptStorageReader, *, flatten: bool = True) -> None:
    """``dcp.load`` on this rank alone, re-raising the error a read hit (not DCP's wrapper).

    Each rank plans its own reads: no collective, so nothing is pickled between ranks either.
    """
    with warnings.catch_warnings():
        # DCP warns that no_dist "assumes a single process"; here it is the intent.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            state_dict_loader.load(
                state, storage_reader=reader, planner=JsonLoadPlanner(flatten_state_dict=flatten), no_dist=True
            )
        except CheckpointException as exc:
            cause: BaseException = unwrap(exc)
            if isinstance(cause, CkptError):
                raise cause from None
        except (RuntimeError, ValueError) as exc:  # DCP's planning: missing keys, other shapes
            if isinstance(exc, CkptError):
                raise
            cause = exc
        else:
            return
    # Corrupt data is a ckptsdk error from the verified read; anything else is a state that
    # does not fit the checkpoint (DCP names the key).
    raise StateMismatchError(
        f"{reader.backend.url}/{reader.folder} does not fit the state given to restore: {cause}. "
        "Build the same model/optimizer (any parallelism) as the job that saved it",
        url=reader.backend.url,
        mismatches=[str(cause)],
    ) from cause
