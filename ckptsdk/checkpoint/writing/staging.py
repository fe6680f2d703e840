"""Staging: a snapshot of the state's tensors in reusable host buffers, for async saves.

The training loop pays only for one ``copy_`` per tensor into memory allocated once (pinned when
the source is on a GPU); a background writer then serialises the snapshot while training goes
on. Writing, digests and commit belong to ``tensorfile.py`` and the manager, not here.
"""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Collection, Mapping
from typing import Any, Literal, get_args

import numpy as np
import torch

from ckptsdk.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

__all__ = ["NO_STORAGE", "SNAPSHOT_MODES", "PendingSnapshot", "SnapshotMode", "Stager", "tensor_key"]

#: How a non-blocking save copies the state: "pipelined" defers the parameters and optimizer state
#: to the next ``optimizer.step()``; "copy" copies everything at ``save()``.
SnapshotMode = Literal["pipelined", "copy"]
SNAPSHOT_MODES: tuple[SnapshotMode, ...] = get_args(SnapshotMode)


class PendingSnapshot:
    """A snapshot whose deferred copies may still be running; see :meth:`Stager.begin`.

    It also watches the pipelined snapshot's rule. Each deferred source's version counter (which
    every in-place torch op on the tensor, or on a view or ``detach()`` of it, moves) is recorded
    at ``save()`` and compared twice: when the copies are done, before the next held
    ``optimizer.step()`` may run (:meth:`finish`), and right before the commit with the counters
    the first held step found at its start (:meth:`verify`). A moved counter fails the save.

    Attributes:
        tensors: name -> staging buffer (complete once :meth:`finish` returned).
        device: the first accelerator a source was on ("cpu" when none).
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        later: list[tuple[torch.Tensor, torch.Tensor]],
        events: list[Any],
        side_events: list[tuple[torch.device, Any]],
        *,
        watched: tuple[list[str], list[torch.Tensor], list[int]] = ([], [], []),
        device: str = "cpu",
        where: str = "",
    ) -> None:
        self.tensors = tensors
        self.device = device
        self._later = later
        self._events = events
        self._side_events = side_events
        self._copied = threading.Event()
        # CUDA sources: the step waits for the copier's check of their counters too (the side
        # stream's copies are done long before, during the forward and backward).
        if not later and not (side_events and watched[0]):
            self._copied.set()
        self._finished = threading.Event()
        self._failure: BaseException | None = None
        self._watched = watched
        self._where = where
        self._at_step: list[int] | None = None  # the counters when the first held step() began

    @property
    def deferred(self) -> int:
        """How many CPU copies wait for :meth:`finish`."""
        return len(self._later)

    def finish(self) -> None:
        """Run the deferred CPU copies, wait for device copies (on the copier thread), then
        check the rule: no held step can have run yet (it waits for this), so every counter that
        moved was moved by something else."""
        try:
            try:
                for buf, src in self._later:
                    _copy(buf, src)
                for ev in self._events:
                    ev.synchronize()
                self._check(self._counters())
            finally:
                self._later = []
                self._copied.set()  # never leave a training step waiting on a failed copy
        except BaseException as exc:
            self._failure = exc
            raise
        finally:
            self._finished.set()

    def verify(self) -> None:
        """The check right before the commit: against the counters the first held ``step()``
        found at its start (on the training thread, where no in-place op of the job can still be
        running). Nothing more to compare when no held step has run yet.

        Raises:
            CheckpointError: names the tensor, the rule and the opt-out ``snapshot="copy"``.
        """
        if self._at_step is not None:
            self._check(self._at_step)
        # Checked for good: let go of the sources (a replaced parameter's old storage with them).
        self._watched = ([], [], [])

    def _counters(self) -> list[int]:
        return [t._version for t in self._watched[1]]

    def _check(self, now: list[int]) -> None:
        names, _, versions = self._watched
        if now == versions:
            return
        i = next(i for i, (a, b) in enumerate(zip(now, versions, strict=True)) if a != b)
        raise CheckpointError(
            f"{self._where}the pipelined snapshot's rule was broken: {names[i]!r} was changed in place "
            "between save() and the next optimizer.step() (its version counter moved from "
            f"{versions[i]} to {now[i]}), so the checkpoint could hold edited values; it was not "
            "committed and the previous checkpoint is intact. After a save, change parameters and "
            "optimizer state only through optimizer.step() (make edits, load_state_dict, set_ or "
            "another optimizer's step before save()), or pass "
            'CheckpointManager(..., save_options=SaveOptions(snapshot="copy")), which copies everything at save()',
            key=names[i],
        )

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
        stream's copies. Then record the sources' version counters, once (at the first held
        step, before it moves them), for :meth:`verify`.
        """
        self._copied.wait()
        for device, ev in self._side_events:
            torch.cuda.current_stream(device).wait_event(ev)
        if self._at_step is None and self._watched[0]:
            self._at_step = self._counters()


