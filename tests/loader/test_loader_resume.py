"""A real DataLoader (shuffle, 2 workers, random augmentation in them) SIGKILLed and resumed ends
with the same model and optimizer bytes as an uninterrupted run, and the audit proves it.

torchdata's StatefulDataLoader (``generator=None``) with 0 and 2 workers is bit-exact too, through
the TrainState: torchdata 0.11's resumed ``iter()`` draws once more from torch's global RNG (put
back by ckptsdk when it happens) and restarts its workers' RNGs (ckptsdk makes them part of each
worker's saved state).

The job is tests/support/_loader_child.py (5 batches an epoch, 3 epochs, a save every 3 or 5
steps); each kill lands after the run log's flusher thread, not a save, published the step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptsdk
from ckptsdk.runlog.audit import audit

REPO = Path(__file__).resolve().parents[2]
FINAL = 15


KINDS = {  # the job's arguments for each loader
    "ckptsdk": ("--loader", "ckptsdk"),
    "stateful-0-workers": ("--loader", "stateful", "--workers", "0"),
    "stateful-2-workers": ("--loader", "stateful", "--workers", "2"),
}


def job(root: Path, *args: str, expect: int = 0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support._loader_child", str(root), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
    )
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


def tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(tensors(v, f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(tensors(v, f"{prefix}/{i}"))
    return out


def final_bytes(root: Path) -> dict[str, bytes]:
    tree = ckptsdk.CheckpointManager(str(root), read_only=True).load(step=FINAL)
    objects = {k: tree["objects"][k] for k in ("model", "optimizer")}
    found = tensors(objects)
    assert len(found) > 10
    return {
        k: v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() + str(v.dtype).encode()
        for k, v in found.items()
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, bytes]]:
    """The uninterrupted run's final bytes, per loader kind, trained on first use: a worker runs
    only the kinds of its tests (each kind's tests are one xdist group, so each trains once)."""
    done: dict[str, dict[str, bytes]] = {}

    def of(kind: str) -> dict[str, bytes]:
        if kind not in done:
            root = tmp_path_factory.mktemp(f"ref-{kind}")
            job(root, *KINDS[kind])
            done[kind] = final_bytes(root)
        return done[kind]

    return of


CASES = {
    # (save every, kill after step): epoch e batch b is step 5e + b
    "mid-epoch": (3, 8),  # saved at 6 (epoch 1, 1 batch done), killed at epoch 1's 3rd batch
    "at-an-epochs-last-batch": (3, 10),  # saved at 9, killed after epoch 1's last batch
    "during-an-epochs-first-batch": (5, 11),  # saved at 10 (epoch 1's last batch), killed in epoch 2's first
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.xdist_group(f"loader-resume-{k}")) for k in KINDS])
@pytest.mark.parametrize("case", list(CASES))
def test_sigkill_and_resume_ends_equal_and_audited(tmp_path, reference, kind, case):
    every, kill = CASES[case]
    root = tmp_path / "run"
    job(root, *KINDS[kind], "--save-every", str(every), "--kill-after", str(kill), expect=-9)
    job(root, *KINDS[kind], "--save-every", str(every))
    assert final_bytes(root) == reference(kind)
    report = audit(ckptsdk.open_backend(str(root)))
    assert report.verdict == "bit-exact", report
    assert report.overlap_steps == kill - (kill // every) * every > 0
    assert report.scalars["loss"].compared_steps == report.overlap_steps
    if kind == "ckptsdk":  # our loader logs each step's sample indices, compared too
        assert report.data_compared == {"data/loader": report.overlap_steps}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_resume_that_draws_once_more_is_diverged_at_its_first_step(tmp_path):
    root = tmp_path / "run"
    job(root, "--kill-after", "8", expect=-9)
    job(root, "--perturb")
    report = audit(ckptsdk.open_backend(str(root)))
    assert report.verdict == "DIVERGED at step 7" and report.first_divergence.scalar == "loss"
    cli = subprocess.run(
        [sys.executable, "-m", "ckptsdk", "audit", str(root), "--strict"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert cli.returncode == 1, cli.stdout + cli.stderr
    assert "DIVERGED at step 7" in cli.stdout and "first divergence: step 7, loss" in cli.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_kill_right_after_a_save_is_unverified_and_strict_fails(tmp_path):
    root = tmp_path / "run"
    job(root, "--kill-after", "6", expect=-9)  # saved at 6: no step after it to run twice
    job(root)
    cli = subprocess.run(
        [sys.executable, "-m", "ckptsdk", "audit", str(root), "--strict"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert cli.returncode == 1, cli.stdout + cli.stderr
    assert "audit of" in cli.stdout and ": unverified" in cli.stdout
    assert "attempt 1 was not closed cleanly and its last step on storage is 6" in cli.stdout
    assert "unverified, nothing was compared" in cli.stderr
    # Without --strict the command still reports, and exits 0.
    plain = subprocess.run(
        [sys.executable, "-m", "ckptsdk", "audit", str(root)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert plain.returncode == 0 and ": unverified" in plain.stdout
