"""Tensor files: the safetensors layout written straight from tensor memory, read back verified.

One file holds every tensor of a checkpoint, byte-for-byte what safetensors' own ``save`` would
produce, plus a content digest of the whole file computed while the storage is busy syncing.
Nothing here knows about manifests, state trees or leases; pinned staging lives in ``staging.py``.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import struct
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import xxhash

from .backends.base import Backend
from .errors import ConfigError, CorruptCheckpointError, ObjectNotFound

logger = logging.getLogger(__name__)

__all__ = ["DIGEST_ALGORITHM", "ALGORITHMS", "HeaderEntry", "write_tensorfile", "read_header", "read_tensorfile",
           "verify_file"]

#: The digest every new tensor file gets: a few percent of a disk write, where sha256 costs ~0.9x.
DIGEST_ALGORITHM = "xxh3-128"
#: Digests a manifest may name (older or foreign manifests may say sha256).
ALGORITHMS = ("xxh3-128", "sha256")

# Reads go in chunks of this size: big enough for one syscall (or one ranged GET) to be cheap,
# small enough that each chunk is hashed while it is still in the CPU cache.
_READ_CHUNK = 8 << 20
# Tensors bigger than this go to the backend as slices of their own memory (no copy); smaller
# ones are packed into one buffer so a ResNet's hundreds of tiny BN tensors are not hundreds of
# syscalls. Slicing the big ones keeps each chunk a bounded size for streaming uploads.
_SMALL_TENSOR = 64 << 10
_PACK_CHUNK = 1 << 20
_MAX_CHUNK = 16 << 20
# safetensors refuses headers larger than this; so do we (a torn length prefix must not make us
# try to parse gigabytes as JSON).
_MAX_HEADER = 100_000_000
# Bounds on what a header may describe, whatever the file: torch's own limits on dimensions, and
# sizes whose int64 arithmetic cannot overflow.
_MAX_DIMS = 64
_MAX_NBYTES = 1 << 62

# safetensors dtype names, in the order safetensors' own writer sorts tensors (its Rust Dtype
# enum, descending; then by name). Matching it makes our files byte-identical to theirs.
_DTYPE_ORDER: tuple[tuple[str, str], ...] = (
    ("U64", "uint64"),
    ("I64", "int64"),
    ("F64", "float64"),
    ("C64", "complex64"),
    ("F32", "float32"),
    ("U32", "uint32"),
    ("I32", "int32"),
    ("BF16", "bfloat16"),
    ("F16", "float16"),
    ("U16", "uint16"),
    ("I16", "int16"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E8M0", "float8_e8m0fnu"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("I8", "int8"),
    ("U8", "uint8"),
    ("BOOL", "bool"),
)
_TO_NAME: dict[torch.dtype, str] = {}
_FROM_NAME: dict[str, torch.dtype] = {}
_RANK: dict[str, int] = {}
for _rank, (_name, _attr) in enumerate(_DTYPE_ORDER):
    _dt = getattr(torch, _attr, None)
    if _dt is not None:  # older torch lacks some float8 / unsigned types
        _TO_NAME[_dt] = _name
        _FROM_NAME[_name] = _dt
        _RANK[_name] = _rank

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships wheels for
    raise ImportError("ckptsdk tensor files are little-endian; this platform is big-endian")


def _new_hasher(algorithm: str) -> Any:
    if algorithm == "xxh3-128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ConfigError(
        f"unknown digest algorithm {algorithm!r}; this ckptsdk knows {', '.join(ALGORITHMS)}. "
        "A manifest naming another one was written by a newer ckptsdk: upgrade to read it"
    )


def _byte_view(t: torch.Tensor) -> memoryview:
    """A flat byte view of a CPU contiguous tensor's own memory (no copy; keeps ``t`` alive)."""
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


