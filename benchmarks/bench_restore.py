"""Verified cold restore against a cold ``torch.load`` of the same state, many reps. Not a test.

Target (issue 23 item 4): ``CheckpointManager.restore`` (a new read-only manager each time, as
in a new process: one listing, the newest manifest, the verified read, the codec,
``load_state_dict``, the RNG states) at most 1.0x a cold ``torch.load`` of the same tree (which
only reads it: nothing is loaded into the model). ``bench_checkpoint`` has the same rows among
many others; this one runs only these, so that more reps fit in a minute on a shared machine,
and reports CPU time (``time.process_time``) beside wall time: on a loaded VM the wall time is
mostly waiting for a core.

    python -m benchmarks.bench_restore --reps 15
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_checkpoint import build_resnet, drop_cache, loadavg, raw_read
from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState
from ckptsdk.format.layout import MANIFEST, TENSORS, checkpoint_dir
from ckptsdk.format.manifest import parse_manifest


def read_files(root: Path, folder: str) -> list[Path]:
    """The tensor files a restore of ``folder`` reads: its own and the shared ones its manifest
    names (unchanged tensors live in ``shared/`` files, so the folder's own file can be small)."""
    manifest = parse_manifest((root / folder / MANIFEST).read_bytes())
    return [root / folder / TENSORS] + [root / s.name for s in manifest.shared]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15, help="measured repetitions (default 15)")
    ap.add_argument("--warmup", type=int, default=2, help="unrecorded warm-up repetitions (default 2)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir; must be a real disk)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    job = build_resnet()
    state = TrainState(**job.objects)
    report: dict[str, Any] = {"reps": args.reps, "loadavg_start": loadavg()}
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="ckpt-restore-", dir=args.dir) as tmp:
        root = Path(tmp)
        torch.save(job.tree(), root / "torch.pt")
        with CheckpointManager(
            str(root / "mgr"),
            keep_last=10,
            lease_options=LeaseOptions(ttl=600.0),
            save_options=SaveOptions(on_signal=False),
        ) as mgr:
            for step in (1, 2, 3):
                mgr.save(state, step=step)
        files = read_files(root / "mgr", checkpoint_dir(3, 1))
        report["raw_read_bytes"] = sum(f.stat().st_size for f in files)
        rows: list[tuple[str, Callable[[], Any]]] = [
            ("raw cold read", lambda: [raw_read(f) for f in files]),
            ("torch.load (cold)", lambda: torch.load(root / "torch.pt", weights_only=False)),
            (
                "ckptsdk restore (manager, verified)",
                lambda: CheckpointManager(str(root / "mgr"), read_only=True).restore(state),
            ),
        ]
        for r in range(args.warmup + args.reps):
            rot = r % len(rows)
            for row, fn in rows[rot:] + rows[:rot]:
                drop_cache(root)
                gc.collect()
                c0, t0 = time.process_time(), time.perf_counter()
                out = fn()
                t1, c1 = time.perf_counter(), time.process_time()
                del out
                if r >= args.warmup:
                    wall.setdefault(row, []).append(t1 - t0)
                    cpu.setdefault(row, []).append(c1 - c0)
    report["loadavg_end"] = loadavg()
    report["wall"], report["cpu"] = wall, cpu
    ref = "torch.load (cold)"
    print(
        f"{job.name}, {args.reps} reps (+{args.warmup} warm-up), page cache dropped before each; "
        f"the raw read is of the {len(files)} tensor file(s) the restore reads, {report['raw_read_bytes'] / 1e6:.1f} MB"
    )
    print(f"{'row':38s} {'wall median (min-max) ms':>28s} {'CPU median (min-max) ms':>28s}  wall / CPU x torch.load")
    for row in wall:
        w, c = wall[row], cpu[row]
        ratio_w = statistics.median(w) / statistics.median(wall[ref])
        ratio_c = statistics.median(c) / statistics.median(cpu[ref])
        print(
            f"{row:38s} {statistics.median(w) * 1e3:10.1f} ({min(w) * 1e3:5.0f}-{max(w) * 1e3:5.0f})"
            f"{'':6s}{statistics.median(c) * 1e3:8.1f} ({min(c) * 1e3:5.0f}-{max(c) * 1e3:5.0f})"
            f"        {ratio_w:.2f} / {ratio_c:.2f}"
        )
        report.setdefault("vs_torch_load", {})[row] = {"wall": ratio_w, "cpu": ratio_c}
    target = report["vs_torch_load"]["ckptsdk restore (manager, verified)"]["wall"]
    print(f"verified restore {target:.2f}x a cold torch.load (target <= 1.0: {'ok' if target <= 1.0 else 'MISSED'})")
    print(f"load average: start {report['loadavg_start']}, end {report['loadavg_end']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
