"""Bytes on their way to and from GCS for ``gcs.py``: chunking, CRC32C, timestamps.

Pure helpers with no knowledge of requests' retries (``gcs_transport.py``) or of what an object
means to the backend (``gcs.py``).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import google_crc32c  # gcsfs -> google-cloud-storage dependency

_MiB = 1 << 20


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
