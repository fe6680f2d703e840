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
interleaving that shows the unpatched race every round), and ``POST /_ckptsdk/fail`` (the next
``count`` requests answer ``status``, after being applied with ``applied=1``: a lost reply).
Client code (the backend) does not belong here.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qs

MOTO_VERSION = "5.2.4"
GATE_S = 0.5
REGION = "us-east-1"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
_REPO = Path(__file__).resolve().parents[2]

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
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"unknown control route"]


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


def _exit_with_parent() -> None:
    """Exit when the process that started us is gone (a SIGKILLed pytest leaves no server)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


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
        _exit_with_parent()
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


class S3Server:
    """A running server subprocess. Use ``start_s3_server()``; stop with ``.stop()`` or ``with``."""

    def __init__(self, proc: subprocess.Popen[bytes] | None, port: int, log: IO[bytes] | None, patched: bool) -> None:
        self.proc, self.port, self._log, self.patched = proc, port, log, patched
        self.endpoint = f"http://127.0.0.1:{port}"

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

    def request(self, method: str, path: str, body: bytes | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
        """One raw HTTP request to the server; returns (status, body) for any status."""
        req = urllib.request.Request(self.endpoint + path, data=body, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

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

    def log(self) -> str:
        """What the server wrote to stderr so far (for failure messages)."""
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 5 s)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc.stdout:
            self.proc.stdout.close()
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
    log = tempfile.TemporaryFile()
    cmd = [sys.executable, "-m", "ckptsdk.testing.s3_server", "--port", "0", "--exit-with-parent"]
    cmd += ["--unpatched"] if not patched else []
    cmd += ["--ignore-if-match"] if ignore_if_match else []
    cmd += ["--write-gate", str(write_gate)] if write_gate else []
    env = dict(os.environ)
    env["PYTHONPATH"] = str(_REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=subprocess.PIPE, stderr=log)
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline().decode() if ready else ""
        if line.startswith("PORT "):
            server = S3Server(proc, int(line.split()[1]), log, patched)
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    if server.request("GET", "/_ckptsdk/health", timeout=2.0) == (200, b"OK"):
                        return server
                except OSError:
                    pass
                time.sleep(0.05)
    except BaseException:
        proc.kill()
        proc.wait(timeout=5)
        raise
    proc.kill()
    proc.wait(timeout=5)
    log.seek(0)
    raise RuntimeError(
        f"S3 server did not become ready within {timeout} s (exit code {proc.poll()}); "
        f"its log:\n{log.read().decode('utf-8', 'replace')[-4000:]}"
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
