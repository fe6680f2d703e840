#!/usr/bin/env python
"""Benchmark ckptsdk.distributed against plain DCP (FileSystemWriter/Reader) on 1, 2 and 4 ranks. Not a test.

The same total state at every world size: either replicated on every rank (DDP: DCP's planner
decides who writes each tensor) or sharded by rows (DTensor ``Shard(0)``: each rank owns 1/N).
Each rank is a real process (gloo, FileStore); in each repetition the two methods alternate, a
barrier precedes each timed call and a save/restore time is the slowest rank's. Bytes are what
lands on disk per checkpoint, and per rank file. Writes go to ``--dir`` (a real disk).

    python -m benchmarks.bench_distributed                       # 64 MiB, ranks 1 2 4, 3 reps, 2 runs
    python -m benchmarks.bench_distributed --mb 128 --kind sharded --json-out dist.json
    python -m benchmarks.bench_distributed --rank0-row           # + DCP with rank 0 writing all replicated state
    python -m benchmarks.bench_distributed --async-row           # + save(blocking=False): stall and total
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from ckptsdk import LeaseOptions

N_TENSORS = 8


def _state(mb: int, kind: str, world: int) -> dict[str, Any]:
    import torch

    rows = mb * (1 << 20) // 4 // N_TENSORS // 1024
    g = torch.Generator().manual_seed(0)
    full = {f"layer{i}.weight": torch.randn(rows, 1024, generator=g) for i in range(N_TENSORS)}
    if kind == "replicated":
        return {"model": full}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}}


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def worker(cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckptsdk.distributed import DistributedCheckpointManager

    rank, world = cfg["rank"], cfg["world"]
    dist.init_process_group("gloo", init_method=f"file://{cfg['init']}", rank=rank, world_size=world)
    state = _state(cfg["mb"], cfg["kind"], world)
    base = Path(cfg["dir"])
    dm = DistributedCheckpointManager(
        str(base / "ckptsdk"), keep_last=1, lease_options=LeaseOptions(ttl=60.0), async_save=True
    )
    rows: list[dict[str, Any]] = []

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the save is done when the slowest rank is
        return float(t.item())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rep in range(-1, cfg["reps"]):  # rep -1: warm-up, not recorded
            order = ["ckptsdk", "dcp"] if rep % 2 == 0 else ["dcp", "ckptsdk"]
            if cfg["rank0_row"]:
                order.append("dcp-rank0")
            if cfg["async_row"]:
                order.append("ckptsdk-async")
            for method in order:
                step = rep + 2
                total = None
                if method.startswith("ckptsdk"):
                    if method == "ckptsdk":
                        save = timed(lambda step=step: dm.save(state, step=step, blocking=True))
                    else:  # the stall: what the training loop waits for; total: until committed
                        save = timed(lambda step=step: dm.save(state, step=step + 1000, blocking=False))
                        total = save + timed(dm.wait)
                        step += 1000
                    load = timed(lambda: dm.restore(state))
                    folder = next((base / "ckptsdk").glob(f"step-{step:010d}.*"))
                else:
                    folder = base / f"{method}-{step}"
                    # dcp-rank0: the same, but every replicated tensor written by rank 0 alone.
                    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=method == "dcp-rank0")
                    save = timed(
                        lambda folder=folder, planner=planner: dcp.save(
                            state, storage_writer=dcp.FileSystemWriter(str(folder)), planner=planner
                        )
                    )
                    load = timed(
                        lambda folder=folder: dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)))
                    )
                dist.barrier()
                if rank == 0 and rep >= 0:
                    per_file = {f.name: f.stat().st_size for f in sorted(folder.iterdir())}
                    rows.append(
                        {
                            "world": world,
                            "method": method,
                            "rep": rep,
                            "save_s": save,
                            "total_s": total,
                            "restore_s": load,
                            "bytes": _size(folder),
                            "files": per_file,
                        }
                    )
                dist.barrier()
                if rank == 0 and method != "ckptsdk":
                    shutil.rmtree(folder)
    dm.close()
    dist.destroy_process_group()
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps(rows))


def run_world(world: int, args: argparse.Namespace, run: int) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix=f"bench-dist-{world}-", dir=args.dir))
    try:
        out = work / "rows.json"
        cfg = {
            "world": world,
            "mb": args.mb,
            "kind": args.kind,
            "reps": args.reps,
            "dir": str(work),
            "rank0_row": args.rank0_row,
            "async_row": args.async_row,
            "init": str(work / "store"),
            "out": str(out),
        }
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.bench_distributed", "--worker", json.dumps({**cfg, "rank": r})]
            )
            for r in range(world)
        ]
        codes = [p.wait(1800) for p in procs]
        if codes != [0] * world:
            raise SystemExit(f"world {world}: ranks exited with {codes}")
        rows = json.loads(out.read_text())
        for r in rows:
            r["run"] = run
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _stat(values: list[float]) -> str:
    return f"{statistics.median(values):7.3f} ({min(values):.3f}-{max(values):.3f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=int, default=64, help="total state size in MiB (default 64)")
    parser.add_argument("--kind", choices=("replicated", "sharded"), default="replicated")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--reps", type=int, default=3, help="measured repetitions per run")
    parser.add_argument("--runs", type=int, default=2, help="fresh sets of processes per world size")
    parser.add_argument("--dir", default=None, help="where to write (a real disk; default: the temp dir)")
    parser.add_argument(
        "--rank0-row",
        action="store_true",
        help="add plain DCP with replicated tensors all written by rank 0 (dedup_save_to_lowest_rank)",
    )
    parser.add_argument(
        "--async-row",
        action="store_true",
        help="add ckptsdk's save(blocking=False): the stall as save, the time to commit as total",
    )
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    for run in range(args.runs):
        for world in args.worlds:
            rows += run_world(world, args, run)
    load_after = os.getloadavg()
    print(
        f"state: {args.mb} MiB {args.kind} in {N_TENSORS} float32 tensors; {args.reps} reps x {args.runs} runs; "
        f"load average before {load_before[0]:.2f} after {load_after[0]:.2f}"
    )
    print(
        "world  method    save s: median (min-max)   restore s: median (min-max)   bytes/checkpoint"
        "   per-rank data files"
    )
    for world in args.worlds:
        for method in ("ckptsdk", "ckptsdk-async", "dcp", "dcp-rank0"):
            sel = [r for r in rows if r["world"] == world and r["method"] == method]
            if not sel:
                continue
            files = sel[-1]["files"]
            data = {k: v for k, v in files.items() if k.startswith(("rank-", "__"))}
            print(
                f"{world:5d}  {method:8s}  {_stat([r['save_s'] for r in sel])}       "
                f"{_stat([r['restore_s'] for r in sel])}        {sel[-1]['bytes']:>12,d}   "
                + " ".join(f"{k}={v / 2**20:.1f}M" for k, v in data.items())
                + (f"   total (until committed) {_stat([r['total_s'] for r in sel])}" if sel[-1]["total_s"] else "")
            )
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"args": vars(args), "load": [load_before, load_after], "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
