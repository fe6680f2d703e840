"""An S3 server on 127.0.0.1 for tests and local trials: moto's server, patched to be atomic like S3.

``python -m ckptsdk.testing.s3_server --bucket NAME`` serves in memory on a free port and prints
the environment to export; ``start_s3_server()`` runs the same as a subprocess for tests. moto as
shipped (MOTO_VERSION) checks ``If-None-Match``/``If-Match`` and then writes *without a lock*
between the two (two creators of one key can both win), ignores ``If-Match`` on
CompleteMultipartUpload, and can answer a read racing an overwrite with a server error. The patch
(server side of this module, a WSGI shim around moto's app) fixes exactly that:

1. Every request runs under one lock (as the single-threaded GCS emulator does), its body read
   whole *before* the lock is taken: a check and the write after it cannot interleave, and a
   slow or killed client never holds the lock. A body shorter than its ``Content-Length`` (a
   client killed mid-upload) is refused with 400 and changes nothing.
2. ``If-Match`` on CompleteMultipartUpload is evaluated against the live object (412 on a
   mismatch, 404 when absent), as AWS does since 2024-11.

Test options (never on by default): ``--unpatched`` (moto as shipped), ``--ignore-if-match``
(drops every ``If-Match`` header: an S3-compatible store without compare-and-swap),
``--write-gate N`` (each PutObject write waits up to ``GATE_S`` for N writers to reach it: the
interleaving that shows the unpatched race every round), ``POST /_ckptsdk/fail`` (the next
``count`` requests answer ``status``, after being applied with ``applied=1``: a lost reply), and
``POST /_ckptsdk/cut`` (patched server only: the next ``count`` ranged GETs answer half the bytes
asked, in a well-formed reply: a store or middlebox that ends a ranged answer early).
Client code (the backend) does not belong here.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

from ckptsdk.testing.child_server import ChildServer, exit_when_orphaned, start_child

MOTO_VERSION = "5.2.4"
GATE_S = 0.5
REGION = "us-east-1"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}

logger = logging.getLogger(__name__)

Environ = dict[str, Any]
StartResponse = Callable[..., Any]

# ---------------------------------------------------------------------------------------------
# Server side (runs only inside the server process)
# ---------------------------------------------------------------------------------------------


class _Gate:
    """Holds each arrival until ``n`` have arrived or ``timeout`` passed (then lets it go alone)."""

    def __init__(self, n: int, timeout: float) -> None:
        self.n, self.timeout = n, timeout
        self.cond = threading.Condition()
        self.waiting = 0
        self.generation = 0

    def arrive(self) -> None:
        with self.cond:
            generation = self.generation
            self.waiting += 1
            if self.waiting >= self.n:
                self.generation += 1
                self.waiting = 0
                self.cond.notify_all()
                return
            if not self.cond.wait_for(lambda: self.generation != generation, timeout=self.timeout):
                self.waiting -= 1


def _error(start_response: StartResponse, status: int, code: str, message: str) -> list[bytes]:
    body = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message></Error>'
    start_response(f"{status} {code}", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
    return [body.encode()]


class _Shim:
    """The WSGI app in front of moto's: control routes, faults, the lock, whole bodies."""

    def __init__(self, app: Any, *, patched: bool, ignore_if_match: bool) -> None:
        self.app, self.patched, self.ignore_if_match = app, patched, ignore_if_match
        self.lock = threading.Lock()
        self.faults: dict[str, Any] = {"count": 0}
        self.cuts = 0  # ranged GETs still to answer short
        self.faults_lock = threading.Lock()

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path.startswith("/_ckptsdk/"):
            return self._control(path, environ, start_response)
        if self.ignore_if_match and environ["REQUEST_METHOD"] in ("PUT", "POST", "DELETE"):
            environ.pop("HTTP_IF_MATCH", None)
        fault = self._take_fault(environ["REQUEST_METHOD"])
        if fault is not None and not fault["applied"]:
            return _error(start_response, fault["status"], "InternalError", "injected by the test")
        if not self.patched:
            out: Iterable[bytes] = self.app(environ, start_response)
        else:
            try:
                length = int(environ.get("CONTENT_LENGTH") or 0)
            except ValueError:
                length = 0
            body = environ["wsgi.input"].read(length) if length else b""
            if len(body) != length:  # the client died mid-body: create nothing
                return _error(start_response, 400, "IncompleteBody", "the request body ended early")
            environ["wsgi.input"] = io.BytesIO(body)
            with self.lock:
                captured: list[Any] = []

                def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
                    captured[:] = [status, headers]
                    return lambda data: None

                result = self.app(environ, capture)
                try:
                    data = b"".join(result)
                finally:
                    close = getattr(result, "close", None)
                    if close is not None:
                        close()
            if self._take_cut(environ):
                captured[1], data = _cut(captured[1], data)
            start_response(*captured)
            out = [data]
        if fault is not None:  # applied, then the reply is "lost"
            return _error(start_response, fault["status"], "InternalError", "applied, reply replaced by the test")
        return out

    def _take_fault(self, method: str) -> dict[str, Any] | None:
        with self.faults_lock:
            f = self.faults
            if f["count"] > 0 and f.get("method") in (None, method):
                f["count"] -= 1
                return dict(f)
        return None

    def _take_cut(self, environ: Environ) -> bool:
        if environ["REQUEST_METHOD"] != "GET" or "HTTP_RANGE" not in environ:
            return False
        with self.faults_lock:
            if self.cuts <= 0:
                return False
            self.cuts -= 1
            return True

    def _control(self, path: str, environ: Environ, start_response: StartResponse) -> list[bytes]:
        if path == "/_ckptsdk/health":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"OK"]
        if path == "/_ckptsdk/fail":
            q = {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
            with self.faults_lock:
                self.faults = {
                    "count": int(q.get("count", "1")),
                    "status": int(q.get("status", "503")),
                    "method": q.get("method"),
                    "applied": q.get("applied") == "1",
                }
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"OK"]
        if path == "/_ckptsdk/cut":
            if not self.patched:  # only the patched path holds a whole reply it can cut
                start_response("409 Conflict", [("Content-Type", "text/plain")])
                return [b"cut needs the patched server"]
            q = {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
            with self.faults_lock:
                self.cuts = int(q.get("count", "1"))
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"OK"]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"unknown control route"]


