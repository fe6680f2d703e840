"""When background saves run: one on the worker, at most one waiting, the newest replacing it.

``save()`` never waits for the previous save: a save due while one is still writing takes its
snapshot into a second staging buffer and waits in the one slot; a newer save replaces a waiting
one (the newest state is the one worth committing); past the staging budget the due save is
skipped. The counts and save times are :class:`SaveStats`. What a save does is the pipeline's.
Work that follows a commit made on the caller's thread (a blocking save's rotation) runs on the
same worker, ahead of the waiting save, and is waited for like a save.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptsdk.backends.deadline import carried
from ckptsdk.checkpoint.writing.staging import PendingSnapshot, Stager
from ckptsdk.format.template import Captured

logger = logging.getLogger(__name__)

__all__ = ["Job", "SaveSlots", "SaveStats"]

#: Background saves whose durations and intervals the keep-up judgement looks at.
_WINDOW = 16


@dataclass(frozen=True)
class SaveStats:
    """What the background saves of one writer did so far.

    Attributes:
        committed: saves committed (background and blocking).
        replaced: due saves that waited for the worker and were replaced by a newer one.
        skipped: due saves not taken because a second staging buffer would exceed
            ``max_staging_bytes``.
        failed: saves that raised (their error surfaced on the next save, wait or close).
        save_s: seconds the last background save kept the worker busy (write, commit, rotation).
        save_s_median: the median of that over the recent saves (None before the first).
        interval_s_median: the median time between due saves (None before the second).
        staging_bytes: host memory held by staging buffers now.
    """

    committed: int = 0
    replaced: int = 0
    skipped: int = 0
    failed: int = 0
    save_s: float | None = None
    save_s_median: float | None = None
    interval_s_median: float | None = None
    staging_bytes: int = 0


@dataclass
class Job:
    """One background save on the worker: its storage half, the staging buffer it holds."""

    run: Callable[[], None]
    buffer: Stager | None
    step: int
    #: waits until this save's snapshot copy no longer writes into ``buffer``
    settle: Callable[[], None]


class SaveSlots:
    """A long-lived worker thread with one running and one waiting slot, and two staging buffers.

    The worker is started once and fed through the slot: ``Thread.start()`` per save would make
    every save wait for the new thread to come up and hand the interpreter lock back, a few
    milliseconds of stall on a busy machine. A failure is kept until someone asks
    (:meth:`raise_failure`, :meth:`wait`).
    """

    def __init__(self, *, max_staging_bytes: int | None = None) -> None:
        self.max_staging_bytes = max_staging_bytes
        # Real time, whatever clock the lease runs on: these are the waits and durations of real threads.
        self._clock = time.monotonic
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._waiting: Job | None = None
        # After-commit work of blocking saves: never replaced, run before the waiting save.
        self._tails: deque[Callable[[], None]] = deque()
        self._tail_running = False
        self._local = threading.local()  # marks the worker threads (on_worker)
        self._thread: threading.Thread | None = None
        self._copier: ThreadPoolExecutor | None = None
        self._error: BaseException | None = None
        self._free: list[Stager] = []
        self._buffers: list[Stager] = []
        self._durations: deque[float] = deque(maxlen=_WINDOW)
        self._due: deque[tuple[float, int]] = deque(maxlen=_WINDOW + 1)
        self._told = False
        self.committed = 0
        self.replaced = 0
        self.skipped = 0
        self.failed = 0

    # ------------------------------------------------------------------ the training thread's side
    @property
    def busy(self) -> bool:
        """A background save is running or waiting."""
        with self._cond:
            return self._busy()

    def _busy(self) -> bool:
        return self._running is not None or self._waiting is not None or bool(self._tails) or self._tail_running

    def raise_failure(self) -> None:
        """Re-raise the failure of a background save here, once (no waiting)."""
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def claim(self, step: int, need_bytes: int) -> tuple[Stager | None, Job | None]:
        """A staging buffer for the save of ``step`` now due, or None when it must be skipped.

        Returns (buffer, replaced): ``replaced`` is the waiting save this one replaces (its
        buffer is the one returned: the caller waits for that save's copy before reusing it).
        """
        with self._cond:
            self._due.append((self._clock(), step))
            waiting, self._waiting = self._waiting, None
            if waiting is not None:
                self.replaced += 1
                self._cannot_keep_up("replaced by a newer one while it waited")
                return waiting.buffer, waiting
            if self._free:
                return self._free.pop(), None
            held = sum(b.nbytes for b in self._buffers)
            if len(self._buffers) < 2 and (
                not self._buffers or self.max_staging_bytes is None or held + need_bytes <= self.max_staging_bytes
            ):
                buffer = Stager()
                self._buffers.append(buffer)
                return buffer, None
            self.skipped += 1
            self._cannot_keep_up(
                f"skipped: a second staging buffer ({need_bytes / 1e6:.0f} MB) would exceed "
                f"SaveOptions(max_staging_bytes={self.max_staging_bytes})"
            )
            return None, None

    def stage(
        self, step: int, captured: Captured, defer: list[bool], *, where: str = ""
    ) -> tuple[PendingSnapshot, Stager] | None:
        """Snapshot ``captured``'s tensors for the save of ``step`` into a free staging buffer
        (None: skipped). ``defer``: per tensor, whether its copy may wait (see ``Stager``).

        The copies not deferred are made now. The caller submits the job next, then starts the
        deferred ones with :meth:`start_copies` (it must, whatever happens: the next optimizer
        step waits for them).
        """
        need = captured.nbytes
        buffer, replaced = self.claim(step, need)
        if buffer is None:
            return None
        try:
            if replaced is not None:
                logger.info("the save of step %d replaces the save of step %d, still waiting", step, replaced.step)
                replaced.settle()  # its copy must be done before its buffer is reused
            fixed = captured.names if captured.sized else None  # see Stager.begin_aligned
            pending = buffer.begin_aligned(captured.names, captured.tensors, defer, where=where, fixed=fixed)
            captured.tensors = []  # the buffers (and the pending copies) hold what is needed now
        except BaseException:
            self.release(buffer)
            raise
        return pending, buffer

    def start_copies(self, pending: PendingSnapshot) -> None:
        """Start ``pending``'s deferred copies on the copier thread, not when the worker is free:
        the next optimizer step waits for them, and the worker may still be writing the previous
        save.

        The last thing ``save()`` does. The copier's loop is Python between copies: woken earlier,
        it took the GIL from the rest of ``save()`` for a whole switch interval (5 ms) in most
        saves, the stall's p90 (``benchmarks.bench_overhead --step gpu-like``).
        """
        with self._cond:
            if self._copier is None:
                self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptsdk-snapshot")
            copier = self._copier
        copier.submit(_finish_quietly, pending)

    def submit(self, job: Job) -> None:
        """Put ``job`` in the waiting slot; the worker runs it once the running save is done."""
        job.run = carried(job.run)  # in this context: a deadline set around save() bounds the worker too
        with self._cond:
            assert self._waiting is None, "claim() first: it empties the waiting slot"
            self._waiting = job
            self._start_worker()

    def after(self, run: Callable[[], None]) -> None:
        """Run ``run`` on the worker, before any waiting save: what follows a commit made on the
        caller's thread. It is never replaced; a failure is kept and raised like a save's (it
        counts as no save: its commit was counted already)."""
        with self._cond:
            self._tails.append(carried(run))  # under the deadline of the save it follows
            self._start_worker()

    def on_worker(self) -> bool:
        """Whether the calling thread is a save worker (also one finishing after ``stop()``)."""
        return getattr(self._local, "worker", False)

    def _start_worker(self) -> None:  # the caller holds the lock
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name="ckptsdk-save", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def release(self, buffer: Stager | None) -> None:
        """Give back a claimed buffer that was not submitted (the snapshot failed)."""
        if buffer is not None:
            with self._cond:
                self._free.append(buffer)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no save runs or waits; re-raise a failure here. False on timeout."""
        end = None if timeout is None else self._clock() + timeout
        with self._cond:
            while self._busy():
                left = None if end is None else end - self._clock()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        self.raise_failure()
        return True

    def settle(self) -> None:
        """Wait until no after-commit work (:meth:`after`) is queued or running; raise nothing."""
        with self._cond:
            while self._tails or self._tail_running:
                self._cond.wait()

    def stop(self) -> None:
        """Let the worker (and the copier) end once the slots are empty."""
        with self._cond:
            self._thread = None
            copier, self._copier = self._copier, None
            self._cond.notify_all()
        if copier is not None:
            copier.shutdown(wait=False)  # copies already queued still run

    def stats(self) -> SaveStats:
        """A snapshot of the counts and times (see :class:`SaveStats`)."""
        with self._cond:
            durations = list(self._durations)
            return SaveStats(
                committed=self.committed,
                replaced=self.replaced,
                skipped=self.skipped,
                failed=self.failed,
                save_s=durations[-1] if durations else None,
                save_s_median=statistics.median(durations) if durations else None,
                interval_s_median=self._interval(),
                staging_bytes=sum(b.nbytes for b in self._buffers),
            )

    def drop_buffers(self) -> None:
        """Free the staging memory of idle buffers (after close)."""
        with self._cond:
            for buffer in self._free:
                buffer.release()
            self._buffers = [b for b in self._buffers if b not in self._free]
            self._free = []

    # ------------------------------------------------------------------ the worker's side
    def _work(self) -> None:
        me = threading.current_thread()
        self._local.worker = True
        while True:
            with self._cond:
                while self._waiting is None and not self._tails:
                    if self._thread is not me:
                        return
                    self._cond.wait()
                job: Job | None = None
                tail: Callable[[], None] | None = None
                if self._tails:
                    tail = self._tails.popleft()
                    self._tail_running = True
                else:
                    job, self._waiting = self._waiting, None
                    self._running = job
            if tail is not None:
                self._run_tail(tail)
                continue
            assert job is not None
            started = self._clock()
            try:
                job.run()
            except BaseException as exc:  # kept and re-raised on the caller's thread
                with self._cond:
                    self.failed += 1
                    if self._error is None:
                        self._error = exc
            else:
                with self._cond:
                    self.committed += 1
            finally:
                with self._cond:
                    self._durations.append(self._clock() - started)
                    self._running = None
                    if job.buffer is not None:
                        self._free.append(job.buffer)
                    self._cond.notify_all()

    def _run_tail(self, tail: Callable[[], None]) -> None:
        try:
            tail()
        except BaseException as exc:  # kept and re-raised on the caller's thread
            with self._cond:
                if self._error is None:
                    self._error = exc
        finally:
            with self._cond:
                self._tail_running = False
                self._cond.notify_all()

    def _interval(self) -> float | None:
        due = list(self._due)
        gaps = [b[0] - a[0] for a, b in zip(due, due[1:], strict=False)]
        return statistics.median(gaps) if gaps else None

    def _cannot_keep_up(self, what: str) -> None:
        """Say once, clearly, that storage is slower than the saves are due (caller holds the lock)."""
        if self._told or not self._durations:
            return
        self._told = True
        save_s = statistics.median(self._durations)
        interval = self._interval()
        due = list(self._due)
        steps = [b[1] - a[1] for a, b in zip(due, due[1:], strict=False) if b[1] > a[1]]
        fit = ""
        if interval and steps:
            every = statistics.median(steps)
            fit = f"; save_every={math.ceil(every * save_s / interval)} or more would fit"
        logger.warning(
            "storage cannot keep up with the saves: a background save takes %.2f s but saves are due "
            "every %s s, so a due save was %s. Training does not wait; the newest state is committed "
            "when the worker is free%s",
            save_s,
            "?" if interval is None else f"{interval:.2f}",
            what,
            fit,
        )


def _finish_quietly(pending: PendingSnapshot) -> None:
    """The copier thread's part: a failure is kept in ``pending`` and raised on the worker."""
    try:
        pending.finish()
    except BaseException:  # re-raised by wait_finished() on the save worker
        logger.debug("snapshot copy failed; the save worker reports it", exc_info=True)
