"""Tensors recorded by digest and never written (format 3.0's ``referenced``): hashing live ones, proving them.

A fine-tune's checkpoint may record its frozen base by dtype, shape and digest only; before a
restore loads anything it must prove that the live tensors hold exactly those bytes. The digest is
the one ``shared`` records per tensor: xxh3-128 of ``"<dtype> [<d0>, <d1>, ...]\\n"`` then the raw
bytes, row-major. Hashing reads a CPU tensor in place and a CUDA one through a bounded host buffer;
nothing here writes to a live tensor. Which tensors are referenced, and when they are re-hashed,
belongs to the save path (ckptsdk/checkpoint/), not here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ckptsdk.errors import StateMismatchError
from ckptsdk.format.digest import Hasher, new_hasher
from ckptsdk.format.dtype import of_torch
from ckptsdk.format.manifest import ReferencedBase, ReferencedTensor

__all__ = [
    "CHUNK_BYTES",
    "TENSOR_ALGORITHMS",
    "Difference",
    "digest_header",
    "first_difference",
    "hash_tensor",
    "prove",
]

#: What a tensor digest (``referenced[].algorithm``) may name: what ckptsdk writes there. A new one
#: goes in ``digest.ALGORITHMS`` and here; a reader that does not know it refuses the checkpoint.
TENSOR_ALGORITHMS: tuple[str, ...] = ("xxh3-128",)
#: The most bytes hashed per step: the host buffer a CUDA tensor goes through (two of them, one
#: being filled while the other is hashed), and the largest copy made of a non-contiguous tensor.
CHUNK_BYTES = 64 << 20


def _dtype_name(dtype: torch.dtype) -> str:
    """The skeleton's name of a torch dtype (``"float32"``), or torch's own for one no checkpoint holds."""
    entry = of_torch(dtype)
    return entry.name if entry is not None else str(dtype).removeprefix("torch.")


def digest_header(dtype: str, shape: Sequence[int]) -> bytes:
    """What a tensor digest hashes before the bytes, so that equal bytes of another dtype or shape differ.

    Example:
        >>> digest_header("float32", (2, 3))
        b'float32 [2, 3]\\n'
    """
    return f"{dtype} {list(shape)}\n".encode()


def _byte_chunks(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """``t``'s row-major bytes as flat uint8 tensors on its device, each at most ``limit`` bytes.

    Views of ``t`` where it is contiguous (no copy); otherwise copies of at most ``limit`` bytes
    (a block of rows, or one row at a time when a row is larger), so that a strided or conjugate
    view of a large tensor is never copied whole.
    """
    if t.numel() == 0:
        return
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        flat = t.reshape(-1)
        if flat.stride(0) != 1:  # one element: "contiguous" whatever its stride, which view() refuses
            flat = flat.clone(memory_format=torch.contiguous_format)
        flat = flat.view(torch.uint8)
        for start in range(0, flat.numel(), limit):
            yield flat[start : start + limit]
        return
    if t.dim() == 0:
        yield from _byte_chunks(t.resolve_conj().resolve_neg().contiguous(), limit)
        return
    row = t[0].numel() * t.element_size()
    if row > limit:
        for i in range(t.shape[0]):
            yield from _byte_chunks(t[i], limit)
        return
    rows = max(1, limit // max(row, 1))
    for start in range(0, t.shape[0], rows):
        yield from _byte_chunks(t[start : start + rows].resolve_conj().resolve_neg().contiguous(), limit)


def _hash_cuda(chunks: Iterator[torch.Tensor], hasher: Hasher, limit: int, device: torch.device) -> None:
    # Two pinned host buffers on a side stream: chunk i+1 is copied while chunk i is hashed, so the
    # proof costs about max(copy, hash), with 2 x limit bytes of host memory whatever the tensor's
    # size. The side stream first waits for the work queued on the current one (a load_state_dict
    # still in flight is what must be hashed). torch's host allocator caches the pinned blocks.
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    buffers = [torch.empty(limit, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    pending: tuple[torch.Tensor, torch.cuda.Event] | None = None
    with torch.cuda.stream(stream):
        for i, chunk in enumerate(chunks):
            host = buffers[i % 2][: chunk.numel()]
            host.copy_(chunk, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
            if pending is not None:
                pending[1].synchronize()
                hasher.update(pending[0].numpy().data)
            pending = (host, done)
    if pending is not None:
        pending[1].synchronize()
        hasher.update(pending[0].numpy().data)


def hash_tensor(t: torch.Tensor, *, algorithm: str = "xxh3-128", chunk_bytes: int = CHUNK_BYTES) -> str:
    """The tensor digest of a live tensor (dtype, shape, raw bytes), read in place; nothing is written.

    Args:
        t: any tensor with storage (CPU, CUDA, or another device through a bounded copy).
        algorithm: one of ``TENSOR_ALGORITHMS``.
        chunk_bytes: the most bytes copied at once (a CUDA tensor's host buffer, a non-contiguous
            tensor's blocks).

    Raises:
        ConfigError: an algorithm that is not a tensor digest's.
        ValueError: a tensor without bytes (on the meta device).

    Example:
        >>> hash_tensor(torch.zeros(2)) == hash_tensor(torch.zeros(4)[::2])
        True
        >>> hash_tensor(torch.zeros(2)) == hash_tensor(torch.zeros(1, 2))
        False
    """
    if t.device.type == "meta":
        raise ValueError(f"a {_dtype_name(t.dtype)} {list(t.shape)} tensor on the meta device has no bytes to hash")
    t = t.detach()
    hasher = new_hasher(algorithm, among=TENSOR_ALGORITHMS)
    hasher.update(digest_header(_dtype_name(t.dtype), t.shape))
    chunks = _byte_chunks(t, chunk_bytes)
    if t.device.type == "cuda":
        _hash_cuda(chunks, hasher, chunk_bytes, t.device)
    else:
        for chunk in chunks:  # CPU: the views themselves; another device: a bounded copy each
            hasher.update((chunk if chunk.device.type == "cpu" else chunk.cpu()).numpy().data)
    return hasher.hexdigest()


@dataclass(frozen=True)
class Difference:
    """How a live tensor differs from the one a checkpoint references (the first found)."""

    path: str
    source: str | None
    expected: ReferencedTensor
    #: what the live tensor is: ``"float32 [2, 3] digest 1a2b..."``, ``"absent"``, ``"on the meta device"``
    found: str

    def message(self, *, url: str = "", step: int | None = None) -> str:
        """What happened, where and what to do, for ``StateMismatchError``."""
        where = f"checkpoint {url}" + (f" at step {step}" if step is not None else "")
        recorded = f"{self.expected.dtype} {self.expected.shape} digest {self.expected.digest}"
        return (
            f"{where.strip()} records tensor {self.path!r} by reference (from {self.source or 'an unnamed source'}): "
            f"expected {recorded}, found {self.found}. The live model is not the base this checkpoint was "
            "trained on; nothing was restored. Load that base (the same revision) into the model, then restore"
        )


def _cheap_difference(path: str, t: torch.Tensor | None, group: ReferencedBase) -> Difference | None:
    """A difference seen without hashing: absent, no bytes, another dtype or shape."""
    expected = group.tensors[path]
    if t is None:
        return Difference(path, group.source, expected, "absent (the state has no tensor at that path)")
    if t.device.type == "meta":
        return Difference(path, group.source, expected, f"{_dtype_name(t.dtype)} {list(t.shape)} on the meta device")
    if (_dtype_name(t.dtype), list(t.shape)) != (expected.dtype, expected.shape):
        return Difference(path, group.source, expected, f"{_dtype_name(t.dtype)} {list(t.shape)}")
    return None


def first_difference(
    live: Mapping[str, torch.Tensor], referenced: Sequence[ReferencedBase], *, chunk_bytes: int = CHUNK_BYTES
) -> Difference | None:
    """The first referenced tensor the live state does not hold exactly, or None; writes nothing.

    Absent tensors, dtypes and shapes are checked for all before any byte is hashed (a wrong base
    is found in microseconds); then each is hashed, in the manifest's order.

    Args:
        live: tensor path (as the manifest's skeleton names it) -> the live tensor.
        referenced: the manifest's ``referenced`` groups.
        chunk_bytes: see ``hash_tensor``.

    Raises:
        ConfigError: a group names a digest algorithm this ckptsdk does not know (upgrade).
    """
    for group in referenced:
        new_hasher(group.algorithm, among=TENSOR_ALGORITHMS)  # an unknown one refuses before any work
        for path in group.tensors:
            cheap = _cheap_difference(path, live.get(path), group)
            if cheap is not None:
                return cheap
    for group in referenced:
        for path, expected in group.tensors.items():
            t = live[path]
            digest = hash_tensor(t, algorithm=group.algorithm, chunk_bytes=chunk_bytes)
            if digest != expected.digest:
                return Difference(
                    path, group.source, expected, f"{_dtype_name(t.dtype)} {list(t.shape)} digest {digest}"
                )
    return None


def prove(
    live: Mapping[str, torch.Tensor],
    referenced: Sequence[ReferencedBase],
    *,
    url: str = "",
    step: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> int:
    """Prove that ``live`` holds every tensor ``referenced`` records, byte for byte; touch nothing.

    Run it before anything is loaded: a refused restore must leave every live object as it was.

    Args:
        live: tensor path -> the live tensor (see ``first_difference``).
        referenced: the manifest's ``referenced`` groups.
        url: the checkpoint root, for the message.
        step: the checkpoint's step, for the message.
        chunk_bytes: see ``hash_tensor``.

    Returns:
        The bytes hashed.

    Raises:
        StateMismatchError: the first tensor that differs (absent, dtype, shape or bytes); the
            message names it, what was recorded and found, and the recorded source;
            ``mismatches`` is ``[path]``.
        ConfigError: an unknown digest algorithm.

    Example:
        >>> from ckptsdk.format.manifest import ReferencedBase, ReferencedTensor
        >>> w = torch.ones(2)
        >>> entry = ReferencedTensor(dtype="float32", shape=[2], size=8, digest=hash_tensor(w))
        >>> prove({"w": w}, [ReferencedBase(source="hub:x", algorithm="xxh3-128", tensors={"w": entry})])
        8
    """
    found = first_difference(live, referenced, chunk_bytes=chunk_bytes)
    if found is not None:
        raise StateMismatchError(found.message(url=url, step=step), url=url, step=step, mismatches=[found.path])
    return sum(entry.size for group in referenced for entry in group.tensors.values())
