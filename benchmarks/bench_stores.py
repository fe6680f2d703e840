"""Object stores side by side: GCS and S3 on their patched local servers (127.0.0.1), same state, same code.

For each store and repetition: the cost of opening a writer (the precondition probe alone, then
the whole ``CheckpointManager`` open: probe, listing, lease), ``SAVES`` blocking saves of a state
of ``--mb`` MiB (steady state: saves after the first), and a verified restore by a fresh reader;
wall times and the HTTP requests each sends (S3: ``S3Backend.requests``; GCS: every call of its
transport's ``_request``). The servers are emulators: the times say what the client and its
round trips cost on loopback, not what AWS or Google would take. Not a test: it prints numbers.

    python -m benchmarks.bench_stores [--mb 32] [--reps 3] [--saves 5] [--no-gcs] [--no-s3] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from ckptsdk import CheckpointManager, SaveOptions  # noqa: E402
from ckptsdk.backends import open_backend, probe  # noqa: E402


def _counted(backend: Any) -> Counter[str]:
    """A live count of the HTTP requests ``backend`` sends."""
    requests = getattr(backend, "requests", None)
    if isinstance(requests, Counter):  # S3Backend counts its own
        return requests
    counts: Counter[str] = Counter()
    send = backend._request  # GCSBackend: every request goes through here

    def counting(method: str, url: str, **kw: Any) -> Any:
        counts[method] += 1
        return send(method, url, **kw)

    backend._request = counting
    return counts


def _state(mb: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    n = mb * (1 << 20) // 4
    return {"model": {"w": torch.randn(n - 1000, generator=g), "b": torch.randn(1000, generator=g)}, "step": 0}


def one_run(kind: str, url: str, options: dict[str, Any], mb: int, saves: int) -> dict[str, Any]:
    row: dict[str, Any] = {"kind": kind}
    probe.forget_proofs()  # a fresh process, as far as the probe knows
    b = open_backend(url, **options)
    counts = _counted(b)
    t = time.perf_counter()
    probe.prove_preconditions(b)
    row["probe_s"], row["probe_requests"] = time.perf_counter() - t, sum(counts.values())
    probe.forget_proofs()
    b = open_backend(url, **options)
    counts = _counted(b)
    t = time.perf_counter()
    mgr = CheckpointManager(b, keep_last=2, save_options=SaveOptions(asynchronous=False, on_signal=False))
    row["open_s"], row["open_requests"] = time.perf_counter() - t, sum(counts.values())
    state = _state(mb)
    times, calls = [], []
    try:
        for step in range(1, saves + 1):
            state["step"] = step
            before = sum(counts.values())
            t = time.perf_counter()
            mgr.save(state, step=step)
            times.append(time.perf_counter() - t)
            calls.append(sum(counts.values()) - before)
    finally:
        mgr.close()
    row["save_s"], row["save_requests"] = times[1:], calls[1:]  # steady state: after the first
    row["first_save_s"], row["first_save_requests"] = times[0], calls[0]
    reader_b = open_backend(url, **options)
    rcounts = _counted(reader_b)
    t = time.perf_counter()
    tree = CheckpointManager(reader_b, read_only=True).load()
    row["restore_s"], row["restore_requests"] = time.perf_counter() - t, sum(rcounts.values())
    assert torch.equal(tree["model"]["w"], state["model"]["w"])
    return row


def _fmt(values: list[float], unit: str = "s") -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return (
        f"{med:.3f} {unit} [{min(values):.3f}-{max(values):.3f}]"
        if unit
        else f"{med:g} [{min(values):g}-{max(values):g}]"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=32, help="state size in MiB (S3 multi-part above 16 MiB)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--no-gcs", action="store_true")
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--json-out")
    args = p.parse_args()
    servers: list[tuple[str, Any]] = []
    if not args.no_gcs:
        from ckptsdk.testing.gcs_emulator import start_emulator

        servers.append(("gcs", start_emulator()))
    if not args.no_s3:
        from ckptsdk.testing.s3_server import start_s3_server

        servers.append(("s3", start_s3_server()))
    out: dict[str, Any] = {"load_average_start": os.getloadavg(), "mb": args.mb, "rows": []}
    try:
        for rep in range(args.reps):
            for kind, server in servers if rep % 2 == 0 else servers[::-1]:  # alternate the order
                bucket = f"bench-{uuid.uuid4().hex[:12]}"
                server.make_bucket(bucket)
                out["rows"].append(
                    one_run(kind, server.url(bucket, "run"), server.storage_options, args.mb, args.saves)
                )
    finally:
        for _, server in servers:
            server.stop()
    out["load_average_end"] = os.getloadavg()
    print(f"state {args.mb} MiB, {args.reps} runs, {args.saves} saves each; median [min-max]")
    for kind, _ in servers:
        rows = [r for r in out["rows"] if r["kind"] == kind]

        def all_of(name: str, rows: list[dict[str, Any]] = rows) -> list[float]:
            vals: list[float] = []
            for r in rows:
                vals += r[name] if isinstance(r[name], list) else [r[name]]
            return vals

        print(
            f"{kind:4} probe {_fmt(all_of('probe_s'))} ({_fmt(all_of('probe_requests'), '')} requests); "
            f"open {_fmt(all_of('open_s'))} ({_fmt(all_of('open_requests'), '')} req)"
        )
        print(
            f"     save {_fmt(all_of('save_s'))} ({_fmt(all_of('save_requests'), '')} req per save; first save "
            f"{_fmt(all_of('first_save_requests'), '')} req); restore {_fmt(all_of('restore_s'))} "
            f"({_fmt(all_of('restore_requests'), '')} req)"
        )
    print(f"load average: start {out['load_average_start']}, end {out['load_average_end']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
