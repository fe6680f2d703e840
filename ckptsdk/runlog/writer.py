"""The per-attempt step log: what each attempt ran, written so that it can be audited later.

Each attempt (one lease takeover) appends its steps to its own folder, ``runlog/attempt-NNNNNN/``,
as a series of small immutable chunks; ``ckptsdk.runlog.audit`` reads them back and compares the steps
logged by more than one attempt. Checkpoint files, leases, the audit and plotting do not belong here.

Layout (every object is written once, with ``create``, and never rewritten: GCS objects cannot
grow, and a Drive mount may show another VM's rewrites late and out of order)::

    runlog/attempt-000003/attempt.json        AttemptRecord as the attempt started
    runlog/attempt-000003/chunk-000000.jsonl  line 1: header (the AttemptRecord as of this flush)
    runlog/attempt-000003/chunk-000001.jsonl  next lines: {"step": N, "time": T, "scalars": {...}}

The newest chunk's header is the attempt's current record (last step seen, closed cleanly), so a
reader that sees only some chunks (Drive delivers them out of order) still learns who wrote them.
The documents themselves (the record, the rows, their format and keys, reading them back) are
``ckptsdk.runlog.record``'s.

With ``background=True`` (the manager's setting) a flusher thread publishes what is buffered every
``flush_interval`` seconds (1 s by default), so a runtime killed a few steps after a save still
leaves those steps for the audit; the training thread only appends to a list.
"""

from __future__ import annotations

import logging
import numbers
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ckptsdk.backends.base import Backend
from ckptsdk.errors import BackendError, ConfigError, ObjectNotFound, PreconditionFailed
from ckptsdk.format.document import utc_now
from ckptsdk.format.environment import describe_device, versions
from ckptsdk.runlog.record import (
    DATA_PREFIX,
    RUNLOG_FORMAT,
    AttemptRecord,
    StepRow,
    attempt_prefix,
    chunk_key,
    digest_value,
    parse_runlog_key,
)

logger = logging.getLogger(__name__)

# RUNLOG_FORMAT and chunk_key are ckptsdk.runlog.record's, re-exported: tests import them from here.
__all__ = ["RUNLOG_FORMAT", "RunLog", "chunk_key"]

_SCALAR_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]{0,127}$")


