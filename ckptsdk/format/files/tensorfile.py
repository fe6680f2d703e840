"""Tensor files: reading a safetensors file back verified, and the one parser of its header.

A checkpoint's tensors are one safetensors file (written by tensorwriter.py; ``write_tensorfile``
is also importable from here, loaded on first use, so that ``ckptsdk.format.files.tensorfile`` is the
whole API without importing torch at import time), plus a content digest of the whole file that every
read checks (through hashedread.py). Nothing here knows about manifests, state trees or leases;
the dtype table is dtype.py's and the digest table digest.py's. torch is imported only to make tensors (reading,
writing): checking a header and re-hashing a file, as ``ckptsdk show``/``verify`` do, need none.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from ckptsdk.backends.base import Backend
from ckptsdk.errors import CheckpointTooLargeError, CkptError, ConfigError, CorruptCheckpointError
from ckptsdk.format.digest import CHECKPOINT_ALGORITHMS, DEFAULT, new_hasher
from ckptsdk.format.dtype import BY_CODE, byte_view, to_torch
from ckptsdk.format.files.hashedread import HashedReader, corrupt, open_file, verify_file
from ckptsdk.format.files.memory import advise_huge_pages, available_memory, describe_size

if TYPE_CHECKING:
    import torch

    from ckptsdk.format.files.tensorwriter import write_tensorfile as write_tensorfile  # for type checkers

# write_tensorfile is not listed: it resolves lazily (__getattr__ below), which pdoc cannot follow.
__all__ = ["HeaderEntry", "TensorFile", "open_tensorfile", "read_header", "read_tensorfile", "verify_file"]

# Tensors at least this big are read straight into their own memory; smaller ones share one read.
_SMALL_TENSOR = 64 << 10
# safetensors refuses headers larger than this; so do we (a torn length prefix must not make us
# try to parse gigabytes as JSON).
_MAX_HEADER = 100_000_000
# Bounds on what a header may describe, whatever the file: torch's own limits on dimensions, and
# sizes whose int64 arithmetic cannot overflow.
_MAX_DIMS = 64
_MAX_NBYTES = 1 << 62


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One tensor as a tensor file's header describes it (checked against the file's size).

    Attributes:
        name: the tensor's key in the file.
        code: its safetensors dtype code (``"F32"``).
        shape: its shape.
        begin: where its bytes start, counted from the end of the header.
        end: where they end (exclusive).
    """

    name: str
    code: str
    shape: list[int]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""
        return self.end - self.begin

    @property
    def dtype(self) -> torch.dtype | None:
        """Its torch dtype (imports torch), or None if this torch build lacks it."""
        return to_torch(BY_CODE[self.code])


def _header(backend: Backend, key: str, size: int, read: Callable[[int], bytes]) -> list[HeaderEntry]:
    """The one safetensors header parser: its length, bounded, then its entries.

    ``size`` is the file's real size and ``read(n)`` returns exactly the next ``n`` bytes (or
    raises): nothing a header says can make a reader allocate more than the file holds.
    """
    if size < 8:
        raise corrupt(backend, key, f"only {size} bytes, shorter than the 8-byte header length")
    (hlen,) = struct.unpack("<Q", read(8))
    if hlen > min(_MAX_HEADER, size - 8):
        raise corrupt(backend, key, f"header length {hlen} exceeds the file ({size} bytes)")
    return _entries(backend, key, read(hlen), size - 8 - hlen)


