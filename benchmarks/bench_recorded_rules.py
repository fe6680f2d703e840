"""What recording the writer's keep rules in each manifest costs, and what a bare ``gc`` costs.

Part 1: the rules as a manifest records them (``Rotation.keep_record()``, built at every commit)
for the rule set of bench_retention.py plus keep_last, in microseconds per call, and the bytes
they add to a manifest. Part 2: a blocking save of a small state on ``memory://``, with the rules
recorded (this code) against the same save with the record left out, in milliseconds. Part 3:
``ckptsdk gc URL --dry-run`` without rule flags (it reads the rules back) in its own process over
a local root of 20 checkpoints, in seconds. Not a test: it prints numbers.

    python -m benchmarks.bench_recorded_rules [--reps 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState  # noqa: E402
from ckptsdk.backends.memory import MemoryBackend  # noqa: E402
from ckptsdk.checkpoint import retention  # noqa: E402
from ckptsdk.checkpoint.pruning.rotation import Rotation  # noqa: E402
from ckptsdk.manager import Simulation  # noqa: E402


def _rules() -> list[retention.Rule]:
    return [
        retention.keep_every(1000),
        retention.keep_every_seconds(3600),
        retention.keep_best("val_loss", 5),
        retention.keep_if(lambda c: c.metrics.get("milestone") is True, "milestone"),
    ]


def _fmt(xs: list[float], unit: str) -> str:
    return f"{statistics.median(xs):.3g} {unit} (min {min(xs):.3g}, max {max(xs):.3g}, n={len(xs)})"


def _record_cost(reps: int) -> list[float]:
    rotation = Rotation(MemoryBackend(f"bench-{uuid.uuid4().hex}"), keep_last=3, keep_every=None, rules=_rules())
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(2000):
            rotation.keep_record()
        out.append((time.perf_counter() - t0) / 2000 * 1e6)
    return out


def _saves(record: bool, saves: int) -> list[float]:
    name = f"bench-{uuid.uuid4().hex}"
    state = TrainState(model=torch.nn.Linear(16, 16))
    times = []
    patch = contextlib.nullcontext() if record else mock.patch.object(Rotation, "keep_record", lambda self: None)
    with (
        patch,
        CheckpointManager(
            f"memory://{name}",
            keep=_rules(),
            lease_options=LeaseOptions(ttl=30),
            save_options=SaveOptions(on_signal=False),
            keep_last=3,
            _simulation=Simulation(heartbeat=False),
        ) as mgr,
    ):
        for step in range(1, saves + 1):
            t0 = time.perf_counter()
            mgr.save(state, step=step, metrics={"val_loss": 1.0 / step}, blocking=True)
            times.append((time.perf_counter() - t0) * 1e3)
    MemoryBackend.discard_store(name)
    return times


def _gc_wall(reps: int) -> list[float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory() as tmp:
        url = f"{tmp}/run"
        with CheckpointManager(
            url,
            keep_last=20,
            keep=_rules(),
            lease_options=LeaseOptions(ttl=30),
            save_options=SaveOptions(on_signal=False),
        ) as mgr:
            for step in range(1, 21):
                mgr.save(TrainState(model=torch.nn.Linear(16, 16)), step=step, metrics={"val_loss": 1.0 / step})
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "ckptsdk", "gc", url, "--dry-run"], env=env, check=True,
                           capture_output=True)  # fmt: skip
            out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--saves", type=int, default=60)
    args = parser.parse_args()
    print(f"load average at start: {open('/proc/loadavg').read().split()[0]}")
    print(f"keep_record() (keep_last + 4 rules): {_fmt(_record_cost(args.reps), 'us')}")
    rotation = Rotation(MemoryBackend(f"bench-{uuid.uuid4().hex}"), keep_last=3, keep_every=None, rules=_rules())
    added = len(b',"keep":' + b",".join(r.model_dump_json().encode() for r in rotation.keep_record()) + b"[]")
    print(f"bytes the record adds to a manifest: {added}")
    with_record: list[float] = []
    without: list[float] = []
    for i in range(4):  # alternate which goes first: the first run of a process pays warm-up
        for record in (i % 2 == 0, i % 2 == 1):
            (with_record if record else without).extend(_saves(record, args.saves))
    print(f"blocking save, rules recorded:    {_fmt(with_record, 'ms')}")
    print(f"blocking save, record left out:   {_fmt(without, 'ms')}")
    print(f"ratio of medians: {statistics.median(with_record) / statistics.median(without):.3f}")
    print(f"`ckptsdk gc URL --dry-run` (bare, 20 checkpoints, own process): {_fmt(_gc_wall(args.reps), 's')}")


if __name__ == "__main__":
    main()