#: Tensors of fewer elements are copied in one ``torch._foreach_copy_`` call (BatchNorm's running
#: stats: 60 tensors in 0.02 ms instead of 0.35 ms one by one). Below torch's grain size (32768
#: elements) a copy runs on the calling thread, so the intra-op threads ``memcpy`` avoids never
#: take part.
_SMALL = 32768


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
        # Buffers aligned with the names of the last snapshot; pinned (for CUDA sources) or not.
        self._names: tuple[str, ...] = ()
        self._list: list[torch.Tensor | None] = []
        self._pins: list[bool] = []
        # The fixed layout (a sized template's names tuple) the buffers were last checked against.
        self._fixed: tuple[str, ...] | None = None
        self._plan: _Plan | None = None  # the last snapshot's sorting, while ``_fixed`` holds
        self._lock = threading.Lock()
        self.allocations = 0  # buffers allocated so far (a reuse check for tests and benchmarks)

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers now."""
        return sum(b.numel() * b.element_size() for b in self._list if b is not None)

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
        :meth:`PendingSnapshot.wait_copied`, and a change made anyway through torch fails the
        snapshot (:meth:`PendingSnapshot.check`).

        Args:
            tensors: name -> dense tensor on any device.
            defer: names whose copy may wait for the worker.

        Raises:
            ConfigError: a value is not a dense tensor.
        """
        names = tuple(tensors)
        return self.begin_aligned(names, list(tensors.values()), [n in defer for n in names])

    def begin_aligned(
        self,
        names: tuple[str, ...],
        tensors: list[torch.Tensor],
        defer: list[bool],
        *,
        where: str = "",
        fixed: tuple[str, ...] | None = None,
    ) -> PendingSnapshot:
        """:meth:`begin` for tensors given as a list aligned with ``names`` and a flag per tensor
        (what ``format.template.Captured`` holds): the buffers of the last snapshot are reused
        position by position when ``names`` is the same, with no lookup by name.

        Args:
            names: the tensors' names, in order.
            tensors: dense tensors on any device, aligned with ``names``.
            defer: per tensor, whether its copy may wait for the worker.
            where: prefix of the rule's error message (which save).
            fixed: a token (the same object at every save) promising that every tensor is dense
                and has the dtype and shape it had at the last snapshot given the same token: a
                sized template's ``names``, whose capture checked exactly that. The buffers then
                fit without a check per tensor; only the device is still looked at.

        Raises:
            ConfigError: a value is not a dense tensor.
        """
        with self._lock:
            if names != self._names:
                self._rebind(names)
            trusted = fixed is not None and fixed is self._fixed
            plan = self._plan
            if trusted and plan is not None and plan.defer == defer and all(map(_IS_CPU, tensors)):
                return plan.begin(tensors, where)
            self._fixed = None  # set again below once every buffer was checked against ``fixed``
            self._plan = None
            bufs = self._list
            pins = self._pins  # (``_allocate`` updates it in place)
            later: list[tuple[torch.Tensor, torch.Tensor]] = []
            watch_names: list[str] = []
            watch_src: list[torch.Tensor] = []
            small_dst: list[torch.Tensor] = []
            small_src: list[torch.Tensor] = []
            side: dict[torch.device, Any] = {}
            devices: set[torch.device] = set()
            with torch.no_grad():
                for i, src in enumerate(tensors):
                    buf = bufs[i]
                    # The common case: a CPU source of a trusted layout, whose buffer fits (see ``fixed``).
                    cpu = trusted and not pins[i] and src.is_cpu
                    if not cpu:
                        if not isinstance(src, torch.Tensor) or src.layout is not torch.strided:
                            raise ConfigError(
                                f"cannot stage {names[i]!r}: a {type(src).__name__} "
                                f"({getattr(src, 'layout', '')}), not a dense tensor"
                            )
                        cpu = src.is_cpu
                        if (
                            buf is None
                            or buf.dtype is not src.dtype
                            or buf.shape != src.shape
                            or pins[i] is not src.is_cuda
                        ):
                            buf = self._allocate(i, src)
                    assert buf is not None  # allocated above, or by the snapshot that checked ``fixed``
                    if cpu:
                        if defer[i]:
                            # detach: a later ``p.data = x`` or ``set_`` on the live tensor leaves
                            # the storage this copy reads alone.
                            src = src.detach()
                            later.append((buf, src))
                            watch_names.append(names[i])
                            watch_src.append(src)
                        elif src.numel() < _SMALL:
                            small_dst.append(buf)
                            small_src.append(
                                src.detach() if src.requires_grad else src
                            )  # (else the buffer gets a grad_fn)
                        else:
                            _copy(buf, src)
                        continue
                    devices.add(src.device)
                    src = src.detach()
                    if src.device.type == "cuda":
                        if defer[i]:
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
                            watch_names.append(names[i])
                            watch_src.append(src)
                        else:
                            # Same stream as the forward that changes it next: ordered after us.
                            buf.copy_(src, non_blocking=True)
                    else:
                        buf.copy_(src)  # other accelerators: a plain blocking copy
            if small_src:
                torch._foreach_copy_(small_dst, small_src)  # one call: per-tensor calls cost more than the bytes
            events: list[Any] = []
            for device in (d for d in devices if d.type == "cuda"):
                main_done = torch.cuda.Event()
                main_done.record(torch.cuda.current_stream(device))
                events.append(main_done)
            side_events = []
            for stream in side.values():
                ev = torch.cuda.Event()
                ev.record(stream)
                side_events.append((stream.device, ev))
            first = str(min(devices, key=str)) if devices else "cpu"
            watched = (watch_names, watch_src, [t._version for t in watch_src])
            if fixed is not None:  # every buffer fits now: the next snapshot of ``fixed`` may trust it
                self._fixed = fixed
                if not devices and not any(pins):
                    self._plan = _Plan(names, bufs, defer, [t.numel() for t in tensors])  # type: ignore[arg-type]
            return PendingSnapshot(
                dict(zip(names, bufs, strict=True)),  # type: ignore[arg-type]  # all allocated above
                later,
                events + [e for _, e in side_events],
                side_events,
                watched=watched,
                device=first,
                where=where,
            )

    def _rebind(self, names: tuple[str, ...]) -> None:
        """A new list of names: keep the buffers of names still present (reused if they fit)."""
        old = dict(zip(self._names, zip(self._list, self._pins, strict=True), strict=True))
        self._names = names
        self._fixed = None
        self._plan = None
        kept = [old.get(n, (None, False)) for n in names]
        self._list = [b for b, _ in kept]
        self._pins = [p for _, p in kept]

    def _allocate(self, i: int, src: torch.Tensor) -> torch.Tensor:
        pin = src.is_cuda
        # torch.empty: the copy overwrites every byte, so zero-filling would be a wasted pass.
        buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
        self._list[i] = buf
        self._pins[i] = pin
        self.allocations += 1
        return buf

    def release(self) -> None:
        """Drop every buffer (frees the host memory; the next snapshot allocates again)."""
        with self._lock:
            self._names, self._list, self._pins = (), [], []
            self._fixed = None
            self._plan = None


