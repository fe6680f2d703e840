"""Fault suite, part 6: a store frozen for real (its server process SIGSTOPped) during a blocking save.

The backends keep their shipped per-request bounds (GCS: 120 s per request plus its body at
1 MiB/s; S3: 300 s per call, 60 s socket timeouts); only ``save_deadline`` is short. A frozen
server's kernel still accepts connections and buffers bytes, so nothing but a deadline ends the
wait: one deadline for the whole save, not one per request in turn (before it, the same save
hung for two minutes and more). The save raises ``DeadlineExceeded`` naming the store and the
request it waited for, commits nothing, and the previous checkpoint restores exactly.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from ckptsdk import CheckpointManager, SaveOptions, TrainState
from ckptsdk.errors import DeadlineExceeded

SAVE_DEADLINE = 3.0
# The saves before the freeze and after the thaw run against a healthy store, but on a loaded CI
# machine (moto or the emulator sharing 2 cores with the xdist workers) the first save, lease and
# listing included, has taken over 3.3 s: those saves get a deadline no healthy store misses.
HEALTHY_DEADLINE = 120.0


def _state(step: int) -> TrainState:
    """About 2 MB of parameters and momentum, a function of ``step``."""
    torch.manual_seed(step)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return TrainState(model=model, optimizer=opt)


def _weights(state: TrainState) -> list[torch.Tensor]:
    model = state.objects["model"]
    return [t.detach().clone() for t in model.state_dict().values()]


@contextmanager
def _server(kind: str) -> Iterator[tuple[Any, str, dict[str, Any]]]:
    """(server, root URL, storage options) on a server of our own: the session's must not freeze."""
    bucket = f"frozen-{uuid.uuid4().hex[:12]}"
    if kind == "gcs":
        pytest.importorskip("gcp_storage_emulator")
        from ckptsdk.testing.gcs_emulator import start_emulator

        server: Any = start_emulator()
    else:
        pytest.importorskip("moto")
        from ckptsdk.testing.s3_server import start_s3_server

        server = start_s3_server()
    try:
        server.make_bucket(bucket)
        yield server, server.url(bucket, "run"), dict(server.storage_options)
    finally:
        if server.proc is not None and server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", [pytest.param("gcs", marks=pytest.mark.gcs), pytest.param("s3", marks=pytest.mark.s3)])
def test_a_frozen_store_fails_a_blocking_save_within_one_deadline_and_nothing_is_lost(kind):
    with _server(kind) as (server, url, options):
        mgr = CheckpointManager(
            url, storage_options=options, save_options=SaveOptions(save_deadline=HEALTHY_DEADLINE, on_signal=False)
        )
        first = _state(1)
        mgr.save(first, step=1)
        assert mgr.wait(timeout=60)  # its rotation runs on the worker after it: not what is frozen here
        mgr._saving.save_deadline = SAVE_DEADLINE  # only the save against the frozen store is short
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded) as caught:
                mgr.save(_state(2), step=2, blocking=True)
            took = time.monotonic() - started
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        err = caught.value
        assert type(err) is DeadlineExceeded
        message = str(err)
        assert message.startswith(f"the save of step 2 under {url} did not finish within its ")
        assert "deadline (save_deadline): still waiting for " in message
        assert err.waited_for.startswith(("GCS at " if kind == "gcs" else "S3 at ") + server.endpoint)
        assert err.key is not None and err.key.endswith("/tensors.safetensors")  # the upload it waited for
        assert err.url == url and SAVE_DEADLINE < err.seconds < SAVE_DEADLINE + 3  # + 2 MB at 1 MiB/s
        assert "previous committed checkpoint is intact" in message and "raise save_deadline" in message
        # A generous bound that a hang exceeds: each request alone may wait 120 s (GCS), 300 s (S3).
        assert took < 60, f"the save against a frozen {kind} server took {took:.1f} s"

        # Nothing lost: the previous checkpoint restores exactly, and the writer carries on.
        reader = CheckpointManager(url, storage_options=options, read_only=True)
        got = _state(0)
        point = reader.restore(got)
        assert point is not None and point.step == 1
        assert all(torch.equal(a, b) for a, b in zip(_weights(got), _weights(first), strict=True))
        assert [c.step for c in reader.list() if c.committed] == [1]
        mgr._saving.save_deadline = HEALTHY_DEADLINE  # the thawed store may still be slow to answer
        mgr.save(_state(3), step=3)
        mgr.close()
        assert [c.step for c in reader.list() if c.committed] == [1, 3]
        print(f"frozen {kind} server: the blocking save failed after {took:.1f} s (save_deadline {SAVE_DEADLINE} s)")
