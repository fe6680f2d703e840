#!/usr/bin/env python
"""Reference mode (issue 48): a frozen base recorded by digest. Not a test.

A frozen base of ``--base-mib`` MiB (Linear layers, ``requires_grad=False``) with a LoRA-sized
trained head and AdamW; a save every ``--every`` steps of a short CPU step, non-blocking. Per mode
(``frozen="store"``, today's incremental saves; ``frozen="reference"``): bytes written per save
after the first, the root's footprint with ``keep_last=3``, the ``save()`` call's pause (median,
p99), the restore time into a fresh model built from the same "source" (the digest proof
included), and for reference mode the pause with a second, smaller base (``--small-mib``) and the
proof's time against a plain read of the base's bytes.

    python -m benchmarks.bench_reference --base-mib 256 --small-mib 32
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ckptsdk import CheckpointManager, TrainState  # noqa: E402
from ckptsdk.format.files.reference import hash_tensor  # noqa: E402
from ckptsdk.options import Retention, SaveOptions  # noqa: E402

WIDTH = 1024


def build(base_mib: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, TrainState]:
    torch.manual_seed(seed)  # the base's "source"
    rows = max(1, base_mib * (1 << 20) // (WIDTH * WIDTH * 4))
    base = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(rows)])
    for p in base.parameters():
        p.requires_grad_(False)
    torch.manual_seed(1)
    adapter = torch.nn.Sequential(torch.nn.Linear(WIDTH, 8, bias=False), torch.nn.Linear(8, WIDTH, bias=False))
    model = torch.nn.ModuleDict({"base": base, "adapter": adapter})
    opt = torch.optim.AdamW(adapter.parameters(), lr=1e-3)
    return model, opt, TrainState(model=model, optimizer=opt)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(i))
    model["adapter"](x).square().mean().backward()  # the gpu-like step: the base is not in the graph
    opt.step()
    opt.zero_grad()


def folder_bytes(root: Path) -> int:
    seen, total = set(), 0
    for f in root.rglob("*"):
        if f.is_file() and (st := f.stat()).st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_size
    return total


def run(mode: str, base_mib: int, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    root = tmp / f"{mode}-{base_mib}"
    model, opt, state = build(base_mib)
    options = SaveOptions(frozen=mode, frozen_source="bench:base@1", asynchronous=True, on_signal=False)
    pauses, sizes = [], []
    with CheckpointManager(str(root), save_options=options, retention=Retention(keep_last=3)) as mgr:
        for i in range(1, args.saves * args.every + 1):
            step(model, opt, i)
            if i % args.every == 0:
                t0 = time.perf_counter()
                mgr.save(state, step=i)
                pauses.append(time.perf_counter() - t0)
                mgr.wait()
                m = mgr.load_manifest()
                sizes.append(sum(f.size for f in m.files) + (m.shared[0].size if m.shared and i == args.every else 0))
    foot = folder_bytes(root)
    fresh, opt2, state2 = build(base_mib)
    t0 = time.perf_counter()
    with CheckpointManager(str(root), read_only=True) as mgr:
        mgr.restore(state2)
    restore_s = time.perf_counter() - t0
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    later = pauses[1:]
    return {
        "bytes_per_save": statistics.median(sizes[1:]),
        "footprint": foot,
        "pause_med_ms": statistics.median(later) * 1e3,
        "pause_p99_ms": sorted(later)[min(len(later) - 1, int(0.99 * len(later)))] * 1e3,
        "restore_s": restore_s,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def proof_vs_read(base_mib: int, tmp: Path) -> tuple[float, float]:
    model, _, _ = build(base_mib)
    tensors = list(model["base"].parameters())
    path = tmp / "base.bin"
    with open(path, "wb") as f:
        for t in tensors:
            f.write(t.numpy().tobytes())
    buf = bytearray(tensors[0].nbytes)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t in tensors:
        hash_tensor(t)
    return time.perf_counter() - t0, read_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-mib", type=int, default=256)
    ap.add_argument("--small-mib", type=int, default=32)
    ap.add_argument("--saves", type=int, default=12)
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args(argv)
    print(f"load average: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows = {
            ("store", args.base_mib): run("store", args.base_mib, args, tmp),
            ("reference", args.base_mib): run("reference", args.base_mib, args, tmp),
            ("reference", args.small_mib): run("reference", args.small_mib, args, tmp),
        }
        proof, read = proof_vs_read(args.base_mib, tmp)
    print(f"{'mode':10} {'base':>5} {'B/save':>10} {'footprint':>11} {'pause med':>9} {'p99':>7} {'restore':>8}")
    for (mode, mib), r in rows.items():
        print(
            f"{mode:10} {mib:>4}M {r['bytes_per_save'] / 1024:>8.0f}Ki {r['footprint'] / 2**20:>9.1f}Mi "
            f"{r['pause_med_ms']:>7.2f}ms {r['pause_p99_ms']:>5.2f}ms {r['restore_s']:>7.3f}s"
        )
    big, small = rows[("reference", args.base_mib)], rows[("reference", args.small_mib)]
    print(f"reference footprint / base: {big['footprint'] / (args.base_mib << 20):.3%} (target <= 10 %)")
    ratio = big["pause_med_ms"] / small["pause_med_ms"]
    print(f"pause {args.base_mib} MiB / {args.small_mib} MiB base: {ratio:.2f}x (target <= 2x)")
    print(f"digest proof {proof:.3f}s / plain read {read:.3f}s of the base: {proof / read:.2f}x (<= 1.5x)")
    print(f"peak RSS of the process: {max(r['peak_rss_mib'] for r in rows.values()):.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
