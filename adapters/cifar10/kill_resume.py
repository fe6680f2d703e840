"""The kill-and-resume harness: run the CIFAR-10 job as child processes, SIGKILL them at chosen steps.

Used by the demo (``python -m examples.kill_and_resume``), ``examples/gpu_check.py`` and
tests/adapters/test_cifar_job.py: child command lines and environment, one attempt run and killed at a
marker line (also inside a save), kill plans, and the comparison of the final state trees. The
training job itself is ``train.py``; argument parsing and printing belong to the examples.
"""

from __future__ import annotations

import glob
import math
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptsdk import AuditReport

# The source tree the children run in (their cwd and PYTHONPATH): the folder holding adapters/,
# examples/ and ckptsdk/. The harness drives a checkout's ``examples.train_cifar10``.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Attempt:
    """One child process of the job and how it ended."""

    number: int
    kill: tuple[str, int] | None
    returncode: int | None = None
    killed_at: int | None = None
    save_state: str = ""  # for a kill inside a save: what the kill left on storage
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)

    @property
    def killed(self) -> bool:
        return self.returncode == -signal.SIGKILL


def child_command(ckpt: str, *, lease_ttl: float, threads: int = 1, extra: Sequence[str] = ()) -> list[str]:
    """The command line of one attempt of the quick job on synthetic data."""
    return [
        sys.executable,
        "-m",
        "examples.train_cifar10",
        "--ckpt",
        ckpt,
        "--data",
        "synthetic",
        "--preset",
        "quick",
        "--threads",
        str(threads),
        "--lease-ttl",
        str(lease_ttl),
        "--no-progress",
        "--events",
        *extra,
    ]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: this repo importable, one OpenMP thread, plus ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def _runlog_objects(root: str) -> int:
    names = glob.glob(os.path.join(root, "runlog", "**", "*"), recursive=True)
    return sum(1 for n in names if os.path.isfile(n) and not os.path.basename(n).startswith(".ckptsdk-tmp."))


def _save_state(root: str, step: int) -> str:
    """What a kill during the save of ``step`` left behind in a local root."""
    folders = glob.glob(os.path.join(root, f"step-{step:010d}.e*"))
    names = {n for f in folders for n in os.listdir(f)}
    if "manifest.json" in names:
        return "killed just after the commit (manifest published)"
    if "tensors.safetensors" in names:
        return "killed mid-save: tensors written, manifest not published (a torn checkpoint)"
    if any(n.startswith(".ckptsdk-tmp.") for n in names):
        return "killed mid-save: the tensor file was half written (a temp file, never published)"
    return "killed mid-save: step log flushed, tensor file not started yet"


def run_attempt(
    number: int,
    cmd: Sequence[str],
    *,
    env: Mapping[str, str],
    kill: tuple[str, int] | None = None,
    local_root: str | None = None,
    timeout: float = 600.0,
    echo: Callable[[str], None] | None = None,
) -> Attempt:
    """Run one attempt; SIGKILL it when it prints the marker ``kill`` = (event, step).

    For a ``("saving", N)`` kill on a local root, the kill waits (at most 2 s) until the run log
    chunk that ``save()`` publishes before the tensors appears, so the kill lands inside the save
    and the steps since the previous checkpoint are on record for the audit to compare.

    Raises:
        TimeoutError: the attempt ran past ``timeout`` seconds (it is killed first).
    """
    att = Attempt(number=number, kill=kill)
    start = time.monotonic()
    proc = subprocess.Popen(
        list(cmd),
        cwd=REPO,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    marker = f"@@ {kill[0]} {kill[1]}" if kill else None
    try:
        while True:
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                raise TimeoutError(f"attempt {number} ran past {timeout:.0f} s: {' | '.join(att.lines[-5:])}")
            try:
                line = lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                break
            att.lines.append(line)
            if echo is not None and not line.startswith("@@"):
                echo(f"  [attempt {number}] {line}")
            if marker is not None and att.killed_at is None and line == marker:
                if kill is not None and kill[0] == "saving" and local_root is not None:
                    before, until = _runlog_objects(local_root), time.monotonic() + 2.0
                    # The save flushes the step log first; wait for that chunk, then kill.
                    while _runlog_objects(local_root) <= before and time.monotonic() < until:
                        time.sleep(0.001)
                proc.kill()
                att.killed_at = kill[1] if kill else None
    finally:
        if proc.poll() is None and att.killed_at is None:
            proc.kill()
        att.returncode = proc.wait(timeout=60)
        reader.join(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
    att.seconds = time.monotonic() - start
    if kill is not None and kill[0] == "saving" and att.killed and local_root is not None:
        att.save_state = _save_state(local_root, kill[1])
    return att


def plan_kills(
    *, total_steps: int, save_every: int, steps_per_epoch: int, count: int, rng: random.Random
) -> list[tuple[str, int]]:
    """``count`` kill points at strictly increasing steps, the middle one inside a save.

    Increasing steps guarantee each attempt reaches its kill point: it resumes from a checkpoint
    at or before the previous one. The first kill comes after a few steps, so that the first
    attempt has committed something.

    Raises:
        ValueError: the run is too short for that many kill points.
    """
    if count < 1:
        return []
    lo = max(2, total_steps // (2 * count + 2))
    middle, after = count // 2, count - count // 2 - 1
    saves = [s for s in range(lo, total_steps) if s % save_every == 0 or s % steps_per_epoch == 0]
    fits = [s for s in saves if s - lo >= middle and total_steps - 1 - s >= after]
    if not fits:
        raise ValueError(f"{total_steps} steps leave no room for {count} kills around a save")
    in_save = rng.choice(fits)
    before_steps = sorted(rng.sample(range(lo, in_save), middle))
    after_steps = sorted(rng.sample(range(in_save + 1, total_steps), after))
    return [("step", s) for s in before_steps] + [("saving", in_save)] + [("step", s) for s in after_steps]


def compare_states(a: Any, b: Any, path: str = "") -> list[str]:
    """Every place where two state trees differ (tensors and arrays compared byte for byte)."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: tensor vs {type(b if isinstance(a, torch.Tensor) else a).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        same = torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
        return [] if same else [f"{path}: tensor bytes differ"]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        same = (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
        return [] if same else [f"{path}: arrays differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))[:5]} in one only"]
        return [d for k in a for d in compare_states(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{path}: {type(a).__name__}[{len(a)}] vs {type(b).__name__}[{len(b)}]"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in compare_states(x, y, f"{path}/{i}")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if (type(a) is type(b) and a == b) else [f"{path}: {a!r} vs {b!r}"]


def final_state(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[int, Any]:
    """(step, state tree) of the newest checkpoint under ``url``, read through ckptsdk."""
    import ckptsdk

    mgr = ckptsdk.CheckpointManager(url, read_only=True, storage_options=storage_options)
    try:
        info = mgr.latest()
        if info is None:
            raise ckptsdk.CkptError(f"no committed checkpoint under {url}")
        return info.step, mgr.load(info.step)
    finally:
        mgr.close()


def audit(url: str, storage_options: Mapping[str, Any] | None = None, *, series: bool = False) -> AuditReport:
    """The resume audit of the run under ``url`` (read-only; ``series``: for a plot)."""
    import ckptsdk

    mgr = ckptsdk.CheckpointManager(url, read_only=True, storage_options=storage_options)
    try:
        return mgr.audit(series=series)
    finally:
        mgr.close()
