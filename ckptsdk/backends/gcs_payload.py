"""Bytes on their way to and from GCS for ``gcs.py``: chunking, CRC32C, ranged reads, timestamps.

Pure helpers with no knowledge of requests' retries (``gcs_transport.py``) or of what an object
means to the backend (``gcs.py``).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import google_crc32c  # gcsfs -> google-cloud-storage dependency

from ckptsdk.errors import BackendError

_MiB = 1 << 20


class RangeReader(io.RawIOBase):
    """Raw seekable reads of ``size`` bytes through ``fetch(offset, n)`` (wrapped in a BufferedReader).

    ``fetch`` returns up to ``n`` bytes at ``offset`` (``gcs.py``: one ranged GET pinned to a
    generation) and raises if the object is gone; an empty answer before the end is an error.
    """

    def __init__(self, fetch: Callable[[int, int], bytes], size: int, *, url: str, key: str) -> None:
        super().__init__()
        self._fetch, self._size, self._pos, self._url, self._key = fetch, size, 0, url, key

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
        n = min(len(data), want)
        if n == 0:
            raise BackendError(
                f"GCS returned no bytes for {self._key!r} at offset {self._pos} of {self._size} "
                f"in {self._url}; retry the read",
                url=self._url,
                key=self._key,
            )
        out[:n] = data[:n]
        self._pos += n
        return n


def chain(first: bytearray, rest: Iterator[Any]) -> Iterator[memoryview]:
    yield memoryview(first)
    for chunk in rest:
        yield memoryview(chunk).cast("B")


def slices(view: memoryview, step: int) -> Iterator[tuple[memoryview, bool]]:
    """(slice, is_last) of one buffer, without copying."""
    for i in range(0, view.nbytes, step):
        yield view[i : i + step], i + step >= view.nbytes


def rechunk(pieces: Iterator[memoryview], step: int) -> Iterator[tuple[bytes, bool]]:
    """Regroup pieces into ``step``-byte chunks (copied: producers may reuse their buffers).

    A chunk goes out only once more bytes are known to follow: the last must carry the total.
    """
    buf = bytearray()
    for piece in pieces:
        buf += piece
        while len(buf) > step:
            chunk = bytes(buf[:step])
            del buf[:step]
            yield chunk, False
    yield bytes(buf), True


def rfc3339(stamp: Any) -> float | None:
    """GCS's ``updated`` (RFC 3339, server clock) as POSIX seconds; None if absent or odd."""
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def crc32c(crc: int, data: Any) -> int:
    """Extend a CRC32C; google_crc32c takes only ``bytes``, so copy other buffers in 8 MiB slices."""
    if isinstance(data, bytes):
        extended: int = google_crc32c.extend(crc, data)
        return extended
    view = memoryview(data).cast("B")
    for i in range(0, view.nbytes, 8 * _MiB):
        crc = google_crc32c.extend(crc, bytes(view[i : i + 8 * _MiB]))
    return crc


def b64crc(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


def persisted(headers: dict[str, str]) -> int:
    """Bytes the server holds, from a resumable 308's ``Range: bytes=0-N`` (absent: none)."""
    value = headers.get("Range") or headers.get("range")
    if not value:
        return 0
    return int(value.rsplit("-", 1)[1]) + 1
