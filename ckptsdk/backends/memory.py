"""In-process backend (``memory://NAME``) for tests and examples: nothing survives the process.

One store per NAME, shared by every backend opened on it in this process and safe across threads.
It meets the whole contract (conditional writes included) so upper layers can be tested without
a disk; persistence, crash behaviour and other hosts belong to the real backends.
"""

from __future__ import annotations

import builtins
import io
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

from ckptsdk.backends.base import (
    Capabilities,
    Data,
    ObjectInfo,
    check_folder_prefix,
    check_key,
    check_prefix,
    iter_chunks,
)
from ckptsdk.errors import ObjectNotFound, PreconditionFailed


@dataclass
class _Store:
    lock: threading.Lock = field(default_factory=threading.Lock)
    objects: dict[str, tuple[bytes, str, float]] = field(default_factory=dict)  # data, version, mtime
    counter: int = 0

    def next_version(self) -> str:
        self.counter += 1
        return str(self.counter)


_stores: dict[str, _Store] = {}
_stores_lock = threading.Lock()


class MemoryBackend:
    """A process-global dict of objects per ``name``; versions are a per-store counter.

    Args:
        name: the store's name; every ``MemoryBackend`` of the same name shares its objects.
        url: the URL it was opened with; defaults to ``memory://NAME``.

    Example:
        >>> a, b = MemoryBackend("demo"), MemoryBackend("demo")
        >>> _ = a.write("x", b"1")
        >>> b.read("x")
        b'1'
    """

    # Atomic and conditional within the process; gone when the process dies.
    capabilities = Capabilities(exclusive_create=True, compare_and_swap=True, durable_on_return=False, cheap_copy=True)

    def __init__(self, name: str, *, url: str | None = None) -> None:
        self.name = name
        self.url = url or f"memory://{name}"
        with _stores_lock:
            self._store = _stores.setdefault(name, _Store())

    def __repr__(self) -> str:
        return f"MemoryBackend({self.name!r})"

    @staticmethod
    def discard_store(name: str) -> None:
        """Forget the store ``name`` (its objects go once no backend holds it). For test teardown."""
        with _stores_lock:
            _stores.pop(name, None)

    def read(self, key: str) -> bytes:
        """Return the whole object at ``key``."""
        return self._get(key)[0]

    def open(self, key: str) -> BinaryIO:
        """A seekable in-memory stream over the object (``read``, ``readinto``, ``seek``)."""
        return io.BytesIO(self._get(key)[0])

    def stat(self, key: str) -> ObjectInfo:
        """Size and version of ``key``, or ``ObjectNotFound``."""
        data, version, mtime = self._get(key)
        return ObjectInfo(key, len(data), version, mtime)

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists now."""
        check_key(key, url=self.url)
        with self._store.lock:
            return key in self._store.objects

    def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, sorted by key."""
        check_prefix(prefix, url=self.url)
        with self._store.lock:
            items = [(k, v) for k, v in self._store.objects.items() if k.startswith(prefix)]
        return [ObjectInfo(k, len(data), version, mtime) for k, (data, version, mtime) in sorted(items)]

    def list_folders(self, prefix: str) -> builtins.list[str]:
        """The top-level folders (first parts of keys with a ``/``) starting with ``prefix``, sorted."""
        check_folder_prefix(prefix, url=self.url)
        with self._store.lock:
            return sorted({k.partition("/")[0] for k in self._store.objects if k.startswith(prefix) and "/" in k})

    def write(self, key: str, data: Data) -> ObjectInfo:
        """Publish ``data`` at ``key``; the joined bytes appear at once, never in part."""
        return self._put(key, data, lambda current: None)

    def create(self, key: str, data: Data) -> ObjectInfo:
        """Publish only if ``key`` is absent, else ``PreconditionFailed``."""

        def check(current: tuple[bytes, str, float] | None) -> None:
            if current is not None:
                raise PreconditionFailed(
                    f"create of {key!r} under {self.url} failed: it already exists (version "
                    f"{current[1]}); another writer created it first",
                    url=self.url,
                    key=key,
                    expected=None,
                    actual=current[1],
                )

        return self._put(key, data, check)

    def replace(self, key: str, data: Data, version: str) -> ObjectInfo:
        """Publish only if ``key``'s version is ``version``, else ``PreconditionFailed``."""
        return self._put(key, data, lambda current: self._check_version("replace", key, current, version))

    def copy(self, src: str, dst: str) -> ObjectInfo:
        """Publish ``src``'s bytes at ``dst`` (shared, not copied); ``dst`` must not exist."""
        data = self._get(src)[0]
        return self.create(dst, data)

    def delete(self, key: str, *, version: str | None = None) -> None:
        """Delete ``key`` (with ``version``: only if unchanged)."""
        check_key(key, url=self.url)
        with self._store.lock:
            current = self._store.objects.get(key)
            if current is None:
                raise ObjectNotFound(f"no object {key!r} under {self.url}", url=self.url, key=key)
            if version is not None:
                self._check_version("delete", key, current, version)
            del self._store.objects[key]

    def sweep(
        self, older_than: float, *, only: Callable[[str], bool] | None = None
    ) -> builtins.list[str]:  # `list`: the method above
        """Nothing to sweep: a memory write has no temp objects."""
        return []

    def _get(self, key: str) -> tuple[bytes, str, float]:
        check_key(key, url=self.url)
        with self._store.lock:
            current = self._store.objects.get(key)
        if current is None:
            raise ObjectNotFound(f"no object {key!r} under {self.url}", url=self.url, key=key)
        return current

    def _put(self, key: str, data: Data, check: Callable[[tuple[bytes, str, float] | None], None]) -> ObjectInfo:
        check_key(key, url=self.url)
        # Join outside the lock: the caller's iterable may be slow or raise (then nothing changes).
        blob = b"".join(iter_chunks(data))
        with self._store.lock:
            check(self._store.objects.get(key))
            version = self._store.next_version()
            mtime = time.time()
            self._store.objects[key] = (blob, version, mtime)
        return ObjectInfo(key, len(blob), version, mtime)

    def _check_version(self, op: str, key: str, current: tuple[bytes, str, float] | None, version: str) -> None:
        actual = None if current is None else current[1]
        if actual != version:
            state = "is gone" if actual is None else f"is now at version {actual}"
            raise PreconditionFailed(
                f"{op} of {key!r} under {self.url} expected version {version}, but the object "
                f"{state}: another writer changed it; re-read it and decide again",
                url=self.url,
                key=key,
                expected=version,
                actual=actual,
            )