_IS_CPU = operator.attrgetter("is_cpu")


class _Plan:
    """How the last snapshot of a fixed layout (see ``Stager.begin_aligned``) sorted its CPU
    tensors: deferred, copied together (small), copied one by one. A snapshot of the same
    layout, with the same deferral and every source on the CPU, sorts them alike with no test
    per tensor (the training thread's time in ``save()``)."""

    def __init__(self, names: tuple[str, ...], bufs: list[torch.Tensor], defer: list[bool], sizes: list[int]) -> None:
        self.defer = list(defer)
        self.by_name = dict(zip(names, bufs, strict=True))
        self.deferred = [i for i, d in enumerate(defer) if d]
        self.deferred_bufs = [bufs[i] for i in self.deferred]
        self.watch_names = [names[i] for i in self.deferred]
        rest = [i for i, d in enumerate(defer) if not d]
        self.small = [i for i in rest if sizes[i] < _SMALL]
        self.small_bufs = [bufs[i] for i in self.small]
        self.large = [(i, bufs[i]) for i in rest if sizes[i] >= _SMALL]

    def begin(self, tensors: list[torch.Tensor], where: str) -> PendingSnapshot:
        """What the general loop of ``begin_aligned`` returns for these CPU sources."""
        with torch.no_grad():
            # detach: see the general loop (a later ``p.data = x`` leaves this storage alone).
            sources = [tensors[i].detach() for i in self.deferred]
            for i, buf in self.large:
                _copy(buf, tensors[i])
            if self.small:
                small = [tensors[i] for i in self.small]
                torch._foreach_copy_(self.small_bufs, [t.detach() if t.requires_grad else t for t in small])
        watched = (list(self.watch_names), sources, [t._version for t in sources])
        later = list(zip(self.deferred_bufs, sources, strict=True))
        return PendingSnapshot(dict(self.by_name), later, [], [], watched=watched, where=where)


#: ``tensor_key`` of every empty tensor (they share data pointer 0).
NO_STORAGE = (0, torch.float32, (0,))


def tensor_key(t: torch.Tensor) -> tuple[int, torch.dtype, tuple[int, ...]]:
    """Which storage a tensor's bytes live in (pointer, dtype, shape): the pipelined snapshot's
    test for "the optimizer step will change this tensor in place"."""
    # Empty tensors share data pointer 0; they are copied at save() (nothing to copy anyway).
    return (t.data_ptr(), t.dtype, tuple(t.shape)) if t.numel() else NO_STORAGE
