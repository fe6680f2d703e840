#!/usr/bin/env python
"""Benchmark ckptsdk save/restore against the raw disk, torch.save and DCP. Not a test.

For the 89 MB ResNet-18 training state and a larger synthetic one, in one run, methods
alternating within each repetition (order rotated per repetition), after warm-up rounds:
raw write+fsync of the same bytes (the limit), torch.save+fsync, DCP save, ckptsdk save (sync),
ckptsdk async stall, raw cold read, torch.load, ckptsdk restore with verification; peak extra
memory during save, each measured in a fresh subprocess. Optional GCS-emulator rows (--gcs).

    python -m benchmarks.bench_checkpoint                     # ~5 min on a 2-core VM
    python -m benchmarks.bench_checkpoint --reps 7 --large-mb 256 --json-out bench.json

"direct" rows call ckptsdk.tensorfile/staging themselves; "manager" rows go through
ckptsdk.CheckpointManager (lease, manifest, run log included). Cold reads drop the page cache of
each file with posix_fadvise(DONTNEED) after it was fsynced.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ckptsdk import LeaseOptions, SaveOptions, open_backend  # noqa: E402
from ckptsdk.checkpoint.writing.staging import Stager  # noqa: E402
from ckptsdk.format.files.tensorfile import read_tensorfile, write_tensorfile  # noqa: E402

try:  # the manager rows need the lead's CheckpointManager and C's TrainState
    from ckptsdk.manager import CheckpointManager
    from ckptsdk.state import TrainState
except ImportError as _exc:  # pragma: no cover - only while those modules are being written
    CheckpointManager = TrainState = None  # type: ignore[assignment,misc]
    _MANAGER_MISSING = str(_exc)
else:
    _MANAGER_MISSING = ""

CHUNK = 8 << 20
TARGETS = {  # row -> (reference row, max ratio); issue #12's targets for the manager rows
    "ckptsdk save (manager, sync)": ("raw write+fsync", 1.15),
    "ckptsdk save (direct, sync)": ("raw write+fsync", 1.15),
    "ckptsdk async stall (manager)": ("raw write+fsync", 0.05),
    "ckptsdk async stall (direct)": ("raw write+fsync", 0.15),
    "ckptsdk async total (manager)": ("ckptsdk save (manager, sync)", 1.3),
    "ckptsdk restore (manager, verified)": ("torch.load (cold)", 1.0),
    "ckptsdk restore (direct, verified)": ("raw cold read", 1.25),
}
#: Storage latencies (seconds per call) at which the manager's async stall is measured: the
#: stall must not depend on them (issue #12: the same within 2 ms at 0, 20 and 50 ms).
LATENCIES = (0.020, 0.050)
STALL_SPREAD_TARGET = 0.002
VS_TORCH_LOAD = ("ckptsdk restore (manager, verified)", "ckptsdk restore (direct, verified)")


# ------------------------------------------------------------------------------ states


class Job:
    """A training state: live objects, the tree torch.save/DCP get, and its flat tensors."""

    def __init__(self, name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, scaler: Any):
        self.name, self.model, self.opt, self.sched, self.scaler = name, model, opt, sched, scaler
        self.objects = {"model": model, "optimizer": opt}
        if sched is not None:
            self.objects["scheduler"] = sched
        if scaler is not None:
            self.objects["scaler"] = scaler

    def tree(self) -> dict[str, Any]:
        tree: dict[str, Any] = {k: v.state_dict() for k, v in self.objects.items()}
        tree["rng"] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        return tree

    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}

        def walk(node: Any, path: str) -> None:
            if isinstance(node, torch.Tensor):
                out[path] = node
            elif isinstance(node, dict):
                for k, v in node.items():
                    walk(v, f"{path}/{k}" if path else str(k))
            elif isinstance(node, (list, tuple)):
                for i, v in enumerate(node):
                    walk(v, f"{path}/{i}")

        walk(self.tree(), "")
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def build_resnet() -> Job:
    """ResNet-18 (10 classes) + SGD momentum + OneCycleLR + GradScaler after one step: ~89 MB."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=1000)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    opt.zero_grad(set_to_none=True)  # gradients are not part of the state: free them
    return Job("resnet18", model, opt, sched, scaler)


