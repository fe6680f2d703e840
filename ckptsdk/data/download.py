"""Fetch one HTTP(S) URL into a local file: timeouts, bounded retries, resume, progress, logs.

Only transport lives here (urllib, no third-party HTTP client): whether the bytes are the right
ones is the caller's business (``ckptsdk.data.cache`` verifies digests). Nothing here knows about caches,
datasets or archives.
"""

from __future__ import annotations

import http.client
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptsdk.errors import DownloadError

logger = logging.getLogger(__name__)

__all__ = ["Downloaded", "DownloadError", "download", "progress_bar"]

_CHUNK = 1 << 20  # 1 MiB reads: large enough for loopback speed, small enough for a smooth bar
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Downloaded:
    """What one successful download did.

    Attributes:
        url: the source.
        path: the file written (complete, not verified).
        size: bytes in the file.
        seconds: wall time of the whole download, retries included.
        attempts: HTTP requests made (1 when nothing went wrong).
        resumed_bytes: bytes kept from an earlier interrupted attempt thanks to a Range request.
    """

    url: str
    path: str
    size: int
    seconds: float
    attempts: int
    resumed_bytes: int

    @property
    def mib_per_s(self) -> float:
        return self.size / (1 << 20) / max(self.seconds, 1e-9)


def progress_bar(total: int | None, initial: int, desc: str, enabled: bool) -> Any:
    """A tqdm byte counter (KiB/MiB units), or a silent one when not ``enabled``: every copy's bar.

    A ``tqdm`` object; ``Any`` because tqdm ships no type information.

    Example:
        >>> with progress_bar(10, 0, "x", enabled=False) as bar:
        ...     _ = bar.update(10)
    """
    from tqdm.auto import tqdm  # late: tqdm is only needed once something is copied

    return tqdm(
        total=total,
        initial=initial,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        disable=not enabled,
        leave=False,
        mininterval=0.5,
    )


def _content_range_start(value: str | None) -> int | None:
    """Start offset of ``Content-Range: bytes START-END/TOTAL``, or None if unparsable."""
    if not value or not value.startswith("bytes "):
        return None
    try:
        return int(value[6:].split("-", 1)[0])
    except ValueError:
        return None


def download(
    url: str,
    path: str,
    *,
    timeout: float = 30.0,
    retries: int = 4,
    backoff: float = 0.5,
    progress: bool = True,
    resume: bool = True,
    sleep: Callable[[float], None] = time.sleep,
) -> Downloaded:
    """Download ``url`` into ``path`` (``path + '.part'`` while in flight, renamed when complete).

    A broken transfer (connection reset, short body, socket timeout, HTTP 5xx/429) is retried up
    to ``retries`` times with exponential backoff; when the server honours ``Range`` the retry
    continues from the bytes already received, else it starts over. A 4xx other than 408/425/429
    fails at once (retrying a 404 cannot help).

    Args:
        url: an ``http://`` or ``https://`` URL.
        path: the destination file; its folder must exist.
        timeout: seconds for connecting and for each socket read (a stalled server fails, then retries).
        retries: extra attempts after the first one.
        backoff: the first retry waits this many seconds, doubling each time (capped at 30 s).
        progress: show a tqdm progress bar on stderr.
        resume: continue a partial ``.part`` file with a Range request.
        sleep: injectable for tests.

    Returns:
        A :class:`Downloaded` record; the file is complete but its digest is not checked here.

    Raises:
        DownloadError: the URL could not be fetched; the message has the last error and the count.

    Example:
        >>> download("http://127.0.0.1:8000/a.bin", "/tmp/a.bin").size  # doctest: +SKIP
        1048576
    """
    if not url.startswith(("http://", "https://")):
        raise DownloadError(f"cannot download {url!r}: only http:// and https:// URLs are supported", url=url)
    part = path + ".part"
    if not resume and os.path.exists(part):
        os.remove(part)
    start = time.monotonic()
    kept_by_range = 0
    last_error = "no attempt made"
    last_status: int | None = None
    attempts = 0
    for attempt in range(retries + 1):
        attempts += 1
        have = os.path.getsize(part) if os.path.exists(part) else 0
        request = urllib.request.Request(url, headers={"User-Agent": "ckptsdk-datacache/0.1"})
        if have:
            request.add_header("Range", f"bytes={have}-")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status = response.status
                last_status = status
                if have and status == 206 and _content_range_start(response.headers.get("Content-Range")) == have:
                    mode, offset = "ab", have
                    kept_by_range += have
                    logger.info("resuming %s at byte %d (server honoured Range)", url, have)
                else:
                    if have:
                        logger.info("server ignored Range for %s (status %d); starting over", url, status)
                    mode, offset = "wb", 0
                length = response.headers.get("Content-Length")
                total = offset + int(length) if length and length.isdigit() else None
                received = offset
                with open(part, mode) as out, progress_bar(total, offset, os.path.basename(path), progress) as bar:
                    while True:
                        chunk = response.read(_CHUNK)
                        if not chunk:
                            break
                        out.write(chunk)
                        received += len(chunk)
                        bar.update(len(chunk))
                if total is not None and received != total:
                    # urllib reads to EOF without complaint when the peer closes early.
                    raise http.client.IncompleteRead(b"", total - received)
        except urllib.error.HTTPError as exc:
            last_status = exc.code
            last_error = f"HTTP {exc.code} {exc.reason}"
            if exc.code == 416 and have:
                # Our partial file is at or past the end the server knows: start clean.
                os.remove(part)
            elif exc.code not in _RETRY_STATUS:
                raise DownloadError(
                    f"downloading {url} failed with HTTP {exc.code} {exc.reason}; check the URL (a 4xx is not retried)",
                    url=url,
                    status=exc.code,
                    attempts=attempts,
                ) from exc
        except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:  # resets, timeouts too
            reason = getattr(exc, "reason", None) if isinstance(exc, urllib.error.URLError) else None
            last_error = f"{type(exc).__name__}: {reason or exc}"
        else:
            os.replace(part, path)
            seconds = time.monotonic() - start
            result = Downloaded(url, path, received, seconds, attempts, kept_by_range)
            logger.info(
                "downloaded %s: %d bytes in %.2f s (%.1f MiB/s), %d attempt(s), %d bytes resumed",
                url,
                received,
                seconds,
                result.mib_per_s,
                attempts,
                kept_by_range,
            )
            return result
        if attempt < retries:
            delay = min(backoff * (2**attempt), 30.0)
            logger.warning(
                "download of %s failed (%s), attempt %d of %d; retrying in %.1f s",
                url,
                last_error,
                attempt + 1,
                retries + 1,
                delay,
            )
            sleep(delay)
    raise DownloadError(
        f"downloading {url} failed after {attempts} attempt(s); last error: {last_error}. "
        "Check the network or use another source/mirror",
        url=url,
        status=last_status,
        attempts=attempts,
    )
