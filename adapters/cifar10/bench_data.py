"""Measure time to data-ready for CIFAR-10-sized synthetic data served on loopback.

``python -m adapters.cifar10.bench_data [--n-train 50000 --n-test 10000] [--workdir DIR] [--json]``
writes both layouts of a full-size synthetic set, serves them from a local HTTP server, and times
``load_cifar10`` from each source, from the cache (fresh local folder) and from the local copy.
A measurement script, not a test; it needs the repository's ``tests`` package (the server).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time

from .data import load_cifar10
from .synthetic import synthetic_cifar10, write_both

_FILES = (
    ("/hf/plain_text/train-00000-of-00001.parquet", "hf_train"),
    ("/hf/plain_text/test-00000-of-00001.parquet", "hf_test"),
    ("/tv/cifar-10-python.tar.gz", "tarball"),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m adapters.cifar10.bench_data")
    p.add_argument("--n-train", type=int, default=50_000)
    p.add_argument("--n-test", type=int, default=10_000)
    p.add_argument("--workdir", default=None, help="scratch folder (default: a temp dir, removed after)")
    p.add_argument("--json", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true", help="log every step (sizes, times, speeds)")
    args = p.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    from ckptsdk.testing.http_server import FileServer  # the loopback server the tests use

    work = args.workdir or tempfile.mkdtemp(prefix="ckptsdk-bench-data-")
    results: dict[str, object] = {"n_train": args.n_train, "n_test": args.n_test}
    try:
        t = time.monotonic()
        data = synthetic_cifar10(n_train=args.n_train, n_test=args.n_test, seed=0)
        paths = write_both(data, os.path.join(work, "files"))
        results["generate_s"] = round(time.monotonic() - t, 2)
        results["sizes_mb"] = {k: round(os.path.getsize(paths[k]) / 1e6, 1) for _, k in _FILES}
        with FileServer() as srv:
            for rel, key in _FILES:
                with open(paths[key], "rb") as f:
                    srv.add(rel, f.read())

            def downloads() -> int:
                return sum(srv.requests(rel) for rel, _ in _FILES)

            absent_hf, absent_tv = srv.url("/absent/"), srv.url("/absent.tar.gz")
            runs = [  # (expected source, cache folder, local folder, hf base, tarball URL)
                ("huggingface", "cache-hf", "local-hf", srv.url("/hf/"), absent_tv),
                ("torchvision", "cache-tv", "local-tv", absent_hf, srv.url("/tv/cifar-10-python.tar.gz")),
                ("cache", "cache-hf", "local-fresh", absent_hf, absent_tv),
                ("local", "cache-hf", "local-fresh", absent_hf, absent_tv),
            ]
            timings = {}
            for expect, cache, local, hf, tv in runs:
                before, cpu = downloads(), time.process_time()
                got = load_cifar10(
                    cache=os.path.join(work, cache),
                    local=os.path.join(work, local),
                    hf_base=hf,
                    tv_url=tv,
                    progress=False,
                )
                if got.source != expect or got.tensor_hash != data.tensor_hash:
                    raise SystemExit(f"unexpected result: {got.source} {got.tensor_hash}, wanted {expect}")
                # CPU seconds of this process (the HTTP server threads included): on a shared box
                # the wall time is inflated by other load, the CPU time much less so.
                timings[expect] = {
                    "seconds": round(got.seconds, 2),
                    "cpu_s": round(time.process_time() - cpu, 2),
                    "downloads": downloads() - before,
                }
            results["time_to_ready"] = timings
            results["tensor_hash"] = data.tensor_hash
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        sys.stdout.write(json.dumps(results) + "\n")
    else:
        for k, v in results.items():
            sys.stdout.write(f"{k}: {v}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
