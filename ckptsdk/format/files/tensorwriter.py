"""Writing a tensor file: the safetensors layout streamed straight from tensor memory, hashed.

The file is byte-for-byte what safetensors' own ``save`` would produce; its digest is computed
while the storage is busy syncing. Reading and checking a tensor file (and its header) belong to
tensorfile.py, which also re-exports ``write_tensorfile``; pinned staging lives in staging.py.
"""

from __future__ import annotations

import json
import logging
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ckptsdk.backends.base import Writable
from ckptsdk.errors import ConfigError, CorruptCheckpointError
from ckptsdk.format.digest import DEFAULT, Hasher, new_hasher
from ckptsdk.format.dtype import TABLE, byte_view, of_torch, to_torch

logger = logging.getLogger(__name__)

__all__ = ["write_tensorfile"]

# Tensors bigger than this go to the backend as slices of their own memory (no copy); smaller
# ones are packed into one buffer so a ResNet's hundreds of tiny BN tensors are not hundreds of
# syscalls. Slicing the big ones keeps each chunk a bounded size for streaming uploads.
_SMALL_TENSOR = 64 << 10
_PACK_CHUNK = 1 << 20
_MAX_CHUNK = 16 << 20
# The digest thread hashes in slices of this size, calling ``pause`` before each (~0.5-1 ms of
# hashing on a small VM): a background save's hash gives way to the optimizer step at that grain.
_HASH_SLICE = 4 << 20

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships wheels for
    raise ImportError("ckptsdk tensor files are little-endian; this platform is big-endian")


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
        entry = of_torch(t.dtype)
        if entry is None:
            supported = [str(dt) for dt in map(to_torch, TABLE) if dt is not None]
            raise ConfigError(
                f"tensor file {key!r}: {name!r} has dtype {t.dtype}, which safetensors cannot store; "
                f"supported: {', '.join(supported)}"
            )
        t = t.detach().resolve_conj().resolve_neg()
        entries.append((entry.rank, name, t, entry.code))
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
        view = byte_view(t)
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

    def __init__(self, *, inline: bool, pause: Callable[[], None] | None = None) -> None:
        self.hasher: Hasher = new_hasher(DEFAULT)
        self.pause = pause
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
                for start in range(0, len(chunk), _HASH_SLICE):
                    if self.pause is not None:
                        self.pause()
                    self.hasher.update(chunk[start : start + _HASH_SLICE])
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
    backend: Writable,
    key: str,
    tensors: Mapping[str, torch.Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
    pause: Callable[[], None] | None = None,
) -> tuple[int, str]:
    """Write ``tensors`` to ``key`` as a safetensors file, streamed from the tensors' memory.

    The bytes are exactly what safetensors' own ``save(tensors, metadata)`` produces (for at
    most one metadata entry; safetensors orders several at random), so any safetensors reader
    loads the file. CPU contiguous tensors are written from their own memory without a copy, and
    the digest is computed from that memory while the backend syncs; GPU or non-contiguous
    tensors are copied one at a time. The tensors must not change until this returns (stage
    them with :class:`ckptsdk.checkpoint.writing.staging.Stager` to keep training meanwhile).

    Args:
        backend: where to write (a backend, or anything with its ``write`` and ``url``); a
            backend's ``write`` publishes the file atomically.
        key: the object key, e.g. ``"step-0000000100.e1/tensors.safetensors"``.
        tensors: name -> dense tensor (any device, any safetensors dtype; 0-d and empty too).
        metadata: optional str -> str map, stored as the header's ``__metadata__``.
        pause: called on the digest thread before each slice of at most 4 MiB it hashes (a
            background save passes its pacing, so the hash gives way to the optimizer step as
            the writes do); it may block, never alters the bytes. The writes are done by then.

    Returns:
        ``(size, hexdigest)``: the file's size in bytes and its ``digest.DEFAULT`` (xxh3-128) digest.

    Raises:
        ConfigError: a name, dtype, layout or metadata value safetensors cannot store.
        BackendError: the write failed (the previous object at ``key``, if any, is intact).
        CorruptCheckpointError: the backend reports a size other than the bytes streamed.

    Example:
        >>> import torch
        >>> from ckptsdk import open_backend
        >>> from ckptsdk.format.files.tensorfile import read_tensorfile
        >>> b = open_backend("memory://demo")
        >>> size, digest = write_tensorfile(b, "t.safetensors", {"w": torch.ones(2)})
        >>> read_tensorfile(b, "t.safetensors", size=size, digest=digest)["w"]
        tensor([1., 1.])
    """
    plan = _plan(key, tensors, metadata)
    digest = _Digest(inline=not plan.zero_copy, pause=pause)
    try:
        info = backend.write(key, _chunks(plan, digest))
    finally:
        digest.join()  # never leave a thread reading tensor memory behind an exception
    if not digest.finished:
        raise CorruptCheckpointError(
            f"the backend at {backend.url} returned from writing {key!r} without consuming every chunk; "
            "the object may be incomplete. This is a backend bug: report it",
            url=backend.url,
            key=key,
        )
    if info.size != plan.size:
        raise CorruptCheckpointError(
            f"wrote {plan.size} bytes to {key!r} at {backend.url} but the backend reports {info.size}; "
            "the storage may be failing, try again or use another location",
            url=backend.url,
            key=key,
        )
    hexdigest = digest.result()
    logger.debug("wrote %s (%d bytes, %d tensors, %s %s)", key, plan.size, len(plan.tensors), DEFAULT, hexdigest)
    return plan.size, hexdigest
