"""A ``torch.distributed.checkpoint`` storage layer on ckptsdk backends, with JSON instead of pickle.

Each rank's share of a DCP save is one safetensors file (``rank-00003.safetensors``) with its
digest; on the coordinator ``finish()`` hands DCP's metadata, as JSON, and the digests to a commit
callback (the manager's manifest). Non-tensor entries travel as codec JSON through the planners
here, never ``torch.save``. The lease, the folder and the manifest belong to :mod:`.manager`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

# From the modules that define them: the package root re-exports them without an __all__ entry
# that mypy --strict accepts (same objects either way).
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ckptsdk.backends.base import Backend
from ckptsdk.distributed.metadata import metadata_to_json
from ckptsdk.errors import CkptError, CorruptCheckpointError, UnsupportedStateError
from ckptsdk.format import codec
from ckptsdk.format.digest import DEFAULT as DIGEST_ALGORITHM
from ckptsdk.format.files.tensorfile import read_tensorfile, write_tensorfile

logger = logging.getLogger(__name__)

__all__ = ["CkptStorageWriter", "CkptStorageReader", "JsonSavePlanner", "JsonLoadPlanner", "rank_file", "unwrap"]

# Non-tensor entries are stored as this prefix + the codec's JSON skeleton, in a uint8 tensor.
# The prefix lets the writer refuse bytes that another planner pickled.
_JSON_MAGIC = b"ckptsdk-json/1\n"

#: ``commit(metadata_json, files)``: called on the coordinator once every rank's files exist.
Commit = Callable[[dict[str, Any], dict[str, dict[str, Any]]], None]


def unwrap(exc: BaseException) -> BaseException:
    """The error a rank raised inside DCP, out of DCP's ``CheckpointException`` (a ckptsdk one first)."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return exc
    found = [pair[0] for _rank, pair in sorted(failures.items())]
    return next((e for e in found if isinstance(e, CkptError)), found[0])


def rank_file(rank: int) -> str:
    """The file a rank's DCP data goes to, inside the checkpoint folder."""
    return f"rank-{rank:05d}.safetensors"


class JsonSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with non-tensor entries encoded as JSON (never pickled).

    Args:
        staged: ``id(DTensor in the state dict)`` -> a copy of its local shard: DCP plans the
            DTensor's chunks from the DTensor and writes the copy's bytes (a background save's
            staging buffer; see :mod:`.snapshot`).
    """

    def __init__(self, *, staged: Mapping[int, torch.Tensor] | None = None) -> None:
        super().__init__()
        self._staged = dict(staged or {})

    def lookup_object(self, index: MetadataIndex) -> Any:
        if self._staged:
            buf = self._staged.get(id(self.state_dict.get(index.fqn)))
            if buf is not None:  # a DTensor with a plain local shard: that shard is the whole item
                return buf
        return super().lookup_object(index)

    def transform_object(self, write_item: Any, object: Any) -> Any:  # noqa: A002 (DCP's name)
        if write_item.type != WriteItemType.BYTE_IO:
            return object
        tensors, skeleton = codec.encode(object)
        if tensors:
            raise UnsupportedStateError(
                f"state entry {write_item.index.fqn!r} is a non-tensor value holding tensors; put "
                "the tensors directly in the state dict",
                path=write_item.index.fqn,
                type_name=type(object).__name__,
            )
        return io.BytesIO(_JSON_MAGIC + json.dumps(skeleton, allow_nan=False).encode("utf-8"))


class JsonLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries back from JSON (never unpickled)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raw = value.read()
        fqn = read_item.dest_index.fqn
        if not raw.startswith(_JSON_MAGIC):
            raise CorruptCheckpointError(
                f"state entry {fqn!r} is not ckptsdk JSON; refusing to read it (it may be a pickle)", key=fqn
            )
        obj = codec.decode(json.loads(raw[len(_JSON_MAGIC) :].decode("utf-8")), {})
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class CkptStorageWriter(StorageWriter):
    """Write a DCP save into ``folder`` of ``backend``: one verified safetensors file per rank.

    Args:
        backend: the checkpoint root.
        folder: the checkpoint folder (the manager names it; unique per writer).
        commit: called on the coordinator in ``finish()`` with the DCP metadata as JSON and
            ``{file: {"size", "digest", "algorithm"}}``; what it publishes is the commit.
        verify: called on every rank at the end of ``write_data``, once its file is written;
            raising there fails the save on every rank before the commit (DCP gathers the
            ranks' write results first): a background save's check of the pipelined rule.

    Example (on every rank, with torch.distributed initialised)::

        dcp.save(sd, storage_writer=CkptStorageWriter(b, "step-0000000010.e1", commit=fn),
                 planner=JsonSavePlanner())
    """

    def __init__(
        self, backend: Backend, folder: str, *, commit: Commit, verify: Callable[[], None] | None = None
    ) -> None:
        super().__init__()
        self.backend = backend
        self.folder = folder
        self._commit = commit
        self._verify = verify
        self.is_coordinator = False
        #: the exception ``commit`` raised, if any (DCP wraps it; the manager re-raises this one).
        self.commit_error: BaseException | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        self.commit_error = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Plans arrive in rank order: each rank writes the file named after its rank.
        return [dataclasses.replace(p, storage_data=rank_file(i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name_of_file = plan.storage_data
        counts = Counter(item.index.fqn for item in plan.items)
        tensors: dict[str, torch.Tensor] = {}
        placed: list[tuple[Any, str, int]] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            fqn = item.index.fqn
            # A rank holding several chunks of one entry names them by offset.
            name = fqn if counts[fqn] == 1 else f"{fqn}@{','.join(map(str, item.index.offset or ()))}"
            if item.type == WriteItemType.BYTE_IO:
                # resolve_data returns BytesIO for BYTE_IO items and a tensor otherwise.
                raw = cast(io.BytesIO, data).getvalue()
                if not raw.startswith(_JSON_MAGIC):
                    raise UnsupportedStateError(
                        f"state entry {fqn!r} arrived pickled; save with "
                        "ckptsdk.distributed.JsonSavePlanner (the manager does)",
                        path=fqn,
                        type_name="bytes",
                    )
                t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            else:
                t = cast(torch.Tensor, data).detach()
                if t.device.type != "cpu":
                    t = t.cpu()
            tensors[name] = t
            placed.append((item.index, name, t.numel() * t.element_size()))
        results: list[WriteResult] = []
        if tensors:
            size, digest = write_tensorfile(self.backend, f"{self.folder}/{name_of_file}", tensors)
            for index, name, nbytes in placed:
                results.append(
                    WriteResult(
                        index=index,
                        size_in_bytes=nbytes,
                        storage_data={
                            "file": name_of_file,
                            "name": name,
                            "size": size,
                            "digest": digest,
                            "algorithm": DIGEST_ALGORITHM,
                        },
                    )
                )
        if self._verify is not None:
            self._verify()  # last: an edit made while this rank wrote is still seen
        fut: Future[list[WriteResult]] = Future()  # DCP waits on torch futures
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, dict[str, Any]] = {}
        storage: dict[MetadataIndex, dict[str, str]] = {}
        for per_rank in results:
            for wr in per_rank:
                sd = wr.storage_data
                files[sd["file"]] = {"size": sd["size"], "digest": sd["digest"], "algorithm": sd["algorithm"]}
                storage[wr.index] = {"file": sd["file"], "name": sd["name"]}
        metadata.storage_data = storage
        try:
            self._commit(metadata_to_json(metadata), files)
        except BaseException as exc:
            self.commit_error = exc
            raise

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.folder)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never picked by DCP from a bare path: the manager constructs it


class CkptStorageReader(StorageReader):
    """Read a DCP checkpoint that :class:`CkptStorageWriter` wrote, verifying every file first.

    Args:
        backend: the checkpoint root.
        folder: the checkpoint folder.
        metadata: the DCP metadata (from the manifest's JSON; see :mod:`.metadata`).
        files: ``{file: {"size", "digest", "algorithm"}}`` from the manifest.
    """

    def __init__(
        self, backend: Backend, folder: str, *, metadata: Metadata, files: Mapping[str, Mapping[str, Any]]
    ) -> None:
        super().__init__()
        self.backend = backend
        self.folder = folder
        self.metadata = metadata
        self.files = dict(files)
        self._storage: dict[MetadataIndex, dict[str, str]] = dict(metadata.storage_data or {})

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._storage = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _read_file(self, name: str) -> dict[str, torch.Tensor]:
        entry = self.files.get(name)
        if entry is None:
            raise CorruptCheckpointError(
                f"{self.backend.url}/{self.folder}: the manifest lists no "
                f"digest for {name!r}; the checkpoint cannot be verified",
                url=self.backend.url,
                key=f"{self.folder}/{name}",
            )
        return read_tensorfile(
            self.backend,
            f"{self.folder}/{name}",
            size=entry["size"],
            digest=entry["digest"],
            algorithm=entry["algorithm"],
        )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self._storage[item.storage_index]["file"], []).append(item)
        for name, items in per_file.items():
            tensors = self._read_file(name)  # whole file, digest checked before use
            for req in items:
                stored = tensors[self._storage[req.storage_index]["name"]]
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(stored.numpy().tobytes()))
                    continue
                for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                    stored = stored.narrow(dim, start, length)
                target = planner.resolve_tensor(req).detach()
                if target.size() != stored.size():
                    raise CorruptCheckpointError(
                        f"{self.backend.url}/{self.folder}/{name}: {req.storage_index.fqn} has shape "
                        f"{tuple(stored.size())} where {tuple(target.size())} is expected",
                        url=self.backend.url,
                        key=f"{self.folder}/{name}",
                    )
                target.copy_(stored)
                planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False