def _entries(backend: Backend, key: str, raw: bytes, data_len: int) -> list[HeaderEntry]:
    """The header's tensors in file order, checked to tile the ``data_len`` data bytes exactly."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise corrupt(backend, key, f"the header is not valid JSON ({str(exc)[:200]})") from exc
    if not isinstance(header, dict):
        raise corrupt(backend, key, "the header is not a JSON object")
    header.pop("__metadata__", None)
    entries: list[HeaderEntry] = []
    for name, entry in header.items():
        try:
            code = entry["dtype"]
            itemsize = BY_CODE[code].itemsize
            shape = entry["shape"]
            begin, end = entry["data_offsets"]
            if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
                raise ValueError(f"shape must be a list of at most {_MAX_DIMS} dimensions")
            if not all(type(v) is int and v >= 0 for v in [*shape, begin, end]):
                raise ValueError("negative or non-integer shape/offset")
            # Zero-element tensors allocate nothing but their sizes must not overflow torch's
            # int64 size arithmetic either.
            if math.prod(d for d in shape if d) * itemsize > _MAX_NBYTES:
                raise ValueError("dimensions too large")
        except (KeyError, TypeError, ValueError) as exc:
            raise corrupt(backend, key, f"malformed header entry for {name!r}: {str(entry)[:200]}") from exc
        nbytes = math.prod(shape) * itemsize
        if end - begin != nbytes or end > data_len:
            raise corrupt(
                backend,
                key,
                f"tensor {name!r} spans bytes [{begin}, {end}) of {data_len}, "
                f"but {entry['dtype']}{shape} needs {nbytes}",
            )
        entries.append(HeaderEntry(name, code, shape, begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    pos = 0
    for e in entries:
        if e.begin != pos:
            raise corrupt(backend, key, f"tensor {e.name!r} starts at byte {e.begin}, expected {pos} (gap or overlap)")
        pos = e.end
    if pos != data_len:
        raise corrupt(backend, key, f"the header covers {pos} data bytes but the file has {data_len}")
    return entries


def _torch_holds(backend: Backend, key: str, entries: list[HeaderEntry]) -> None:
    """Raise if this torch build lacks a dtype of the file (checked here, not by the header
    parser, so that listing a header needs no torch)."""
    import torch

    for e in entries:
        if e.dtype is None:
            raise corrupt(
                backend,
                key,
                f"tensor {e.name!r} is {BY_CODE[e.code].name}, which torch "
                f"{torch.__version__} lacks; upgrade torch to read this file",
            )


def _fills_in_place(t: torch.Tensor | None, e: HeaderEntry) -> bool:
    """Whether entry ``e``'s bytes can be read straight into ``t``'s own memory as they are."""
    import torch

    return (
        t is not None
        and t.dtype == e.dtype
        and list(t.shape) == e.shape
        and t.device.type == "cpu"
        and t.layout is torch.strided
        and t.is_contiguous()
        and not (t.is_conj() or t.is_neg())  # their memory holds other values than they show
    )


class TensorFile:
    """A tensor file opened for reading, its header checked: :meth:`allocate`, then :meth:`fill`.

    Between the two a caller can look at the tensors' dtypes and shapes (restore decodes its
    tree and checks that it fits the live state before a data byte is read), and name live
    tensors the bytes go straight into. Made by :func:`open_tensorfile`.
    """

    def __init__(self, reader: HashedReader, entries: list[HeaderEntry]) -> None:
        self._reader, self.entries = reader, entries
        self._dest: list[tuple[HeaderEntry, torch.Tensor | None]] = []  # None: hashed, not kept

    def allocate(
        self,
        live: Mapping[str, torch.Tensor] | None = None,
        *,
        wanted: Collection[str] | None = None,
        besides: int = 0,
    ) -> dict[str, torch.Tensor]:
        """name -> the tensor each entry is read into: ``live[name]`` where its bytes can go
        straight into that tensor's memory (its dtype and shape, CPU, dense; given detached),
        else a fresh one.

        Args:
            live: tensors to read straight into, by name.
            wanted: the entries to keep (None: all). The others get no memory: :meth:`fill`
                hashes their bytes through the small scratch buffer (a shared file's tensors that
                this checkpoint no longer uses).
            besides: fresh bytes the caller takes for the other files of the same read, so that
                the memory check is of the whole read, not of each file alone.

        Raises:
            CheckpointTooLargeError: the fresh tensors exceed the memory this process can allocate.
        """
        import torch

        plan = self._plan(live, wanted)
        need = _fresh(plan)
        room = available_memory()
        if room is not None and need + besides > room:
            raise _too_large(self._reader, need, room, besides)
        dest: list[tuple[HeaderEntry, torch.Tensor | None]] = []
        try:
            for e, t, keep in plan:
                if keep and t is None:
                    # torch.empty per tensor: no zero-fill, aligned memory at offset 0 (set_rng_state
                    # segfaults on a view at another), freed alone (no whole-file buffer kept alive).
                    t = torch.empty(e.shape, dtype=e.dtype)
                    advise_huge_pages(t.data_ptr(), e.nbytes)
                dest.append((e, t))
        except RuntimeError as exc:  # torch's allocator said no after all (overcommit, another thread)
            raise _too_large(self._reader, need, available_memory() or 0, besides) from exc
        self._dest = dest
        return {e.name: t for e, t in dest if t is not None}

    def fresh_bytes(self, live: Mapping[str, torch.Tensor] | None = None, wanted: Collection[str] | None = None) -> int:
        """The bytes of fresh memory :meth:`allocate` with the same arguments takes."""
        return _fresh(self._plan(live, wanted))

    def _plan(
        self, live: Mapping[str, torch.Tensor] | None, wanted: Collection[str] | None
    ) -> list[tuple[HeaderEntry, torch.Tensor | None, bool]]:
        out = []
        for e in self.entries:
            t = (live or {}).get(e.name)
            out.append((e, t if _fills_in_place(t, e) else None, wanted is None or e.name in wanted))
        return out

    def fill(self) -> None:
        """Read the data section into the allocated tensors, in file order, and check the whole
        file's size and digest (CorruptCheckpointError: the live tensors given hold part of it)."""
        reader = self._reader
        views: list[tuple[memoryview, int]] = []  # small tensors waiting for one shared read
        pending = 0

        def flush() -> None:
            nonlocal pending
            if not views:
                return
            buf = reader.scratch(pending)
            reader.read_into(buf)
            at = 0
            for view, n in views:
                view[:] = buf[at : at + n]
                at += n
            views.clear()
            pending = 0

        for e, t in self._dest:
            n = e.nbytes
            if n == 0:
                continue
            if t is None:  # not wanted: hashed, not kept
                flush()
                reader.skip(n)
                continue
            view = byte_view(t)
            if n >= _SMALL_TENSOR or n > reader.chunk:  # (a chunk below 64 KiB: only tests shrink it so)
                flush()
                reader.read_into(view)  # large sequential reads straight into the tensor's memory
            else:
                if pending + n > reader.chunk:
                    flush()
                views.append((view, n))
                pending += n
        flush()
        reader.finish()