def _cut(headers: list[tuple[str, str]], data: bytes) -> tuple[list[tuple[str, str]], bytes]:
    """A reply's first half, with ``Content-Length`` and ``Content-Range`` made to match it."""
    kept = data[: len(data) // 2]
    out = []
    for name, value in headers:
        if name.lower() == "content-length":
            value = str(len(kept))
        elif name.lower() == "content-range" and kept:  # bytes FIRST-LAST/TOTAL
            first, _, rest = value.removeprefix("bytes ").partition("-")
            value = f"bytes {first}-{int(first) + len(kept) - 1}/{rest.partition('/')[2]}"
        out.append((name, value))
    return out, kept


def _install_patches(*, write_gate: int) -> None:
    """Patch moto's S3 handlers (see the module docstring); refuse a moto we have not read."""
    import importlib.metadata

    from moto.s3 import models, responses
    from moto.s3.exceptions import MissingKey, PreconditionFailed

    installed = importlib.metadata.version("moto")
    if installed != MOTO_VERSION:
        raise RuntimeError(f"ckptsdk.testing.s3_server patches moto {MOTO_VERSION}, found {installed}")

    original_post = responses.S3Response._key_response_post

    def key_response_post(self: Any, request: Any, body: bytes, bucket_name: str, query: Any, key_name: str) -> Any:
        if_match = request.headers.get("If-Match")
        if query.get("uploadId") and if_match:
            live = self.backend.get_object(bucket_name, key_name)
            if live is None:
                raise MissingKey(key=key_name)
            if if_match.replace('"', "") != live.etag.replace('"', ""):
                raise PreconditionFailed("If-Match")
        return original_post(self, request, body, bucket_name, query, key_name)

    responses.S3Response._key_response_post = key_response_post  # type: ignore[method-assign]
    _install_gate(models, write_gate)


def _install_gate(models: Any, write_gate: int) -> None:
    if write_gate < 2:
        return
    gate = _Gate(write_gate, GATE_S)
    original_put = models.S3Backend.put_object

    def put_object(self: Any, *args: Any, **kwargs: Any) -> Any:
        gate.arrive()  # between moto's precondition check and its write
        return original_put(self, *args, **kwargs)

    models.S3Backend.put_object = put_object


def run_server(
    port: int,
    *,
    patched: bool = True,
    ignore_if_match: bool = False,
    write_gate: int = 0,
    exit_with_parent: bool = False,
    bucket: str | None = None,
) -> None:
    """Run the server in this process until killed; print ``PORT <n>`` once listening."""
    os.environ.setdefault("MOTO_ALLOW_NONEXISTENT_REGION", "true")
    # From the module that defines them: moto.server re-exports them without an explicit export.
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    if exit_with_parent:
        exit_when_orphaned()
    logging.basicConfig(level=logging.WARNING, format="s3-server %(levelname)s %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    if patched:
        _install_patches(write_gate=write_gate)
    else:
        from moto.s3 import models

        _install_gate(models, write_gate)
    app = _Shim(DomainDispatcherApplication(create_backend_app), patched=patched, ignore_if_match=ignore_if_match)
    httpd = make_server("127.0.0.1", port, app, threaded=True)
    endpoint = f"http://127.0.0.1:{httpd.server_address[1]}"
    print(f"PORT {httpd.server_address[1]}", flush=True)
    if bucket:
        threading.Thread(target=_announce, args=(endpoint, bucket), daemon=True).start()
    httpd.serve_forever()


def _announce(endpoint: str, bucket: str) -> None:
    """Create ``bucket`` and print what a shell needs to use it (``python -m`` mode)."""
    server = S3Server(None, int(endpoint.rsplit(":", 1)[1]), None, True)
    server.make_bucket(bucket)
    lines = [f"export {k}={v}" for k, v in server.env.items()]
    lines.append(f"# bucket {bucket!r} is ready: use s3://{bucket}/RUN as the storage URL (Ctrl-C stops)")
    print("\n".join(lines), flush=True)


# ---------------------------------------------------------------------------------------------
# Client side: start, use and stop the server from tests
# ---------------------------------------------------------------------------------------------


class S3Server(ChildServer):
    """A running server subprocess. Use ``start_s3_server()``; stop with ``.stop()`` or ``with``."""

    @property
    def storage_options(self) -> dict[str, str]:
        """What ``open_backend("s3://...", **options)`` needs to reach this server."""
        return {
            "endpoint_url": self.endpoint,
            "region": REGION,
            "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        }

    @property
    def env(self) -> dict[str, str]:
        """Environment for processes (children, a shell) that open ``s3://`` URLs against this server."""
        return {"AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_DEFAULT_REGION": REGION, **CREDENTIALS}

    def url(self, bucket: str, prefix: str = "") -> str:
        prefix = prefix.strip("/")
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    def make_bucket(self, name: str) -> None:
        """Create bucket ``name`` (idempotent)."""
        status, body = self.request("PUT", f"/{name}")
        if status not in (200, 409):
            raise RuntimeError(f"S3 server at {self.endpoint} refused bucket {name!r}: {status} {body!r}")

    def fail(self, count: int, *, status: int = 503, method: str | None = None, applied: bool = False) -> None:
        """Make the next ``count`` requests (of ``method``) answer ``status``; ``applied``: after doing them."""
        query = f"count={count}&status={status}&applied={int(applied)}" + (f"&method={method}" if method else "")
        code, body = self.request("POST", f"/_ckptsdk/fail?{query}")
        if code != 200:
            raise RuntimeError(f"S3 server at {self.endpoint} refused the fault: {code} {body!r}")

    def cut_reads(self, count: int = 1) -> None:
        """Answer the next ``count`` ranged GETs with half the bytes asked (patched server only)."""
        code, body = self.request("POST", f"/_ckptsdk/cut?count={count}")
        if code != 200:
            raise RuntimeError(f"S3 server at {self.endpoint} refused the cut: {code} {body!r}")


def start_s3_server(
    *, patched: bool = True, ignore_if_match: bool = False, write_gate: int = 0, timeout: float = 60.0
) -> S3Server:
    """Start an in-memory S3 server on a free 127.0.0.1 port and wait until it answers.

    Args:
        patched: apply the atomicity patch (module docstring); False runs moto as shipped.
        ignore_if_match: drop every ``If-Match`` header (a store without compare-and-swap).
        write_gate: hold each PutObject write until this many arrive (race tests; 0: off).
        timeout: seconds to wait for the server to answer.

    Raises:
        RuntimeError: the server exited or did not answer within ``timeout`` (its log included).
    """
    args = ["--unpatched"] if not patched else []
    args += ["--ignore-if-match"] if ignore_if_match else []
    args += ["--write-gate", str(write_gate)] if write_gate else []
    return start_child(
        S3Server,
        "ckptsdk.testing.s3_server",
        args,
        patched=patched,
        health="/_ckptsdk/health",
        name="S3 server",
        timeout=timeout,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="moto's S3 server on 127.0.0.1, in memory, made atomic")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed)")
    parser.add_argument("--bucket", help="create this bucket and print the environment to export")
    parser.add_argument("--unpatched", action="store_true", help="run moto as shipped")
    parser.add_argument("--ignore-if-match", action="store_true", help="drop If-Match (a store without CAS)")
    parser.add_argument("--write-gate", type=int, default=0, help="hold PutObject writes until N arrive")
    parser.add_argument("--exit-with-parent", action="store_true", help="exit when the parent dies")
    args = parser.parse_args(argv)
    run_server(
        args.port,
        patched=not args.unpatched,
        ignore_if_match=args.ignore_if_match,
        write_gate=args.write_gate,
        exit_with_parent=args.exit_with_parent,
        bucket=args.bucket,
    )


if __name__ == "__main__":
    main()

__all__ = ["S3Server", "start_s3_server", "run_server", "MOTO_VERSION"]
