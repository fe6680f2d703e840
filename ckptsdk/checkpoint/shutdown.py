"""How a checkpoint writer ends: the last save after a stop signal, ``close``, interpreter exit.

``WriterShutdown`` is a base of ``ckptsdk.manager.CheckpointManager`` holding those steps (wait
for the save in flight, stop the pipeline, close the step log, release the lease, let the signal
act). Opening, restoring and saving belong to the manager; the save pipeline to ``saving.py``.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from ckptsdk.checkpoint.catalog import CheckpointInfo
from ckptsdk.checkpoint.saving import SavePipeline
from ckptsdk.checkpoint.scheduling import SaveStats
from ckptsdk.errors import BackendError, CheckpointError, LeaseLostError
from ckptsdk.format.manifest import FileEntry, Position
from ckptsdk.lease.acquire import Lease
from ckptsdk.preemption import Preemption
from ckptsdk.runlog.writer import RunLog

# The manager's logger, as before these steps moved here: their records keep their logger name.
logger = logging.getLogger("ckptsdk.manager")

__all__ = ["WriterShutdown"]


class WriterShutdown:
    """The ending half of a writer: what ``CheckpointManager`` sets up, this stops."""

    url: str
    lease: Lease | None
    runlog: RunLog | None
    _saving: SavePipeline | None
    _preemption: Preemption | None
    _lock: threading.RLock
    _closed: bool

    @property
    def stats(self) -> SaveStats:
        """Saves committed, replaced (by a newer one while waiting), skipped, failed; save times.

        Example:
            >>> import torch
            >>> from ckptsdk import CheckpointManager
            >>> mgr = CheckpointManager("memory://stats", lease_ttl=5)
            >>> _ = mgr.save({"w": torch.ones(2)}, step=1)
            >>> mgr.stats.committed, mgr.stats.replaced, mgr.stats.skipped
            (1, 0, 0)
            >>> mgr.close()
        """
        return SaveStats() if self._saving is None else self._saving.stats

    def _save_and_stop(
        self,
        state: Any,  # TrainState | Stateful | Mapping[str, Any] (ckptsdk.state is a layer above)
        *,
        step: int,
        position: Position,
        metrics: Mapping[str, Any] | None,
        tags: Mapping[str, str] | None,
        extra_files: Sequence[FileEntry] = (),
    ) -> CheckpointInfo:
        """The last save after a stop signal: commit within the deadline, close, then let the
        signal act (this returns only if a chained handler returns)."""
        assert self._preemption is not None and self._saving is not None
        deadline = self._preemption.deadline
        end = time.monotonic() + deadline
        finished = False
        try:
            with self._lock:
                # A save already in flight finishes first (its failure surfaces here).
                if self._saving.wait(deadline):
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
                    finished = self._saving.wait(max(0.0, end - time.monotonic()))
            if finished:
                logger.warning("stop signal: committed step %d under %s; stopping", step, self.url)
            else:
                logger.error(
                    "stop signal: the save of step %d under %s took over %.0f s; abandoned "
                    "(the previous committed checkpoint stands)",
                    step,
                    self.url,
                    deadline,
                )
        finally:
            if not finished:
                self._saving.abandon()
            self._shutdown(wait=finished)
        self._preemption.deliver()
        # Only a chained handler that returns brings us here: the job goes on, without a writer.
        return self._saving.last_committed or CheckpointInfo(
            step=step,
            epoch=self._saving.rank[0],
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
        save takes effect here, once the lease is released.
        """
        if self._closed:
            return
        self._shutdown(wait=True)
        if self._preemption is not None and self._preemption.requested:
            self._preemption.deliver()

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
        finally:
            try:
                if self.runlog is not None:
                    self.runlog.close()
            finally:
                if self.lease is not None:
                    self.lease.release()


def _close_at_exit(ref: weakref.ReferenceType[WriterShutdown]) -> None:
    mgr = ref()
    if mgr is None or mgr._closed:
        return
    if mgr._saving is not None and mgr._saving.busy:
        logger.warning("interpreter exit: waiting for the checkpoint save in flight under %s", mgr.url)
    try:
        mgr.close()
    except CheckpointError as exc:
        logger.error("interpreter exit: the last save under %s failed: %s", mgr.url, exc)
    except (BackendError, LeaseLostError) as exc:
        logger.error("interpreter exit: closing %s failed: %s (the last committed checkpoint is intact)", mgr.url, exc)
