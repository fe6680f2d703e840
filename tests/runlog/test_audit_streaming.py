"""The audit streams the run log: attempts are merged by step as they are read, so its memory
does not grow with the run (checked on a real ``ckptsdk audit`` process), and what it reports is
what a comparison holding every row finds (checked against one, on varied stories)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_audit import write_big_log
from ckptsdk.backends import open_backend
from ckptsdk.runlog.audit import audit, read_runlog
from ckptsdk.runlog.writer import RunLog

REPO = Path(__file__).resolve().parents[2]
# Peak RSS of `ckptsdk audit` over 200k lines: ~32 MiB streaming, ~365 MiB holding one parsed row
# per step (the implementation before; measured 2026-12-01). The bound sits between, far from both.
RSS_BOUND_MIB = 150


@pytest.mark.timeout(300)
def test_the_audit_of_a_long_log_stays_in_bounded_memory(tmp_path):
    root = tmp_path / "root"
    shared = write_big_log(root, 200_000, chunk_rows=20_000, garbage_mb=8)
    code = (
        "import resource, subprocess, sys\n"
        "p = subprocess.run([sys.executable, '-m', 'ckptsdk', 'audit', sys.argv[1], '--json'], capture_output=True)\n"
        "sys.stdout.write(p.stdout.decode())\n"
        "sys.stderr.write(f'rc={p.returncode} rss={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(root)], cwd=REPO, capture_output=True, text=True, timeout=280, check=True
    )
    rc, rss = (int(part.split("=")[1]) for part in proc.stderr.strip().rsplit("\n", 1)[-1].split())
    report = json.loads(proc.stdout)["report"]
    assert rc == 0 and report["verdict"] == "bit-exact" and report["overlap_steps"] == shared == 50_000
    assert report["scalars"]["loss"]["compared_steps"] == shared
    assert any("longer than" in w for w in report["warnings"])  # the garbage line: skipped, said so
    assert rss / 1024 < RSS_BOUND_MIB, f"peak RSS {rss / 1024:.0f} MiB"


def _log(backend, attempt: int, steps, value, *, resumed=None) -> None:
    log = RunLog(backend, run_id="r", attempt=attempt, lease_epoch=attempt, resumed_from_step=resumed, flush_every=7)
    for s in steps:
        log.log_step(s, loss=value(attempt, s))
    log.close()


def _held_comparison(backend) -> dict:
    """What the audit must find, from every row held in memory (read_runlog)."""
    _, steps, _ = read_runlog(backend)
    by_step: dict[int, dict[int, float]] = {}
    for attempt, rows in steps.items():
        for s, row in rows.items():
            by_step.setdefault(s, {})[attempt] = row["loss"]
    shared = sorted(s for s, per in by_step.items() if len(per) > 1)
    diverged = [s for s in shared if len(set(by_step[s].values())) > 1]
    return {"shared": len(shared), "diverged_at": diverged[0] if diverged else None}


@pytest.mark.parametrize("seed", range(12))
def test_streaming_finds_what_holding_every_row_finds(seed):
    rng = random.Random(seed)
    backend = open_backend(f"memory://stream-{seed}")
    bad = rng.choice([None, rng.randrange(0, 120)])

    def value(attempt: int, s: int) -> float:
        return math.sin(s) + (1e-3 if attempt == 3 and s == bad else 0.0)

    start = 0
    for attempt in (1, 2, 3):
        length = rng.randrange(5, 60)
        steps = range(start, start + length, rng.choice([1, 1, 3]))
        _log(backend, attempt, steps, value, resumed=start - 1 if attempt > 1 else None)
        start = max(0, start + length - rng.randrange(0, 40))
    want = _held_comparison(backend)
    report = audit(backend)
    assert report.overlap_steps == want["shared"]
    assert report.diverged_at == want["diverged_at"]
    assert sum(o.steps for o in report.overlaps) == want["shared"]


def test_a_step_logged_again_later_in_an_attempt_is_compared_from_memory_last_wins():
    backend = open_backend("memory://out-of-order")
    _log(backend, 1, [0, 1, 2, 3, 4, 2], lambda a, s: float(s))  # step 2 again, at the end
    _log(backend, 2, range(1, 6), lambda a, s: float(s) + (0.5 if s == 2 else 0.0), resumed=0)
    report = audit(backend)
    assert report.overlap_steps == 4 and report.verdict == "DIVERGED at step 2"
    assert report.attempts[0].steps == 5 and report.attempts[0].last_step == 4
    assert "attempt 1 logged steps out of order: compared from memory" in report.warnings
    # Of two rows of one step, the later is compared (9.0 would diverge, 2.5 agrees).
    backend2 = open_backend("memory://out-of-order-2")
    log = RunLog(backend2, run_id="r", attempt=1, lease_epoch=1, resumed_from_step=None)
    for s, v in ((0, 0.0), (1, 1.0), (2, 9.0), (3, 3.0), (2, 2.5)):
        log.log_step(s, loss=v)
    log.close()
    _log(backend2, 2, range(1, 4), lambda a, s: 2.5 if s == 2 else float(s), resumed=0)
    assert audit(backend2).verdict == "bit-exact"


def test_a_step_logged_twice_in_a_row_streams_and_the_last_row_wins():
    backend = open_backend("memory://twice")
    log = RunLog(backend, run_id="r", attempt=1, lease_epoch=1, resumed_from_step=None, flush_every=2)
    for s, v in ((0, 0.0), (1, 7.0), (1, 1.0), (2, 2.0)):
        log.log_step(s, loss=v)
    log.close()
    _log(backend, 2, range(1, 3), lambda a, s: float(s), resumed=0)
    report = audit(backend)
    assert report.verdict == "bit-exact" and report.overlap_steps == 2 and report.warnings == []
    assert report.attempts[0].steps == 3


def test_the_series_is_kept_only_on_request():
    backend = open_backend("memory://series")
    _log(backend, 1, range(0, 6), lambda a, s: float(s))
    _log(backend, 2, range(3, 8), lambda a, s: float(s), resumed=2)
    assert audit(backend).series == {}
    series = audit(backend, series=True).series
    assert [s for s, _ in series[1]] == list(range(6)) and [s for s, _ in series[2]] == list(range(3, 8))
    assert series[2][0] == (3, {"loss": 3.0})