class _Plan:
    """What will be written: the header bytes and, per tensor in file order, its tensor."""

    def __init__(self, header: bytes, tensors: list[torch.Tensor], data_size: int) -> None:
        self.header = header
        self.tensors = tensors
        self.size = len(header) + data_size
        # The fast path hashes after the writes, from the tensors' own memory; that is only
        # possible when every tensor's bytes exist as-is on the CPU (no per-tensor temporary).
        self.zero_copy = all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _plan(key: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> _Plan:
    entries: list[tuple[int, str, torch.Tensor, str]] = []
    for name, t in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ConfigError(f"tensor file {key!r}: tensor name {name!r} must be a str other than '__metadata__'")
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"tensor file {key!r}: {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise ConfigError(
                f"tensor file {key!r}: {name!r} is a {t.layout} / quantized / meta tensor; only dense "
                "strided tensors can be saved (call .to_dense() or dequantize it first)"
            )
        dname = _TO_NAME.get(t.dtype)
        if dname is None:
            raise ConfigError(
                f"tensor file {key!r}: {name!r} has dtype {t.dtype}, which safetensors cannot store; "
                f"supported: {', '.join(str(d) for d in _TO_NAME)}"
            )
        t = t.detach().resolve_conj().resolve_neg()
        entries.append((_RANK[dname], name, t, dname))
    entries.sort(key=lambda e: (e[0], e[1]))

    header: dict[str, Any] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ConfigError(f"tensor file {key!r}: metadata must map str to str, got {metadata!r}")
        header["__metadata__"] = dict(metadata)
    offset = 0
    ordered: list[torch.Tensor] = []
    for _, name, t, dname in entries:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": dname, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        ordered.append(t)
    # serde_json's compact form, which safetensors writes: no spaces, UTF-8 kept as is.
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)  # pad so the data section starts 8-byte aligned
    return _Plan(struct.pack("<Q", len(text)) + text, ordered, offset)


def _chunks(plan: _Plan, digest: _Digest) -> Iterator[memoryview]:
    """Yield the file as memoryviews, then hand them to ``digest.finish``.

    The consumer (a backend's ``write``) asks for the next chunk only after writing the previous
    one, so code after the last ``yield`` runs exactly when every byte has been written and the
    backend is about to fsync or finish the upload: the moment to start hashing in parallel.
    """
    emitted: list[memoryview] = []
    pack = bytearray()

    def emit(view: memoryview) -> memoryview:
        if digest.inline:
            digest.hasher.update(view)
        else:
            emitted.append(view)
        return view

    pack += plan.header
    for t in plan.tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            continue
        if t.device.type != "cpu":
            t = t.to("cpu")  # one tensor at a time: peak extra memory is the largest tensor
        if not t.is_contiguous():
            t = t.contiguous()
        view = _byte_view(t)
        if nbytes < _SMALL_TENSOR:
            pack += view
            if len(pack) < _PACK_CHUNK:
                continue
            view, nbytes = memoryview(pack), len(pack)
            # A fresh buffer each time: a backend may keep chunks (e.g. to retry an upload).
            pack = bytearray()
        elif pack:
            yield emit(memoryview(pack))
            pack = bytearray()
        for start in range(0, nbytes, _MAX_CHUNK):
            yield emit(view[start : start + _MAX_CHUNK])
    if pack:
        yield emit(memoryview(pack))
    digest.finish(emitted)


class _Digest:
    """The file digest: hashed inline (slow path) or in a thread started after the last write."""

    def __init__(self, *, inline: bool) -> None:
        self.hasher = xxhash.xxh3_128()
        # Inline when some tensor is copied per chunk (GPU, non-contiguous): its copy is gone
        # after the write, so it must be hashed before. Otherwise hash later, off the write path:
        # hashing in a thread *during* the writes caused 200 ms outliers on a 2-core VM.
        self.inline = inline
        self.thread: threading.Thread | None = None
        self.finished = False
        self.error: BaseException | None = None

    def finish(self, emitted: list[memoryview]) -> None:
        self.finished = True
        if emitted:
            self.thread = threading.Thread(target=self._run, args=(emitted,), name="ckptsdk-digest", daemon=True)
            self.thread.start()

    def _run(self, chunks: list[memoryview]) -> None:
        try:
            for chunk in chunks:
                self.hasher.update(chunk)
        except BaseException as exc:  # re-raised by result(): a thread cannot raise to its caller
            self.error = exc

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def result(self) -> str:
        self.join()
        if self.error is not None:
            raise self.error
        return self.hasher.hexdigest()


