"""The client side of the GCS test emulator: start ``python -m ckptsdk.testing.gcs_server``, talk to it, stop it.

``start_emulator()`` runs the server in a subprocess (in-memory, free port, ready-checked with a
bounded wait: ``child_server.py``) and returns an :class:`Emulator`. The server and its
GCS-conformance patch live in ``ckptsdk.testing.gcs_server``; the ckptsdk GCS backend does not
belong here either.
"""

from __future__ import annotations

import json
from urllib.parse import quote

from ckptsdk.testing.child_server import ChildServer, start_child


class Emulator(ChildServer):
    """A running emulator subprocess. Use ``start_emulator()``; stop with ``.stop()`` or ``with``.

    ``proc`` and ``log`` are None for a client of a server this object did not start (``serve``
    announcing its own bucket): then there is nothing to stop or read.
    """

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
    args = [] if patched else ["--unpatched"]
    return start_child(
        Emulator, "ckptsdk.testing.gcs_server", args, patched=patched, health="/", name="GCS emulator", timeout=timeout
    )
