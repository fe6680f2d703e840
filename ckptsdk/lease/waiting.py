"""Saying that ckptsdk is waiting, on stderr: for a live lease holder, for Drive's settle.

A wait of more than a moment is shown by default, not only logged (neither the library nor a
typical training script configures logging, so an INFO record reaches nobody): in a terminal a
tqdm countdown under one line that says why and how to skip it; otherwise that line at the start
and again about every 10 s. What is waited for, and when to stop, belongs to the caller.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

__all__ = ["WaitNotice", "LINE_EVERY_S", "SHOW_FROM_S"]

LINE_EVERY_S = 10.0  # without a terminal: one line this often
SHOW_FROM_S = 1.0  # shorter waits (tests, tiny settles) pass silently


class WaitNotice:
    """One wait, told to a person. Progress is judged by this process's real time only.

    Args:
        title: what is waited for, e.g. "waiting for the lease on gs://b/run".
        stream: where to write; None: ``sys.stderr`` as it is now.
        every: seconds between lines when ``stream`` is not a terminal.

    Example:
        >>> notice = WaitNotice("waiting for the lease on /tmp/run")
        >>> notice.update(remaining=45.0, total=60.0, detail="held by host 'vm' pid 7 ...")
        >>> notice.close("took over the lease")
    """

    def __init__(self, title: str, *, stream: TextIO | None = None, every: float = LINE_EVERY_S) -> None:
        self.title = title
        self.stream = stream if stream is not None else sys.stderr
        self.every = every
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self._bar: Any = None
        self._detail: str | None = None
        self._last_line: float | None = None
        self._lock = threading.Lock()

    def update(self, *, remaining: float, total: float, detail: str, goal: str = "go") -> None:
        """Show the wait.

        Args:
            remaining: seconds until the wait ends by itself; of ``total``.
            detail: why, and how to skip it (shown again only when it changes, in a terminal).
            goal: what happens when ``remaining`` reaches 0 ("takeover if it stays silent").
        """
        with self._lock:
            now = time.monotonic()
            status = f"{remaining:.0f} s to {goal}"
            if self.tty:
                if detail != self._detail:
                    self._write_above(f"ckptsdk: {self.title}: {detail}")
                self._draw(remaining, total, status)
            elif self._last_line is None or now - self._last_line >= self.every:
                self._write(f"ckptsdk: {self.title}: {detail}; {status}")
                self._last_line = now
            self._detail = detail

    def sleep(self, seconds: float, sleep: Any, *, detail: str, goal: str = "go") -> None:
        """``sleep(seconds)`` (the caller's, maybe simulated) while the notice counts down."""
        if seconds < SHOW_FROM_S:
            sleep(seconds)
            return
        start = time.monotonic()
        done = threading.Event()

        def tick() -> None:  # real time only: a simulated sleep returns at once and ends this
            while not done.wait(0.5 if self.tty else self.every):
                self.update(
                    remaining=max(0.0, seconds - (time.monotonic() - start)), total=seconds, detail=detail, goal=goal
                )

        self.update(remaining=seconds, total=seconds, detail=detail, goal=goal)
        ticker = threading.Thread(target=tick, name="ckptsdk-wait-notice", daemon=True)
        ticker.start()
        try:
            sleep(seconds)
        finally:
            done.set()
            ticker.join()
            self.close()

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

    def _write_above(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            self._write(line)

    def _write(self, line: str) -> None:
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed stderr must never break a save or a lease
            pass
