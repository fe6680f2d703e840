"""The per-attempt step log, the resume audit and its plot (ckptsdk.runlog.writer, ckptsdk.runlog.plot)."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptsdk.backends import open_backend
from ckptsdk.errors import (
    ConfigError,
    ManifestError,
    MissingDependencyError,
    PreconditionFailed,
    StorageUnavailable,
)
from ckptsdk.format.document import parse_document
from ckptsdk.runlog.audit import AUDIT_FORMAT, AuditReport, audit, read_runlog
from ckptsdk.runlog.plot import plot_audit
from ckptsdk.runlog.record import parse_chunk
from ckptsdk.runlog.writer import RUNLOG_FORMAT, RunLog, chunk_key

CHUNK_RE = re.compile(r"^runlog/attempt-\d{6}/(attempt\.json|chunk-\d{6}\.jsonl)$")


def loss_at(step: int) -> float:
    """A deterministic, irregular loss curve (what a bit-exact resume reproduces)."""
    return 2.5 * math.exp(-step / 90.0) + 0.05 * math.sin(step * 0.7) + 0.3


def run_attempt(backend, attempt, steps, *, resumed_from=None, close=True, flush_every=40, loss=loss_at, **extra):
    log = RunLog(
        backend,
        run_id="run-1",
        attempt=attempt,
        lease_epoch=attempt,
        resumed_from_step=resumed_from,
        flush_every=flush_every,
        host=f"host-{attempt}",
        device="cpu",
    )
    for s in steps:
        log.log_step(s, loss=loss(s), lr=0.1 * 0.99 ** (s // 10), **{k: f(s) for k, f in extra.items()})
    if close:
        log.close()
    else:
        log.flush()  # a killed runtime's last periodic flush; never closed
    return log


def story(backend, *, loss2=loss_at):
    """Attempt 1 runs 0..149 and dies (checkpoint at 100); attempt 2 resumes from 100 to 249."""
    run_attempt(backend, 1, range(0, 150), close=False)
    run_attempt(backend, 2, range(100, 250), resumed_from=100, loss=loss2)


def test_two_attempts_overlapping_50_steps_bit_exact(backend):
    story(backend)
    report = audit(backend)
    assert report.verdict == "bit-exact"
    assert report.ok and report.diverged_at is None and report.first_divergence is None
    assert report.overlap_steps == 50
    assert [(o.attempts, o.first_step, o.last_step, o.steps) for o in report.overlaps] == [([1, 2], 100, 149, 50)]
    a1, a2 = report.attempts
    fields = ("attempt", "first_step", "last_step", "steps", "closed", "resumed_from_step")
    assert tuple(getattr(a1, f) for f in fields) == (1, 0, 149, 150, False, None)
    assert tuple(getattr(a2, f) for f in fields) == (2, 100, 249, 150, True, 100)
    assert (a1.lease_epoch, a1.host, a1.run_id, a2.host) == (1, "host-1", "run-1", "host-2")
    assert a1.versions["python"] and a1.started_at
    assert set(report.scalars) == {"loss", "lr"}
    for diff in report.scalars.values():
        assert (diff.max_abs_diff, diff.at_step, diff.compared_steps) == (0.0, None, 50)
    assert report.warnings == []


def test_a_difference_at_one_step_is_diverged_at_that_step(backend):
    story(backend, loss2=lambda s: loss_at(s) + (3e-7 if s >= 123 else 0.0))
    report = audit(backend)
    assert report.verdict == "DIVERGED at step 123"
    assert not report.ok and report.diverged_at == 123
    div = report.first_divergence
    assert div is not None and (div.step, div.scalar) == (123, "loss")
    assert div.values == {1: loss_at(123), 2: loss_at(123) + 3e-7}
    assert report.scalars["loss"].max_abs_diff == pytest.approx(3e-7, rel=1e-3)
    assert report.scalars["lr"].max_abs_diff == 0.0
    # The same logs within a tolerance: accepted, but not called bit-exact.
    loose = audit(backend, tolerance=1e-6)
    assert (loose.verdict, loose.ok, loose.diverged_at) == ("within tolerance", True, None)


def test_nan_and_inf_are_kept_and_compared(backend):
    nan_from = lambda s: math.nan if s >= 120 else loss_at(s)  # noqa: E731
    run_attempt(backend, 1, range(0, 150), close=False, loss=nan_from, g=lambda s: math.inf if s == 130 else 1.0)
    run_attempt(backend, 2, range(100, 200), resumed_from=100, loss=nan_from, g=lambda s: math.inf if s == 130 else 1.0)
    report = audit(backend)
    assert report.verdict == "bit-exact"  # nan against nan, inf against inf: the same
    _, steps, _ = read_runlog(backend)
    assert math.isnan(steps[1][125]["loss"]) and steps[2][130]["g"] == math.inf

    # A nan against a number is a divergence, whatever the tolerance.
    run_attempt(backend, 3, range(140, 160), resumed_from=140, loss=loss_at, g=lambda s: 1.0)
    report = audit(backend, tolerance=1e9)
    assert report.verdict == "DIVERGED at step 140"
    assert report.first_divergence.scalar == "loss"
    assert report.scalars["loss"].max_abs_diff == math.inf
    doc = json.loads(report.to_json())  # strict JSON even with inf inside: document's float tag
    assert doc["scalars"]["loss"]["max_abs_diff"] == {"$float": "inf"}
    assert json.loads(report.model_dump_json()) == doc


def test_chunks_are_never_rewritten(backend):
    log = RunLog(backend, run_id="r", attempt=7, lease_epoch=3, resumed_from_step=None, flush_every=10)
    seen: dict[str, str] = {}
    for step in range(55):
        log.log_step(step, loss=loss_at(step))
        now = {o.key: o.version for o in backend.list("runlog/")}
        for key, version in seen.items():
            assert now.get(key) == version, f"{key} was rewritten or removed"
        seen.update(now)
    log.close()
    final = {o.key: o.version for o in backend.list("runlog/")}
    assert all(final[k] == v for k, v in seen.items())
    assert all(CHUNK_RE.match(k) for k in final)
    # 5 full chunks of 10 steps, then close() publishes the last 5 steps with the closing header.
    assert sorted(final) == ["runlog/attempt-000007/attempt.json"] + [chunk_key(7, i) for i in range(6)]
    last = backend.read(chunk_key(7, 5)).decode().splitlines()
    header = json.loads(last[0])
    assert (header["closed"], header["last_step"], header["steps_logged"], header["chunk"]) == (True, 54, 55, 5)
    assert len(last) == 1 + 5
    log.close()  # idempotent: nothing new
    assert {o.key: o.version for o in backend.list("runlog/")} == final


def test_reopened_attempt_continues_numbering(backend):
    run_attempt(backend, 4, range(0, 30), close=False, flush_every=10)
    again = run_attempt(backend, 4, range(30, 45), flush_every=10)
    keys = [o.key for o in backend.list("runlog/attempt-000004/")]
    assert keys[-1] == chunk_key(4, 4) and again.record.closed
    (summary,) = audit(backend).attempts
    assert (summary.first_step, summary.last_step, summary.steps, summary.chunks) == (0, 44, 45, 5)


def test_two_writers_of_one_attempt_collide_loudly(backend):
    a = RunLog(backend, run_id="r", attempt=2, lease_epoch=1, resumed_from_step=None)
    b = RunLog(backend, run_id="r", attempt=2, lease_epoch=1, resumed_from_step=None)
    a.log_step(1, loss=1.0)
    b.log_step(1, loss=2.0)
    b._next_seq = 0  # both listed before either wrote: the race the create() guards against
    a.flush()
    with pytest.raises(PreconditionFailed) as info:
        b.flush()
    assert info.value.key == chunk_key(2, 0)
    assert json.loads(backend.read(chunk_key(2, 0)).decode().splitlines()[1])["scalars"]["loss"] == 1.0
    assert b._pending is not None and b._pending[0] == chunk_key(2, 0), "the losing writer keeps its steps"
    with pytest.raises(PreconditionFailed):
        b.close()  # and keeps failing loudly rather than writing elsewhere


def test_scalar_types(backend):
    log = RunLog(backend, run_id="r", attempt=1, lease_epoch=1, resumed_from_step=None)
    t = torch.tensor(0.25, dtype=torch.float32)
    log.log_step(
        3,
        loss=t,
        lr=np.float32(0.1),
        n=np.int64(7),
        i=5,
        f=1.5,
        b=True,
        one=torch.tensor([2.0]),
        half=torch.tensor(1.0 / 3.0, dtype=torch.bfloat16),
        neg_inf=-math.inf,
    )
    t.add_(1.0)  # a later in-place update must not change what was logged
    log.close()
    _, steps, _ = read_runlog(backend)
    got = steps[1][3]
    assert got == {
        "loss": 0.25,
        "lr": float(np.float32(0.1)),
        "n": 7.0,
        "i": 5.0,
        "f": 1.5,
        "b": 1.0,
        "one": 2.0,
        "half": float(torch.tensor(1.0 / 3.0, dtype=torch.bfloat16)),
        "neg_inf": -math.inf,
    }
    log2 = RunLog(backend, run_id="r", attempt=2, lease_epoch=1, resumed_from_step=None)
    with pytest.raises(ConfigError, match="'acc'.*str"):
        log2.log_step(1, acc="high")
    with pytest.raises(ConfigError, match="shape"):
        log2.log_step(1, loss=torch.zeros(3))
    with pytest.raises(ConfigError, match="step"):
        log2.log_step(-1, loss=1.0)
    with pytest.raises(ConfigError, match="no scalars"):
        log2.log_step(1)
    with pytest.raises(ConfigError, match="after close"):
        log.log_step(4, loss=1.0)


def test_step_logged_twice_in_one_attempt_last_wins(backend):
    log = RunLog(backend, run_id="r", attempt=1, lease_epoch=1, resumed_from_step=None, flush_every=3)
    for s, v in [(1, 1.0), (2, 2.0), (2, 2.5), (3, 3.0), (2, 2.75)]:
        log.log_step(s, loss=v)
    log.close()
    _, steps, _ = read_runlog(backend)
    assert steps[1] == {1: {"loss": 1.0}, 2: {"loss": 2.75}, 3: {"loss": 3.0}}


class _Shuffled:
    """A view of a backend that lists in reverse order and hides some keys (Drive, mid-sync)."""

    def __init__(self, inner, hidden=()):
        self.inner, self.hidden, self.url = inner, set(hidden), inner.url

    def list(self, prefix=""):
        return [o for o in reversed(self.inner.list(prefix)) if o.key not in self.hidden]

    def read(self, key):
        return self.inner.read(key)

    def open(self, key):
        return self.inner.open(key)


def test_out_of_order_and_missing_chunks(backend):
    story(backend)
    hidden = {chunk_key(1, 0), chunk_key(1, 2), "runlog/attempt-000002/attempt.json"}
    report = audit(_Shuffled(backend, hidden))
    assert report.verdict == "bit-exact"
    a1, a2 = report.attempts
    assert a1.missing_chunks == [0, 2] and a1.first_step == 40 and a1.host == "host-1"
    assert a2.resumed_from_step == 100 and a2.missing_chunks == []
    assert any("attempt 1: chunks 0, 2 not found" in w for w in report.warnings)
    # Only the newest chunk of attempt 2 is visible: its header still says who wrote it, and
    # that chunk numbers before it are missing.
    keys = [o.key for o in backend.list("runlog/attempt-000002/")]
    only_last = audit(_Shuffled(backend, set(keys[:-1])))
    assert only_last.attempts[1].missing_chunks == list(range(0, 3))
    assert only_last.attempts[1].closed and only_last.attempts[1].run_id == "run-1"


def test_unreadable_chunk_is_reported_not_fatal(backend):
    story(backend)
    backend.write("runlog/attempt-000002/chunk-000009.jsonl", b"\x00not json\n")
    backend.write("runlog/attempt-000009/chunk-000000.jsonl", b'{"format": "ckptsdk.runlog/9"}\n')
    report = audit(backend)
    assert report.verdict == "bit-exact"
    assert any("unreadable chunk runlog/attempt-000002/chunk-000009.jsonl" in w for w in report.warnings)
    assert any("ckptsdk.runlog/9" in w for w in report.warnings)


def test_no_overlap_and_empty_are_unverified_never_a_pass(backend):
    empty = audit(backend)
    assert (empty.verdict, empty.verified) == ("unverified", False)
    assert "no attempt logged a step" in empty.unverified_reason
    run_attempt(backend, 1, range(0, 20))
    report = audit(backend)
    assert (report.verdict, report.ok, report.verified, report.overlap_steps) == ("unverified", True, False, 0)
    assert "one attempt only" in report.unverified_reason
    with pytest.raises(ConfigError):
        audit(backend, tolerance=-1.0)


def test_time_based_flush_and_failed_flush_keeps_steps(backend):
    now = [0.0]
    fail = [True]

    class Flaky:
        def __init__(self, inner):
            self.inner, self.url = inner, inner.url

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def create(self, key, data):
            if fail[0]:
                raise StorageUnavailable("the mount is gone", url=self.url, key=key)
            return self.inner.create(key, data)

    log = RunLog(
        Flaky(backend),
        run_id="r",
        attempt=1,
        lease_epoch=1,
        resumed_from_step=None,
        flush_every=1000,
        flush_interval=15.0,
        clock=lambda: now[0],
    )
    log.log_step(0, loss=1.0)
    now[0] = 16.0
    log.log_step(1, loss=2.0)  # due by time; the store fails; training goes on
    assert backend.list("runlog/") == [] and len(log._buffer) == 2
    with pytest.raises(StorageUnavailable):
        log.flush()  # an explicit flush does report it
    fail[0] = False
    now[0] = 40.0
    log.log_step(2, loss=3.0)  # due again: now it goes out, nothing was lost
    assert not log._buffer and log._pending is None
    _, steps, _ = read_runlog(backend)
    assert steps[1] == {0: {"loss": 1.0}, 1: {"loss": 2.0}, 2: {"loss": 3.0}}


def test_a_write_that_landed_but_reported_failure_is_not_duplicated(backend):
    failed = []

    class LandsThenFails:
        """The store keeps the chunk, but the call fails (a timeout after GCS stored it)."""

        def __init__(self, inner):
            self.inner, self.url = inner, inner.url

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def create(self, key, data):
            info = self.inner.create(key, data)
            if key.endswith("chunk-000000.jsonl") and not failed:
                failed.append(key)
                raise StorageUnavailable("connection reset after upload", url=self.url, key=key)
            return info

    log = RunLog(LandsThenFails(backend), run_id="r", attempt=1, lease_epoch=1, resumed_from_step=None, flush_every=5)
    for s in range(12):
        log.log_step(s, loss=float(s))  # the first chunk "fails" at step 4, is resent at step 9
    log.close()
    assert failed == [chunk_key(1, 0)]
    (summary,) = audit(backend).attempts
    assert (summary.steps, summary.first_step, summary.last_step, summary.chunks, summary.closed) == (
        12,
        0,
        11,
        3,
        True,
    )
    assert [o.key for o in backend.list("runlog/")][-1] == chunk_key(1, 2)


def test_logging_and_flushing_from_two_threads_loses_nothing(backend):
    import threading

    log = RunLog(backend, run_id="r", attempt=1, lease_epoch=1, resumed_from_step=None, flush_every=10**6)
    stop = threading.Event()

    def flusher():
        for _ in range(200):  # bounded: what a manager's save thread could do
            if stop.is_set():
                return
            log.flush()

    t = threading.Thread(target=flusher)
    t.start()
    try:
        for s in range(600):
            log.log_step(s, loss=s / 7)
    finally:
        stop.set()
        t.join(timeout=60)
    log.close()
    _, steps, _ = read_runlog(backend)
    assert steps[1] == {s: {"loss": s / 7} for s in range(600)}


def test_resumed_from_step_set_after_construction(backend):
    log = RunLog(backend, run_id="r", attempt=3, lease_epoch=2, resumed_from_step=None)
    log.resumed_from_step = 5700  # what the manager does in restore()
    log.log_step(5701, loss=1.0)
    log.close()
    assert audit(backend).attempts[0].resumed_from_step == 5700
    with pytest.raises(ConfigError):
        log.resumed_from_step = -3


def test_report_json_round_trip(backend):
    story(backend, loss2=lambda s: loss_at(s) + (1e-3 if s == 140 else 0.0))
    report = audit(backend)
    doc = json.loads(report.model_dump_json())
    assert "series" not in doc and doc["verdict"] == "DIVERGED at step 140"
    back = AuditReport.model_validate_json(report.model_dump_json())
    assert back.model_dump(exclude={"series"}) == report.model_dump(exclude={"series"})


def _png_ok(path) -> tuple[int, int]:
    from PIL import Image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 15_000, f"suspiciously small plot: {len(data)} bytes"
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        return img.size


def test_plot_is_a_real_png(make_backend_target, tmp_path):
    backend = make_backend_target("memory").open()  # drawing does not depend on the store
    tmp_path = tmp_path / "plots"
    tmp_path.mkdir()
    story(backend, loss2=lambda s: loss_at(s) + (1e-2 if s >= 130 else 0.0))
    out = tmp_path / "audit.png"
    assert plot_audit(backend, out) == str(out)
    width, height = _png_ok(out)
    assert width >= 600 and height >= 300
    # From an in-process report made with its series too; one without (the default, or
    # JSON-parsed) has none and says what to do.
    report = audit(backend, series=True)
    plot_audit(report, tmp_path / "again.png")
    with pytest.raises(ConfigError, match="pass the backend"):
        plot_audit(audit(backend), tmp_path / "x.png")
    _png_ok(tmp_path / "again.png")
    parsed = AuditReport.model_validate_json(report.model_dump_json())
    with pytest.raises(ConfigError, match="pass the backend"):
        plot_audit(parsed, tmp_path / "x.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.png", "audit.png"]  # no temp left


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingDependencyError) as info:
        plot_audit(open_backend("memory://plot-no-mpl"), tmp_path / "x.png")
    assert info.value.extra == "plot" and "ckptsdk[plot]" in str(info.value)
    assert not (tmp_path / "x.png").exists()


_KILLED_CHILD = """
import math, sys, time
from ckptsdk.backends import open_backend
from ckptsdk.runlog.writer import RunLog
log = RunLog(open_backend(sys.argv[1]), run_id="run-1", attempt=1, lease_epoch=1,
             resumed_from_step=None, flush_every=5)
