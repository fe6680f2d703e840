"""The client side of the GCS test emulator: start ``python -m ckptsdk.testing.gcs_server``, talk to it, stop it.

``start_emulator()`` runs the server in a subprocess (in-memory, free port, ready-checked with a
bounded wait) and returns an :class:`Emulator`. The server and its GCS-conformance patch live in
``ckptsdk.testing.gcs_server``; the ckptsdk GCS backend does not belong here either.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO
from urllib.parse import quote

_REPO = Path(__file__).resolve().parents[2]


class Emulator:
    """A running emulator subprocess. Use ``start_emulator()``; stop with ``.stop()`` or ``with``.

    ``proc`` and ``log`` are None for a client of a server this object did not start (``serve``
    announcing its own bucket): then there is nothing to stop or read.
    """

    def __init__(self, proc: subprocess.Popen[bytes] | None, port: int, log: IO[bytes] | None, patched: bool) -> None:
        self.proc = proc
        self.port = port
        self.patched = patched
        self.endpoint = f"http://127.0.0.1:{port}"
        self._log = log

    @property
    def storage_options(self) -> dict[str, str]:
        """What ``open_backend``/``GCSFileSystem`` need to reach this server."""
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "test"}

    @property
    def env(self) -> dict[str, str]:
        """Environment for child processes that open ``gs://`` URLs against this server."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def url(self, bucket: str, prefix: str = "") -> str:
        """``gs://bucket/prefix`` (``gs://bucket`` for an empty prefix)."""
        prefix = prefix.strip("/")
        return f"gs://{bucket}/{prefix}" if prefix else f"gs://{bucket}"

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

    def make_bucket(self, name: str) -> None:
        """Create bucket ``name`` (idempotent) with soft delete off."""
        status, body = self.request(
            "POST",
            "/storage/v1/b?project=test",
            json.dumps({"name": name}).encode(),
            {"Content-Type": "application/json"},
        )
        if status not in (200, 409):
            raise RuntimeError(f"emulator at {self.endpoint} refused bucket {name!r}: {status} {body!r}")
        status, body = self.request(
            "PATCH",
            f"/storage/v1/b/{quote(name, safe='')}",
            json.dumps({"softDeletePolicy": {"retentionDurationSeconds": "0"}}).encode(),
            {"Content-Type": "application/json"},
        )
        if status != 200:
            raise RuntimeError(f"emulator at {self.endpoint}: turning soft delete off failed: {status} {body!r}")

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

    def __enter__(self) -> Emulator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_emulator(*, patched: bool = True, timeout: float = 30.0) -> Emulator:
    """Start an in-memory emulator on a free 127.0.0.1 port and wait until it answers.

    Args:
        patched: apply the GCS-conformance patch (see module docstring); False runs it as shipped.
        timeout: seconds to wait for ``GET /`` to answer ``OK``.

    Returns:
        The running :class:`Emulator`.

    Raises:
        RuntimeError: the server exited or did not answer within ``timeout`` (its log included).
    """
    log = tempfile.TemporaryFile()
    cmd = [sys.executable, "-m", "ckptsdk.testing.gcs_server", "--port", "0", "--exit-with-parent"]
    if not patched:
        cmd.append("--unpatched")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(_REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=subprocess.PIPE, stderr=log)
    deadline = time.monotonic() + timeout
    port = None
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline().decode() if ready else ""
        if line.startswith("PORT "):
            port = int(line.split()[1])
        emulator = Emulator(proc, port or 0, log, patched)
        while port is not None and proc.poll() is None and time.monotonic() < deadline:
            try:
                status, body = emulator.request("GET", "/", timeout=2.0)
                if status == 200 and body.strip() == b"OK":
                    return emulator
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
        f"GCS emulator did not become ready within {timeout} s (exit code {proc.poll()}); "
        f"its log:\n{log.read().decode('utf-8', 'replace')[-4000:]}"
    )