def _fresh(plan: list[tuple[HeaderEntry, torch.Tensor | None, bool]]) -> int:
    """The bytes of fresh memory a plan (``TensorFile._plan``) takes: kept entries with no live tensor."""
    return sum(e.nbytes for e, t, keep in plan if keep and t is None)


def _size_of(backend: Backend, key: str, f: BinaryIO) -> int:
    """The size of the open object ``f`` as the storage has it (not as a manifest says)."""
    try:
        return os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass
    try:
        end = f.seek(0, os.SEEK_END)
        f.seek(0)
        return int(end)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return backend.stat(key).size


def read_header(backend: Backend, key: str) -> list[HeaderEntry]:
    """The tensors a tensor file holds (name, dtype, shape, bytes), reading only its header.

    The same checks as :func:`read_tensorfile` (header length and every entry bounded by the
    file's real size, entries tiling the data exactly); the data is not read or hashed.

    Raises:
        CorruptCheckpointError: missing, too short, or a malformed or inconsistent header.
        BackendError: the storage failed while reading.
    """
    with open_file(backend, key) as f:

        def read(n: int) -> bytes:
            data = f.read(n)
            if len(data) != n:
                raise corrupt(backend, key, f"truncated header: {len(data)} of {n} bytes")
            return data

        return _header(backend, key, _size_of(backend, key, f), read)