def write_tensorfile(
    backend: Backend, key: str, tensors: Mapping[str, torch.Tensor], *, metadata: Mapping[str, str] | None = None
) -> tuple[int, str]:
    """Write ``tensors`` to ``key`` as a safetensors file, streamed from the tensors' memory.

    The bytes are exactly what safetensors' own ``save(tensors, metadata)`` produces (for at
    most one metadata entry; safetensors orders several at random), so any safetensors reader
    loads the file. CPU contiguous tensors are written from their own memory without a copy, and
    the digest is computed from that memory while the backend syncs; GPU or non-contiguous
    tensors are copied one at a time. The tensors must not change until this returns (stage
    them with :class:`ckptsdk.staging.Stager` to keep training meanwhile).

    Args:
        backend: where to write; its ``write`` publishes the file atomically.
        key: the object key, e.g. ``"step-0000000100.e1/tensors.safetensors"``.
        tensors: name -> dense tensor (any device, any safetensors dtype; 0-d and empty too).
        metadata: optional str -> str map, stored as the header's ``__metadata__``.

    Returns:
        ``(size, hexdigest)``: the file's size in bytes and its ``DIGEST_ALGORITHM`` digest.

    Raises:
        ConfigError: a name, dtype, layout or metadata value safetensors cannot store.
        BackendError: the write failed (the previous object at ``key``, if any, is intact).
        CorruptCheckpointError: the backend reports a size other than the bytes streamed.

    Example:
        >>> b = open_backend("memory://demo")
        >>> size, digest = write_tensorfile(b, "t.safetensors", {"w": torch.ones(2)})
        >>> read_tensorfile(b, "t.safetensors", size=size, digest=digest)["w"]
        tensor([1., 1.])
    """
    plan = _plan(key, tensors, metadata)
    digest = _Digest(inline=not plan.zero_copy)
    try:
        info = backend.write(key, _chunks(plan, digest))
    finally:
        digest.join()  # never leave a thread reading tensor memory behind an exception
    if not digest.finished:
        raise CorruptCheckpointError(
            f"the backend at {backend.url} returned from writing {key!r} without consuming every chunk; "
            "the object may be incomplete. This is a backend bug: report it",
            url=backend.url, key=key,
        )
    if info.size != plan.size:
        raise CorruptCheckpointError(
            f"wrote {plan.size} bytes to {key!r} at {backend.url} but the backend reports {info.size}; "
            "the storage may be failing, try again or use another location",
            url=backend.url, key=key,
        )
    hexdigest = digest.result()
    logger.debug("wrote %s (%d bytes, %d tensors, xxh3-128 %s)", key, plan.size, len(plan.tensors), hexdigest)
    return plan.size, hexdigest


def _corrupt(backend: Backend, key: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"tensor file {key!r} at {backend.url} is corrupt: {why}. Restore an earlier checkpoint "
        "(CheckpointManager.restore skips corrupt ones) or re-save it",
        url=backend.url, key=key,
    )


def _open(backend: Backend, key: str) -> Any:
    try:
        f = backend.open(key)
    except ObjectNotFound as exc:
        raise _corrupt(backend, key, "the file is missing") from exc
    try:
        # Tell the kernel the whole file is wanted in order: doubles readahead on Linux.
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except (AttributeError, OSError, ValueError):
        pass  # not a local file (GCS, memory): nothing to advise
    return f


class _Reader:
    """Sequential reads of one file through a hasher, checking its size and digest at the end."""

    def __init__(self, backend: Backend, key: str, f: Any, size: int, digest: str, algorithm: str) -> None:
        self.backend, self.key, self.f = backend, key, f
        self.size, self.digest, self.algorithm = size, digest, algorithm
        self.hasher = _new_hasher(algorithm)
        self.pos = 0
        self._scratch: memoryview | None = None

    def scratch(self, n: int) -> memoryview:
        """A reusable uninitialised buffer of at least ``n`` bytes (n <= _READ_CHUNK)."""
        if self._scratch is None:
            self._scratch = memoryview(torch.empty(max(1, min(self.size, _READ_CHUNK)), dtype=torch.uint8).numpy())
        return self._scratch[:n]

    def read_into(self, dest: memoryview) -> None:
        """Fill ``dest`` from the file in chunks, hashing each chunk as it arrives."""
        total = len(dest)
        if self.pos + total > self.size:
            raise _corrupt(self.backend, self.key, f"the header points past the {self.size} bytes of the file")
        done = 0
        while done < total:
            window = dest[done : done + min(_READ_CHUNK, total - done)]
            got = self.f.readinto(window)
            if not got:
                raise _corrupt(self.backend, self.key,
                               f"truncated: {self.pos + done} bytes where the manifest says {self.size}")
            self.hasher.update(window[:got])
            done += got
        self.pos += total

    def read_bytes(self, n: int) -> bytes:
        out = bytearray(n)
        self.read_into(memoryview(out))
        return bytes(out)

    def finish(self) -> None:
        """Hash whatever is left, then check the size and the digest."""
        while self.pos < self.size:
            self.read_into(self.scratch(min(_READ_CHUNK, self.size - self.pos)))
        if self.f.read(1):
            raise _corrupt(self.backend, self.key, f"longer than the {self.size} bytes the manifest records")
        actual = self.hasher.hexdigest()
        if actual != self.digest.lower():
            raise _corrupt(self.backend, self.key,
                           f"{self.algorithm} digest {actual} differs from the recorded {self.digest}")


