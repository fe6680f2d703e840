#!/usr/bin/env python
"""The training thread's pause in a non-blocking distributed save (2 ranks, gloo). Not a test.

Each rank holds a replicated MLP with Adam (parameters and two moments: ~3x the parameters) and a
4 MiB buffer; per save, the pause is the time ``save(blocking=False)`` takes on the training
thread, and the next ``optimizer.step()``'s time (it waits for a pipelined copy) is shown beside
a plain step's. Run it on this tree, or on another with ``--tree`` (e.g. an export of main,
whose manager copies everything at save()).

    python -m benchmarks.bench_dist_pause                      # ~64 MB per rank, 5 saves, 2 runs
    python -m benchmarks.bench_dist_pause --tree /tmp/main --snapshot none
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from ckptsdk import LeaseOptions, SaveOptions


def worker(cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from ckptsdk.distributed import AppState, DistributedCheckpointManager

    rank = cfg["rank"]
    dist.init_process_group("gloo", init_method=f"file://{cfg['init']}", rank=rank, world_size=2)
    torch.manual_seed(0)
    width = cfg["width"]
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(2)))
    model.register_buffer("stat", torch.zeros(1 << 20))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = {"app": AppState(model, opt)}
    kw = {} if cfg["snapshot"] == "none" else {"snapshot": cfg["snapshot"]}
    dm = DistributedCheckpointManager(
        os.path.join(cfg["dir"], "root"),
        lease_options=LeaseOptions(ttl=30.0),
        save_options=SaveOptions(asynchronous=True, **kw),
    )
    x = torch.randn(8, width)

    def step() -> float:
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    pauses, held, plain = [], [], []
    for i in range(cfg["saves"] + 1):  # the first is a warm-up (buffers allocated)
        dm.wait()
        dist.barrier()
        plain.append(step())
        t0 = time.perf_counter()
        dm.save(state, step=i + 1, blocking=False)
        pause = time.perf_counter() - t0
        model.stat.add_(1)  # a forward
        h = step()
        if i:
            pauses.append(pause)
            held.append(h)
    dm.close()
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    size += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    with open(os.path.join(cfg["dir"], f"r{rank}.json"), "w") as f:
        json.dump({"pause": pauses, "held": held, "plain": plain, "mb": size / 1e6}, f)
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, f"store-{uuid.uuid4().hex[:6]}")
        env = {**os.environ, "PYTHONPATH": args.tree, "PYTHONDONTWRITEBYTECODE": "1"}
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    json.dumps(
                        {
                            "rank": r,
                            "init": init,
                            "dir": d,
                            "width": args.width,
                            "saves": args.saves,
                            "snapshot": args.snapshot,
                        }
                    ),
                ],
                env=env,
                cwd=d,
            )
            for r in (0, 1)
        ]
        assert [p.wait(600) for p in procs] == [0, 0]
        return [json.loads(Path(d, f"r{r}.json").read_text()) for r in (0, 1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]), help="the ckptsdk tree to run")
    parser.add_argument("--snapshot", choices=("pipelined", "copy", "none"), default="pipelined")
    parser.add_argument("--width", type=int, default=1536, help="Linear width (1536: ~61 MB per rank)")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    for i in range(args.runs):
        ranks = run(args)
        load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else "?"
        pause = [p * 1e3 for r in ranks for p in r["pause"]]
        held = [h * 1e3 for r in ranks for h in r["held"]]
        plain = [h * 1e3 for r in ranks for h in r["plain"]]
        print(
            f"run {i + 1} ({args.snapshot}, {ranks[0]['mb']:.0f} MB per rank, load {' '.join(load)}): "
            f"save() pause median {statistics.median(pause):.1f} ms (min {min(pause):.1f}, max {max(pause):.1f}); "
            f"next step median {statistics.median(held):.1f} ms (min {min(held):.1f}, max {max(held):.1f}), "
            f"a plain step {statistics.median(plain):.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
