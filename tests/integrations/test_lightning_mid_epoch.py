"""Lightning killed mid-epoch (SIGKILL, a real process) and resumed through CkptsdkCheckpointIO
with ckpt_path="last", through Lightning's own loops: with ckptsdk.DataLoader (0 and 2 workers,
random augmentation, dropout) the final weights and AdamW state are equal to an uninterrupted
run's, byte for byte; with a plain torch DataLoader or a torchdata StatefulDataLoader the resume
is not exact, and the plugin says so loudly when it loads the checkpoint (never a silent resume).

The job is tests/integrations/_lightning_child.py (6 batches an epoch, 3 epochs, a checkpoint
every 4 steps, killed as step 10 begins: resumed from step 8, 2 batches into epoch 1).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch

pytest.importorskip("lightning")

from ckptsdk import CheckpointManager  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KINDS = {
    "ckptsdk-0-workers": ("ckptsdk", "0"),
    "ckptsdk-2-workers": ("ckptsdk", "2"),
    "torch": ("torch", "0"),
    "stateful": ("stateful", "0"),
}
NOT_EXACT = "this resume is NOT bit-exact"


def job(work: Path, kind: str, *, kill_at: int | None = None) -> subprocess.CompletedProcess[str]:
    loader, workers = KINDS[kind]
    cmd = [sys.executable, "-m", "tests.integrations._lightning_child", str(work / "root"), str(work / "work")]
    cmd += [str(work / "out.safetensors"), "--loader", loader, "--workers", workers]
    if kill_at is not None:
        cmd += ["--kill-at", str(kill_at)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == (-9 if kill_at is not None else 0), proc.stderr[-3000:]
    return proc


def out_bytes(work: Path) -> dict[str, bytes]:
    tensors = safetensors.torch.load_file(str(work / "out.safetensors"))
    assert any(k.startswith("opt.") for k in tensors) and any(k.startswith("net.") for k in tensors)
    return {k: v.numpy().tobytes() + str(v.dtype).encode() for k, v in tensors.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, dict[str, bytes]] = {}

    def get(kind: str) -> dict[str, bytes]:
        if kind not in cache:
            work = tmp_path_factory.mktemp(f"ref-{kind}")
            job(work, kind)
            cache[kind] = out_bytes(work)
        return cache[kind]

    return get


def _killed_mid_epoch(work: Path, kind: str) -> list | None:
    job(work, kind, kill_at=10)
    with CheckpointManager(str(work / "root"), read_only=True) as mgr:
        assert [c.step for c in mgr.list() if c.valid] == [4, 8]
        tree = mgr.load(step=8)["lightning"]
    progress = tree["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert tree["epoch"] == 1 and progress["current"]["processed"] == 2 and not progress["is_last_batch"]
    return tree["loops"]["fit_loop"]["state_dict"].get("combined_loader")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["ckptsdk-0-workers", "ckptsdk-2-workers"])
def test_lightning_killed_mid_epoch_with_ckptsdk_loader_resumes_bit_exact(tmp_path, reference, kind):
    loaders = _killed_mid_epoch(tmp_path, kind)
    # The position Lightning saved is that of the batches trained on (its prefetch not counted).
    assert [(s["epoch"], s["batch_idx"]) for s in loaders] == [(1, 2)]
    resumed = job(tmp_path, kind)
    assert "Restored all states" in resumed.stderr + resumed.stdout
    assert NOT_EXACT not in resumed.stderr
    assert out_bytes(tmp_path) == reference(kind)
    # The audit compared the steps both attempts ran (9 and 10: after the save at 8, before the kill).
    with CheckpointManager(str(tmp_path / "root"), read_only=True) as mgr:
        report = mgr.audit()
    assert report.verdict == "bit-exact" and report.overlap_steps == 2, report


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lightning_killed_mid_epoch_with_a_plain_loader_is_said_not_exact(tmp_path, reference):
    assert not _killed_mid_epoch(tmp_path, "torch")  # a torch DataLoader: no position saved
    resumed = job(tmp_path, "torch")
    assert (
        NOT_EXACT in resumed.stderr and "2 batch(es) of epoch 1 done), but the train loader saved no" in resumed.stderr
    )
    assert out_bytes(tmp_path) != reference("torch")  # the warning is not a false alarm
    with CheckpointManager(str(tmp_path / "root"), read_only=True) as mgr:
        report = mgr.audit()
    assert report.verdict.startswith("DIVERGED at step 9"), report  # and the audit says so too


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lightning_killed_mid_epoch_with_a_stateful_dataloader_is_said_not_exact(tmp_path, reference):
    # Exact in a TrainState (test_loader_resume.py); under Lightning the plugin never sees the loader.
    assert _killed_mid_epoch(tmp_path, "stateful")  # torchdata's position is saved by Lightning
    resumed = job(tmp_path, "stateful")
    assert NOT_EXACT in resumed.stderr and "with a torchdata StatefulDataLoader" in resumed.stderr
    assert out_bytes(tmp_path) != reference("stateful")
