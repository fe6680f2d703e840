"""A backend wrapper that fails chosen calls and counts calls (ckptsdk.testing.FaultyBackend).

Lets tests put a failure exactly in a crash window (between a checkpoint's tensors and its
manifest, between a lease write and its read-back) on any real backend. Nothing in the library
uses this module; it only wraps the public backend contract.
"""

from __future__ import annotations

import builtins
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, BinaryIO, TypeVar

from ckptsdk.backends.base import (
    Backend,
    Browsable,
    Capabilities,
    Copyable,
    Data,
    ObjectInfo,
    Rewritable,
    durable_batch,
)
from ckptsdk.errors import BackendError

_T = TypeVar("_T")

__all__ = ["FaultyBackend", "SimulatedCrash", "fail_nth", "FailOn", "OPS"]

#: Every operation a backend has, as named to ``fail_on`` and counted in ``FaultyBackend.calls``.
OPS = (
    "read",
    "open",
    "stat",
    "exists",
    "list",
    "write",
    "create",
    "replace",
    "delete",
    "sweep",
    "copy",
    "move",
    "overwrite",
)  # the last three: optional, where the wrapped backend has them

#: ``fail_on(op, key, n)``: return an exception to raise instead of the call (or ``None`` to let
#: it through). ``n`` is how many calls of ``op`` this wrapper has seen, this one included (1-based).
#: ``key`` is the key (the prefix for ``list``, ``""`` for ``sweep``).
FailOn = Callable[[str, str, int], BaseException | None]


class SimulatedCrash(BaseException):
    """Stands for the process dying at this call.

    A ``BaseException``, not an ``Exception``, so code under test that catches ``Exception`` (to
    log and carry on) cannot swallow it, just as it could not survive a real SIGKILL.
    """


class FaultyBackend:
    """Wraps a backend; raises a chosen exception on chosen calls, and counts every call.

    Args:
        inner: the backend that does the real work (any :class:`~ckptsdk.backends.Backend`).
        fail_on: consulted *before* each call; a returned exception is raised and ``inner`` is
            not called (the operation never happened).
        fail_after: consulted *after* each call that succeeded; a returned exception is raised
            although ``inner`` did the work (the write landed but the caller saw a failure, as
            with a timeout after an upload completed).

    Attributes:
        calls: ``Counter`` of op name -> calls so far (failed ones included).
        log: every call as ``(op, key)``, in order.

    Example:
        >>> from ckptsdk.backends import open_backend
        >>> b = FaultyBackend(open_backend("memory://faulty-demo"), fail_on=fail_nth("write", 2))
        >>> _ = b.write("a", b"1")
        >>> b.write("b", b"2")
        Traceback (most recent call last):
        ckptsdk.errors.BackendError: injected fault: write #2 of 'b'
        >>> b.exists("b"), b.calls["write"]
        (False, 2)
    """

    def __init__(self, inner: Backend, *, fail_on: FailOn | None = None, fail_after: FailOn | None = None) -> None:
        self.inner = inner
        self.fail_on = fail_on
        self.fail_after = fail_after
        self.calls: Counter[str] = Counter()
        self.log: builtins.list[tuple[str, str]] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    def __repr__(self) -> str:
        return f"FaultyBackend({self.inner!r})"

    def read(self, key: str) -> bytes:
        return self._call("read", key, lambda: self.inner.read(key))

    def open(self, key: str) -> BinaryIO:
        return self._call("open", key, lambda: self.inner.open(key))

    def stat(self, key: str) -> ObjectInfo:
        return self._call("stat", key, lambda: self.inner.stat(key))

    def exists(self, key: str) -> bool:
        return self._call("exists", key, lambda: self.inner.exists(key))

    def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        return self._call("list", prefix, lambda: self.inner.list(prefix))

    def write(self, key: str, data: Data) -> ObjectInfo:
        return self._call("write", key, lambda: self.inner.write(key, data))

    def create(self, key: str, data: Data) -> ObjectInfo:
        return self._call("create", key, lambda: self.inner.create(key, data))

    def replace(self, key: str, data: Data, version: str) -> ObjectInfo:
        return self._call("replace", key, lambda: self.inner.replace(key, data, version))

    def delete(self, key: str, *, version: str | None = None) -> None:
        return self._call("delete", key, lambda: self.inner.delete(key, version=version))

    def sweep(
        self, older_than: float, *, only: Callable[[str], bool] | None = None
    ) -> builtins.list[str]:  # `list`: the method above
        return self._call("sweep", "", lambda: self.inner.sweep(older_than, only=only))

    # The optional operations, where the wrapped backend has them (see its capabilities).
    def copy(self, src: str, dst: str) -> ObjectInfo:
        inner = self.inner
        if not isinstance(inner, Copyable):
            raise _lacks(inner, "copy")
        return self._call("copy", dst, lambda: inner.copy(src, dst))

    def move(self, src: str, dst: str) -> ObjectInfo:
        inner = self.inner
        if not isinstance(inner, Rewritable):
            raise _lacks(inner, "move")
        return self._call("move", dst, lambda: inner.move(src, dst))

    def overwrite(self, key: str, data: Data) -> ObjectInfo:
        inner = self.inner
        if not isinstance(inner, Rewritable):
            raise _lacks(inner, "overwrite")
        return self._call("overwrite", key, lambda: inner.overwrite(key, data))

    def durability(self, *, sync: bool = True) -> AbstractContextManager[None]:
        """The wrapped store's durability block (no storage call: not counted)."""
        return durable_batch(self.inner, sync=sync)

    def __getattr__(self, name: str) -> Any:
        # ``list_folders`` only where the wrapped store has it (``browser`` then finds it here),
        # and as a "list" call: a fault aimed at the listings hits the one that names folders too.
        inner = self.__dict__.get("inner")
        if name == "list_folders" and isinstance(inner, Browsable):
            return lambda prefix: self._call("list", prefix, lambda: inner.list_folders(prefix))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _call(self, op: str, key: str, run: Callable[[], _T]) -> _T:
        with self._lock:
            self.calls[op] += 1
            n = self.calls[op]
            self.log.append((op, key))
            before, after = self.fail_on, self.fail_after
        if before is not None:
            exc = before(op, key, n)
            if exc is not None:
                raise exc
        result = run()
        if after is not None:
            exc = after(op, key, n)
            if exc is not None:
                raise exc
        return result


