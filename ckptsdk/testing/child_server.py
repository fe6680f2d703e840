"""A test server in a child process: start it on a free port, wait until it answers, stop it with its parent.

Shared by the S3 server (``s3_server.py``) and the GCS emulator (``gcs_emulator.py``, whose server
is ``gcs_server.py``). The protocol between the two sides is small: the child is
``python -m MODULE --port 0 --exit-with-parent ...``, prints ``PORT <n>`` once listening and
answers ``GET <health path>`` with ``OK`` once ready. What a store's server serves, and the
store-specific calls of its handle, belong in those modules.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, TypeVar

__all__ = ["ChildServer", "exit_when_orphaned", "start_child"]

_REPO = Path(__file__).resolve().parents[2]

Server = TypeVar("Server", bound="ChildServer")


class ChildServer:
    """A running server subprocess on 127.0.0.1; stop with ``.stop()`` or ``with``.

    ``proc`` and ``log`` are None for a handle on a server this object did not start (a server
    announcing its own bucket in ``python -m`` mode): then there is nothing to stop or read.
    """

    def __init__(self, proc: subprocess.Popen[bytes] | None, port: int, log: IO[bytes] | None, patched: bool) -> None:
        self.proc, self.port, self._log, self.patched = proc, port, log, patched
        self.endpoint = f"http://127.0.0.1:{port}"

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> tuple[int, bytes]:
        """One raw HTTP request to the server; returns (status, body) for any status."""
        req = urllib.request.Request(self.endpoint + path, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

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

    def __enter__(self: Server) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_child(
    handle: type[Server], module: str, args: list[str], *, patched: bool, health: str, name: str, timeout: float
) -> Server:
    """Run ``python -m module --port 0 --exit-with-parent *args`` and wait until ``GET health`` answers OK.

    Args:
        handle: the :class:`ChildServer` subclass to return, built as ``handle(proc, port, log, patched)``.
        module: the server's module (run from this repository, whatever the caller's cwd).
        args: the server's other command-line options.
        patched: passed to ``handle`` (whether the server runs with its conformance patch).
        health: the path that answers 200 ``OK`` once the server serves.
        name: the server's name, for the error message.
        timeout: seconds to wait for the ``PORT`` line and the health answer together.

    Raises:
        RuntimeError: the server exited or did not answer within ``timeout`` (its log included).
    """
    log = tempfile.TemporaryFile()
    cmd = [sys.executable, "-m", module, "--port", "0", "--exit-with-parent", *args]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(_REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=subprocess.PIPE, stderr=log)
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline().decode() if ready else ""
        if line.startswith("PORT "):
            server = handle(proc, int(line.split()[1]), log, patched)
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    status, body = server.request("GET", health, timeout=2.0)
                    if status == 200 and body.strip() == b"OK":
                        return server
                except OSError:  # not listening yet, or a reply cut by start-up
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
        f"{name} did not become ready within {timeout} s (exit code {proc.poll()}); "
        f"its log:\n{log.read().decode('utf-8', 'replace')[-4000:]}"
    )


def exit_when_orphaned() -> None:
    """In the server: exit when the process that started it is gone (a SIGKILLed pytest leaves no server)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