def build_large(mb: int) -> Job:
    """A synthetic state of about ``mb`` MB: Linear layers (half) + SGD momentum (half)."""
    torch.manual_seed(0)
    dim = 2048 if mb >= 64 else 512
    per_layer = (dim * dim + dim) * 4
    layers = max(1, round(mb * 1e6 / 2 / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(2, dim)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return Job(f"synthetic-{mb}MB", model, opt, None, None)


# ------------------------------------------------------------------------------ file helpers


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(root: Path) -> None:
    """Evict every file under ``root`` from the page cache (they are fsynced, so pages are clean)."""
    paths = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def raw_read(path: Path) -> torch.Tensor:
    size = path.stat().st_size
    buf = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < size:
            n = f.readinto(view[pos : pos + CHUNK])
            if not n:
                raise OSError(f"{path} shrank while reading")
            pos += n
    return buf


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


# ------------------------------------------------------------------------------ one state


class Bench:
    """Runs every method on one state, alternating, and records the times."""

    def __init__(self, job: Job, root: Path, use_manager: bool) -> None:
        self.job, self.root = job, root
        self.times: dict[str, list[float]] = {}
        self.extra: dict[str, list[float]] = {}
        self.stager = Stager()
        self.direct = open_backend(str(root / "direct"))
        self.step = 0
        self.mgr = None
        if use_manager:
            self.state = TrainState(**job.objects)
            # incremental=False: every rep saves the same state, which an incremental save would
            # not write again; these rows measure the full write, against torch.save and raw writes.
            self.mgr = CheckpointManager(
                str(root / "mgr"),
                keep_last=1000,
                lease_options=LeaseOptions(ttl=600.0),
                save_options=SaveOptions(on_signal=False, incremental=False),
            )
            # Restores go through a reader: a writer restores once, before its first save.
            # A new reader each time: a cold restore is a new process, with no manifest memo.
            self.reader = lambda: CheckpointManager(str(root / "mgr"), read_only=True)
            self.slow = {
                lat: CheckpointManager(
                    _slow_backend(root / f"mgr-{int(lat * 1000)}ms", lat),
                    keep_last=2,
                    lease_options=LeaseOptions(ttl=600.0),
                    save_options=SaveOptions(on_signal=False, incremental=False),
                )
                for lat in LATENCIES
            }
        self.raw_bytes = _safetensors_bytes(job.tensors())

    def record(self, row: str, seconds: float, keep: bool) -> None:
        if keep:
            self.times.setdefault(row, []).append(seconds)

    def rep(self, r: int, keep: bool) -> None:
        d = self.root / f"rep{r}"
        d.mkdir()
        tensors = self.job.tensors()
        key = f"rep{r}/sync.safetensors"
        written: dict[str, tuple[int, str]] = {}
        saves: list[tuple[str, Callable[[], None]]] = [
            ("raw write+fsync", lambda: raw_write(d / "raw.bin", self.raw_bytes)),
            ("backend publish, same bytes", lambda: self.direct.write(f"rep{r}/raw.bin", self.raw_bytes)),
            ("torch.save+fsync", lambda: self._torch_save(d / "torch.pt")),
            ("DCP save", lambda: self._dcp_save(d / "dcp")),
            ("ckptsdk save (direct, sync)", lambda: written.update(r=write_tensorfile(self.direct, key, tensors))),
        ]
        if self.mgr is not None:
            saves.append(("ckptsdk save (manager, sync)", self._mgr_sync))
        # Every turn records its own rows; the async saves (stall: what the training loop waits
        # for; total: with the background write) take theirs in the rotation too. Always last,
        # after six 89 MB writes, the async total read 2.86x a sync save in one run.
        turns: list[Callable[[], None]] = [
            *(lambda row=row, fn=fn: self.record(row, timed(fn)[0], keep) for row, fn in saves),
            lambda: self._async_direct(r, tensors, keep),
        ]
        if self.mgr is not None:
            turns.append(lambda: self._async_manager(keep))
        rot = r % len(turns)
        for turn in turns[rot:] + turns[:rot]:
            gc.collect()
            turn()
        if self.mgr is not None:
            for lat, mgr in self.slow.items():
                self._async_slow(mgr, lat, keep)

        size, digest = written["r"]
        for p in (d, self.root / "direct", self.root / "mgr"):
            drop_cache(p)
        reads: list[tuple[str, Callable[[], Any]]] = [
            ("raw cold read", lambda: raw_read(d / "raw.bin")),
            ("torch.load (cold)", lambda: torch.load(d / "torch.pt", weights_only=False)),
            ("ckptsdk restore (direct, verified)", lambda: read_tensorfile(self.direct, key, size=size, digest=digest)),
        ]
        if self.mgr is not None:
            reads.append(("ckptsdk restore (manager, verified)", lambda: self.reader().restore(self.state)))
        rot = r % len(reads)
        for row, fn in reads[rot:] + reads[:rot]:
            gc.collect()
            seconds, out = timed(fn)
            del out
            self.record(row, seconds, keep)
        self._cleanup(d)

    def _torch_save(self, path: Path) -> None:
        torch.save(self.job.tree(), path)
        fsync_path(path)

    def _dcp_save(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        tree = self.job.tree()
        tree["rng"] = {"torch": tree["rng"]["torch"]}  # DCP pickles non-tensors; keep it tensors
        dcp.save(tree, checkpoint_id=str(path))  # FileSystemWriter fsyncs its files itself

    def _mgr_sync(self) -> None:
        self.step += 1
        self.mgr.save(self.state, step=self.step, blocking=True)

    def _async_direct(self, r: int, tensors: dict[str, torch.Tensor], keep: bool) -> None:
        result: dict[str, Any] = {}

        def begin() -> threading.Thread:
            snap = self.stager.snapshot(tensors)
            t = threading.Thread(
                target=lambda: result.update(out=write_tensorfile(self.direct, f"rep{r}/async.safetensors", snap))
            )
            t.start()
            return t

        gc.collect()
        stall, thread = timed(begin)
        total, _ = timed(lambda: thread.join())
        self.record("ckptsdk async stall (direct)", stall, keep)
        self.record("ckptsdk async total (direct)", stall + total, keep)

    def _async_manager(self, keep: bool) -> None:
        self.step += 1
        gc.collect()
        stall, _ = timed(lambda: self.mgr.save(self.state, step=self.step, blocking=False))
        rest, _ = timed(lambda: self.mgr.wait())
        self.record("ckptsdk async stall (manager)", stall, keep)
        self.record("ckptsdk async total (manager)", stall + rest, keep)

    def _async_slow(self, mgr: Any, latency: float, keep: bool) -> None:
        """The stall with every storage call slowed to ``latency`` (the save's storage work,
        on the worker, is waited for outside the timing)."""
        self.step += 1
        gc.collect()
        stall, _ = timed(lambda: mgr.save(self.state, step=self.step, blocking=False))
        mgr.wait()
        self.record(f"ckptsdk async stall (manager, +{latency * 1000:.0f} ms/call)", stall, keep)

    def _cleanup(self, d: Path) -> None:
        shutil.rmtree(d)
        shutil.rmtree(self.root / "direct", ignore_errors=True)
        if self.mgr is not None:  # drop old steps ourselves (outside the timings): manifest first
            for info in self.mgr.list()[:-1]:
                for obj in self.mgr.backend.list(info.key + "/"):
                    if obj.key.endswith("manifest.json"):
                        self.mgr.backend.delete(obj.key)
                for obj in self.mgr.backend.list(info.key + "/"):
                    self.mgr.backend.delete(obj.key)

    def close(self) -> None:
        if self.mgr is not None:
            self.mgr.close()
            for mgr in self.slow.values():
                mgr.close()


def _slow_backend(root: Path, latency: float) -> Any:
    """A local root whose every storage call first sleeps ``latency`` s (a GCS request or a
    Drive FUSE metadata call costs tens of milliseconds)."""
    from ckptsdk.testing import FaultyBackend

    def sleep(_op: str, _key: str, _n: int) -> None:
        time.sleep(latency)
        return None

    return FaultyBackend(open_backend(str(root)), fail_on=sleep)


def _safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    import safetensors.torch

    return safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()})


# ------------------------------------------------------------------------------ memory


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


MEMORY_METHODS = ["torch.save", "DCP", "direct sync", "direct async", "manager sync", "manager async"]


def _trim() -> None:
    """Give freed heap memory back to the OS, so RSS counts only live memory."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


def memory_child(state: str, large_mb: int, root: Path, with_manager: bool) -> dict[str, Any]:
    """In a fresh process: for each save method, peak RSS above the RSS just before it.

    Before each method freed memory is trimmed and VmHWM reset to the current RSS (Linux
    ``clear_refs`` 5), so each peak is that save's own; a Stager is created per method, so its
    staging buffers count in full.
    """
    job = build_resnet() if state == "resnet" else build_large(large_mb)
    out: dict[str, Any] = {}
    for method in MEMORY_METHODS:
        if method.startswith("manager") and not with_manager:
            continue
        d = root / method.replace(" ", "-")
        d.mkdir()
        mgr = ts = None
        if method.startswith("manager"):
            ts = TrainState(**job.objects)
            mgr = CheckpointManager(
                str(d / "mgr"),
                keep_last=1000,
                lease_options=LeaseOptions(ttl=600.0),
                save_options=SaveOptions(incremental=False),
            )
        backend = open_backend(str(d / "direct"))
        _trim()
        try:
            Path("/proc/self/clear_refs").write_text("5")
            reset = True
        except OSError:
            reset = False
        base = _status_kb("VmRSS")
        if method == "torch.save":
            torch.save(job.tree(), d / "t.pt")
            fsync_path(d / "t.pt")
        elif method == "DCP":
            import torch.distributed.checkpoint as dcp

            tree = job.tree()
            tree["rng"] = {"torch": tree["rng"]["torch"]}
            dcp.save(tree, checkpoint_id=str(d / "dcp"))
        elif method == "direct sync":
            write_tensorfile(backend, "sync.safetensors", job.tensors())
        elif method == "direct async":
            snap = Stager().snapshot(job.tensors())
            write_tensorfile(backend, "async.safetensors", snap)
            del snap
        elif method == "manager sync":
            mgr.save(ts, step=1, blocking=True)
        elif method == "manager async":
            mgr.save(ts, step=1, blocking=False)
            mgr.wait()
        peak = _status_kb("VmHWM")
        if mgr is not None:
            mgr.close()
        out[method] = {"extra_bytes": (peak - base) * 1024, "state_bytes": job.nbytes(), "hwm_reset": reset}
        shutil.rmtree(d)
    return out


def measure_memory(state: str, large_mb: int, with_manager: bool, parent: str | None, timeout: float) -> dict[str, Any]:
    """Run :func:`memory_child` in a fresh interpreter (no allocator history from the timings)."""
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-mem-", dir=parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.bench_checkpoint",
            "--_mem",
            state,
            "--large-mb",
            str(large_mb),
            "--dir",
            tmp,
        ] + ([] if with_manager else ["--no-manager"])
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"all": {"error": proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]}}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ GCS


def gcs_rows(job: Job, reps: int, warmup: int) -> dict[str, list[float]]:
    """Upload/download through the GCS emulator: raw bytes (the limit) vs ckptsdk."""
    from ckptsdk.testing.gcs_emulator import start_emulator

    times: dict[str, list[float]] = {}
    tensors = job.tensors()
    data = _safetensors_bytes(tensors)
    with start_emulator() as emu:
        emu.make_bucket("bench")
        backend = open_backend(emu.url("bench", "direct"), **emu.storage_options)
        mgr = None
        if CheckpointManager is not None:
            state = TrainState(**job.objects)
            mgr = CheckpointManager(
                emu.url("bench", "mgr"),
                storage_options=emu.storage_options,
                keep_last=2,
                lease_options=LeaseOptions(ttl=600.0),
                save_options=SaveOptions(incremental=False),
            )
            reader = CheckpointManager(
                emu.url("bench", "mgr"), storage_options=emu.storage_options, read_only=True
            )  # a writer restores once, before saving
        step = 0
        for r in range(warmup + reps):
            keep = r >= warmup
            rows: list[tuple[str, Callable[[], Any]]] = [
                ("gcs raw upload", lambda: backend.write("raw.bin", data)),
                ("gcs ckptsdk save (direct)", lambda: write_tensorfile(backend, "t.safetensors", tensors)),
            ]
            if mgr is not None:

                def mgr_save() -> None:
                    nonlocal step
                    step += 1
                    mgr.save(state, step=step, blocking=True)

                rows.append(("gcs ckptsdk save (manager)", mgr_save))
            for row, fn in rows:
                seconds, out = timed(fn)
                if keep:
                    times.setdefault(row, []).append(seconds)
            size = backend.stat("t.safetensors").size
            import xxhash

            digest = xxhash.xxh3_128(data).hexdigest()
            reads: list[tuple[str, Callable[[], Any]]] = [
                ("gcs raw download", lambda: backend.read("raw.bin")),
                (
                    "gcs ckptsdk restore (direct)",
                    lambda size=size, digest=digest: read_tensorfile(
                        backend, "t.safetensors", size=size, digest=digest
                    ),
                ),
            ]
            if mgr is not None:
                reads.append(("gcs ckptsdk restore (manager)", lambda: reader.restore(state)))
            for row, fn in reads:
                seconds, out = timed(fn)
                del out
                if keep:
                    times.setdefault(row, []).append(seconds)
        if mgr is not None:
            mgr.close()
    return times


# ------------------------------------------------------------------------------ report


ROW_ORDER = [
    "raw write+fsync",
    "backend publish, same bytes",
    "torch.save+fsync",
    "DCP save",
    "ckptsdk save (direct, sync)",
    "ckptsdk save (manager, sync)",
    "ckptsdk async stall (direct)",
    "ckptsdk async total (direct)",
    "ckptsdk async stall (manager)",
    "ckptsdk async total (manager)",
    "ckptsdk async stall (manager, +20 ms/call)",
    "ckptsdk async stall (manager, +50 ms/call)",
    "raw cold read",
    "torch.load (cold)",
    "ckptsdk restore (direct, verified)",
    "ckptsdk restore (manager, verified)",
    "gcs raw upload",
    "gcs ckptsdk save (direct)",
    "gcs ckptsdk save (manager)",
    "gcs raw download",
    "gcs ckptsdk restore (direct)",
    "gcs ckptsdk restore (manager)",
]


def summarise(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    rows = sorted(times, key=lambda r: ROW_ORDER.index(r) if r in ROW_ORDER else len(ROW_ORDER))
    return {
        r: {"median": statistics.median(times[r]), "min": min(times[r]), "max": max(times[r]), "n": len(times[r])}
        for r in rows
    }


def ratios(summary: dict[str, dict[str, float]], times: dict[str, list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in summary:
        ref = "raw cold read" if ("read" in row or "restore" in row or "load" in row) else "raw write+fsync"
        if row.startswith("gcs"):
            ref = "gcs raw download" if ("restore" in row or "download" in row) else "gcs raw upload"
        if ref not in summary:
            continue
        entry = {"reference": ref, "ratio": summary[row]["median"] / summary[ref]["median"]}
        # Paired ratios (same repetition): less sensitive to drift across the run.
        pairs = [a / b for a, b in zip(times[row], times[ref], strict=True)]
        entry["paired_median"] = statistics.median(pairs)
        if row in TARGETS and TARGETS[row][0] in summary:
            tref = TARGETS[row][0]
            entry["target_reference"] = tref
            entry["target_ratio"] = summary[row]["median"] / summary[tref]["median"]
            entry["target"] = TARGETS[row][1]
            entry["met"] = entry["target_ratio"] <= TARGETS[row][1]
        if row in VS_TORCH_LOAD and "torch.load (cold)" in summary:
            entry["vs_torch_load"] = summary[row]["median"] / summary["torch.load (cold)"]["median"]
            entry["met_vs_torch_load"] = entry["vs_torch_load"] <= 1.0
        if row.startswith("gcs ckptsdk"):
            entry["target"] = 1.15 if "save" in row else 1.25
            entry["met"] = entry["ratio"] <= entry["target"]
        out[row] = entry
    return out


def print_table(
    title: str, summary: dict[str, dict[str, float]], rat: dict[str, Any], mem: dict[str, Any], state_bytes: int
) -> None:
    print(f"\n== {title}: {state_bytes / 1e6:.1f} MB of tensors ==")
    print(f"{'row':40s} {'median s':>9s} {'min–max s':>17s} {'× limit':>8s}  target")
    for row, s in summary.items():
        r = rat.get(row, {})
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else ""
        target = ""
        if "target" in r:
            tref = r.get("target_reference", r["reference"])
            tr = r.get("target_ratio", r["ratio"])
            vs = "" if tref == r["reference"] else f" of {tref}"
            target = f"{tr:.2f}{vs} ≤{r['target']:.2f} {'ok' if r['met'] else 'MISSED'}"
        if "vs_torch_load" in r and r.get("target_reference") != "torch.load (cold)":
            target += f"; {r['vs_torch_load']:.2f}× torch.load {'ok' if r['met_vs_torch_load'] else 'MISSED'}"
        print(f"{row:40s} {s['median']:9.3f} {s['min']:8.3f}–{s['max']:<8.3f} {ratio:>8s}  {target}")
    stalls = {row: s["median"] for row, s in summary.items() if row.startswith("ckptsdk async stall (manager")}
    if len(stalls) > 1:
        spread = max(stalls.values()) - min(stalls.values())
        ok = "ok" if spread <= STALL_SPREAD_TARGET else "MISSED"
        print(
            f"async stall at 0/20/50 ms per storage call: spread {spread * 1000:.1f} ms "
            f"(target ≤{STALL_SPREAD_TARGET * 1000:.0f} ms {ok})"
        )
    for method, m in mem.items():
        if "error" in m:
            print(f"peak extra memory, {method:14s}: failed: {m['error']}")
            continue
        ratio = m["extra_bytes"] / m["state_bytes"]
        ok = "" if not method.startswith(("direct", "manager")) else (" ok" if ratio <= 1.1 else " MISSED")
        print(
            f"peak extra memory, {method:14s}: {m['extra_bytes'] / 1e6:8.1f} MB = {ratio:.2f}× state"
            f"{' (target ≤1.10' + ok + ')' if ok else ''}{'' if m['hwm_reset'] else ' [VmHWM not resettable]'}"
        )


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="measured repetitions (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="unrecorded warm-up repetitions (default 1)")
    ap.add_argument("--large-mb", type=int, default=1024, help="size of the synthetic state in MB (0: skip it)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir; must be a real disk)")
    ap.add_argument("--json-out", default=None, help="write every timing, summary and ratio here")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--no-manager", action="store_true", help="only the direct tensorfile rows")
    ap.add_argument("--gcs", action="store_true", help="also upload/download through the GCS emulator (ResNet state)")
    ap.add_argument("--_mem", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")  # DCP warns that it runs without a process group: intended
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    if args._mem:
        with_manager = not args.no_manager and CheckpointManager is not None
        print(json.dumps(memory_child(args._mem, args.large_mb, Path(args.dir), with_manager)))
        return 0

    use_manager = not args.no_manager and CheckpointManager is not None
    if not args.no_manager and CheckpointManager is None:
        print(f"manager rows skipped: {_MANAGER_MISSING}")
    report: dict[str, Any] = {
        "reps": args.reps,
        "warmup": args.warmup,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "loadavg_start": loadavg(),
        "states": {},
    }
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-", dir=args.dir) as tmp:
        jobs = [build_resnet()]
        if args.large_mb > 0:
            jobs.append(build_large(args.large_mb))
        benches = []
        for job in jobs:
            root = Path(tmp) / job.name
            root.mkdir()
            benches.append(Bench(job, root, use_manager))
        # Alternate the states too, so slow drift of the machine hits both equally.
        for r in range(args.warmup + args.reps):
            for b in benches:
                b.rep(r, keep=r >= args.warmup)
        for b in benches:
            b.close()
            summary = summarise(b.times)
            report["states"][b.job.name] = {
                "state_bytes": b.job.nbytes(),
                "times": b.times,
                "summary": summary,
                "ratios": ratios(summary, b.times),
            }
        del benches
        gc.collect()
    report["loadavg_end_timings"] = loadavg()
    # (printing happens after memory so one table per state holds everything)
    for job in jobs:
        entry = report["states"][job.name]
        state = "resnet" if job.name == "resnet18" else "large"
        entry["memory"] = (
            {} if args.no_memory else measure_memory(state, args.large_mb, use_manager, args.dir, timeout=600)
        )
    if args.gcs:
        g = gcs_rows(jobs[0], args.reps, args.warmup)
        report["gcs"] = {"times": g, "summary": summarise(g), "ratios": ratios(summarise(g), g)}
    report["loadavg_end"] = loadavg()
    report["wall_s"] = time.perf_counter() - t_start
    for job in jobs:
        e = report["states"][job.name]
        print_table(job.name, e["summary"], e["ratios"], e["memory"], e["state_bytes"])
    if args.gcs:
        g = report["gcs"]
        print_table("GCS emulator, " + jobs[0].name, g["summary"], g["ratios"], {}, jobs[0].nbytes())
    print(
        f"\nload average: start {report['loadavg_start']}, end {report['loadavg_end']}; "
        f"wall {report['wall_s']:.0f} s; ratios are median/median of the reference row in the same run"
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
