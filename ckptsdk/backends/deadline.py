"""One deadline for a whole save, carried by a context variable, and the retry schedule that honours it.

The save pipeline opens :func:`bounded` around the storage half of one save (and the shutdown
after a stop signal around everything that follows it); every retry loop and socket timeout of
the object-store transports (``gcs_transport.py``, ``s3_transport.py``) takes its time from
:class:`Retries`, so a frozen store fails the save with ``DeadlineExceeded`` naming the store and
what was waited for, instead of each request waiting out its own bound in turn. A thread sees the
deadline only if it runs in a copy of the caller's context (:func:`carried`). What a save does,
and what a request means, do not belong here.
"""

from __future__ import annotations

import contextvars
import math
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from ckptsdk.errors import DeadlineExceeded

__all__ = ["MIN_RATE_BPS", "SAVE_RATE_BPS", "Deadline", "Retries", "bounded", "carried", "current", "socket_timeout"]

_T = TypeVar("_T")

#: The slowest transfer the time bounds allow for (bytes per second, 1 MiB/s): a save's
#: deadline, like each request's, grows by its bytes at this rate, so a big checkpoint on a slow
#: but working link is not cut off. One rule for both (see ``SaveOptions.save_deadline``).
MIN_RATE_BPS = 1 << 20
#: What a whole save's default deadline allows per byte (8 MiB/s): one request on a slow link may
#: take its time, but a save's default stays well under twice the lease ttl for the states users
#: checkpoint every few minutes (89 MB: ttl + 11 s), and a frozen store is noticed in about a ttl
#: whatever the state's size. A slower link needs an explicit ``save_deadline``, as the error says.
SAVE_RATE_BPS = 8 << 20

_CURRENT: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar("ckptsdk_deadline", default=None)


@dataclass(frozen=True)
class Deadline:
    """When the work in this context must be over (``time.monotonic()``), and what that work is.

    Attributes:
        at: the monotonic time it ends.
        seconds: how long it was, for messages.
        what: the work, e.g. ``"the save of step 5 under gs://b/run"``.
        option: the option that sets it (``"save_deadline"``, ``"signal_deadline"``), for the hint.
    """

    at: float
    seconds: float
    what: str
    option: str

    def remaining(self) -> float:
        """Seconds left (negative once passed)."""
        return self.at - time.monotonic()

    def exceeded(self, *, url: str, key: str | None, waited_for: str) -> DeadlineExceeded:
        """The error for this deadline passing while ``waited_for`` (a request, at which store) was pending."""
        return DeadlineExceeded(
            f"{self.what} did not finish within its {self.seconds:.1f} s deadline ({self.option}): still "
            f"waiting for {waited_for}. Nothing was committed after it; the previous committed checkpoint "
            f"is intact. Check that the store answers, or raise {self.option}",
            url=url,
            key=key,
            seconds=self.seconds,
            waited_for=waited_for,
        )


def current() -> Deadline | None:
    """The deadline of the work in this context, if any."""
    return _CURRENT.get()


@contextmanager
def bounded(
    seconds: float, what: str, *, option: str, nbytes: int = 0, rate: float = MIN_RATE_BPS
) -> Iterator[Deadline]:
    """Bound everything this context does for ``seconds``, plus ``nbytes`` at ``rate`` bytes per
    second; an earlier deadline already set wins.

    Example:
        >>> with bounded(30.0, "the save of step 5 under memory://x", option="save_deadline") as d:
        ...     0 < d.remaining() <= 30.0
        True
        >>> current() is None
        True
    """
    outer = _CURRENT.get()
    seconds += nbytes / rate
    mine = Deadline(time.monotonic() + seconds, seconds, what, option)
    if outer is not None and outer.at <= mine.at:
        mine = outer  # the stop after a signal bounds the save inside it
    token = _CURRENT.set(mine)
    try:
        yield mine
    finally:
        _CURRENT.reset(token)


def carried(fn: Callable[[], _T]) -> Callable[[], _T]:
    """``fn`` to run on another thread in a copy of this context: the deadline goes with it.

    A new thread starts with an empty context (Python < 3.14), so without this a save handed to
    the worker thread, or the shutdown after a signal, would run unbounded.
    """
    context = contextvars.copy_context()
    return lambda: context.run(fn)


class Retries:
    """The attempts of one request: at most ``attempts``, a jittered exponential backoff between
    them, all within ``allowance`` seconds and the current deadline (the earlier of the two).

    Iterate for the seconds each attempt may take; after the loop, :meth:`expired` tells whether
    the deadline of the save (not the request's own allowance) is what ended it.

    Args:
        attempts: tries at most.
        backoff: seconds before the second try; doubled before each next one.
        spread: the jitter, as a fraction of each pause (from ``jitter``).
        allowance: the request's own bound, all attempts together.
        jitter: the generator of the jitter; never the global ``random`` (a save must not move a
            training job's Python RNG stream).

    Example:
        >>> r = Retries(3, backoff=0.0, spread=0.0, allowance=10.0, jitter=random.Random(0))
        >>> [round(left) for left in r], r.tried, r.expired()
        ([10, 10, 10], 3, False)
    """

    def __init__(
        self, attempts: int, *, backoff: float, spread: float, allowance: float, jitter: random.Random
    ) -> None:
        self.attempts, self.backoff, self.spread, self._jitter = attempts, backoff, spread, jitter
        self.deadline = _CURRENT.get()
        self.end = time.monotonic() + allowance
        if self.deadline is not None:
            self.end = min(self.end, self.deadline.at)
        self.tried = 0

    def __iter__(self) -> Iterator[float]:
        for attempt in range(self.attempts):
            if attempt:
                pause = self.backoff * 2 ** (attempt - 1) * (1 + self.spread * self._jitter.random())
                time.sleep(max(0.0, min(pause, self.end - time.monotonic())))
            left = self.end - time.monotonic()
            if left <= 0:
                return
            self.tried += 1
            yield left

    def expired(self) -> bool:
        """The deadline of the save has passed (so it, not the request's allowance, ended the tries)."""
        return self.deadline is not None and self.deadline.remaining() <= 0

    def cut_short(self) -> bool:
        """Fewer tries than allowed were made (a time bound ended them)."""
        return self.tried < self.attempts


def socket_timeout(configured: float, left: float) -> float:
    """A socket timeout no longer than ``left`` (at least 1 s), in powers of two below ``configured``.

    For clients whose timeouts are fixed when they are made (botocore): a few sizes, each made
    once, instead of one client per request.

    Example:
        >>> socket_timeout(60.0, 100.0), socket_timeout(60.0, 11.0), socket_timeout(60.0, 0.2)
        (60.0, 8.0, 1.0)
    """
    if left >= configured:
        return configured
    return float(2 ** math.floor(math.log2(max(left, 1.0))))