def read_tensorfile(
    backend: Backend, key: str, *, size: int, digest: str, algorithm: str = DEFAULT
) -> dict[str, torch.Tensor]:
    """Read and verify a tensor file, returning its tensors (on the CPU, independent of the file).

    Large sequential reads straight into each tensor's uninitialised memory, hashed chunk by
    chunk as they arrive; nothing is mapped, nothing returned unless size and digest match.

    Args:
        backend: where the file is.
        key: the object key.
        size: the size recorded in the manifest.
        digest: the hex digest recorded in the manifest.
        algorithm: ``"xxh3-128"`` (what ``write_tensorfile`` produces) or ``"sha256"``
            (``digest.CHECKPOINT_ALGORITHMS``).

    Returns:
        name -> tensor, in file order; each tensor owns its memory.

    Raises:
        CorruptCheckpointError: missing, truncated, too long, different digest or a malformed
            header; the message names the key and why.
        CheckpointTooLargeError: the tensors verify but exceed the memory this process can
            allocate (checked before allocating; the message names both sizes).
        ConfigError: a digest algorithm a checkpoint file may not name, or a negative size.
        BackendError: the storage failed while reading.

    Example:
        >>> import torch
        >>> from ckptsdk import open_backend
        >>> from ckptsdk.format.files.tensorfile import write_tensorfile
        >>> b = open_backend("memory://read-demo")
        >>> size, digest = write_tensorfile(b, "t.safetensors", {"w": torch.arange(3)})
        >>> read_tensorfile(b, "t.safetensors", size=size, digest=digest)
        {'w': tensor([0, 1, 2])}
    """
    with open_tensorfile(backend, key, size=size, digest=digest, algorithm=algorithm) as tf:
        tensors = tf.allocate()
        tf.fill()
        return tensors


@contextmanager
def open_tensorfile(
    backend: Backend,
    key: str,
    *,
    size: int,
    digest: str,
    algorithm: str = DEFAULT,
    stream: BinaryIO | None = None,
) -> Iterator[TensorFile]:
    """The tensor file ``key`` open, its size and header checked (:func:`read_tensorfile`'s first
    half; the same arguments and errors): ``allocate()`` then ``fill()`` read and verify it.

    ``stream``: ``key`` already opened with ``hashedread.open_file`` (restore opens its files
    first to read them ahead); it is read from its start and closed on leaving, like one opened here.
    """
    new_hasher(algorithm, among=CHECKPOINT_ALGORITHMS)
    if type(size) is not int or size < 0:
        if stream is not None:
            stream.close()
        raise ConfigError(f"size for {key!r} must be a non-negative int, got {size!r}")
    with stream if stream is not None else open_file(backend, key) as f:
        actual = _size_of(backend, key, f)
        if actual != size:
            # Before anything is read or allocated: the header is then bounded by a real size.
            raise corrupt(
                backend,
                key,
                f"truncated: {actual} bytes where the manifest says {size}"
                if actual < size
                else f"longer than the {size} bytes the manifest records (it has {actual})",
            )
        reader = HashedReader(backend, key, f, size, digest, algorithm)
        try:
            entries = _header(backend, key, size, reader.read_bytes)
            _torch_holds(backend, key, entries)
        except CorruptCheckpointError:
            # A damaged header is usually a damaged file: report the digest if that differs,
            # and the header's own problem only for a file that is what was written.
            reader.finish()
            raise
        yield TensorFile(reader, entries)


def __getattr__(name: str) -> Any:
    # write_tensorfile is part of this module's API but imports torch: loaded on first use.
    if name == "write_tensorfile":
        from ckptsdk.format.files.tensorwriter import write_tensorfile

        return write_tensorfile
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _too_large(reader: HashedReader, need: int, room: int, besides: int = 0) -> CkptError:
    """The error for tensors that do not fit, decided without allocating them.

    The rest of the file is hashed through the small scratch buffer first: a torn copy (a
    sparse file whose header and manifest agree on 100 GB, the digest stale) is corrupt, and
    restore falls back; only verified bytes make the "too large" error.
    """
    reader.finish()  # raises CorruptCheckpointError when the bytes are not what was written
    return CheckpointTooLargeError(
        f"tensor file {reader.key!r} at {reader.backend.url} holds {describe_size(need)} of tensors"
        + (f" ({describe_size(need + besides)} with the checkpoint's other files)" if besides else "")
        + ", but this "
        f"process can allocate only {describe_size(room)} now (RAM and swap, cgroup, ulimit -v); its bytes verify, "
        "so it is not corrupt. "
        "Free memory, or restore on a machine with more",
        url=reader.backend.url,
        key=reader.key,
        needed=need + besides,
        available=room,
    )
