"""Staging: a snapshot of the state's tensors in reusable host buffers, for async saves.

The training loop pays only for one ``copy_`` per tensor into memory allocated once (pinned when
the source is on a GPU); a background writer then serialises the snapshot while training goes
on. Writing, digests and commit belong to ``tensorfile.py`` and the manager, not here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Mapping
from typing import Any, Literal, get_args

import numpy as np
import torch

from ckptsdk.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["NO_STORAGE", "SNAPSHOT_MODES", "PendingSnapshot", "SnapshotMode", "Stager", "tensor_key"]

#: How a non-blocking save copies the state: "pipelined" defers the parameters and optimizer state
#: to the next ``optimizer.step()``; "copy" copies everything at ``save()``.
SnapshotMode = Literal["pipelined", "copy"]
SNAPSHOT_MODES: tuple[SnapshotMode, ...] = get_args(SnapshotMode)


class PendingSnapshot:
    """A snapshot whose deferred copies may still be running; see :meth:`Stager.begin`.

    Attributes:
        tensors: name -> staging buffer (complete once :meth:`finish` returned).
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        later: list[tuple[torch.Tensor, torch.Tensor]],
        events: list[Any],
        side_events: list[tuple[torch.device, Any]],
    ) -> None:
        self.tensors = tensors
        self._later = later
        self._events = events
        self._side_events = side_events
        self._copied = threading.Event()
        if not later:
            self._copied.set()
        self._finished = threading.Event()
        self._failure: BaseException | None = None

    @property
    def deferred(self) -> int:
        """How many CPU copies wait for :meth:`finish`."""
        return len(self._later)

    def finish(self) -> None:
        """Run the deferred CPU copies, then wait for device copies (on the save worker)."""
        try:
            try:
                for buf, src in self._later:
                    _copy(buf, src)
            finally:
                self._later = []
                self._copied.set()  # never leave a training step waiting on a failed copy
            for ev in self._events:
                ev.synchronize()
        except BaseException as exc:
            self._failure = exc
            raise
        finally:
            self._finished.set()

    def settle(self) -> None:
        """Block until :meth:`finish` is done, failed or not: the buffers are no longer written."""
        self._finished.wait()

    def wait_finished(self) -> None:
        """Block until :meth:`finish` (run on another thread) is done; re-raise its failure."""
        self._finished.wait()
        if self._failure is not None:
            raise self._failure

    def wait_copied(self) -> None:
        """Block until no deferred source is still being read (the optimizer-step pre-hook).

        CPU copies: wait for :meth:`finish`. CUDA: make the current stream wait for the side
        stream's copies, without blocking the host.
        """
        self._copied.wait()
        for device, ev in self._side_events:
            torch.cuda.current_stream(device).wait_event(ev)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if src.is_contiguous() and not (src.is_conj() or src.is_neg()):
        memcpy(dst, src)
    else:
        dst.copy_(src)  # strided: torch walks the strides


def memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Plain single-threaded memcpy of a contiguous CPU tensor into ``dst``.

    Not ``dst.copy_(src)``: torch splits every copy over its intra-op threads, and on a small
    VM whose cores are busy (the training loop, data loaders) those threads wait on each other;
    measured on 2 shared cores, ``copy_`` took 750 ms for the 89 MB ResNet-18 state where one
    memcpy took 50 ms.
    """
    if src.numel() == 0:
        return
    d = dst.reshape(-1).view(torch.uint8).numpy()
    s = src.reshape(-1).view(torch.uint8).numpy()
    np.copyto(d, s)


class Stager:
    """Copies tensors into buffers it owns and reuses from one snapshot to the next.

    A buffer is kept per tensor name and reused while that name keeps its shape, dtype and
    kind of source (CPU or accelerator); otherwise it is reallocated. Buffers are contiguous,
    so the writer never needs another copy; for CUDA sources they are pinned so the device to
    host copy runs at full bandwidth.

    Thread-safety: one snapshot in flight. ``snapshot`` overwrites the buffers the previous
    snapshot returned, so the caller must have finished with (written) the previous snapshot
    before taking the next; the manager does this by waiting for the previous save. Concurrent
    calls to ``snapshot`` are serialised by a lock, never interleaved.

    Example:
        >>> stager = Stager()
        >>> w = torch.ones(3)
        >>> snap = stager.snapshot({"w": w})
        >>> _ = w.add_(1)  # training continues; the snapshot keeps the old values
        >>> snap["w"]
        tensor([1., 1., 1.])
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._pinned: set[str] = set()  # names whose buffer is pinned (asked once, not per call)
        self._lock = threading.Lock()
        self.allocations = 0  # buffers allocated so far (a reuse check for tests and benchmarks)

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers now."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def snapshot(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into the staging buffers and return them (name -> CPU tensor).

        Returns once every copy is complete (device copies are synchronised), so the caller may
        modify the sources right away. Buffers of names no longer present are released.

        Args:
            tensors: name -> dense tensor on any device.

        Returns:
            name -> CPU contiguous tensor holding a copy of the source's values, valid until the
            next ``snapshot`` call.

        Raises:
            ConfigError: a value is not a dense tensor.
        """
        pending = self.begin(tensors)
        pending.finish()
        return pending.tensors

    def begin(self, tensors: Mapping[str, torch.Tensor], defer: Collection[str] = ()) -> PendingSnapshot:
        """Start a snapshot: copy every tensor not in ``defer`` now, the others later.

        The deferred copies (parameters and optimizer state, which only ``optimizer.step()``
        changes) run in :meth:`PendingSnapshot.finish` on the save worker while training goes on;
        on CUDA they are queued on a side stream at once. Until ``finish`` returns, the sources
        named in ``defer`` must not change: the caller holds the next optimizer step with
        :meth:`PendingSnapshot.wait_copied`.

        Args:
            tensors: name -> dense tensor on any device.
            defer: names whose copy may wait for the worker.

        Raises:
            ConfigError: a value is not a dense tensor.
        """
        with self._lock:
            out: dict[str, torch.Tensor] = {}
            later: list[tuple[torch.Tensor, torch.Tensor]] = []
            side: dict[torch.device, Any] = {}
            events: list[Any] = []
            with torch.no_grad():
                for name, src in tensors.items():
                    if not isinstance(src, torch.Tensor) or src.layout != torch.strided:
                        raise ConfigError(
                            f"cannot stage {name!r}: a {type(src).__name__} "
                            f"({getattr(src, 'layout', '')}), not a dense tensor"
                        )
                    buf = self._buffer(name, src)
                    src = src.detach()
                    out[name] = buf
                    if src.device.type == "cuda":
                        if name in defer:
                            stream = side.get(src.device)
                            if stream is None:
                                # The side stream first waits for the work already queued (the
                                # step that produced these values), then copies while the next
                                # forward runs on the main stream.
                                stream = side[src.device] = torch.cuda.Stream(src.device)
                                stream.wait_stream(torch.cuda.current_stream(src.device))
                            with torch.cuda.stream(stream):
                                buf.copy_(src, non_blocking=True)
                                src.record_stream(stream)
                        else:
                            # Same stream as the forward that changes it next: ordered after us.
                            buf.copy_(src, non_blocking=True)
                    elif src.device.type != "cpu":
                        buf.copy_(src)  # other accelerators: a plain blocking copy
                    elif name in defer:
                        later.append((buf, src))
                    else:
                        _copy(buf, src)
            cuda_devices = {t.device for t in tensors.values() if t.device.type == "cuda"}
            for device in cuda_devices:
                main_done = torch.cuda.Event()
                main_done.record(torch.cuda.current_stream(device))
                events.append(main_done)
            side_events = []
            for stream in side.values():
                ev = torch.cuda.Event()
                ev.record(stream)
                side_events.append((stream.device, ev))
            for stale in set(self._buffers) - set(out):
                del self._buffers[stale]
                self._pinned.discard(stale)
            return PendingSnapshot(out, later, events + [e for _, e in side_events], side_events)

    def _buffer(self, name: str, src: torch.Tensor) -> torch.Tensor:
        pin = src.device.type == "cuda"
        buf = self._buffers.get(name)
        if buf is not None and buf.shape == src.shape and buf.dtype == src.dtype and (name in self._pinned) == pin:
            return buf
        # torch.empty: the copy overwrites every byte, so zero-filling would be a wasted pass.
        buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
        self._buffers[name] = buf
        if pin:
            self._pinned.add(name)
        else:
            self._pinned.discard(name)
        self.allocations += 1
        return buf

    def release(self) -> None:
        """Drop every buffer (frees the host memory; the next snapshot allocates again)."""
        with self._lock:
            self._buffers.clear()
            self._pinned.clear()


#: ``tensor_key`` of every empty tensor (they share data pointer 0).
NO_STORAGE = (0, torch.float32, (0,))


def tensor_key(t: torch.Tensor) -> tuple[int, torch.dtype, tuple[int, ...]]:
    """Which storage a tensor's bytes live in (pointer, dtype, shape): the pipelined snapshot's
    test for "the optimizer step will change this tensor in place"."""
    # Empty tensors share data pointer 0; they are copied at save() (nothing to copy anyway).
    return (t.data_ptr(), t.dtype, tuple(t.shape)) if t.numel() else NO_STORAGE
