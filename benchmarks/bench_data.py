#!/usr/bin/env python
"""What the data position and the run log's flusher cost. Not a test: it prints figures.

1. Resume cost: time to the first batch after a restore, for a 50,000-sample CIFAR-shaped
   dataset (uint8 3x32x32, random crop + flip in the workers) killed at 90 % of an epoch:
   ``ckptsdk.DataLoader`` (the restored position skips by index) against replaying the epoch
   through a plain ``torch.utils.data.DataLoader`` (load and drop the consumed batches).
2. Step-log cost on the training thread: ``log_step`` per call with the flusher thread publishing
   every second to a local disk, against ``log_step`` with no publishing at all.
3. ``--audit-lines N``: the audit of a run log of N step lines (two attempts, half overlapping)
   plus one ``--garbage-mb`` garbage line, in a child process: wall time and peak RSS.

    python -m benchmarks.bench_data                 # ~1-2 min on a 2-core VM
    python -m benchmarks.bench_data --reps 3 --workers 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.utils.data as tud

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import ckptsdk  # noqa: E402
from ckptsdk.backends import open_backend  # noqa: E402
from ckptsdk.runlog.writer import RunLog  # noqa: E402


class Cifarish(tud.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """50,000 uint8 images and labels; random crop (pad 4) and flip per item, as the CIFAR job does."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = torch.nn.functional.pad(self.x[i], (4, 4, 4, 4))
        dx, dy = torch.randint(0, 9, (2,)).tolist()
        img = img[:, dy : dy + 32, dx : dx + 32]
        if torch.rand(()) < 0.5:
            img = img.flip(2)
        return img.float().div_(255), self.y[i]


def first_batch_ckptsdk(ds: Cifarish, batch: int, workers: int, done: int) -> float:
    saved = ckptsdk.DataLoader(ds, batch_size=batch, shuffle=True, seed=3).state_dict()
    saved["batch_idx"] = done  # what a checkpoint taken after `done` batches holds
    t0 = time.perf_counter()
    loader = ckptsdk.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers)
    loader.load_state_dict(saved)
    next(iter(loader))
    return time.perf_counter() - t0


def first_batch_replay(ds: Cifarish, batch: int, workers: int, done: int) -> float:
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(3)
    it = iter(tud.DataLoader(ds, batch_size=batch, shuffle=True, generator=g, num_workers=workers))
    for _ in range(done):
        next(it)
    next(it)
    return time.perf_counter() - t0


def log_cost(n: int, background: bool, tmp: Path) -> tuple[float, int]:
    """Seconds per log_step on the training thread, and chunks published."""
    backend = open_backend(str(tmp))
    log = RunLog(
        backend,
        run_id="bench",
        attempt=1,
        lease_epoch=1,
        resumed_from_step=None,
        background=background,
        flush_every=10**9,  # only the period (or nothing) publishes
        flush_interval=1.0 if background else 10**9,
    )
    loss = torch.tensor(0.5)
    spent = 0.0
    for step in range(n):
        t0 = time.perf_counter()
        log.log_step(step, loss=loss, lr=0.1)
        spent += time.perf_counter() - t0
        if step % 500 == 0:
            time.sleep(0.05)  # a training step's worth of time now and then, so the period elapses
    log.close()
    return spent / n, len(backend.list("runlog/"))


def audit_cost(lines: int, garbage_mb: int, tmp: Path) -> str:
    """Write the log, then time ``ckptsdk audit`` of it in a fresh process (its peak RSS too)."""
    import subprocess

    backend = open_backend(str(tmp))
    half = lines // 2
    for attempt, steps in ((1, range(0, half)), (2, range(half // 2, half // 2 + half))):
        log = RunLog(backend, run_id="bench", attempt=attempt, lease_epoch=attempt, resumed_from_step=None)
        log.flush_every = 50_000
        for step in steps:
            log.log_step(step, loss=1.0 / (step + 1))
        log.close()
    with open(tmp / "runlog" / "attempt-000002" / "chunk-000000.jsonl", "ab") as f:
        for _ in range(garbage_mb):
            f.write(b"z" * (1 << 20))
        f.write(b"\n")
    code = (
        "import resource, time, sys; from ckptsdk.backends import open_backend; from ckptsdk.runlog.audit import audit;"
        "rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024;"
        "t = time.perf_counter(); r = audit(open_backend(sys.argv[1]));"
        "rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024;"
        "print(f'{r.verdict}, {r.overlap_steps} shared steps, {len(r.warnings)} warning(s): '"
        "f'{time.perf_counter() - t:.1f} s, peak RSS {rss:.0f} MiB ({rss0:.0f} MiB after the imports)')"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp)], capture_output=True, text=True, cwd=REPO, check=True)
    return out.stdout.strip()


def fmt(xs: list[float], scale: float, unit: str) -> str:
    return f"median {statistics.median(xs) * scale:.3g} {unit} (min {min(xs) * scale:.3g}, max {max(xs) * scale:.3g})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=50_000)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--log-steps", type=int, default=20_000)
    ap.add_argument("--audit-lines", type=int, default=0)
    ap.add_argument("--garbage-mb", type=int, default=200)
    args = ap.parse_args()
    if args.audit_lines:
        with tempfile.TemporaryDirectory() as tmp:
            result = audit_cost(args.audit_lines, args.garbage_mb, Path(tmp))
        print(f"audit of {args.audit_lines} step lines + one {args.garbage_mb} MB garbage line: {result}")
        return 0
    ds = Cifarish(args.samples)
    per_epoch = -(-args.samples // args.batch_size)
    done = int(per_epoch * 0.9)
    ours = [first_batch_ckptsdk(ds, args.batch_size, args.workers, done) for _ in range(args.reps)]
    replay = [first_batch_replay(ds, args.batch_size, args.workers, done) for _ in range(args.reps)]
    print(
        f"resume at batch {done} of {per_epoch} ({args.samples} samples, batch {args.batch_size}, "
        f"{args.workers} workers), time to the first batch after restore, {args.reps} runs:"
    )
    print(f"  ckptsdk.DataLoader (skip by index): {fmt(ours, 1, 's')}")
    print(f"  replay through torch DataLoader:    {fmt(replay, 1, 's')}")
    with_thread, without = [], []
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            cost, chunks = log_cost(args.log_steps, True, Path(tmp))
            with_thread.append(cost)
        with tempfile.TemporaryDirectory() as tmp:
            without.append(log_cost(args.log_steps, False, Path(tmp))[0])
    print(f"log_step on the training thread, {args.log_steps} steps, {args.reps} runs:")
    print(f"  flusher thread every 1 s ({chunks} objects in the last run): {fmt(with_thread, 1e6, 'us')}")
    print(f"  no publishing at all:                          {fmt(without, 1e6, 'us')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
