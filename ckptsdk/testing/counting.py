"""A backend wrapper that counts the bytes each operation sends to storage (tests, benchmarks).

Everything is forwarded to the wrapped backend; ``bytes_written`` adds up what ``write``,
``create``, ``replace`` and ``overwrite`` streamed, so a test can tell a full copy (the bytes pass
through here) from a cheap one (``copy``: a hard link or a server-side rewrite, counted apart).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

from ckptsdk.backends.base import Data, durable_batch, iter_chunks


class CountingBackend:
    """Forward to ``inner``; count bytes and calls per operation.

    Attributes:
        bytes_written: bytes streamed by write/create/replace/overwrite.
        by_key: the same, per key written.
        calls: operations seen, by name.
        ops: every operation as ``(name, key)``, in the order they started (the key is the first
            argument; ``copy`` records its destination).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.url = inner.url
        self.capabilities = inner.capabilities
        self.bytes_written = 0
        self.by_key: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.ops: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # read, open, stat, exists, list, delete, sweep, move
        attr = getattr(self.inner, name)
        if callable(attr):

            def counted(*args: Any, **kwargs: Any) -> Any:
                with self._lock:
                    self.calls[name] += 1
                    self.ops.append((name, str(args[0]) if args else ""))
                return attr(*args, **kwargs)

            return counted
        return attr

    def _count(self, op: str, key: str, data: Data) -> Iterator[memoryview]:
        # Counted now, not when the inner backend starts reading: a call refused before it reads
        # (a stale compare-and-swap) is still a call.
        with self._lock:
            self.calls[op] += 1
            self.ops.append((op, key))
        return self._stream(key, data)

    def _stream(self, key: str, data: Data) -> Iterator[memoryview]:
        for chunk in iter_chunks(data):
            with self._lock:
                self.bytes_written += chunk.nbytes
                self.by_key[key] += chunk.nbytes
            yield chunk

    def durability(self, *, sync: bool = True) -> AbstractContextManager[None]:
        """The wrapped store's durability block (no storage call: not counted)."""
        return durable_batch(self.inner, sync=sync)

    def write(self, key: str, data: Data) -> Any:
        return self.inner.write(key, self._count("write", key, data))

    def create(self, key: str, data: Data) -> Any:
        return self.inner.create(key, self._count("create", key, data))

    def replace(self, key: str, data: Data, version: str) -> Any:
        return self.inner.replace(key, self._count("replace", key, data), version)

    def overwrite(self, key: str, data: Data) -> Any:
        return self.inner.overwrite(key, self._count("overwrite", key, data))

    def copy(self, src: str, dst: str) -> Any:
        with self._lock:
            self.calls["copy"] += 1
            self.ops.append(("copy", dst))
        return self.inner.copy(src, dst)
