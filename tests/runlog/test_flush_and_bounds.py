"""The run log's flusher thread, its data digests, and an audit that reads in bounded memory."""

from __future__ import annotations

import json
import threading
import tracemalloc

import pytest

from ckptsdk.backends import open_backend
from ckptsdk.errors import ConfigError
from ckptsdk.runlog.audit import audit, read_runlog
from ckptsdk.runlog.record import chunk_key, digest_value
from ckptsdk.runlog.writer import RunLog


def wait_until(predicate, timeout: float = 60.0) -> bool:
    event = threading.Event()
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return True
        event.wait(0.05)
    return predicate()


def logged(backend, attempt: int = 1) -> set[int]:
    return set(read_runlog(backend)[1].get(attempt, {}))


def test_the_flusher_thread_publishes_without_another_log_step(tmp_path):
    backend = open_backend(str(tmp_path / "root"))
    log = RunLog(backend, run_id="r", attempt=1, lease_epoch=1, resumed_from_step=None, background=True)
    log.log_step(1, loss=0.5)
    log.log_step(2, loss=0.25)
    # Nothing else is called: the thread alone gets the steps out (a job stuck in a long step,
    # or killed, still leaves them for the audit).
    assert wait_until(lambda: logged(backend) == {1, 2})
    assert not log.closed and log._flusher is not None and log._flusher.is_alive()
    log.log_step(3, loss=0.125)
    log.flush_soon()
    assert wait_until(lambda: logged(backend) == {1, 2, 3})
    log.close()
    assert not log._flusher.is_alive()
    summary = read_runlog(backend)[0][1]
    assert summary.closed and summary.steps == 3


def test_flush_interval_is_configurable_and_checked(tmp_path):
    backend = open_backend("memory://flush-interval")
    with pytest.raises(ConfigError, match="flush_interval"):
        RunLog(backend, run_id="r", attempt=1, lease_epoch=1, resumed_from_step=None, flush_interval=0)
    log = RunLog(backend, run_id="r", attempt=1, lease_epoch=1, resumed_from_step=None, flush_interval=3600.0)
    assert log.flush_interval == 3600.0
    log.close()


def run(backend, attempt, steps, digest, *, resumed_from=None, close=True):
    log = RunLog(backend, run_id="r", attempt=attempt, lease_epoch=attempt, resumed_from_step=resumed_from)
    current = {}
    log.watch_data("data/loader", lambda: current.get("d"))
    for s in steps:
        current["d"] = digest(s)
        log.log_step(s, loss=1.0 / (s + 1))
    if close:
        log.close()
    else:
        log.flush()


def test_a_data_digest_that_differs_diverges_even_when_losses_agree():
    backend = open_backend("memory://digest-div")
    run(backend, 1, range(0, 10), lambda s: f"0:{s}:aaaa", close=False)
    run(backend, 2, range(6, 12), lambda s: f"0:{s}:{'bbbb' if s == 8 else 'aaaa'}", resumed_from=6)
    report = audit(backend, tolerance=1.0)  # no tolerance applies to data
    assert report.verdict == "DIVERGED at step 8" and not report.ok and not report.verified
    div = report.first_divergence
    assert (div.scalar, div.in_data, div.abs_diff) == ("data/loader", True, float("inf"))
    assert div.values == {1: digest_value("0:8:aaaa"), 2: digest_value("0:8:bbbb")}
    assert report.scalars["loss"].max_abs_diff == 0.0 and report.data_compared == {"data/loader": 4}
    assert "data/loader" not in report.scalars  # digests are not differences to report


def test_digests_are_plain_scalars_a_format_1_1_reader_reads():
    backend = open_backend("memory://digest-format")
    run(backend, 1, range(0, 3), lambda s: f"0:{s}:aaaa")
    header, row = backend.read(chunk_key(1, 0)).decode().splitlines()[:2]
    assert json.loads(header)["format"] == "ckptsdk.runlog/1.1"
    assert json.loads(row)["scalars"]["data/loader"] == digest_value("0:0:aaaa")
    log = RunLog(backend, run_id="r", attempt=2, lease_epoch=2, resumed_from_step=None)
    with pytest.raises(ConfigError, match="reserved for data digests"):
        log.log_step(1, **{"data/x": 1.0})
    with pytest.raises(ConfigError, match="data/"):
        log.watch_data("loader", lambda: None)
    log.close()


def test_same_digests_are_bit_exact_and_counted():
    backend = open_backend("memory://digest-same")
    run(backend, 1, range(0, 10), lambda s: f"d{s}", close=False)
    run(backend, 2, range(6, 12), lambda s: f"d{s}", resumed_from=6)
    report = audit(backend)
    assert (report.verdict, report.verified, report.data_compared) == ("bit-exact", True, {"data/loader": 4})


def test_unverified_names_the_steps_that_never_reached_storage():
    backend = open_backend("memory://unverified")
    run(backend, 1, range(0, 6), lambda s: None, close=False)  # killed; its steps 6.. never flushed
    run(backend, 2, range(6, 9), lambda s: None, resumed_from=5)
    report = audit(backend)
    assert (report.verdict, report.ok, report.verified) == ("unverified", True, False)
    assert "attempt 1 was not closed cleanly and its last step on storage is 5" in report.unverified_reason
    assert "unverified" in str(report)


def test_an_overlong_garbage_line_is_skipped_unread_in_bounded_memory(tmp_path):
    backend = open_backend(str(tmp_path / "root"))
    run(backend, 1, range(0, 10), lambda s: None, close=False)
    run(backend, 2, range(6, 12), lambda s: None, resumed_from=6)
    key = chunk_key(2, 0)
    path = tmp_path / "root" / key
    good = path.read_bytes().splitlines(keepends=True)
    # 64 MiB of garbage on one line between the header and the rows (the hostile round used
    # 200 MB; the point is that memory does not grow with it).
    with open(path, "wb") as f:
        f.write(good[0])
        block = b"z" * (1 << 20)
        for _ in range(64):
            f.write(block)
        f.write(b"\n")
        f.writelines(good[1:])
    tracemalloc.start()
    try:
        report = audit(backend)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.verdict == "bit-exact" and report.overlap_steps == 4
    assert any(f"{key}: line 2 is longer than" in w for w in report.warnings), report.warnings
    assert peak < 8 << 20, f"audit peaked at {peak / 2**20:.1f} MiB over a 64 MiB line"
