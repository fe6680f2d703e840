"""The lease's heartbeat: a daemon thread that renews a held lease every ttl/3.

A collaborator of :class:`ckptsdk.lease.acquire.Lease`, which makes one and starts, stops or
restarts it; what a renewal writes, judges and fences is the lease's. Nothing else belongs here.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from ckptsdk.errors import BackendError, LeaseLostError

if TYPE_CHECKING:
    from ckptsdk.lease.acquire import Lease

logger = logging.getLogger(__name__)

__all__ = ["Heartbeat"]


class Heartbeat:
    """Renews ``lease`` from a daemon thread until it is fenced or released.

    A renewal that finds another holder fences the lease and ends the thread; storage errors are
    retried at the next beat, and fence the lease once no renewal succeeded for a whole ttl. The
    first beat after the lease's settle is its background read-back, so it is not left to chance.

    Args:
        lease: the lease it renews.
    """

    def __init__(self, lease: Lease) -> None:
        self._lease = lease
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def thread(self) -> threading.Thread | None:
        """The running thread, if any (tests join it)."""
        return self._thread

    def start(self, interval: float) -> None:
        """Beat every ``interval`` seconds (a no-op while a beat thread runs)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run,
            args=(interval,),
            name=f"ckptsdk-lease-heartbeat-e{self._lease.epoch}",
            daemon=True,
        )
        self._thread.start()

    def stop_soon(self) -> None:
        """Ask the thread to end at its next wake-up (safe under the lease's lock: no join)."""
        self._stop.set()

    def stop(self) -> None:
        """End the thread and wait for it (at most a ttl; never from the thread itself)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(5.0, self._lease.ttl))
        self._thread = None

    def _run(self, interval: float) -> None:
        # Real time on purpose: Event.wait lets stop() end us at once.
        lease = self._lease
        while not self._stop.wait(self._next_beat(interval)):
            try:
                lease.renew()
                logger.debug("renewed the lease on %s (epoch %d)", lease.url, lease.epoch)
            except LeaseLostError as exc:
                logger.error("lease heartbeat on %s stopped: %s", lease.url, exc)
                return
            except BackendError as exc:
                stale = lease.seconds_since_renewal()
                logger.warning("lease renewal on %s failed (%s); last success %.1f s ago", lease.url, exc, stale)
                if stale > lease.ttl:
                    lease.fence(f"could not renew for {stale:.1f} s (> ttl): {exc}")
                    return
            except Exception as exc:  # a bug here must not leave a writer without a lease
                logger.exception("lease heartbeat on %s crashed", lease.url)
                lease.fence(f"the lease heartbeat crashed: {exc!r}")
                return

    def _next_beat(self, interval: float) -> float:
        due = self._lease.seconds_to_read_back()
        return interval if due is None else min(interval, max(0.0, due) + 0.01)