def verify_file(backend: Backend, key: str, *, size: int, digest: str, algorithm: str = DIGEST_ALGORITHM) -> None:
    """Check that ``key`` has exactly ``size`` bytes with the given digest, reading it once.

    Args:
        backend: where the file is.
        key: the object key.
        size: the size recorded in the manifest.
        digest: the hex digest recorded in the manifest.
        algorithm: ``"xxh3-128"`` or ``"sha256"``, as the manifest names it.

    Raises:
        CorruptCheckpointError: missing, truncated, too long, or a different digest.
        ConfigError: an unknown digest algorithm.
        BackendError: the storage failed while reading.
    """
    _new_hasher(algorithm)  # reject an unknown algorithm before any I/O
    with _open(backend, key) as f:
        _Reader(backend, key, f, size, digest, algorithm).finish()


class _Entry:
    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name: str, dtype: torch.dtype, shape: list[int], begin: int, end: int) -> None:
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end


def _parse_header(backend: Backend, key: str, raw: bytes, data_len: int) -> list[_Entry]:
    """The header's tensors in file order, checked to tile the data section exactly.

    ``data_len`` must be what the file really holds after the header: every check below is
    against it, so nothing a header says can make a reader allocate more than the file's size.
    """
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _corrupt(backend, key, f"the header is not valid JSON ({str(exc)[:200]})") from exc
    if not isinstance(header, dict):
        raise _corrupt(backend, key, "the header is not a JSON object")
    header.pop("__metadata__", None)
    entries: list[_Entry] = []
    for name, entry in header.items():
        try:
            dtype = _FROM_NAME[entry["dtype"]]
            shape = entry["shape"]
            begin, end = entry["data_offsets"]
            if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
                raise ValueError(f"shape must be a list of at most {_MAX_DIMS} dimensions")
            if not all(type(v) is int and v >= 0 for v in [*shape, begin, end]):
                raise ValueError("negative or non-integer shape/offset")
            # Zero-element tensors allocate nothing but their sizes must not overflow torch's
            # int64 size arithmetic either.
            if math.prod(d for d in shape if d) * dtype.itemsize > _MAX_NBYTES:
                raise ValueError("dimensions too large")
        except (KeyError, TypeError, ValueError) as exc:
            raise _corrupt(backend, key, f"malformed header entry for {name!r}: {str(entry)[:200]}") from exc
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or end > data_len:
            raise _corrupt(backend, key, f"tensor {name!r} spans bytes [{begin}, {end}) of {data_len}, "
                           f"but {entry['dtype']}{shape} needs {nbytes}")
        entries.append(_Entry(name, dtype, shape, begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    pos = 0
    for e in entries:
        if e.begin != pos:
            raise _corrupt(backend, key, f"tensor {e.name!r} starts at byte {e.begin}, expected {pos} (gap or overlap)")
        pos = e.end
    if pos != data_len:
        raise _corrupt(backend, key, f"the header covers {pos} data bytes but the file has {data_len}")
    return entries


def _read_entries(reader: _Reader, entries: list[_Entry]) -> dict[str, torch.Tensor]:
    """Read the data section straight into one fresh tensor per entry, in file order."""
    out: dict[str, torch.Tensor] = {}
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

    for e in entries:
        # torch.empty per tensor: no zero-fill pass, each tensor owns aligned memory at offset 0
        # (torch.set_rng_state segfaults on a view at a non-zero storage offset), and dropping
        # one tensor frees it without keeping a whole-file buffer alive.
        t = torch.empty(e.shape, dtype=e.dtype)
        out[e.name] = t
        n = e.end - e.begin
        if n == 0:
            continue
        view = _byte_view(t)
        if n >= _SMALL_TENSOR:
            flush()
            reader.read_into(view)  # large sequential reads straight into the tensor's memory
        else:
            if pending + n > _READ_CHUNK:
                flush()
            views.append((view, n))
            pending += n
    flush()
    return out


def _size_of(backend: Backend, key: str, f: Any) -> int:
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


class HeaderEntry:
    """One tensor as a tensor file's header describes it (checked against the file's size)."""

    __slots__ = ("name", "dtype", "code", "shape", "nbytes")

    def __init__(self, name: str, dtype: torch.dtype, code: str, shape: list[int], nbytes: int) -> None:
        self.name, self.dtype, self.code, self.shape, self.nbytes = name, dtype, code, shape, nbytes


def read_header(backend: Backend, key: str) -> list[HeaderEntry]:
    """The tensors a tensor file holds (name, dtype, shape, bytes), reading only its header.

    The same checks as :func:`read_tensorfile` (header length and every entry bounded by the
    file's real size, entries tiling the data exactly); the data is not read or hashed.

    Raises:
        CorruptCheckpointError: missing, too short, or a malformed or inconsistent header.
        BackendError: the storage failed while reading.
    """
    with _open(backend, key) as f:
        size = _size_of(backend, key, f)
        head = f.read(8) if size >= 8 else b""
        if len(head) != 8:
            raise _corrupt(backend, key, f"only {size} bytes, shorter than the 8-byte header length")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > min(_MAX_HEADER, size - 8):
            raise _corrupt(backend, key, f"header length {hlen} exceeds the file ({size} bytes)")
        raw = f.read(hlen)
        if len(raw) != hlen:
            raise _corrupt(backend, key, f"truncated header: {len(raw)} of {hlen} bytes")
    entries = _parse_header(backend, key, raw, size - 8 - hlen)
    return [HeaderEntry(e.name, e.dtype, _TO_NAME[e.dtype], list(e.shape), e.end - e.begin) for e in entries]


def read_tensorfile(
    backend: Backend, key: str, *, size: int, digest: str, algorithm: str = DIGEST_ALGORITHM
) -> dict[str, torch.Tensor]:
    """Read and verify a tensor file, returning its tensors (on the CPU, independent of the file).

    The data is read with large sequential reads straight into each tensor's uninitialised
    memory and hashed chunk by chunk as it arrives; nothing is mapped, and nothing is returned
    unless the size and the digest of the whole file match.

    Args:
        backend: where the file is.
        key: the object key.
        size: the size recorded in the manifest.
        digest: the hex digest recorded in the manifest.
        algorithm: ``"xxh3-128"`` (what ``write_tensorfile`` produces) or ``"sha256"``.

    Returns:
        name -> tensor, in file order; each tensor owns its memory.

    Raises:
        CorruptCheckpointError: missing, truncated, too long, different digest or a malformed
            header; the message names the key and why.
        ConfigError: an unknown digest algorithm, or a negative size.
        BackendError: the storage failed while reading.
    """
    _new_hasher(algorithm)
    if type(size) is not int or size < 0:
        raise ConfigError(f"size for {key!r} must be a non-negative int, got {size!r}")
    with _open(backend, key) as f:
        actual = _size_of(backend, key, f)
        if actual != size:
            # Before anything is read or allocated: the header is then bounded by a real size.
            raise _corrupt(backend, key, f"truncated: {actual} bytes where the manifest says {size}"
                           if actual < size else f"longer than the {size} bytes the manifest records "
                           f"(it has {actual})")
        reader = _Reader(backend, key, f, size, digest, algorithm)
        try:
            if size < 8:
                raise _corrupt(backend, key, f"only {size} bytes, shorter than the 8-byte header length")
            (hlen,) = struct.unpack("<Q", reader.read_bytes(8))
            if hlen > min(_MAX_HEADER, size - 8):
                raise _corrupt(backend, key, f"header length {hlen} exceeds the file ({size} bytes)")
            entries = _parse_header(backend, key, reader.read_bytes(hlen), size - 8 - hlen)
        except CorruptCheckpointError:
            # A damaged header is usually a damaged file: report the digest if that differs,
            # and the header's own problem only for a file that is what was written.
            reader.finish()
            raise
        tensors = _read_entries(reader, entries)
        reader.finish()
    return tensors
