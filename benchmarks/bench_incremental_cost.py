#!/usr/bin/env python
"""What incremental saves add to a save where everything trains (issue 25's "detection costs nothing"). Not a test.

GPT-2 small from a config (no hub) with AdamW, one real step between saves: the time of the work
``incremental=True`` adds per save (the live tensors' pointer and version counter at ``save()``,
then the plan on the worker), measured in-process so that storage noise does not drown it. Compare
with the save time ``bench_incremental`` prints for the same state (seconds).

    python -m benchmarks.bench_incremental_cost [--saves 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ckptsdk import TrainState  # noqa: E402
from ckptsdk.checkpoint.writing.sharing import Sharing  # noqa: E402
from ckptsdk.format.template import EncodingCache  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=6)
    args = ap.parse_args(argv)
    from transformers import GPT2Config, GPT2LMHeadModel

    print(f"command: {' '.join(sys.argv)}; load average at start {os.getloadavg()}")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    opt = torch.optim.AdamW(model.parameters())
    state = TrainState(model=model, optimizer=opt)
    sharing, cache = Sharing(), EncodingCache()
    times = []
    for i in range(args.saves):
        out = model(torch.randint(0, 50257, (1, 8)), labels=torch.randint(0, 50257, (1, 8)))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        captured = cache.encode(state.state_dict())
        t0 = time.perf_counter()
        flags = state.step_only_flags(captured.tensors) if sharing.fresh else ()
        hints = sharing.hints(captured.names, captured.tensors, flags)
        plan = sharing.plan(captured.tensor_dict(), hints)
        took = (time.perf_counter() - t0) * 1e3
        # What a commit without shared files leaves (committed() with this save's hints).
        sharing._keys, sharing._fresh = dict(hints.keys) if hints else None, False
        times.append(took)
        print(
            f"save {i + 1}: {len(captured.names)} tensors, {plan.hashed} bytes hashed, "
            f"{len(plan.new)} to a new shared file, {plan.reused} referred to: {took:.2f} ms"
        )
    later = times[1:]
    print(
        f"after the first save: median {statistics.median(later):.2f} ms (min-max {min(later):.2f}-{max(later):.2f}); "
        f"load average at end {os.getloadavg()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