for s in range(1, 20001):
    log.log_step(s, loss=2.5 * math.exp(-s / 90.0) + 0.05 * math.sin(s * 0.7) + 0.3)
    if s % 5 == 0:
        print(s, flush=True)  # this step's chunk is published
    time.sleep(0.001)
"""


def test_a_runtime_killed_mid_run_leaves_its_flushed_steps(tmp_path):
    import os
    import signal
    import subprocess

    root = str(tmp_path / "root")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
    )
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, root], stdout=subprocess.PIPE, text=True, env=env)
    try:
        published = 0
        for line in child.stdout:  # bounded: the child stops by itself after 20000 steps
            published = int(line)
            if published >= 60:
                break
        os.kill(child.pid, signal.SIGKILL)  # the runtime vanishes between two flushes
    finally:
        child.kill()
        child.wait(timeout=30)
        child.stdout.close()
    assert published >= 60
    # Attempt 2 resumes from the checkpoint at step 40 and reproduces the same losses.
    backend = open_backend(root)
    run_attempt(backend, 2, range(41, 120), resumed_from=40)
    report = audit(backend)
    a1, a2 = report.attempts
    assert a1.closed is False and a1.first_step == 1 and a1.last_step >= 60 and a1.last_step % 5 == 0
    assert report.verdict == "bit-exact" and report.warnings == []  # no torn chunk, nothing missing
    assert report.overlaps[0].first_step == 41 and report.overlaps[0].last_step == a1.last_step


# ---------------------------------------------------------------- the documents and their versions

# Written by ckptsdk before format 1.1 (the run log's 1.0 and the audit's 1.0): non-finite
# floats as the strings "NaN"/"Infinity", times with milliseconds and "+00:00".
_OLD_CHUNK = (
    b'{"format":"ckptsdk.runlog/1","kind":"attempt","attempt":1,"run_id":"run-1","lease_epoch":1,'
    b'"host":"vm-a","pid":41,"device":"cpu","versions":{"python":"3.11.9"},'
    b'"started_at":"2026-11-30T06:10:00.123+00:00","resumed_from_step":null,"last_step":3,'
    b'"steps_logged":3,"chunk":0,"closed":false}\n'
    b'{"step":1,"time":1764483000.5,"scalars":{"loss":0.5,"g":"Infinity"}}\n'
    b'{"step":2,"time":1764483000.6,"scalars":{"loss":"NaN","g":"-Infinity"}}\n'
    b'{"step":3,"time":1764483000.7,"scalars":{"loss":0.25,"g":1}}\n'
)
_OLD_REPORT = (
    '{"format":"ckptsdk.audit/1","url":"memory://x","tolerance":0.0,"verdict":"DIVERGED at step 3",'
    '"diverged_at":3,"attempts":[{"attempt":1,"run_id":"r","lease_epoch":1,"host":"h","device":"cpu",'
    '"versions":{},"started_at":"2026-11-30T06:10:00.123+00:00","resumed_from_step":null,'
    '"first_step":1,"last_step":3,"steps":3,"chunks":1,"missing_chunks":[],"closed":false}],'
    '"overlap_steps":1,"overlaps":[{"attempts":[1,2],"first_step":3,"last_step":3,"steps":1}],'
    '"scalars":{"loss":{"max_abs_diff":"Infinity","at_step":3,"compared_steps":1}},'
    '"first_divergence":{"step":3,"scalar":"loss","values":{"1":"NaN","2":0.5},"abs_diff":"Infinity"},'
    '"warnings":[]}'
)


def test_a_chunk_written_by_format_1_0_is_still_read(backend):
    backend.create(chunk_key(1, 0), _OLD_CHUNK)
    summaries, steps, warnings = read_runlog(backend)
    assert warnings == [] and summaries[1].host == "vm-a" and summaries[1].steps == 3
    assert steps[1][1] == {"loss": 0.5, "g": math.inf}
    assert math.isnan(steps[1][2]["loss"]) and steps[1][2]["g"] == -math.inf
    assert steps[1][3] == {"loss": 0.25, "g": 1.0}
    # A new attempt (format 1.1) over the old one compares like any other.
    run_attempt(backend, 2, [3], loss=lambda s: 0.25, g=lambda s: 1.0)
    assert audit(backend).verdict == "bit-exact"


def test_chunks_store_non_finite_scalars_with_the_document_float_tag(backend):
    log = RunLog(backend, run_id="r", attempt=1, lease_epoch=1, resumed_from_step=None, device="cpu")
    log.log_step(1, loss=math.nan, g=-math.inf, ok=0.5)
    log.close()
    header, row = backend.read(chunk_key(1, 0)).decode().splitlines()
    assert json.loads(header)["format"] == RUNLOG_FORMAT == "ckptsdk.runlog/1.1"
    assert json.loads(header)["started_at"].endswith("Z")
    assert json.loads(row)["scalars"] == {"loss": {"$float": "nan"}, "g": {"$float": "-inf"}, "ok": 0.5}
    assert "NaN" not in row and "Infinity" not in row


def test_a_newer_major_run_log_is_skipped_with_upgrade_advice(backend):
    backend.create(chunk_key(1, 0), _OLD_CHUNK.replace(b"ckptsdk.runlog/1", b"ckptsdk.runlog/2", 1))
    summaries, steps, warnings = read_runlog(backend)
    assert steps[1] == {} and len(warnings) == 1
    assert "ckptsdk.runlog/2" in warnings[0] and "upgrade ckptsdk" in warnings[0]
    with pytest.raises(ManifestError, match="upgrade ckptsdk"):
        parse_chunk(backend.read(chunk_key(1, 0)), key=chunk_key(1, 0))


def test_an_audit_report_of_format_1_0_is_still_read():
    old = parse_document(_OLD_REPORT, AuditReport)
    assert old.scalars["loss"].max_abs_diff == math.inf
    assert old.first_divergence is not None and math.isnan(old.first_divergence.values[1])
    assert old.attempts[0].started_at == "2026-11-30T06:10:00.123+00:00"
    again = json.loads(old.to_json())  # re-written as the current format
    assert again["format"] == AUDIT_FORMAT == "ckptsdk.audit/1.2"
    assert again["first_divergence"]["values"] == {"1": {"$float": "nan"}, "2": 0.5}
    newer = _OLD_REPORT.replace("ckptsdk.audit/1", "ckptsdk.audit/2")
    with pytest.raises(ManifestError, match="upgrade ckptsdk"):
        parse_document(newer, AuditReport)


# ---------------------------------------------------------------- the device, without initialising CUDA

_NO_CUDA_INIT = """
import torch
from ckptsdk.backends import open_backend
from ckptsdk.runlog.writer import RunLog
log = RunLog(open_backend("memory://no-cuda-init"), run_id="r", attempt=1, lease_epoch=1,
             resumed_from_step=None)
log.log_step(1, loss=0.5)
log.close()
print(log.record.device, torch.cuda.is_initialized())
"""


def test_naming_the_device_never_initialises_cuda():
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _NO_CUDA_INIT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "False"]


def test_the_device_is_named_once_the_job_itself_initialised_cuda(backend, monkeypatch):
    """On a GPU machine: no question to CUDA before the job initialised it, its name after."""
    asked: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append("is_available") or True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: asked.append("current_device") or 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: asked.append("name") or "NVIDIA H200")
    log = RunLog(backend, run_id="r", attempt=1, lease_epoch=1, resumed_from_step=None)
    log.log_step(1, loss=0.5)
    log.flush()
    assert log.record.device == "cpu" and "current_device" not in asked and "name" not in asked
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the job moved to the GPU
    log.log_step(2, loss=0.5)
    log.close()
    # The manifest's format (ckptsdk.format.environment.describe_device): index and model.
    assert log.record.device == "cuda:0 (NVIDIA H200)"
    assert json.loads(backend.read(chunk_key(1, 1)).decode().splitlines()[0])["device"] == "cuda:0 (NVIDIA H200)"
