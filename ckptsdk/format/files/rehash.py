"""Re-hashing referenced live tensors off the training thread: edits torch cannot see (``.data``, numpy).

A referenced tensor's bytes may change without moving its version counter (``p.data.add_``, a
numpy view written in place): only its bytes tell. ``Rehasher`` hashes the tensors a writer
references in passes on its own thread (one every ``interval`` seconds, one on demand) and says
which ones no longer hold their recorded digest. When a save may name a tensor, and what it does
with a changed one, belongs to the save path (ckptsdk/checkpoint/), not here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

import torch

from ckptsdk.format.files.reference import CHUNK_BYTES, hash_tensor

__all__ = ["Rehasher"]


class Rehasher:
    """Hash ``tensors`` in passes on a background thread; remember which differ from ``digests``.

    A change is sticky: once a tensor was seen with other bytes it stays changed (changed back, it
    is still not what every checkpoint since the last pass saw). ``confirm(since)`` is the rule a
    save applies: it waits for a whole pass that began at or after ``since`` (the save's instant),
    so that a tensor it reports unchanged held its digest after that instant; a frozen tensor is
    not stepped, so only an edit could have changed it in between, and such an edit shows in that
    pass or the next.

    Args:
        tensors: path -> the live tensor (held by reference, read only).
        digests: path -> its recorded tensor digest (``reference.hash_tensor``).
        interval: seconds between background passes (0: passes only on demand).
        clock: a monotonic clock (tests pass their own).
        checked_at: when the pass that computed ``digests`` from these very tensors began (by
            ``clock``), which then counts as this rehasher's first; None: no pass yet.

    Example:
        >>> w = torch.zeros(4)
        >>> with Rehasher({"w": w}, {"w": hash_tensor(w)}, interval=0) as watch:
        ...     before = watch.confirm()
        ...     w.numpy()[0] = 1.0  # an edit torch's version counter does not see
        ...     after = watch.confirm()
        >>> before, list(after)
        ({}, ['w'])
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        digests: Mapping[str, str],
        *,
        interval: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        checked_at: float | None = None,
    ) -> None:
        missing = sorted(set(tensors) ^ set(digests))
        if missing:
            raise ValueError(f"tensors and digests name different paths: {missing[:3]}")
        self._tensors = dict(tensors)
        self._digests = dict(digests)
        self._interval = interval
        self._clock = clock
        self._changed: dict[str, str] = {}
        self._cond = threading.Condition()
        self._passed_since: float | None = checked_at  # when the newest finished pass began
        self._wanted = False
        self._closing = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ckptsdk-rehash", daemon=True)
        self._thread.start()

    def __enter__(self) -> Rehasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def changed(self) -> dict[str, str]:
        """Path -> the digest found, of every tensor seen changed so far (no waiting)."""
        with self._cond:
            self._raise_error()
            return dict(self._changed)

    def confirm(self, since: float | None = None, *, timeout: float | None = None) -> dict[str, str]:
        """Wait for a whole pass begun at or after ``since`` (default: now); return ``changed()``.

        Raises:
            TimeoutError: no such pass within ``timeout`` seconds.
            RuntimeError: the rehasher is closed.
        """
        since = self._clock() if since is None else since
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._passed_since is None or self._passed_since < since:
                self._raise_error()
                if self._closing:
                    raise RuntimeError("the rehasher is closed; nothing confirms the tensors any more")
                self._wanted = True
                self._cond.notify_all()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no re-hash pass of {len(self._tensors)} tensor(s) finished in {timeout} s")
                self._cond.wait(left)
            self._raise_error()
            return dict(self._changed)

    def close(self) -> dict[str, str]:
        """One last pass (an edit after the newest save shows), then stop the thread; ``changed()``."""
        if self._thread.is_alive() and not self._closing:
            found = self.confirm()
        else:
            found = self.changed()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        return found

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"re-hashing the referenced tensors failed: {self._error}") from self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._wanted and not self._closing:
                    self._cond.wait(self._interval or None)
                if self._closing:
                    return
                self._wanted = False
            try:
                self._one_pass()
            except Exception as exc:  # noqa: BLE001 - handed to the caller by confirm/changed/close
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return

    def _one_pass(self) -> None:
        began = self._clock()
        found = {}
        for path, t in self._tensors.items():
            digest = hash_tensor(t, chunk_bytes=CHUNK_BYTES)  # the host buffer bound of a CUDA pass
            if digest != self._digests[path]:
                found[path] = digest
        with self._cond:
            for path, digest in found.items():
                self._changed.setdefault(path, digest)
            self._passed_since = began
            self._cond.notify_all()
