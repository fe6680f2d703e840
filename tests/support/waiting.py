"""Waiting in tests for something another thread or process does, with a deadline and a reason.

``wait_for`` is the one place a test polls: it returns as soon as the condition holds (no fixed
sleep to tune), and on timeout fails naming what never happened. Where the code under test offers
an event, wait on that instead; where time itself is the subject, use a fake clock
(tests/support/drive_deterministic_sim.py). Nothing here knows ckptsdk.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: How often a condition is looked at: short next to any deadline, long enough not to spin a core.
POLL_S = 0.01


def poll_until(condition: Callable[[], T], timeout: float, *, interval: float = POLL_S) -> T | None:
    """The first truthy value of ``condition()`` within ``timeout`` seconds, else None.

    The condition is looked at once more after the deadline, so a slow machine that let the
    deadline pass while the thing happened still sees it.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


def wait_for(condition: Callable[[], T], timeout: float, what: str, *, interval: float = POLL_S) -> T:
    """The first truthy value of ``condition()``; fail (AssertionError) after ``timeout`` s.

    Args:
        condition: looked at every ``interval`` seconds; may raise to fail at once (a child
            process that died, an error event).
        timeout: generous: a deadline for a hung test, never a measure of speed.
        what: what was awaited, for the failure message.
    """
    value = poll_until(condition, timeout, interval=interval)
    if not value:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")
    return value
