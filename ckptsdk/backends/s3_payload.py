"""Bytes on their way to and from S3 for ``s3.py``: ranged reads, checksums, ETags and S3's timestamps.

Pure helpers with no knowledge of calls and retries (``s3_transport.py``) or of what an object
means to the backend (``s3.py``).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any

__all__ = ["Ranged", "crc_b64", "etag_of", "http_date", "store_time"]


def crc_b64(value: int) -> str:
    """A CRC32 as S3 writes it (``x-amz-checksum-crc32``: base64 of 4 big-endian bytes)."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def etag_of(raw: Any) -> str:
    """An ETag without its quotes: our version token (``If-Match`` gets the quotes back)."""
    return str(raw or "").strip('"')


def store_time(value: Any) -> float | None:
    """A botocore datetime (LastModified, Initiated) as POSIX seconds; None if absent."""
    return value.timestamp() if isinstance(value, datetime) else None


class Ranged(io.RawIOBase):
    """Seekable raw reads through ``fetch(offset, n)`` (wrapped in a BufferedReader by ``open``)."""

    def __init__(self, fetch: Callable[[int, int], bytes], size: int) -> None:
        super().__init__()
        self._fetch, self._size, self._pos = fetch, size, 0

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
        out[:n] = data[:n]
        self._pos += n
        return n


def http_date(value: str | None) -> float | None:
    """An HTTP ``Date`` header (the store's clock) as POSIX seconds; None if absent or odd."""
    if not value:
        return None
    try:
        return parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
