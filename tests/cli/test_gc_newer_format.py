"""What a reader cannot read because a newer ckptsdk wrote it is never garbage, and never skipped.

Issue 47, items 2 and 3: ``ckptsdk gc`` deleted checkpoints of a newer major manifest format
("bad manifest ... upgrade ckptsdk to read it", then ``deleted 2 item(s)``) with a shared file
only they used; and a reader that could not read the newest checkpoint skipped it "as damaged"
and restored an older one. A mixed-version pair of Colab runtimes is ordinary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState
from ckptsdk.cli import main
from ckptsdk.errors import ManifestError, NewerFormatError
from ckptsdk.format.document import seal

BASE = 1024  # 4 MiB: a shared tensor


def _job(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, TrainState]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(BASE, BASE), torch.nn.Linear(BASE, 4))
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    return model, opt, TrainState(model=model, optimizer=opt)


def _as_newer(path: Path) -> None:
    """Make a manifest one a newer ckptsdk wrote (a newer major format; its checksum holds)."""
    doc = json.loads(path.read_text())
    doc["format"] = "ckptsdk.checkpoint/9.0"
    path.write_bytes(seal({k: v for k, v in doc.items() if k != "checksum"}))


def _root(tmp_path: Path) -> Path:
    """Steps 1, 2 refer to the base's first shared file; the base changes at step 3 (written
    whole), and step 4 refers to a second shared file only it uses (3 and 4 are then made a newer
    ckptsdk's)."""
    root = tmp_path / "r"
    model, opt, state = _job()
    with CheckpointManager(
        str(root), keep_last=10, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        for step in (1, 2, 3, 4):
            if step == 3:
                with torch.no_grad():
                    model[0].weight.add_(1.0)  # the "frozen" base changes: a new shared file
            mgr.save(state, step=step)
    return root


def _shared_of(root: Path, *steps: int) -> set[str]:
    """The shared files the manifests of ``steps`` refer to."""
    manifests = [next(root.glob(f"step-{s:010d}.*/manifest.json")) for s in steps]
    return {f["name"] for m in manifests for f in json.loads(m.read_text()).get("shared", [])}


def _newer_steps(root: Path) -> set[str]:
    """Steps 3 and 4 made a newer ckptsdk's; their folders."""
    newer = {p.parent.name for p in root.glob("step-000000000[34].*/manifest.json")}
    for f in newer:
        _as_newer(root / f / "manifest.json")
    return newer


def test_gc_leaves_a_newer_ckptsdks_checkpoints_and_their_shared_files_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _root(tmp_path)
    theirs, ours = _shared_of(root, 3, 4), _shared_of(root, 1, 2)
    assert theirs and ours and not theirs & ours
    newer = _newer_steps(root)
    assert main(["gc", str(root), "--grace", "0", "--keep-last", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert not [k for k in doc["deleted"] if k.split("/")[0] in newer or k in theirs], doc["deleted"]
    assert set(doc["spared"]) == newer and "newer ckptsdk" in err
    for f in newer:
        assert (root / f / "manifest.json").exists() and (root / f / "tensors.safetensors").exists()
    for name in theirs:
        assert (root / name).exists(), f"gc deleted {name}, which a newer ckptsdk's checkpoint uses"
    # What this reader can judge it still judges: keep-last 1 of the readable steps lets step 1 go.
    assert any(k.startswith("step-0000000001.") for k in doc["deleted"])


def test_a_plain_gc_says_what_it_leaves_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _root(tmp_path)
    newer = _newer_steps(root)
    assert main(["gc", str(root), "--grace", "0"]) == 0
    out, err = capsys.readouterr()
    assert "deleted" not in out or not any(f in out for f in newer)
    assert "written by a newer ckptsdk" in err and all(f in err for f in newer)
    assert all((root / f / "manifest.json").exists() for f in newer)


def test_restore_refuses_to_fall_back_past_a_newer_ckptsdks_checkpoint(tmp_path: Path) -> None:
    root = _root(tmp_path)
    newer = _newer_steps(root)
    with CheckpointManager(str(root), read_only=True) as reader:
        with pytest.raises(NewerFormatError, match="upgrade ckptsdk") as info:
            reader.restore(_job(seed=1)[2])
        assert isinstance(info.value, ManifestError) and info.value.step == 4 and info.value.key in newer
        with pytest.raises(NewerFormatError):
            reader.load()
        rows = reader.list()
    assert [r.step for r in rows if not r.valid] == [3, 4]
    assert all(r.reason and "written by a newer ckptsdk" in r.reason for r in rows if not r.valid)
    # A writer too: it must not train on from step 2 while the run is at step 4.
    with CheckpointManager(
        str(root), lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as writer:
        with pytest.raises(NewerFormatError):
            writer.restore(_job(seed=1)[2])


def test_rotation_keeps_the_shared_files_a_newer_ckptsdks_checkpoint_may_use(tmp_path: Path) -> None:
    root = _root(tmp_path)
    theirs = _shared_of(root, 3, 4)
    _newer_steps(root)
    # An older writer that saves without restoring (a fresh state, keep_last=1): its rotation
    # and tidying (a listing of shared/) must leave the newer checkpoints' files alone.
    _model, _opt, state = _job(seed=2)
    with CheckpointManager(
        str(root), keep_last=1, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as writer:
        for step in (10, 11, 12):
            writer.save(state, step=step)
    for name in theirs:
        assert (root / name).exists(), f"rotation deleted {name}, which a newer ckptsdk's checkpoint uses"
    assert len(list(root.glob("step-0000000003.*/manifest.json"))) == 1
