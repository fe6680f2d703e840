"""A real threaded HTTP server on 127.0.0.1 for download tests, with injectable misbehaviour.

Serves in-memory files; per path it can throttle, fail the first N requests with 500, drop the
connection mid-body, stall, serve truncated or wrong bytes, and honour or ignore Range. It counts
requests per path so tests can assert "zero downloads". Test helper only; nothing else here.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import cast


@dataclass
class Behaviour:
    """How one path misbehaves. Counters (``fail_times``, ``drop_times``...) are used up per request.

    Attributes:
        fail_times: answer this many requests with HTTP 500 first.
        drop_times: on this many requests, send the headers (full Content-Length) and only
            ``drop_after`` bytes of the body, then close the connection.
        drop_after: bytes sent before a drop.
        truncate_to: serve only this many bytes (with a matching Content-Length), every time.
        corrupt: flip a byte in the middle of what is served, every time.
        ranges: honour ``Range: bytes=N-`` with 206; when False, ignore it and send 200 + everything.
        throttle_bps: limit the body to about this many bytes per second.
        stall_seconds: sleep this long after the headers, before the body (to trip client timeouts).
        stall_times: how many requests stall.
    """

    fail_times: int = 0
    drop_times: int = 0
    drop_after: int = 0
    truncate_to: int | None = None
    corrupt: bool = False
    ranges: bool = True
    throttle_bps: float | None = None
    stall_seconds: float = 0.0
    stall_times: int = 0


@dataclass
class _State:
    files: dict[str, bytes] = field(default_factory=dict)
    behaviour: dict[str, Behaviour] = field(default_factory=dict)
    requests: Counter[str] = field(default_factory=Counter)
    range_requests: list[tuple[str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - silence stderr noise
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        st = self.server.state
        path = self.path.split("?", 1)[0]
        with st.lock:
            st.requests[path] += 1
            data = st.files.get(path)
            b = st.behaviour.setdefault(path, Behaviour())
            fail = b.fail_times > 0
            if fail:
                b.fail_times -= 1
            drop = not fail and b.drop_times > 0
            if drop:
                b.drop_times -= 1
            stall = not fail and b.stall_times > 0
            if stall:
                b.stall_times -= 1
        if data is None:
            self._plain(404, b"not found")
            return
        if fail:
            self._plain(500, b"injected failure")
            return
        if b.truncate_to is not None:
            data = data[: b.truncate_to]
        if b.corrupt and data:
            mid = len(data) // 2
            data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1 :]
        start = 0
        rng = self.headers.get("Range")
        if rng and b.ranges and rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[6:-1])
            with st.lock:
                st.range_requests.append((path, start))
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.send_header("Connection", "close")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = memoryview(data)[start:]
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Type", "application/octet-stream")
        if b.ranges:
            self.send_header("Accept-Ranges", "bytes")
        self.send_header("Connection", "close")
        self.end_headers()
        if stall:
            time.sleep(b.stall_seconds)
        if drop:
            body = body[: b.drop_after]
        self._send_body(body, b.throttle_bps)
        if drop:
            self.wfile.flush()
            self.close_connection = True

    def _send_body(self, body: memoryview, throttle_bps: float | None) -> None:
        step = 64 * 1024 if throttle_bps is None else max(1024, int(throttle_bps / 20))
        t0 = time.monotonic()
        sent = 0
        try:
            for i in range(0, len(body), step):
                self.wfile.write(body[i : i + step])
                sent += len(body[i : i + step])
                if throttle_bps:
                    ahead = sent / throttle_bps - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (e.g. its timeout fired); nothing to do

    def _plain(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: _State


class FileServer:
    """A running server on a free 127.0.0.1 port. Use as a context manager or call ``stop()``.

    Example:
        >>> with FileServer() as srv:                     # doctest: +SKIP
        ...     srv.add("/a.bin", b"x" * 100, Behaviour(fail_times=2))
        ...     url = srv.url("/a.bin")
    """

    def __init__(self) -> None:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.state = _State()
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    @property
    def base(self) -> str:
        host, port = self._server.server_address[:2]
        # Typeshed allows bytes for an AF_UNIX address; this server binds 127.0.0.1, so it is a str.
        return f"http://{cast(str, host)}:{port}"

    def url(self, path: str) -> str:
        return self.base + path

    def add(self, path: str, data: bytes, behaviour: Behaviour | None = None) -> str:
        """Serve ``data`` at ``path`` (leading ``/``); return its URL."""
        with self._server.state.lock:
            self._server.state.files[path] = bytes(data)
            self._server.state.behaviour[path] = behaviour or Behaviour()
        return self.url(path)

    def set_behaviour(self, path: str, behaviour: Behaviour) -> None:
        with self._server.state.lock:
            self._server.state.behaviour[path] = behaviour

    def requests(self, path: str | None = None) -> int:
        """Requests received for ``path`` (or for all paths)."""
        with self._server.state.lock:
            c = self._server.state.requests
            return c[path] if path is not None else sum(c.values())

    @property
    def range_requests(self) -> list[tuple[str, int]]:
        with self._server.state.lock:
            return list(self._server.state.range_requests)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FileServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
