"""Preemption: SIGTERM (spot VMs, Kubernetes) or SIGINT (a notebook's stop) becomes one last save.

The handler only sets a flag. The manager's ``should_save`` then says yes at the next step
boundary, the save commits and the lease is released, all within one deadline (what cannot
finish by then is abandoned: the save uncommitted, the lease left for its ttl), and the signal's
original behaviour follows (the previous handler, chained; else death by that signal). A second signal
delivers the original behaviour at once. Saving itself belongs to the manager and saving.py.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_DEADLINE", "RELEASE_RESERVE_S", "Preemption", "release_reserve"]

#: Seconds from the final save's start to the exit: the save, the step log's last flush and the
#: lease release. GCE gives a spot VM 30 s, GKE spot 15 s, Kubernetes 30 s by default: 10 s leaves
#: room for the job to reach a step boundary.
DEFAULT_DEADLINE = 10.0

#: Of the deadline, the seconds kept back from the final save for the step log and the lease
#: release (a quarter of it when it is short): on a healthy store they take well under a second;
#: on a slow one the release is left for the lease's ttl, and the log says so.
RELEASE_RESERVE_S = 2.0


def release_reserve(deadline: float) -> float:
    """Seconds of ``deadline`` kept for what follows the final save.

    Example:
        >>> release_reserve(10.0), release_reserve(2.0)
        (2.0, 0.5)
    """
    return min(RELEASE_RESERVE_S, deadline / 4)


_Handler = Any  # signal.Handlers | Callable[[int, FrameType | None], Any] | int | None


class Preemption:
    """Signal handlers that turn a stop request into a flag the training loop polls.

    Args:
        signals: the signals to catch (default SIGTERM and SIGINT). A signal whose current
            handler is ``SIG_IGN`` is left alone: the process chose to ignore it.
        deadline: seconds from the final save's start to the exit (see ``DEFAULT_DEADLINE``).

    Example:
        >>> p = Preemption()
        >>> p.install()      # in the main thread
        True
        >>> p.requested
        False
        >>> p.uninstall()
    """

    def __init__(
        self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT), *, deadline: float = DEFAULT_DEADLINE
    ) -> None:
        self.signals = tuple(signals)
        self.deadline = deadline
        self.signum: int | None = None  # the first signal received
        self._frame: FrameType | None = None
        self._previous: dict[int, _Handler] = {}
        self._installed = False

    @property
    def requested(self) -> bool:
        """A stop signal arrived: save at the next step boundary, then stop."""
        return self.signum is not None

    def install(self) -> bool:
        """Install the handlers (main thread only); False if there is nothing to catch."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in self.signals:
            current = signal.getsignal(signum)
            if current == signal.SIG_IGN:
                continue
            self._previous[signum] = current
            signal.signal(signum, self._handle)
        self._installed = bool(self._previous)
        return self._installed

    def uninstall(self) -> None:
        """Put the previous handlers back where ours is still the one installed. Idempotent."""
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return  # signal.signal() works only there; an exit handler on another thread skips
        self._installed = False
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum, self._frame = signum, frame
            logger.warning(
                "received %s: saving a checkpoint at the next step boundary, then "
                "stopping (send it again to stop at once)",
                signal.Signals(signum).name,
            )
            return
        logger.warning(
            "received %s again: stopping at once (the last committed checkpoint stands)", signal.Signals(signum).name
        )
        self.deliver(signum, frame)

    def deliver(self, signum: int | None = None, frame: FrameType | None = None) -> None:
        """Do what the signal would have done without us: chain to the previous handler, else
        die by the signal (exit status 128 + signum). Returns only if that handler returns."""
        signum = self.signum if signum is None else signum
        if signum is None:
            return
        previous = self._previous.get(signum, signal.SIG_DFL)
        frame = frame if frame is not None else self._frame
        self.uninstall()
        if callable(previous):
            previous(signum, frame)  # e.g. default_int_handler raises KeyboardInterrupt
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])  # delivered here, if it was blocked
        raise SystemExit(128 + signum)  # not reached where the default action kills us
