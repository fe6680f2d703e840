#!/usr/bin/env python
"""What proving a referenced base costs against a plain read of its bytes (issue 48's target: <= 1.5x). Not a test.

One frozen tensor (``--mb`` MiB, float32): ``reference.hash_tensor`` (the proof restore runs before
it loads anything) against three plain reads of the same bytes: ``tensor.numpy().tobytes()`` (one
copy in memory), a file read of them (page cache warm: the read's floor) and a cold file read (the
page cache dropped for the file first: what reading a stored base costs), and a read into a
reused buffer (no page faults: the floor, a memcpy from the page cache). On CUDA (``--cuda``) the
proof goes through its bounded host buffer, against ``tensor.cpu()``.

    python -m benchmarks.bench_reference_proof [--mb 256] [--reps 7] [--cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ckptsdk.format.files.reference import hash_tensor  # noqa: E402


def _median_seconds(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _read(path: str, *, cold: bool) -> bytes:
    if cold:
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    with open(path, "rb", buffering=0) as f:
        return f.read()


def _readinto(path: str, buffer: bytearray) -> int:
    with open(path, "rb", buffering=0) as f:
        return f.readinto(buffer) or 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--cuda", action="store_true", help="the tensor on the GPU (the proof through the host buffer)")
    ap.add_argument("--dir", default=None, help="where the file of the plain read goes (a real disk)")
    args = ap.parse_args(argv)
    print(f"command: {' '.join(sys.argv)}; load average at start {os.getloadavg()}")
    torch.manual_seed(0)
    cpu = torch.randn(args.mb << 18)  # mb MiB of float32
    raw = cpu.numpy().data
    rows: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = f"{tmp}/base.bin"
        with open(path, "wb") as f:
            f.write(raw)
            os.fsync(f.fileno())
        if args.cuda:
            live = cpu.cuda()
            torch.cuda.synchronize()
            hash_tensor(live)  # warm up the stream, the pinned allocator
            rows.append(
                (
                    "proof: hash_tensor (cuda, bounded host buffer)",
                    _median_seconds(lambda: hash_tensor(live), args.reps),
                )
            )
            rows.append(("plain: tensor.cpu() (one full host copy)", _median_seconds(lambda: live.cpu(), args.reps)))
        rows.append(("proof: hash_tensor (cpu, in place)", _median_seconds(lambda: hash_tensor(cpu), args.reps)))
        rows.append(("xxh3-128 of the bytes alone", _median_seconds(lambda: xxhash.xxh3_128(raw).digest(), args.reps)))
        rows.append(("plain: tensor.numpy().tobytes()", _median_seconds(lambda: cpu.numpy().tobytes(), args.reps)))
        rows.append(("plain: file read, page cache warm", _median_seconds(lambda: _read(path, cold=False), args.reps)))
        rows.append(("plain: file read, cold", _median_seconds(lambda: _read(path, cold=True), args.reps)))
        reused = bytearray(len(raw))  # touched once: no page faults in the timing (a memcpy's floor)
        rows.append(
            ("plain: readinto a reused buffer, warm", _median_seconds(lambda: _readinto(path, reused), args.reps))
        )
    print(f"{args.mb} MiB, median of {args.reps}; load average at end {os.getloadavg()}")
    seconds = dict(rows)
    for name, s in rows:
        print(f"  {name:<50} {s * 1e3:8.1f} ms  {args.mb / 1024 / s:6.2f} GiB/s")
    proof = seconds["proof: hash_tensor (cpu, in place)"]
    plain = [name for name in seconds if name.startswith("plain: ") and "cpu()" not in name]
    for name in plain:
        print(f"  cpu proof / {name.removeprefix('plain: ')}: {proof / seconds[name]:.2f}x")
    if args.cuda:
        gpu = seconds["proof: hash_tensor (cuda, bounded host buffer)"]
        print(f"  cuda proof / tensor.cpu(): {gpu / seconds['plain: tensor.cpu() (one full host copy)']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
