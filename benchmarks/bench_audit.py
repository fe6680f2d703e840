"""The audit of a long run log: wall time and peak RSS of a ``ckptsdk audit`` process.

``python -m benchmarks.bench_audit --lines 2700000 --garbage-mb 200 --reps 2``: writes two
attempts of ``lines / 2`` steps (a quarter of the lines shared) plus one garbage line, then runs
``ckptsdk audit ROOT`` ``--reps`` times in a child, reading its peak RSS with
``getrusage(RUSAGE_CHILDREN)`` in a helper process that runs nothing else. ``write_big_log``
writes the log straight to disk (millions of lines in seconds); the audit's memory test uses it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_CHILD = (
    "import resource, subprocess, sys, time\n"
    "t = time.perf_counter()\n"
    "p = subprocess.run([sys.executable, '-m', 'ckptsdk', 'audit', sys.argv[1]], capture_output=True, text=True)\n"
    "print(p.returncode, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)\n"
    "print(p.stdout.splitlines()[0] if p.stdout else p.stderr[-300:])\n"
)


def _header(attempt: int, resumed: int | None, last: int, count: int, chunk: int) -> str:
    return json.dumps(
        {
            "format": "ckptsdk.runlog/1.1",
            "kind": "attempt",
            "attempt": attempt,
            "run_id": "big",
            "lease_epoch": attempt,
            "host": "bench",
            "pid": 1,
            "device": "cpu",
            "versions": {},
            "started_at": "2026-12-01T00:00:00Z",
            "resumed_from_step": resumed,
            "last_step": last,
            "steps_logged": count,
            "chunk": chunk,
            "closed": True,
        },
        separators=(",", ":"),
    )


def write_big_log(root: Path, lines: int, *, chunk_rows: int = 50_000, garbage_mb: int = 0) -> int:
    """Two attempts of ``lines // 2`` steps each, the second resumed half way through the first
    (so ``lines // 4`` steps are shared, with equal losses); with ``garbage_mb``, one line of
    that many MiB of garbage in the second attempt's first chunk. Returns the shared steps."""
    half = lines // 2
    plan = ((1, None, range(0, half)), (2, half // 2 - 1, range(half // 2, half // 2 + half)))
    for attempt, resumed, steps in plan:
        folder = root / "runlog" / f"attempt-{attempt:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        chunks = [steps[i : i + chunk_rows] for i in range(0, len(steps), chunk_rows)]
        for seq, part in enumerate(chunks):
            with open(folder / f"chunk-{seq:06d}.jsonl", "w") as f:
                f.write(_header(attempt, resumed, part[-1], part[-1] - steps[0] + 1, seq) + "\n")
                if garbage_mb and attempt == 2 and seq == 0:
                    for _ in range(garbage_mb):
                        f.write("z" * (1 << 20))
                    f.write("\n")
                f.writelines(
                    f'{{"step":{s},"time":1796145826.5,"scalars":{{"loss":{1.0 / (s + 1)!r},"lr":0.001}}}}\n'
                    for s in part
                )
    return half - half // 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=2_700_000)
    ap.add_argument("--garbage-mb", type=int, default=200)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--code", default=str(REPO), help="the checkout whose ckptsdk runs the audit")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        shared = write_big_log(Path(tmp), args.lines, garbage_mb=args.garbage_mb)
        print(f"wrote {args.lines} step lines + a {args.garbage_mb} MiB line in {time.perf_counter() - t:.1f} s")
        walls, peaks = [], []
        for _ in range(args.reps):
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, tmp], cwd=args.code, capture_output=True, text=True, check=True
            )
            rc, wall, peak = out.stdout.splitlines()[0].split()
            print(f"  rc {rc}: {float(wall):.1f} s, peak RSS {float(peak):.0f} MiB; {out.stdout.splitlines()[1]}")
            walls.append(float(wall))
            peaks.append(float(peak))
    print(
        f"audit of {args.lines} lines ({shared} shared steps) + {args.garbage_mb} MiB garbage line: "
        f"wall median {statistics.median(walls):.1f} s ({min(walls):.1f}-{max(walls):.1f}), "
        f"peak RSS median {statistics.median(peaks):.0f} MiB ({min(peaks):.0f}-{max(peaks):.0f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
