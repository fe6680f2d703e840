"""A backend wrapper that counts the bytes each operation sends to storage (tests, benchmarks).

Everything is forwarded to the wrapped backend; ``bytes_written`` adds up what ``write``,
``create``, ``replace`` and ``overwrite`` streamed, so a test can tell a full copy (the bytes pass
through here) from a cheap one (``copy``: a hard link or a server-side rewrite, counted apart).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from ckptsdk.backends.base import Data, iter_chunks


class CountingBackend:
    """Forward to ``inner``; count bytes and calls per operation.

    Attributes:
        bytes_written: bytes streamed by write/create/replace/overwrite.
        by_key: the same, per key written.
        calls: operations seen, by name.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.url = inner.url
        self.capabilities = inner.capabilities
        self.bytes_written = 0
        self.by_key: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # read, open, stat, exists, list, delete, sweep, move
        attr = getattr(self.inner, name)
        if callable(attr):

            def counted(*args: Any, **kwargs: Any) -> Any:
                with self._lock:
                    self.calls[name] += 1
                return attr(*args, **kwargs)

            return counted
        return attr

    def _count(self, op: str, key: str, data: Data) -> Iterator[memoryview]:
        with self._lock:
            self.calls[op] += 1
        for chunk in iter_chunks(data):
            with self._lock:
                self.bytes_written += chunk.nbytes
                self.by_key[key] += chunk.nbytes
            yield chunk

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
        return self.inner.copy(src, dst)
