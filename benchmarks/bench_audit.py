"""The audit of a long run log: wall time and peak RSS of a ``ckptsdk audit`` process.

``python -m benchmarks.bench_audit --lines 2700000 --garbage-mb 200 --reps 2``: writes two
attempts of ``lines / 2`` steps (a quarter of the lines shared) plus one garbage line, then runs
``ckptsdk audit ROOT`` ``--reps`` times in a child, reading its peak RSS with
``getrusage(RUSAGE_CHILDREN)`` in a helper process that runs nothing else.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.runlog.biglog import write_big_log

REPO = Path(__file__).resolve().parents[1]
_CHILD = (
    "import resource, subprocess, sys, time\n"
    "t = time.perf_counter()\n"
    "p = subprocess.run([sys.executable, '-m', 'ckptsdk', 'audit', sys.argv[1]], capture_output=True, text=True)\n"
    "print(p.returncode, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)\n"
    "print(p.stdout.splitlines()[0] if p.stdout else p.stderr[-300:])\n"
)


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
