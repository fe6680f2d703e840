"""Saying that ckptsdk is waiting for a live lease holder, on stderr, as one line.

A wait of more than a moment is shown by default, not only logged (neither the library nor a
typical training script configures logging, so an INFO record reaches nobody): in a terminal one
line that says who holds the lease, why we wait and how to skip it, under a tqdm countdown that
redraws in place; otherwise (a log file, a notebook cell's captured stderr) that line once, with
the countdown as it stood, and one line for the outcome. What is waited for, and when to stop,
belongs to the caller.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO

__all__ = ["WaitNotice", "SHOW_FROM_S"]

SHOW_FROM_S = 1.0  # shorter waits (tests, tiny settles) pass silently


class WaitNotice:
    """One wait, told to a person once, then counted down in place where the stream allows it.

    Args:
        title: what is waited for, e.g. "waiting for the lease on gs://b/run".
        stream: where to write; None: ``sys.stderr`` as it is now.

    Example:
        >>> notice = WaitNotice("waiting for the lease on /tmp/run")
        >>> notice.update(remaining=45.0, total=60.0, detail="held by host 'vm' pid 7 ...")
        >>> notice.close("took over the lease")
    """

    def __init__(self, title: str, *, stream: TextIO | None = None) -> None:
        self.title = title
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self._bar: Any = None
        self._detail: str | None = None
        self._lock = threading.Lock()

    def update(self, *, remaining: float, total: float, detail: str, goal: str = "go") -> None:
        """Show the wait: its line the first time, then only the countdown (in a terminal).

        Args:
            remaining: seconds until the wait ends by itself; of ``total``.
            detail: who and why, and how to skip it; said once per wait (a holder's renewal
                count changes in it at every renewal, which is no news to a person).
            goal: what happens when ``remaining`` reaches 0 ("take over if it stays silent").
        """
        with self._lock:
            status = f"{remaining:.0f} s to {goal}"
            if self._detail is None:
                line = f"ckptsdk: {self.title}: {detail}"
                self._write(line if self.tty else f"{line}; {status}")
                self._detail = detail
            if self.tty:
                self._draw(remaining, total, status)

    def close(self, outcome: str | None = None) -> None:
        """End the countdown; ``outcome`` (if any, and if anything was shown) is one last line."""
        with self._lock:
            shown = self._detail is not None
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            if outcome and shown:
                self._write(f"ckptsdk: {outcome}")
            self._detail = None

    def _draw(self, remaining: float, total: float, status: str) -> None:
        from tqdm.auto import tqdm

        total = max(total, 1e-9)
        if self._bar is None or abs(self._bar.total - total) > 1e-6:
            if self._bar is not None:
                self._bar.close()
            self._bar = tqdm(
                total=total,
                file=self.stream,
                leave=False,
                dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {postfix}",
                desc="ckptsdk",
            )
        self._bar.n = min(total, max(0.0, total - remaining))
        self._bar.set_postfix_str(status, refresh=True)

    def _write(self, line: str) -> None:
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed stderr must never break a save or a lease
            pass
