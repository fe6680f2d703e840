"""A long run log written straight to disk (no RunLog: millions of lines in seconds), for the
audit's memory test and benchmarks/bench_audit.py. Not a test module."""

from __future__ import annotations

import json
from pathlib import Path


def _header(attempt: int, resumed: int | None, last: int, count: int, chunk: int) -> str:
    return json.dumps(
        {
            "format": "ckptsdk.runlog/1.1",
            "kind": "attempt",
            "attempt": attempt,
            "run_id": "big",
            "lease_epoch": attempt,
            "host": "bench",
            "pid": 1,
            "device": "cpu",
            "versions": {},
            "started_at": "2026-12-01T00:00:00Z",
            "resumed_from_step": resumed,
            "last_step": last,
            "steps_logged": count,
            "chunk": chunk,
            "closed": True,
        },
        separators=(",", ":"),
    )


def write_big_log(root: Path, lines: int, *, chunk_rows: int = 50_000, garbage_mb: int = 0) -> int:
    """Two attempts of ``lines // 2`` steps each, the second resumed half way through the first
    (so ``lines // 4`` steps are shared, with equal losses); with ``garbage_mb``, one line of
    that many MiB of garbage in the second attempt's first chunk. Returns the shared steps."""
    half = lines // 2
    plan = ((1, None, range(0, half)), (2, half // 2 - 1, range(half // 2, half // 2 + half)))
    for attempt, resumed, steps in plan:
        folder = root / "runlog" / f"attempt-{attempt:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        chunks = [steps[i : i + chunk_rows] for i in range(0, len(steps), chunk_rows)]
        for seq, part in enumerate(chunks):
            with open(folder / f"chunk-{seq:06d}.jsonl", "w") as f:
                f.write(_header(attempt, resumed, part[-1], part[-1] - steps[0] + 1, seq) + "\n")
                if garbage_mb and attempt == 2 and seq == 0:
                    for _ in range(garbage_mb):
                        f.write("z" * (1 << 20))
                    f.write("\n")
                f.writelines(
                    f'{{"step":{s},"time":1796145826.5,"scalars":{{"loss":{1.0 / (s + 1)!r},"lr":0.001}}}}\n'
                    for s in part
                )
    return half - half // 2
