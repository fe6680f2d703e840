"""Bytes on their way to and from S3 for ``s3.py``: checksums, ETags and S3's timestamps.

Pure helpers with no knowledge of calls and retries (``s3_transport.py``) or of what an object
means to the backend (``s3.py``).
"""

from __future__ import annotations

import base64
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any

__all__ = ["crc_b64", "etag_of", "http_date", "store_time"]


def crc_b64(value: int) -> str:
    """A CRC32 as S3 writes it (``x-amz-checksum-crc32``: base64 of 4 big-endian bytes)."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def etag_of(raw: Any) -> str:
    """An ETag without its quotes: our version token (``If-Match`` gets the quotes back)."""
    return str(raw or "").strip('"')


def store_time(value: Any) -> float | None:
    """A botocore datetime (LastModified, Initiated) as POSIX seconds; None if absent."""
    return value.timestamp() if isinstance(value, datetime) else None


def http_date(value: str | None) -> float | None:
    """An HTTP ``Date`` header (the store's clock) as POSIX seconds; None if absent or odd."""
    if not value:
        return None
    try:
        return parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
