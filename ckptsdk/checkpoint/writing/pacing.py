"""Pacing: a background save's tensor writes give way to the optimizer step.

Why: on a machine with few cores (a Colab VM has two) an optimizer step that runs on torch's
intra-op threads loses most of its speed when the save worker takes one of the cores to copy a
tensor file into the page cache: the threads of the step wait on each other. Measured with
``benchmarks/gpu_like.py`` on 2 cores (89 MB ResNet-18 state, SGD update on 2 threads): the step
after a save took +20 to +70 ms more than without saving; with one intra-op thread, +3 ms.

So the worker writes a tensor file in slices of at most ``SLICE_BYTES`` and, before each slice,
waits while an optimizer step of the saved ``TrainState`` runs (``TrainState.steps_idle``), for at
most ``MAX_WAIT_S`` in all per file: a save still finishes when steps run back to back, or when a
step raised and never said it ended. The file's digest, hashed on a thread of its own once the
writes are done (while the store syncs), gives way the same way, slice by slice, from the same
budget: unpaced, it added 5-11 ms per 10-step period to the steps beside it. Only the bytes'
order in time changes, never the bytes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from ckptsdk.backends.base import Data, ObjectInfo, Writable

__all__ = ["MAX_WAIT_S", "SLICE_BYTES", "Paced"]

#: The largest piece written between two looks at the gate (~1-2 ms of copying on a small VM).
SLICE_BYTES = 4 << 20
#: The most a file's writes wait for optimizer steps in all (then they no longer wait).
MAX_WAIT_S = 0.5


class Paced:
    """The backend as ``write_tensorfile`` sees it for a background save: its ``write`` hands
    the chunks on in slices, each once ``idle`` is set (or the wait budget is spent).

    Args:
        backend: what ``write_tensorfile`` would have written to (a backend, or ``InPlace``).
        idle: set while no optimizer step runs (``TrainState.steps_idle``).
        max_wait: the wait budget of one file, in seconds.

    Example:
        >>> from ckptsdk import open_backend
        >>> idle = threading.Event()
        >>> idle.set()
        >>> Paced(open_backend("memory://pace"), idle).write("f", [b"abc"]).size
        3
    """

    def __init__(self, backend: Writable, idle: threading.Event, *, max_wait: float = MAX_WAIT_S) -> None:
        self._backend = backend
        self._idle = idle
        self._left = max_wait
        self.url = backend.url
        self.waited = 0.0  # seconds spent waiting for steps (a check for tests and benchmarks)

    def write(self, key: str, data: Data) -> ObjectInfo:
        return self._backend.write(key, self._slices(data))

    def _slices(self, data: Data) -> Iterator[memoryview]:
        for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
            view = memoryview(chunk)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            for start in range(0, len(view), SLICE_BYTES):
                self.wait()
                yield view[start : start + SLICE_BYTES]

    def wait(self) -> None:
        """Return once no optimizer step runs, or at once when the file's wait budget is spent.

        The writes call it before each slice, then the digest thread before each slice it hashes
        (``write_tensorfile(pause=...)``): one after the other, never at once (the hash starts
        after the last write), so the budget needs no lock.
        """
        if self._left <= 0 or self._idle.is_set():
            return
        t = time.monotonic()
        self._idle.wait(self._left)
        spent = time.monotonic() - t
        self._left -= spent
        self.waited += spent
