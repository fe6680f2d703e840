"""Fault suite, part 5: GCS behind a loopback proxy that stalls, drops replies, answers 429/503,
and a real frozen server (SIGSTOP).

Every storage call has a deadline (GCSBackend.request_deadline_s, shrunk here to seconds): a
server that stops answering makes a save fail with ``BackendError`` within a bounded time and
commit nothing; lost replies and 429/503 storms are retried, and what is restored is exact.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator

import pytest

from ckptsdk import CheckpointManager
from ckptsdk.backends.cloud.gcs import GCSBackend
from ckptsdk.errors import BackendError, CkptError
from ckptsdk.manager import Simulation
from ckptsdk.testing.gcs_emulator import Emulator, start_emulator
from tests.support._fault_state import digest, expected, make_state
from tests.support.gcs_proxy import LoopbackProxy

pytestmark = pytest.mark.gcs


def _fast(backend: GCSBackend) -> GCSBackend:
    backend.backoff_s = 0.05
    backend.connect_timeout_s = 2.0
    backend.read_timeout_s = 1.0
    backend.request_deadline_s = 2.0
    return backend


def _patient(backend: GCSBackend) -> GCSBackend:
    """Retry quickly, wait patiently: for the calls a test does not mean to time out."""
    backend.backoff_s = 0.05
    backend.read_timeout_s, backend.request_deadline_s = 30.0, 60.0
    return backend


@pytest.fixture
def rig(gcs_emulator: Emulator) -> Iterator[tuple[LoopbackProxy, GCSBackend, GCSBackend]]:
    """(proxy, backend through it, direct backend on the same root).

    The backend through the proxy retries quickly but waits patiently: a loaded machine's
    emulator may take over a second to answer an upload, which fast timeouts would call a
    failure (CI saw it). A test of timeouts shrinks them with ``_fast`` once it has opened.
    """
    bucket = f"faults-{uuid.uuid4().hex[:12]}"
    gcs_emulator.make_bucket(bucket)
    proxy = LoopbackProxy(gcs_emulator.port)
    through = _patient(
        GCSBackend(f"{bucket}/run", endpoint_url=proxy.endpoint, token="anon", project="test", skip_instance_cache=True)
    )
    direct = GCSBackend(f"{bucket}/run", **gcs_emulator.storage_options, skip_instance_cache=True)
    yield proxy, through, direct
    proxy.close()


def _restored(backend: GCSBackend) -> tuple[int | None, str | None]:
    state = make_state(0)
    point = CheckpointManager(backend, read_only=True).restore(state)
    return (point.step, digest(state)) if point else (None, None)


@pytest.mark.timeout(120)
def test_a_stalled_server_fails_the_save_in_bounded_time_and_commits_nothing(rig):
    proxy, through, direct = rig
    mgr = CheckpointManager(through, _simulation=Simulation(heartbeat=False))
    mgr.restore(make_state(0))
    mgr.save(make_state(1), step=1)
    # Its rotation and renewal run on the worker after the commit, and save 2 waits for them:
    # against the stall they added their own timeouts to save 2's (35 s in all, on CI).
    assert mgr.wait(timeout=60)
    _fast(through)
    proxy.plan = lambda n, head: "stall"
    started = time.monotonic()
    with pytest.raises(BackendError, match="deadline|failed"):
        mgr.save(make_state(2), step=2)
    took = time.monotonic() - started
    assert took < 30, f"a save against a frozen server took {took:.1f} s"
    proxy.plan = lambda n, head: "pass"
    _patient(through)
    assert _restored(direct) == (1, expected(1))  # step 2 committed nothing
    mgr.save(make_state(3), step=3)  # the writer carries on once the server answers again
    mgr.close()
    assert _restored(direct) == (3, expected(3))
    print(f"stalled server: save failed after {took:.1f} s; nothing committed")


@pytest.mark.timeout(120)
def test_a_storm_of_429_and_503_is_retried_and_a_lasting_one_commits_nothing(rig):
    proxy, through, direct = rig
    mgr = CheckpointManager(through, _simulation=Simulation(heartbeat=False))
    mgr.restore(make_state(0))
    # Every other request is refused once (429 or 503): each is retried, the save succeeds.
    proxy.plan = lambda n, head: (429 if n % 4 == 1 else 503) if n % 2 else "pass"
    for step in (1, 2):
        mgr.save(make_state(step), step=step)
    assert mgr.wait(timeout=60)  # save 2's rotation on the worker is not what fails below
    assert any(action in (429, 503) for action, _ in proxy.seen)
    proxy.plan = lambda n, head: 503  # the service stays down
    with pytest.raises(BackendError):
        mgr.save(make_state(3), step=3)
    proxy.plan = lambda n, head: "pass"
    mgr.close()
    assert _restored(direct) == (2, expected(2))


@pytest.mark.timeout(120)
def test_lost_replies_are_retried_and_restores_are_exact(rig):
    proxy, through, direct = rig
    mgr = CheckpointManager(through, _simulation=Simulation(heartbeat=False))
    mgr.restore(make_state(0))
    _fast(through)
    proxy.plan = lambda n, head: "drop" if n % 3 == 0 else "pass"  # every third reply is lost
    outcomes = []
    for step in (1, 2, 3, 4):
        try:
            mgr.save(make_state(step), step=step)
            outcomes.append("ok")
        except CkptError as exc:  # allowed: a clear error; never a wrong or torn checkpoint
            outcomes.append(type(exc).__name__)
    proxy.plan = lambda n, head: "pass"
    mgr.close()
    assert any(action == "drop" for action, _ in proxy.seen)
    step, got = _restored(direct)
    assert step is not None and got == expected(step), (outcomes, step)
    assert outcomes.count("ok") >= 1 and step >= max(i + 1 for i, o in enumerate(outcomes) if o == "ok")


@pytest.mark.timeout(120)
def test_a_really_frozen_server_process(tmp_path):
    """SIGSTOP the emulator itself: its socket stays open, the kernel still accepts connections."""
    with start_emulator() as server:
        bucket = f"frozen-{uuid.uuid4().hex[:8]}"
        server.make_bucket(bucket)
        backend = _fast(GCSBackend(f"{bucket}/run", **server.storage_options, skip_instance_cache=True))
        backend.write("before", b"1")
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(BackendError):
                backend.write("during", b"2" * 100_000)
            took = time.monotonic() - started
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert took < 30, took
        assert backend.read("before") == b"1"
        print(f"frozen server process: write failed after {took:.1f} s")