def fail_nth(
    ops: str | Iterable[str],
    n: int,
    exc: BaseException | type[BaseException] | None = None,
    *,
    key_prefix: str = "",
    persist: bool = False,
) -> FailOn:
    """A ``fail_on``/``fail_after`` that fails the ``n``-th matching call (1-based).

    A call matches when its op is in ``ops`` and its key starts with ``key_prefix``; matches are
    counted by this function itself, so ``fail_nth("write", 2, key_prefix="step-")`` fails the
    second write under ``step-`` whatever else was written.

    Args:
        ops: one op name or several (see ``OPS``).
        n: which matching call fails.
        exc: the exception to raise: an instance, a class (built with a message naming the call;
            ``BackendError`` subclasses also get ``key=``), or ``None`` for a ``BackendError``.
        key_prefix: only keys starting with this match.
        persist: fail every matching call from the ``n``-th on, not only the ``n``-th (the
            storage stays broken).
    """
    wanted = {ops} if isinstance(ops, str) else set(ops)
    unknown = wanted - set(OPS)
    if unknown or n < 1:
        raise ValueError(f"fail_nth: unknown ops {sorted(unknown)} or n={n} < 1; ops are {OPS}")
    seen = 0
    lock = threading.Lock()

    def fail_on(op: str, key: str, _count: int) -> BaseException | None:
        nonlocal seen
        if op not in wanted or not key.startswith(key_prefix):
            return None
        with lock:
            seen += 1
            index = seen
        if index != n and not (persist and index > n):
            return None
        message = f"injected fault: {op} #{index} of {key!r}"
        if isinstance(exc, BaseException):
            return exc
        if exc is None:
            return BackendError(message, key=key)
        if issubclass(exc, BackendError):
            return exc(message, key=key)
        return exc(message)

    return fail_on


def _lacks(inner: Backend, op: str) -> BackendError:
    return BackendError(f"{op}: the wrapped backend ({type(inner).__name__}) has no {op}", url=inner.url)
