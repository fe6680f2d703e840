"""What the keep rules cost: the pure decision over many checkpoints, and a real writer's save.

Part 1 times :func:`ckptsdk.checkpoint.retention.decide` over N committed candidates with every
rule on (latest 3, every 1000 steps, every hour, best 5 by val_loss with NaN in the stream, a
predicate). Part 2 times blocking saves of a small state on ``memory://`` with ``keep_last=3``
alone and with those rules added (the decision runs after the commit, off the critical path of an
async save; here it is inside the blocking save's time). Not a test: it prints numbers.

    python -m benchmarks.bench_retention [--reps 5] [--saves 60]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState  # noqa: E402
from ckptsdk.backends.memory import MemoryBackend  # noqa: E402
from ckptsdk.checkpoint import retention  # noqa: E402
from ckptsdk.manager import Simulation  # noqa: E402


def _rules() -> list[retention.Rule]:
    return [
        retention.keep_every(1000),
        retention.keep_every_seconds(3600),
        retention.keep_best("val_loss", 5),
        retention.keep_if(lambda c: c.metrics.get("milestone") is True, "milestone"),
    ]


def _figures(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} ms (min {min(values):.3f}, max {max(values):.3f}, n={len(values)})"


def bench_decide(n: int, reps: int) -> list[float]:
    cands = [
        retention.Candidate(
            step * 100,
            time=1.8e9 + step * 60.0,
            metrics={"val_loss": math.nan if step % 17 == 0 else 1.0 / (1 + step % 251), "milestone": step % 997 == 0},
        )
        for step in range(1, n + 1)
    ]
    rules = [retention.keep_last(3), *_rules()]
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        retention.decide(cands, rules, pinned={cands[0].step: retention.RESUME_POINT})
        out.append((time.perf_counter() - start) * 1e3)
    return out


def bench_saves(saves: int, keep: list[retention.Rule]) -> list[float]:
    name = f"bench-retention-{uuid.uuid4().hex}"
    state = TrainState(model=torch.nn.Linear(64, 64))
    out = []
    with CheckpointManager(
        f"memory://{name}",
        keep_last=3,
        keep=keep,
        lease_options=LeaseOptions(ttl=60),
        save_options=SaveOptions(on_signal=False),
        _simulation=Simulation(heartbeat=False),
    ) as mgr:
        for step in range(1, saves + 1):
            loss = math.nan if step % 7 == 0 else 1.0 / step if step % 2 else 2.0
            start = time.perf_counter()
            mgr.save(state, step=step, metrics={"val_loss": loss})
            out.append((time.perf_counter() - start) * 1e3)
    MemoryBackend.discard_store(name)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--saves", type=int, default=60)
    args = parser.parse_args()
    for n in (1_000, 10_000):
        print(f"decide over {n:>6} checkpoints, all rules: {_figures(bench_decide(n, args.reps))}")
    bench_saves(5, [])  # warm-up: first saves pay imports and allocations
    plain = bench_saves(args.saves, [])
    ruled = bench_saves(args.saves, _rules())
    print(f"blocking save, memory://, keep_last=3 alone:    {_figures(plain)}")
    print(f"blocking save, memory://, keep_last=3 + 4 rules: {_figures(ruled)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
