"""The real question: what a save every 10 steps costs a GPU job on slow storage. Not a test.

The step of a T4 training the CIFAR ResNet-18 (SGD momentum: 89.4 MB of state): the GPU's forward
and backward as ``time.sleep(0.08)`` (the GIL is released, as it is while CUDA runs), then the
optimizer's in-place update on the CPU. ``log_step`` every step, ``save(blocking=False)`` every
10 steps, on a local root behind :class:`ckptsdk.testing.FaultyBackend` that sleeps 0, 20 or 50 ms
per storage call. The configurations and a run that never saves take turns in blocks of
``--block`` (10) steps, ``--steps`` per configuration and round (``--reps`` rounds), so a shared
machine's drifting load hits all alike: on 2 cores the update itself (two intra-op threads) takes
8 or 19 ms from one step to the next, and in turns of 100 steps a baseline's bad luck moved the
overhead by ±3 %. Each block's first step is followed by its save, whose background write runs
inside the block; a write still running at the block's end is waited for and counted. With
``--device cuda`` (``examples/gpu_check.py``) the step is the real job's, with AMP.

    python -m benchmarks.bench_overhead --step gpu-like                 # ~3 min
    python -m benchmarks.bench_overhead --step gpu-like --reps 3 --steps 100

Printed per latency: overhead (the steps' wall time against never saving; "median block": the
median block's, robust to another process's load spike, as in ``bench_overhead``), the stall inside
``save()`` (median, p99), the training thread's CPU per save (``time.thread_time`` around
``save()``: median, min-max), storage calls and bytes per
committed save, saves committed / replaced / skipped (``mgr.stats``); then where the overhead
goes in a 10-step period: inside ``save()``, the step right after it (whose optimizer step waits
for the snapshot's deferred copies), and the nine other steps (the worker's CPU and memory
traffic beside them). Each manager's first save (it compiles the tree's template and allocates
the staging buffer) runs before the table's runs and is printed apart: the table is the steady
state, where a p99 over 30 saves would otherwise be that one-off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from adapters.cifar10.model import build_model
from benchmarks.overhead_job import Job
from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState, open_backend
from ckptsdk.format import codec
from ckptsdk.testing import FaultyBackend

LATENCIES_MS = (0.0, 20.0, 50.0)
GPU_STEP_S = 0.08  # a T4's forward + backward of the ResNet-18 at batch 128


class SleepJob:
    """The gpu-like step: sleep (the GPU working), then the optimizer's in-place update."""

    def __init__(self, width: int = 64, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = build_model(width=width)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.full_like(p, 1e-4)  # fixed gradients: the update is what costs CPU
        self.state = TrainState(model=self.model, optimizer=self.opt)

    def step(self, _i: int) -> float:
        time.sleep(GPU_STEP_S)
        self.opt.step()
        return 1.0


def _backend(root: Path, latency: float) -> FaultyBackend:
    def sleep(_op: str, _key: str, _n: int) -> None:
        if latency:
            time.sleep(latency)
        return None

    return FaultyBackend(open_backend(str(root)), fail_on=sleep)


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


def _run(job: Any, steps: int, start: int, mgr: CheckpointManager | None, res: dict[str, Any]) -> None:
    """``steps`` steps (one block); its wall time includes waiting for a save still writing at
    its end, so that no other configuration's block feels it (conservative: training never waits)."""
    t0 = time.perf_counter()
    for i in range(start + 1, start + steps + 1):
        s0 = time.perf_counter()
        loss = job.step(i)
        # Where the time goes: the step right after a save (its optimizer step waits for the
        # snapshot's deferred copies) apart from the nine others of the period.
        res["next" if i % 10 == 1 else "other"].append(time.perf_counter() - s0)
        if mgr is None:
            continue
        mgr.log_step(i, loss=loss)
        if i % 10 == 0:
            w, c = time.perf_counter(), time.thread_time()
            mgr.save(job.state, step=i, blocking=False)
            res["cpu"].append(time.thread_time() - c)
            res["stalls"].append(time.perf_counter() - w)
    if mgr is not None:
        mgr.wait()
    if job_is_cuda(job):
        torch.cuda.synchronize()
    res["runs"].append(time.perf_counter() - t0)


def job_is_cuda(job: Any) -> bool:
    return next(job.model.parameters()).device.type == "cuda"


def main(args: argparse.Namespace) -> int:
    """Run the gpu-like benchmark with ``bench_overhead``'s parsed arguments; print the table."""
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if args.device == "cuda":
        job: Any = Job(64, args.batch_size, args.reps * 4 * args.steps + 20, device="cuda", amp=args.amp)
    else:
        job = SleepJob()
    job.step(-1)  # warm-up (and the optimizer's momentum buffers exist from here on)
    tensors = codec.encode(job.state.state_dict())[0].values()
    state_mb = sum(t.numel() * t.element_size() for t in tensors) / 1e6
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ckpt-gpulike-", dir=args.dir) as tmp:
        backends = {lat: _backend(Path(tmp) / f"root-{lat:.0f}ms", lat / 1000) for lat in LATENCIES_MS}
        mgrs = {
            lat: CheckpointManager(
                b, keep_last=2, lease_options=LeaseOptions(ttl=600.0), save_options=SaveOptions(on_signal=False)
            )
            for lat, b in backends.items()
        }
        first: dict[float, tuple[float, float]] = {}
        for lat, m in mgrs.items():
            m.restore(job.state)
            # The first save of a manager compiles the tree's template and allocates the staging
            # buffer: a one-off, timed apart. The table is the steady state that follows.
            w, c = time.perf_counter(), time.thread_time()
            m.save(job.state, step=0, blocking=False)
            first[lat] = (time.perf_counter() - w, time.thread_time() - c)
            m.wait()
        configs: list[float | None] = [None, *LATENCIES_MS]
        res = {c: {"runs": [], "stalls": [], "cpu": [], "next": [], "other": []} for c in configs}
        # Steps from 10 on: each block's first step (step % 10 == 0) is followed by its save.
        at = dict.fromkeys(configs, 9)
        for _ in range(2):
            job.step(-1)  # warm-up
        for r in range(max(1, args.steps // args.block) * args.reps):
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for c in order:
                _run(job, args.block, at[c], None if c is None else mgrs[c], res[c])
                at[c] += args.block
        drain = {}
        for lat, m in mgrs.items():
            t = time.perf_counter()
            m.wait()
            drain[lat] = time.perf_counter() - t
        stats = {lat: m.stats for lat, m in mgrs.items()}
        sizes = {lat: statistics.median([c.size for c in m.list()] or [0]) for lat, m in mgrs.items()}
        for lat, m in mgrs.items():
            m.save(job.state, step=at[lat])  # untimed, after the figures: close() has no unsaved steps to warn of
            m.close()
    load1 = os.getloadavg()
    base = sum(res[None]["runs"])
    steps = args.steps * args.reps
    what = "the CUDA job, AMP" if args.device == "cuda" else f"sleep {GPU_STEP_S * 1000:.0f} ms + SGD update"
    print(
        f"\n== gpu-like step ({what}), "
        f"state {state_mb:.1f} MB, save every 10 steps, {steps} steps per configuration in blocks of {args.block} =="
    )
    print(f"never saving: {base:.2f} s ({base / steps * 1000:.1f} ms/step)")
    print(
        f"{'latency/call':>12s} {'overhead':>9s} {'(median block)':>14s} {'stall med':>10s} {'stall p99':>10s} "
        f"{'CPU/save (min-max)':>20s} "
        f"{'calls/save':>11s} {'MB/save':>8s} {'committed':>9s} {'replaced':>8s} {'skipped':>7s} {'save s':>7s}"
    )
    for lat in LATENCIES_MS:
        r, s = res[lat], stats[lat]
        over = sum(r["runs"]) / base - 1
        block = statistics.median(r["runs"]) / statistics.median(res[None]["runs"]) - 1
        calls = sum(backends[lat].calls.values()) / max(1, s.committed)
        stall, top = statistics.median(r["stalls"]) * 1000, _p99(r["stalls"]) * 1000
        print(
            f"{lat:10.0f}ms {over:+9.2%} {block:+14.2%} {stall:8.2f}ms {top:8.2f}ms "
            f"{statistics.median(r['cpu']) * 1000:6.2f}ms ({min(r['cpu']) * 1000:.2f}-{max(r['cpu']) * 1000:.2f}) "
            f"{calls:11.1f} {sizes[lat] / 1e6:8.1f} {s.committed:9d} "
            f"{s.replaced:8d} {s.skipped:7d} {s.save_s_median or 0:7.2f}"
        )
    print(
        "first save of each manager (template compiled, staging allocated; not in the table): "
        + ", ".join(f"{lat:.0f}ms: stall {w * 1000:.1f} ms, CPU {c * 1000:.1f} ms" for lat, (w, c) in first.items())
    )
    print("where the overhead goes, per 10-step period against never saving (means):")
    for lat in LATENCIES_MS:
        r, b = res[lat], res[None]
        nxt = (statistics.fmean(r["next"]) - statistics.fmean(b["next"])) * 1000
        other = (statistics.fmean(r["other"]) - statistics.fmean(b["other"])) * 9000
        inside = statistics.fmean(r["stalls"]) * 1000
        print(
            f"{lat:10.0f}ms inside save() {inside:+7.2f} ms, the step after it {nxt:+7.2f} ms, "
            f"the 9 other steps {other:+7.2f} ms (a period never saving: "
            f"{(statistics.fmean(b['next']) + 9 * statistics.fmean(b['other'])) * 1000:.0f} ms)"
        )
    print(
        f"(calls/save: every storage call of the run, step log and lease heartbeat included, over the "
        f"saves committed; the drain after the last run: {', '.join(f'{v:.2f} s' for v in drain.values())})"
    )
    print(f"load average: start {tuple(round(x, 2) for x in load0)}, end {tuple(round(x, 2) for x in load1)}")
    return 0
