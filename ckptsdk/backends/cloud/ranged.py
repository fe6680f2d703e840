"""A seekable raw reader over ranged GETs, shared by the object-store backends (``gcs.py``, ``s3.py``).

Each backend supplies ``fetch(offset, n)`` (one ranged GET pinned to the version it opened); this
module owns seeking and the rule for what a ranged answer must hold. How a GET is made, retried
or pinned does not belong here.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from ckptsdk.errors import BackendError

__all__ = ["RangedReader"]


class RangedReader(io.RawIOBase):
    """Raw seekable reads of ``size`` bytes through ``fetch(offset, n)`` (wrapped in a BufferedReader).

    ``fetch`` returns the ``n`` bytes at ``offset`` and raises if the object is gone. The reader
    asks only for bytes inside the object, so an answer of any other length is a store fault: a
    short one (a reply cut by the store or a proxy) would read as end of file to the
    BufferedReader above, a long one (a store that ignored ``Range``) as the wrong bytes. Both
    raise :class:`~ckptsdk.errors.BackendError` instead of returning silently short or wrong data.

    Args:
        fetch: ``fetch(offset, n) -> bytes``, one ranged GET.
        size: the object's size when it was opened.
        store: the store's name for messages (``"GCS"``, ``"S3"``).
        url: the backend root, for the error's ``url``.
        key: the object, for the error's ``key``.
    """

    def __init__(self, fetch: Callable[[int, int], bytes], size: int, *, store: str, url: str, key: str) -> None:
        super().__init__()
        self._fetch, self._size, self._pos = fetch, size, 0
        self._store, self._url, self._key = store, url, key

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        want = min(out.nbytes, self._size - self._pos)
        if want <= 0:
            return 0
        data = self._fetch(self._pos, want)
        if len(data) != want:
            first, last = self._pos, self._pos + want - 1
            raise BackendError(
                f"{self._store} answered {len(data)} of the {want} bytes asked at offsets {first}-{last} "
                f"of {self._key!r} ({self._size} bytes) in {self._url}: the reply was cut short or the "
                "store ignored the range; retry the read",
                url=self._url,
                key=self._key,
            )
        out[:want] = data
        self._pos += want
        return want