class RunLog:
    """One attempt's step log: buffered in memory, published as immutable chunks.

    Args:
        backend: where the checkpoint root lives; objects go under ``runlog/``.
        run_id: the run this attempt belongs to.
        attempt: the attempt number (from the lease); one folder per attempt.
        lease_epoch: the lease epoch this attempt writes under (recorded, not checked here).
        resumed_from_step: the checkpoint step this attempt resumed from, ``None`` if fresh.
        host: the host name to record (default: this host).
        device: the device to record (default: detected by
            :func:`~ckptsdk.format.environment.describe_device`, as the manifest names it).
        flush_every: publish a chunk once this many steps are buffered.
        flush_interval: also publish once the oldest buffered step is this many seconds old,
            so that a runtime killed between checkpoints still leaves its last steps behind
            (those are the steps the audit compares with the next attempt). With
            ``background`` a thread publishes on this period whether or not ``log_step`` is
            called again (a job stuck in a long step still gets its last steps out).
        clock: a monotonic clock (tests).
        background: publish on a flusher thread of this log's own, every ``flush_interval``
            seconds and at once on :meth:`flush_soon`, so the training loop never waits on
            storage for the log (the manager turns this on). ``flush()`` and ``close()`` still
            publish on the caller's thread.

    Example:
        >>> from ckptsdk.backends import open_backend
        >>> log = RunLog(open_backend("memory://doc-runlog"), run_id="r", attempt=1,
        ...              lease_epoch=1, resumed_from_step=None)
        >>> log.log_step(1, loss=0.5, lr=0.1)
        >>> log.close()
    """

    def __init__(
        self,
        backend: Backend,
        *,
        run_id: str,
        attempt: int,
        lease_epoch: int | None,
        resumed_from_step: int | None,
        host: str | None = None,
        device: str | None = None,
        flush_every: int = 200,
        flush_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        background: bool = False,
    ) -> None:
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
            raise ConfigError(f"RunLog attempt must be a non-negative int, got {attempt!r}")
        if flush_every < 1:
            raise ConfigError(f"RunLog flush_every must be >= 1, got {flush_every!r}")
        if not (isinstance(flush_interval, (int, float)) and 0 < flush_interval < float("inf")):
            raise ConfigError(f"RunLog flush_interval must be a number of seconds > 0, got {flush_interval!r}")
        self.backend = backend
        self.attempt = attempt
        self.flush_every = int(flush_every)
        self.flush_interval = float(flush_interval)
        self._clock = clock
        # Named again at each flush: a job that moves to the GPU after the log is opened (CUDA is
        # never initialised to name it; see describe_device) is named from then on.
        self._detect = device is None
        self._record = AttemptRecord(
            attempt=attempt,
            run_id=str(run_id),
            lease_epoch=lease_epoch,
            host=host or socket.gethostname(),
            pid=os.getpid(),
            device=device or describe_device(),
            versions=versions(),
            started_at=utc_now(),
            resumed_from_step=resumed_from_step,
        )
        # (step, wall time, {name: float or a 0-d tensor not yet read back})
        self._buffer: list[tuple[int, float, dict[str, Any]]] = []
        self._oldest: float | None = None
        self._next_seq: int | None = None  # found by listing at the first flush
        self._pending: tuple[str, bytes, int] | None = None  # a built chunk not yet stored
        self._lock = threading.Lock()  # the buffer
        self._publish_lock = threading.RLock()  # one publish at a time
        self._started_written = False
        self._closed = False
        #: The highest step logged by this attempt (None before the first): what ``close()``
        #: compares with the newest checkpoint, to say which steps no checkpoint holds.
        self.last_logged: int | None = None
        # The flusher thread (background=True) sleeps on _wake for flush_interval, or less when
        # log_step finds the buffer full or flush_soon() asks; _stop ends it at close().
        self._background = background
        self._flusher: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        # What log_step attaches to each row besides the scalars: name -> a callable giving the
        # digest of the data the step used (the ckptsdk loader's batch indices), None when unknown.
        self._digest_sources: dict[str, Callable[[], str | None]] = {}

    @property
    def record(self) -> AttemptRecord:
        """The attempt record as of the last flush."""
        return self._record

    @property
    def resumed_from_step(self) -> int | None:
        """The checkpoint step this attempt resumed from (``None``: a fresh start)."""
        return self._record.resumed_from_step

    @resumed_from_step.setter
    def resumed_from_step(self, step: int | None) -> None:
        # The manager learns this only in restore(), after the log exists. Steps logged before
        # then are unusual; if a chunk already went out, later chunk headers carry the update.
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ConfigError(f"resumed_from_step must be an int >= 0 or None, got {step!r}")
        self._record = self._record.model_copy(update={"resumed_from_step": step})

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has completed."""
        return self._closed

    def log_step(self, step: int, **scalars: Any) -> None:
        """Buffer one step's scalars; publish a chunk when the buffer is full or old enough.

        Also records the digest of every registered data source (:meth:`watch_data`), so the
        audit compares what data each step ran on, not only its losses.

        Args:
            step: the global step (an int >= 0).
            **scalars: numbers: python int/float, numpy scalars, one-element torch tensors
                (read back at flush, so a GPU loss costs no sync per step). NaN and inf are kept.

        Raises:
            ConfigError: a non-numeric scalar, a bad step, or a log already closed.
        """
        if self._closed:
            raise ConfigError(
                f"log_step({step}) after close() on the run log of attempt {self.attempt}: "
                "log steps before closing the manager"
            )
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ConfigError(f"log_step: step must be an int >= 0, got {step!r}")
        if not scalars:
            raise ConfigError(f"log_step({step}) got no scalars: pass at least one, e.g. loss=...")
        if any(name.startswith(DATA_PREFIX) for name in scalars):
            raise ConfigError(
                f"log_step({step}): scalar names under {DATA_PREFIX!r} are reserved for data digests "
                "(the ckptsdk loader's); rename it"
            )
        values = {name: _check_scalar(name, value, step) for name, value in scalars.items()}
        for name, source in self._digest_sources.items():
            digest = source()
            if digest is not None:
                values[name] = digest_value(digest)
        with self._lock:
            if self._oldest is None:
                self._oldest = self._clock()
            self._buffer.append((int(step), time.time(), values))
            self.last_logged = max(int(step), self.last_logged if self.last_logged is not None else -1)
            due = len(self._buffer) >= self.flush_every or self._clock() - self._oldest >= self.flush_interval
        if self._background:
            self._ensure_flusher()
            if due:
                self._wake.set()
        elif due:
            self._flush_quietly()

    def watch_data(self, name: str, source: Callable[[], str | None]) -> None:
        """Attach ``source()`` (a digest of the data the step ran on) to every logged step.

        The manager registers the ckptsdk loaders of the state it restores; the audit then
        compares these digests between attempts like the scalars, so a data-order divergence
        shows even when the losses happen to agree.

        Args:
            name: the digest's name in the log, under ``data/`` (e.g. ``data/loader``).
            source: called by ``log_step`` on the training thread; returns a short string or
                None (nothing to record for this step). It is stored as a scalar
                (:func:`ckptsdk.runlog.record.digest_value`), so any 1.1 reader reads it.
        """
        if not (_SCALAR_NAME_RE.match(name) and name.startswith(DATA_PREFIX)):
            raise ConfigError(f"watch_data: bad digest name {name!r} (data/ then letters, digits, _ . / -)")
        self._digest_sources[name] = source

    def flush_soon(self) -> None:
        """Ask the flusher thread to publish now, without waiting (a save, a stop signal).

        Without ``background`` this publishes on the caller's thread, as :meth:`flush` does.
        """
        if self._background and not self._closed:
            self._ensure_flusher()
            self._wake.set()
        elif not self._closed:
            self._flush_quietly()

    def _ensure_flusher(self) -> None:
        if self._flusher is not None or self._stop.is_set():
            return
        with self._lock:
            if self._flusher is None:
                self._flusher = threading.Thread(
                    target=self._flush_loop, daemon=True, name=f"ckptsdk-runlog-{self.attempt}"
                )
                self._flusher.start()

    def _flush_loop(self) -> None:
        # Daemon: a killed or exiting interpreter must not wait for it; close() joins it first.
        while not self._stop.is_set():
            self._wake.wait(self.flush_interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._lock:
                idle = not self._buffer and self._pending is None
            if not idle:
                self._flush_quietly()

    def _flush_quietly(self) -> None:
        try:
            self.flush()
        except BackendError as exc:
            # Logging must not kill training; the steps stay buffered and go out with the
            # next flush (explicit flush() and close() do raise).
            logger.warning(
                "run log of attempt %d: could not publish buffered steps (%s); keeping them for the next flush",
                self.attempt,
                exc,
            )
            with self._lock:
                self._oldest = self._clock()

    def start(self) -> None:
        """Publish this attempt's record now (once), before any step is logged.

        The manager calls it right after ``restore()``, so an attempt killed before its first
        flush still shows in the audit, with where it resumed from.
        """
        with self._publish_lock:
            self._write_start()

    def _write_start(self) -> None:
        if self._started_written:
            return
        key = f"{attempt_prefix(self.attempt)}attempt.json"
        try:
            self.backend.create(key, self._record.to_json())
        except PreconditionFailed:
            # This attempt's log was opened before (a RunLog re-created in the same
            # attempt): the first record stands; every chunk header carries the current one.
            logger.info("run log: %s already exists; keeping it", key)
        self._started_written = True

    def flush(self) -> None:
        """Publish the buffered steps as one new chunk (no-op when nothing is buffered).

        Raises:
            BackendError: the chunk could not be written; the steps stay buffered.
        """
        self._publish(closed=False)

    def close(self) -> None:
        """Publish what is buffered and a final header marking the attempt closed cleanly.

        Idempotent. Raises ``BackendError`` if storage fails (the log stays open, retry is safe).
        """
        self._stop.set()
        self._wake.set()
        flusher = self._flusher
        if flusher is not None and flusher is not threading.current_thread():
            flusher.join()
        with self._publish_lock:
            if self._closed:
                return
            self._publish(closed=True)
            self._closed = True

    # -- internals -------------------------------------------------------------------------

    def _publish(self, *, closed: bool) -> None:
        # The manager may flush from its save thread while the training thread logs: the buffer
        # is swapped out under a short lock, publishing itself is serialised by another.
        with self._publish_lock:
            if self._pending is not None:
                self._send_pending()  # an earlier chunk first, byte for byte (see _send_pending)
            with self._lock:
                if not self._buffer and not closed:
                    return
            if self._next_seq is None:
                self._next_seq = _next_chunk_seq(self.backend, self.attempt)
            self._write_start()
            with self._lock:
                raw, self._buffer, self._oldest = self._buffer, [], None
            rows = [(step, t, {k: _resolve(v) for k, v in vals.items()}) for step, t, vals in raw]
            seen = [r[0] for r in rows] + ([self._record.last_step] if self._record.last_step is not None else [])
            seq = self._next_seq
            header = self._record.model_copy(
                update={
                    "last_step": max(seen, default=None),
                    "steps_logged": self._record.steps_logged + len(rows),
                    "chunk": seq,
                    "closed": closed,
                    **({"device": describe_device()} if self._detect else {}),
                }
            )
            lines = [header.to_json().decode().rstrip("\n")]
            lines += [StepRow(step=step, time=round(t, 3), scalars=vals).to_line() for step, t, vals in rows]
            self._pending = (chunk_key(self.attempt, seq), ("\n".join(lines) + "\n").encode(), len(rows))
            self._next_seq = seq + 1
            self._record = header
            self._send_pending()

    def _send_pending(self) -> None:
        # A chunk whose upload failed is retried with exactly the same bytes under the same key:
        # if the failed call had in fact landed (a timeout after GCS stored it), create() sees
        # identical content and all is well; new steps go into the next chunk.
        assert self._pending is not None
        key, data, n = self._pending
        self._create(key, data)
        self._pending = None
        logger.debug("run log: published %s (%d steps)", key, n)

    def _create(self, key: str, data: bytes) -> None:
        try:
            self.backend.create(key, data)
        except PreconditionFailed as exc:
            # A retried upload that had in fact succeeded comes back as "exists": same bytes,
            # nothing to do. Different bytes means another writer uses our attempt number.
            try:
                existing = self.backend.read(key)
            except ObjectNotFound:
                existing = None
            if existing != data:
                raise PreconditionFailed(
                    f"run log object {key!r} under {self.backend.url} already exists with other "
                    f"content: two writers share attempt {self.attempt}. Each attempt must come "
                    "from its own lease takeover; check that two jobs do not use this root",
                    url=self.backend.url,
                    key=key,
                ) from exc


def _check_scalar(name: str, value: Any, step: int) -> Any:
    if not _SCALAR_NAME_RE.match(name):
        raise ConfigError(f"log_step({step}): bad scalar name {name!r} (letters, digits, _ . / -)")
    if isinstance(value, float):
        return value
    if isinstance(value, numbers.Real):  # int, bool, numpy integer/floating, Fraction...
        return float(value)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise ConfigError(
                f"log_step({step}): scalar {name!r} is a tensor of shape {tuple(value.shape)}; "
                "log one number (e.g. loss.detach() of a 0-d tensor, or .mean())"
            )
        # Copy it, so that a later in-place update of the caller's tensor does not change what
        # was logged; reading it back waits until flush (no device sync per step).
        return value.detach().reshape(()).clone()
    raise ConfigError(
        f"log_step({step}): scalar {name!r} has type {type(value).__name__}; log numbers only "
        "(python/numpy numbers or one-element tensors)"
    )


def _resolve(value: Any) -> float:
    return value if isinstance(value, float) else float(value.item())


def _next_chunk_seq(backend: Backend, attempt: int) -> int:
    seqs = [
        parsed[1]
        for info in backend.list(attempt_prefix(attempt))
        if (parsed := parse_runlog_key(info.key)) is not None and parsed[1] is not None
    ]
    return max(seqs) + 1 if seqs else 0
