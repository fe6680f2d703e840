"""A fine-tune whose base is recorded by reference, SIGKILLed mid-run and resumed bit-exact.

The child trains a small head on a frozen 4 MiB base built from its "source" (a seed, as a
download would be), saving every 2 steps in the background with ``frozen="reference"``, and
SIGKILLs itself right after a ``save()`` returned (its write, hash and commit still in flight) or
while the worker hashes the base. The parent builds the base again from its source, restores,
trains on to the end, and compares every tensor with an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptsdk import CheckpointManager, TrainState
from ckptsdk.checkpoint.writing import sharing
from ckptsdk.format.files import reference
from ckptsdk.options import LeaseOptions, SaveOptions

REPO = Path(__file__).resolve().parents[2]
SOURCE = "hf:story-base@r1"
OPTIONS = SaveOptions(frozen="reference", frozen_source=SOURCE, on_signal=False, asynchronous=True, every=2)
END = 12


def _job() -> tuple[torch.nn.Module, torch.optim.Optimizer, TrainState]:
    torch.manual_seed(0)  # the base's "source": the same bytes on every runtime
    base = torch.nn.Linear(1024, 1024)
    for p in base.parameters():
        p.requires_grad_(False)
    torch.manual_seed(1)
    model = torch.nn.Sequential(base, torch.nn.Linear(1024, 8))
    opt = torch.optim.AdamW(model[1].parameters(), lr=0.01)
    return model, opt, TrainState(model=model, optimizer=opt)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    model(torch.randn(8, 1024, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _kill_while_hashing(t: torch.Tensor, **_kw: object) -> str:
    """The save worker's hash of the base, then a SIGKILL before the commit."""
    reference.hash_tensor(t)
    os.kill(os.getpid(), signal.SIGKILL)
    return ""


def _run(root: str, *, kill_at: int | None = None, hashing: bool = False) -> torch.nn.Module:
    model, opt, state = _job()
    with CheckpointManager(root, save_options=OPTIONS, lease_options=LeaseOptions(ttl=30)) as mgr:
        point = mgr.restore(state)
        start = 1 if point is None else point.step + 1
        for step in range(start, END + 1):
            _train(model, opt, step)
            if mgr.should_save(step):
                if step == kill_at and hashing:
                    sharing.hash_tensor = _kill_while_hashing  # type: ignore[assignment]
                mgr.save(state, step=step)
                if step == kill_at and not hashing:
                    os.kill(os.getpid(), signal.SIGKILL)  # the save just handed to the worker
    return model


@pytest.mark.parametrize(
    ("kill_at", "hashing", "store"), [(2, True, "local"), (6, False, "local"), (8, False, "local"), (6, False, "drive")]
)
def test_sigkill_mid_run_then_resume_on_the_base_rebuilt_from_its_source(
    tmp_path, monkeypatch, kill_at, hashing, store
) -> None:
    # drive: the Colab mount's rules (DriveBackend on a folder); the same machine takes its dead
    # process's lease over at once there too, and the base is no more written than on a disk.
    folder = tmp_path / "drive" / "root" if store == "drive" else tmp_path / "root"
    root = "drive://root" if store == "drive" else str(folder)
    (tmp_path / "drive").mkdir()  # the mount
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path / "drive"))
    child = subprocess.run(
        [sys.executable, __file__, root, str(kill_at), "1" if hashing else "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    resumed = _run(root)
    whole = _run(str(tmp_path / "whole"))
    for k, v in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k
    with CheckpointManager(root, read_only=True) as mgr:
        manifest = mgr.load_manifest()
    assert manifest.referenced[0].source == SOURCE
    assert not list(folder.glob("shared/*"))  # the base was never written
    assert folder.is_dir()


if __name__ == "__main__":  # the child: ROOT KILL_AT HASHING
    _run(sys.argv[1], kill_at=int(sys.argv[2]), hashing=sys.argv[3] == "1")
    sys.exit(3)  # the kill did not come
