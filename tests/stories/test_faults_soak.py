"""Fault suite, part 4: 10,000 saves with keep_last=3 leave nothing behind.

Files, threads, open descriptors and memory are measured after a warm-up and again after all
saves, on the memory and the local backend: none may grow (memory within a small allowance for
the allocator). A tiny state keeps the run to a few seconds per thousand saves.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import threading

import pytest
import torch

from ckptsdk import CheckpointManager
from ckptsdk.backends import open_backend
from ckptsdk.backends.memory import MemoryBackend
from ckptsdk.manager import Simulation

SAVES = 10_000
WARMUP = 500
KEEP = 3


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _usage(backend) -> dict[str, int]:  # noqa: ANN001
    gc.collect()
    return {"objects": len(backend.list("")), "threads": threading.active_count(), "fds": _fds(), "rss_kib": _rss_kib()}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["memory", "local"])
def test_ten_thousand_saves_grow_nothing(kind, tmp_path):
    # The local root goes on /dev/shm where there is one: a real filesystem with real fsyncs,
    # but 10,000 of them on a busy disk take minutes (measured: 212 s on a loaded CI-like VM).
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    folder = tempfile.mkdtemp(prefix="ckptsdk-soak-", dir=shm or str(tmp_path))
    url = f"memory://soak-{os.getpid()}" if kind == "memory" else os.path.join(folder, "root")
    backend = open_backend(url)
    tree = {"w": torch.arange(4, dtype=torch.float32), "step": 0}
    with CheckpointManager(url, keep_last=KEEP, _simulation=Simulation(heartbeat=False)) as mgr:
        for step in range(1, WARMUP + 1):
            mgr.save({**tree, "step": step}, step=step)
        assert mgr.wait(timeout=60)  # a sync save's rotation follows on the worker: count after it
        before = _usage(backend)
        for step in range(WARMUP + 1, SAVES + 1):
            mgr.save({**tree, "step": step}, step=step)
        assert mgr.wait(timeout=60)
        after = _usage(backend)
        steps = sorted(c.step for c in mgr.list() if c.valid)
    assert steps == list(range(SAVES - KEEP + 1, SAVES + 1))
    assert after["objects"] == before["objects"], (before, after)
    assert after["threads"] <= before["threads"], (before, after)
    assert after["fds"] <= before["fds"], (before, after)
    # 9,500 more saves: a leak of one manifest (~1 KiB) per save would be ~10 MiB.
    assert after["rss_kib"] - before["rss_kib"] < 4096, (before, after)
    print(f"{kind}: {SAVES} saves, keep_last={KEEP}: before {before}, after {after}")
    if kind == "memory":
        MemoryBackend.discard_store(url.removeprefix("memory://"))
    shutil.rmtree(folder, ignore_errors=True)
