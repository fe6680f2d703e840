"""The GCS JSON API over HTTP for ``gcs.py``: endpoint, credentials, session, retries, deadlines.

One request in, one answer out, retried a bounded number of times within its own bound and the
save's deadline (``deadline.py``), with "was it maybe applied?" reported to the caller. Only public
APIs: gcsfs for credentials (``GCSFileSystem(**options).credentials.apply``), fsspec's IO loop
(``fsspec.asyn``), aiohttp's session and client middlewares (aiohttp >= 3.12); see
docs/BACKENDS.md. Tested with gcsfs 2026.10.1, fsspec 2026.9.0, aiohttp 3.14.5. What a request
means (objects, uploads, preconditions) belongs in ``gcs.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import random
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp  # (gcsfs dependency)
import fsspec.asyn

from ckptsdk.backends.deadline import MIN_RATE_BPS, Retries
from ckptsdk.errors import BackendError, MissingDependencyError

if importlib.util.find_spec("gcsfs") is None:  # found without importing it (see _gcsfs_core)
    # What open_backend turns into "pip install 'ckptsdk[gcs]'", as an import of gcsfs would.
    raise ModuleNotFoundError("No module named 'gcsfs'", name="gcsfs")

logger = logging.getLogger(__name__)

_MiB = 1 << 20
# Statuses worth another attempt. 5xx may mean "done, but the reply was lost", so a 412 after
# one of them is checked against what we wrote (see gcs.py, _finished).
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_STREAM_OVER = 1 * _MiB  # request bodies bigger than this are streamed in slices of this size
_USER_AGENT = "ckptsdk (gcs JSON API)"
# The first aiohttp with client middlewares (ClientSession(middlewares=...)); pyproject's gcs extra.
MIN_AIOHTTP = (3, 12)
# Retry jitter from a generator of our own: a draw from the global ``random`` would move the
# training job's Python RNG stream (a save must not draw from it: what restore brings back is
# the state at save(), and a retry during training would change the run). Found by
# tests/stories/test_faults_gcs.py: restores after retried requests were not exact.
_JITTER = random.Random()


#: gcsfs reads this once, when the package is imported (default "true" since 2026.x): its
#: package-level ``GCSFileSystem`` (fsspec's "gs") then becomes the experimental zonal/HNS class,
#: whose import pulls gRPC clients and which probes every bucket over gRPC/TLS first (up to 60 s
#: per operation against an HTTP emulator).
ZB_HNS_SWITCH = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """``os.environ[name]`` defaults to ``value`` inside, and is as it was after (set or not)."""
    before = os.environ.get(name)
    os.environ.setdefault(name, value)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _gcsfs_core() -> Any:
    """``gcsfs.core``, imported when a GCS backend is opened, not when this module is.

    Only ``gcsfs.core.GCSFileSystem``'s credentials are used here, so the experimental class is
    switched off for the import alone (:data:`ZB_HNS_SWITCH`, unless the user set it): the
    user's environment, and what their own ``import gcsfs`` or child processes see, stay theirs
    (this module used to ``os.environ.setdefault`` it at import, for the whole process). When
    gcsfs is already imported, nothing is set: its choice was made.
    """
    if "gcsfs.core" in sys.modules:
        return sys.modules["gcsfs.core"]
    with _environ(ZB_HNS_SWITCH, "false"):
        return importlib.import_module("gcsfs.core")


def endpoint_of(endpoint_url: str | None) -> str:
    """The JSON API's base URL, chosen as gcsfs chooses it (without gcsfs's private helper).

    ``endpoint_url`` if given, else ``$STORAGE_EMULATOR_HOST`` (``http://`` added when it has no
    scheme), else ``https://storage.<$GOOGLE_CLOUD_UNIVERSE_DOMAIN or googleapis.com>``. (gcsfs's
    mTLS endpoint for ``GOOGLE_API_USE_CLIENT_CERTIFICATE`` is not supported.)

    Example:
        >>> endpoint_of("http://127.0.0.1:9023/")
        'http://127.0.0.1:9023'
    """
    if endpoint_url:
        return endpoint_url.rstrip("/")
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if emulator not in ("", "default"):
        return (emulator if emulator.startswith(("http://", "https://")) else f"http://{emulator}").rstrip("/")
    return f"https://storage.{os.environ.get('GOOGLE_CLOUD_UNIVERSE_DOMAIN') or 'googleapis.com'}"


def check_aiohttp(version: str) -> None:
    """Raise ``MissingDependencyError`` unless ``version`` is an aiohttp with client middlewares.

    Example:
        >>> check_aiohttp("3.12.0")
        >>> check_aiohttp("3.9.5")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ckptsdk.errors.MissingDependencyError: gs:// needs aiohttp >= 3.12 ..., found 3.9.5; ...
    """
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    if tuple(parts) < MIN_AIOHTTP:
        raise MissingDependencyError(
            f"gs:// needs aiohttp >= {'.'.join(map(str, MIN_AIOHTTP))} (client middlewares), found "
            f"{version}; install it with: pip install 'ckptsdk[gcs]'",
            extra="gcs",
        )


class HTTPStatusError(OSError):
    """An HTTP answer we did not expect; the ``from`` of the BackendError we raise."""

    def __init__(self, method: str, url: str, status: int, body: bytes) -> None:
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body[:300].decode("utf-8", "replace")
        super().__init__(f"{method} {url.split('?')[0]} -> HTTP {status}: {message}")
        self.status = status
        self.message = message


class ConnectionLost(Exception):
    """The connection dropped after the request was (maybe) sent: it may have been applied.

    Not an ``OSError``/``aiohttp.ClientError`` on purpose: aiohttp silently resends an idempotent
    request (PUT, DELETE, GET) once when a kept-alive connection drops, which would hide a lost
    reply from ``_request`` (a conditional DELETE that already happened answers 404 on the
    resend). Raising this from a client middleware instead stops that resend, through public API.
    """


async def _no_silent_resend(
    request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
) -> aiohttp.ClientResponse:
    try:
        return await handler(request)
    except aiohttp.ClientConnectorError:
        raise  # never reached the server: not applied, and aiohttp does not resend it either
    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
        raise ConnectionLost(f"{type(exc).__name__}: {exc}") from exc


@dataclass
class Reply:
    """One answer from GCS."""

    status: int
    headers: dict[str, str]
    body: bytes
    ambiguous: bool  # an earlier attempt failed in a way that may have applied it


def _close_session(loop: asyncio.AbstractEventLoop, session: aiohttp.ClientSession) -> None:
    """Close ``session`` on its loop, from any thread, without waiting (a finalizer)."""
    if session.closed or loop.is_closed() or not loop.is_running():
        return
    try:
        loop.call_soon_threadsafe(lambda: loop.create_task(session.close()))
    except RuntimeError:  # the loop stopped meanwhile (interpreter exit)
        pass


class JsonApiTransport:
    """Sends requests to the JSON API at ``self.endpoint``; mixed into ``GCSBackend``.

    Tunables are class attributes so a test can shrink them on one instance.
    """

    url: str
    max_attempts = 4  # per request; backoff 0.5, 1, 2 s: a dead server is reported in ~4 s
    backoff_s = 0.5
    connect_timeout_s = 15.0
    read_timeout_s = 60.0  # no byte of a reply for this long: the server is stalled
    # Every request, all its attempts together, ends within request_deadline_s plus the time
    # its body takes at deadline.MIN_RATE_BPS, and within the deadline of the save it belongs
    # to (deadline.py): a frozen server (process stopped, socket open: the kernel still accepts
    # connections and buffers a body) fails a call clearly instead of hanging it.
    request_deadline_s = 120.0
    # Credential discovery (gcsfs -> google.auth.default) may probe the GCE metadata server, about
    # 15 s off Google Cloud; a user who waits longer than this is told what the wait is.
    credential_notice_s = 2.0

    def _init_transport(self, options: Mapping[str, Any]) -> None:
        """Resolve the endpoint and credentials from gcsfs-style ``storage_options``."""
        check_aiohttp(aiohttp.__version__)
        self.endpoint = endpoint_of(options.get("endpoint_url"))
        # gcsfs turns token=/project=/access=... into credentials; we only ask it to sign headers.
        # Given a token it looks for nothing; without one it may wait, and then says so.
        notice = None
        if "token" not in options:
            notice = threading.Timer(self.credential_notice_s, self._tell_about_discovery)
            notice.daemon = True
            notice.start()
        try:
            self._credentials = _gcsfs_core().GCSFileSystem(**options).credentials
        finally:
            if notice is not None:
                notice.cancel()
        self._session_kwargs = dict(options.get("session_kwargs") or {})
        self._session: aiohttp.ClientSession | None = None
        self._session_pid = -1

    def _tell_about_discovery(self) -> None:
        logger.warning(
            "opening %s: looking for Google credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud's "
            "application-default login, then the GCE metadata server, which takes about 15 s to give "
            "up off Google Cloud); pass storage_options token=... (--storage-option token=PATH) to skip it",
            getattr(self, "url", "gs://"),
        )

    @property
    def credentials_method(self) -> str | None:
        """How gcsfs authenticated (``"anon"``, ``"google_default"``...), or None if unknown."""
        return getattr(self._credentials, "method", None)

    def _headers(self, headers: Mapping[str, str] | None) -> dict[str, str]:
        out = {"User-Agent": _USER_AGENT, **(headers or {})}
        self._credentials.apply(out)  # refreshes an expiring token first (blocking, this thread)
        return out

    async def _session_async(self) -> aiohttp.ClientSession:
        # Runs on fsspec's one IO loop thread: no await between the check and the set.
        if self._session is None or self._session.closed or self._session_pid != os.getpid():
            # After a fork the parent's session belongs to a loop that no longer runs here.
            self._session = aiohttp.ClientSession(middlewares=(_no_silent_resend,), **self._session_kwargs)
            self._session_pid = os.getpid()
            weakref.finalize(self, _close_session, asyncio.get_running_loop(), self._session)
        return self._session

    async def _send_async(
        self,
        method: str,
        url: str,
        params: dict[str, str] | None,
        headers: dict[str, str],
        data: Any,
        total: float,
    ) -> tuple[int, dict[str, str], bytes]:
        session = await self._session_async()
        if isinstance(data, (bytes, bytearray, memoryview)) and len(data) > _STREAM_OVER:
            # aiohttp warns about (and would write in one go) a large in-memory body; send it as
            # zero-copy slices with an explicit length instead (no chunked encoding).
            view = memoryview(data).cast("B")
            headers = {**headers, "Content-Length": str(view.nbytes)}
            data = _aslices(view, _STREAM_OVER)
        # sock_read alone never fires while *we* are sending (a frozen server stops reading, the
        # socket buffer fills, the write waits forever): total bounds the whole exchange.
        timeout = aiohttp.ClientTimeout(
            total=total, sock_connect=min(self.connect_timeout_s, total), sock_read=min(self.read_timeout_s, total)
        )
        async with session.request(
            method,
            url,
            params=params,
            headers=headers,
            data=data,
            timeout=timeout,
            allow_redirects=False,  # a resumable 308 is not a redirect
        ) as resp:
            body = await resp.read()
            return resp.status, dict(resp.headers), body

    def _request(
        self,
        method: str,
        url: str,
        *,
        key: str | None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        data: Any = None,
        attempts: int | None = None,
    ) -> Reply:
        """Send one request, retrying transport failures and 408/429/5xx a bounded number of times.

        A 412 is an answer, never retried: the caller decides what it means.
        """
        attempts = attempts or self.max_attempts
        ambiguous = False
        last: BaseException | None = None
        nbytes = len(memoryview(data).cast("B")) if isinstance(data, (bytes, bytearray, memoryview)) else 0
        allowance = self.request_deadline_s + nbytes / MIN_RATE_BPS
        tries = Retries(attempts, backoff=self.backoff_s, spread=0.2, allowance=allowance, jitter=_JITTER)
        for left in tries:
            try:
                status, rheaders, body = fsspec.asyn.sync(
                    fsspec.asyn.get_loop(),
                    self._send_async,
                    method,
                    url,
                    params,
                    self._headers(headers),
                    data,
                    left,
                )
            except aiohttp.ClientConnectorError as exc:  # never reached the server: not applied
                last = exc
                if isinstance(exc, aiohttp.ClientConnectorDNSError) and tries.tried >= 2:
                    # No network, or no such host: each lookup may take seconds to fail, and
                    # more of them (28 s in all, seen offline) only delay the one clear error.
                    break
            except (TimeoutError, ConnectionLost, aiohttp.ClientError, OSError) as exc:
                ambiguous, last = True, exc  # sent, but the reply was lost: maybe applied
            else:
                if status not in RETRY_STATUSES:
                    return Reply(status, rheaders, body, ambiguous)
                ambiguous = ambiguous or status >= 500
                last = HTTPStatusError(method, url, status, body)
            # A request that never reached a server ends in one clear error below (its tries are
            # on -v); one the server may have seen is worth a warning at each retry.
            logger.log(
                logging.DEBUG if isinstance(last, aiohttp.ClientConnectorError) else logging.WARNING,
                "GCS %s %s: attempt %d/%d failed: %r",
                method,
                url.split("?")[0],
                tries.tried,
                attempts,
                last,
            )
        if tries.expired():
            assert tries.deadline is not None
            raise tries.deadline.exceeded(
                url=self.url,
                key=key,
                waited_for=f"GCS at {self.endpoint} to answer {method} {url.split('?')[0]} (key {key!r}; "
                f"attempts: {tries.tried}, last: {last!r})",
            ) from last
        if isinstance(last, aiohttp.ClientConnectorError):
            # Never reached a server (DNS, refused): say what a first-time user is missing.
            raise BackendError(
                f"cannot reach GCS at {self.endpoint} for {self.url} (key {key!r}): "
                f"{getattr(last, 'os_error', None) or last} ({tries.tried} tries). {self._setup_hint()}",
                url=self.url,
                key=key,
            ) from last
        within = f" within its {allowance:.0f} s deadline" if tries.cut_short() else ""
        raise BackendError(
            f"GCS request {method} for {self.url} (key {key!r}) failed {tries.tried} times{within}, last: "
            f"{last!r}. Check the network and {self.endpoint}, then retry",
            url=self.url,
            key=key,
        ) from last

    def _setup_hint(self) -> str:
        method = self.credentials_method
        creds = (
            "no Google credentials were found (anonymous access: public buckets only)"
            if method == "anon"
            else f"credentials: {method or 'unknown'}"
        )
        return (
            f"Check, in order: the network reaches {self.endpoint}; {creds}: run `gcloud auth "
            "application-default login`, set GOOGLE_APPLICATION_CREDENTIALS=key.json, or pass "
            "storage_options token=...; for a local emulator set STORAGE_EMULATOR_HOST="
            "http://127.0.0.1:PORT (or storage_options endpoint_url=...)"
        )

    def _fail(self, reply: Reply, method: str, url: str, key: str | None, what: str) -> BackendError:
        """The error for an answer we cannot use (not 404/412, which callers map themselves)."""
        cause = HTTPStatusError(method, url, reply.status, reply.body)
        if reply.status in (401, 403):
            hint = "check the credentials (storage option token=...) and their access to the bucket"
        else:
            hint = "see the message from GCS"
        err = BackendError(
            f"GCS refused to {what} {key!r} in {self.url}: HTTP {reply.status} {cause.message}; {hint}",
            url=self.url,
            key=key,
        )
        err.__cause__ = cause
        return err


async def _aslices(view: memoryview, step: int) -> AsyncIterator[memoryview]:
    for i in range(0, view.nbytes, step):
        yield view[i : i + step]
