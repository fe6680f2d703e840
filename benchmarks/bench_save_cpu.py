"""Where the training thread's CPU goes inside a non-blocking ``save()``: the gpu-like step's state.

Not a test. The step of ``benchmarks/gpu_like.py`` (an 80 ms sleep for the GPU, then the SGD
update of the 89.4 MB ResNet-18 state), ``save(blocking=False)`` every 10 steps on a local root;
each part of ``save()`` is wrapped and timed with ``time.thread_time`` (the calling thread's CPU),
in place, after the optimizer step has streamed the state through the caches (the same code on
warm caches takes about a third of it). The wrappers add a few microseconds each.

    python -m benchmarks.bench_save_cpu                 # ~15 s
    python -m benchmarks.bench_save_cpu --saves 30 --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu_like import GPU_STEP_S, SleepJob
from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState
from ckptsdk.checkpoint.writing.scheduling import SaveSlots
from ckptsdk.format.template import EncodingCache

#: The parts timed: (owner, attribute, label), in the order ``save()`` runs them.
PARTS: list[tuple[Any, str, str]] = [
    (TrainState, "state_dict", "state tree (TrainState.state_dict)"),
    (EncodingCache, "encode", "template check (EncodingCache.encode)"),
    (TrainState, "step_only_flags", "deferral flags"),
    (SaveSlots, "stage", "staging (SaveSlots.stage)"),
    (SaveSlots, "submit", "hand-over to the worker"),
    (SaveSlots, "start_copies", "deferred copies started"),
]


def _timed(fn: Callable[..., Any], label: str, acc: dict[str, list[float]]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        c = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[label].append(time.thread_time() - c)

    return wrapper


def run(saves: int) -> dict[str, list[float]]:
    """One run: ``saves`` steady-state saves (after the first), each part's CPU per save."""
    acc: dict[str, list[float]] = defaultdict(list)
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in PARTS]
    for owner, name, label in PARTS:
        setattr(owner, name, _timed(getattr(owner, name), label, acc))
    try:
        job = SleepJob()
        job.step(-1)
        with tempfile.TemporaryDirectory(prefix="ckpt-savecpu-") as tmp:
            mgr = CheckpointManager(
                tmp, keep_last=2, lease_options=LeaseOptions(ttl=600.0), save_options=SaveOptions(on_signal=False)
            )
            mgr.restore(job.state)
            mgr.save(job.state, step=0, blocking=False)  # compiles the template: a one-off
            mgr.wait()
            acc.clear()
            for i in range(1, saves * 10 + 1):
                job.step(i)
                mgr.log_step(i, loss=1.0)
                if i % 10 == 0:
                    c = time.thread_time()
                    mgr.save(job.state, step=i, blocking=False)
                    acc["save() in all"].append(time.thread_time() - c)
            mgr.close()
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    return acc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=12, help="steady-state saves per run (default 12)")
    ap.add_argument("--runs", type=int, default=2, help="runs (default 2)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    load0 = tuple(round(x, 2) for x in os.getloadavg())
    runs = [run(args.saves) for _ in range(args.runs)]
    labels = [label for _, _, label in PARTS] + ["save() in all"]
    print(
        f"\n== training-thread CPU per non-blocking save (ms, median of {args.saves} per run; "
        f"gpu-like step: sleep {GPU_STEP_S * 1000:.0f} ms + SGD update, save every 10 steps) =="
    )
    print(f"{'part':40s} " + " ".join(f"{'run ' + str(i + 1):>8s}" for i in range(args.runs)))
    for label in labels:
        cells = " ".join(f"{statistics.median(r[label]) * 1000:8.3f}" for r in runs)
        print(f"{label:40s} {cells}")
    rest = [
        statistics.median(r["save() in all"]) - sum(statistics.median(r[label]) for label in labels[:-1]) for r in runs
    ]
    print(f"{'the rest (checks, bookkeeping)':40s} " + " ".join(f"{x * 1000:8.3f}" for x in rest))
    print("target (issue 23): save() in all <= 2 ms")
    print(f"load average: start {load0}, end {tuple(round(x, 2) for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
