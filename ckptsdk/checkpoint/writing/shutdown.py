"""How a checkpoint writer ends: the last save after a stop signal, ``close``, interpreter exit.

:class:`Shutdown` is a collaborator of ``ckptsdk.manager.CheckpointManager`` holding those steps
(wait for the save in flight, stop the pipeline, close the step log, release the lease, let the
signal act). Opening, restoring and saving belong to the manager; the save pipeline to ``saving.py``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from ckptsdk.backends.deadline import Deadline, bounded, carried
from ckptsdk.checkpoint.reading.catalog import CheckpointInfo
from ckptsdk.checkpoint.writing.saving import SavePipeline
from ckptsdk.checkpoint.writing.scheduling import SaveStats
from ckptsdk.errors import BackendError, CheckpointError, CkptError, LeaseLostError
from ckptsdk.format.manifest import FileEntry, Position
from ckptsdk.lease.acquire import Lease
from ckptsdk.preemption import Preemption, release_reserve
from ckptsdk.runlog.writer import RunLog

logger = logging.getLogger(__name__)

__all__ = ["Shutdown", "close_at_exit"]


class Shutdown:
    """The ending of one manager: what ``CheckpointManager`` set up, this stops.

    Args:
        url: the root (for messages).
        lease: the writer lease (None: a read-only manager).
        runlog: the attempt's step log (None: a read-only manager).
        saving: the save pipeline (None: a read-only manager).
        preemption: the installed stop-signal handler, if any.
        lock: the manager's save lock (the last save after a signal takes it).
    """

    def __init__(
        self,
        url: str,
        *,
        lease: Lease | None,
        runlog: RunLog | None,
        saving: SavePipeline | None,
        preemption: Preemption | None,
        lock: threading.RLock,
    ) -> None:
        self.url = url
        self.lease = lease
        self.runlog = runlog
        self._saving = saving
        self._preemption = preemption
        self._lock = lock
        self._closed = False

    @property
    def closed(self) -> bool:
        """``close()`` was called (or the interpreter exit or a stop signal closed it)."""
        return self._closed

    @property
    def stats(self) -> SaveStats:
        """Saves committed, replaced, skipped, failed; save times (none for a reader)."""
        return SaveStats() if self._saving is None else self._saving.stats

    def save_and_stop(
        self,
        state: Any,  # TrainState | Stateful | Mapping[str, Any] (ckptsdk.state is a layer above)
        *,
        step: int,
        position: Position,
        metrics: Mapping[str, Any] | None,
        tags: Mapping[str, str] | None,
        extra_files: Sequence[FileEntry] = (),
    ) -> CheckpointInfo:
        """The last save after a stop signal, then close, then let the signal act (this returns
        only if a chained handler returns). All of it within ``signal_deadline``: the save, the
        step log's last flush and the lease release."""
        assert self._preemption is not None and self._saving is not None
        seconds = self._preemption.deadline
        finished = False
        failure: BaseException | None = None
        stopped: BaseException | None = None
        what = f"the stop after a signal under {self.url} (the save of step {step}, the step log, the lease release)"
        # The save may use all but a reserve: the step log and the release come after it.
        saving = f"the save of step {step} under {self.url} after a stop signal"
        with bounded(seconds, what, option="signal_deadline") as deadline:
            try:
                with self._lock, bounded(seconds - release_reserve(seconds), saving, option="signal_deadline") as due:
                    # A save already in flight finishes first (its failure surfaces here).
                    if self._saving.wait(max(0.0, due.remaining())):
                        # Not blocking: the worker carries this context, so the deadline bounds
                        # its requests, and the wait below gives up at the deadline whatever the
                        # store does (a frozen mount, a backend that ignores the deadline).
                        self._saving.save(
                            state,
                            step=step,
                            position=position,
                            metrics=metrics,
                            tags=tags,
                            blocking=False,
                            snapshot="copy",
                            extra_files=extra_files,
                        )
                        finished = self._saving.wait(max(0.0, due.remaining()))
            except (CkptError, OSError) as exc:  # the signal must still act: say it, stop, exit
                failure = exc
                logger.error(
                    "stop signal: the save of step %d under %s failed (%s); the previous committed checkpoint stands",
                    step,
                    self.url,
                    exc,
                )
            else:
                if finished:
                    logger.warning("stop signal: committed step %d under %s; stopping", step, self.url)
                else:
                    logger.error(
                        "stop signal: the save of step %d under %s took over %.1f s (signal_deadline); "
                        "abandoned (the previous committed checkpoint stands)",
                        step,
                        self.url,
                        seconds,
                    )
            finally:  # whatever happened, the writer stops
                if not finished:
                    self._saving.abandon()
                stopped = self._stop_by(deadline, wait=finished)
        failure = stopped or failure
        self._preemption.deliver()
        # Only a chained handler that returns brings us here: the job goes on, without a writer.
        if failure is not None:
            raise failure
        return self._saving.last_committed or CheckpointInfo(
            step=step,
            epoch=self._saving.rank[0],
            tag=self._saving.rank[1],
            key="",
            size=0,
            committed=False,
            valid=False,
            reason="abandoned after a stop signal",
        )

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a background save; re-raise its failure. False if it is still running."""
        return True if self._saving is None else self._saving.wait(timeout)

    def close(self) -> None:
        """Wait for a background save, flush the step log, release the lease. Idempotent.

        A stop signal that arrived since (``save_on_signal``) and was not yet acted on by a
        save takes effect here, once the lease is released; then all of this is bounded by
        ``signal_deadline``, as after the last save.
        """
        if self._closed:
            return
        if self._preemption is None or not self._preemption.requested:
            self._shutdown(wait=True)
            return
        what = f"closing {self.url} after a stop signal (the save in flight, the step log, the lease release)"
        with bounded(self._preemption.deadline, what, option="signal_deadline") as deadline:
            failure = self._stop_by(deadline, wait=True)
        self._preemption.deliver()
        if failure is not None:
            raise failure

    def _stop_by(self, deadline: Deadline, *, wait: bool) -> BaseException | None:
        """``_shutdown`` on a helper thread, waited for until ``deadline`` only; its failure, if any.

        What has not finished by then is left to run while the process exits: the signal's
        platform grants a grace period, not more, and a store can hang any one call (a frozen
        server, a Drive mount). A release left unfinished leaves the lease to expire after its
        ttl; it is never half-written (a lease write is one atomic publish).
        """
        failures: list[BaseException] = []

        def run() -> None:
            try:
                self._shutdown(wait=wait)
            except BaseException as exc:  # kept for the caller; logged below
                failures.append(exc)

        helper = threading.Thread(target=carried(run), name="ckptsdk-stop", daemon=True)
        helper.start()
        helper.join(max(0.0, deadline.remaining()))
        if helper.is_alive():
            if self._saving is not None:
                self._saving.abandon()  # a save still in flight must not commit after this message
            ttl = self.lease.ttl if self.lease is not None else float("nan")
            logger.error(
                "stop signal: closing %s did not finish within signal_deadline (%.1f s): the step log's "
                "last steps may be missing, and the lease is left for its ttl (%g s): the next writer "
                "takes over after it. The last committed checkpoint stands",
                self.url,
                deadline.seconds,
                ttl,
            )
            return None
        if failures:
            logger.error(
                "stop signal: closing %s failed: %s (the last committed checkpoint stands)", self.url, failures[0]
            )
            return failures[0]
        return None

    def _shutdown(self, *, wait: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if self._preemption is not None:
            self._preemption.uninstall()
        try:
            if self._saving is not None:
                self._saving.stop()
                if wait:
                    self._saving.wait()
                    self._say_unsaved()
        finally:
            if self._saving is not None and wait:  # (a stop signal's deadline has no time for it)
                self._saving.close()  # the referenced base's last re-hash (a warning, never a failure)
            try:
                if self.runlog is not None:
                    self.runlog.close()
            finally:
                if self.lease is not None:
                    self.lease.release()

    def _say_unsaved(self) -> None:
        """Warn when this attempt logged steps past its newest checkpoint: a loop that saves every
        N steps and stops between two saves ends with its last steps in no checkpoint (a run of
        96 steps saved at 91: ``export`` gave step 91's weights, a resume repeats 92..96)."""
        logged = self.runlog.last_logged if self.runlog is not None else None
        if logged is None or self._saving is None:
            return
        newest = self._saving.last_committed or self._saving.writer.resumed_from
        saved = newest.step if newest is not None else None
        if saved is not None and saved >= logged:
            return
        since = f"steps {saved + 1}..{logged}" if saved is not None and saved + 1 < logged else f"step {logged}"
        logger.warning(
            "closing %s: the newest checkpoint is %s; %s %s logged but not saved (a resume runs %s again, "
            "`ckptsdk export` gives %s). Save the last step before close(): mgr.save(state, step=%d)",
            self.url,
            f"step {saved}" if saved is not None else "none (nothing was saved)",
            since,
            "were" if since.startswith("steps") else "was",
            "them" if since.startswith("steps") else "it",
            f"step {saved}'s weights" if saved is not None else "nothing",
            logged,
        )


def close_at_exit(ref: weakref.ReferenceType[Shutdown]) -> None:
    """``atexit``'s: close a manager its job left open (``ref``: its shutdown, gone with it)."""
    mgr = ref()
    if mgr is None or mgr.closed:
        return
    if mgr._saving is not None and mgr._saving.busy:
        logger.warning("interpreter exit: waiting for the checkpoint save in flight under %s", mgr.url)
    try:
        mgr.close()
    except CheckpointError as exc:
        logger.error("interpreter exit: the last save under %s failed: %s", mgr.url, exc)
    except (BackendError, LeaseLostError) as exc:
        logger.error("interpreter exit: closing %s failed: %s (the last committed checkpoint is intact)", mgr.url, exc)
