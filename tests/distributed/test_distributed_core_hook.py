"""The core manager's ``extra_files`` hook (what ckptsdk.distributed commits its rank files with).

Files other processes wrote into a save's folder are listed in the manifest: a missing or
corrupt one makes the checkpoint torn for listing, verify and restore, and a takeover's anchor
copies them into its own folder.
"""

from __future__ import annotations

import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions
from ckptsdk.errors import CorruptCheckpointError
from ckptsdk.format.digest import DEFAULT as DIGEST_ALGORITHM
from ckptsdk.format.files.tensorfile import write_tensorfile
from ckptsdk.format.layout import checkpoint_dir
from ckptsdk.format.manifest import FileEntry
from ckptsdk.manager import Simulation


def _save_with_extra(mgr: CheckpointManager, step: int) -> str:
    assert mgr.lease is not None
    folder = checkpoint_dir(step, mgr.lease.epoch)
    size, digest = write_tensorfile(
        mgr.backend, f"{folder}/rank-00001.safetensors", {"w": torch.full((4,), float(step))}
    )
    info = mgr.save(
        {"step": step},
        step=step,
        extra_files=[FileEntry(name="rank-00001.safetensors", size=size, digest=digest, algorithm=DIGEST_ALGORITHM)],
    )
    assert info.key == folder
    return folder


def test_extra_files_are_checked_like_the_tensor_file(tmp_path: pytest.TempPathFactory) -> None:
    url = str(tmp_path / "root")
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5)) as mgr:
        _save_with_extra(mgr, 1)
        second = _save_with_extra(mgr, 2)
        data = bytearray(mgr.backend.read(f"{second}/rank-00001.safetensors"))
        data[-1] ^= 1
        mgr.backend.write(f"{second}/rank-00001.safetensors", bytes(data))  # same size, other bytes
        with pytest.raises(CorruptCheckpointError):
            mgr.verify(2)
        mgr.backend.delete(f"{second}/rank-00001.safetensors")
        assert mgr.latest().step == 1  # type: ignore[union-attr]
        assert "torn: rank-00001.safetensors is missing" in next(c.reason for c in mgr.list() if c.step == 2)


def test_a_takeover_anchor_copies_the_extra_files(tmp_path: pytest.TempPathFactory) -> None:
    url = str(tmp_path / "root")
    dead = CheckpointManager(url, lease_options=LeaseOptions(ttl=5), _simulation=Simulation(heartbeat=False))
    first = _save_with_extra(dead, 3)
    dead._shutdown._closed = (
        True  # dies without releasing its lease: the next writer anchors (a clean close needs no anchor)
    )
    with CheckpointManager(url, lease_options=LeaseOptions(ttl=5, force=True)) as mgr:
        assert mgr.restore(type("S", (), {"load_state_dict": lambda self, tree: None})()).step == 3  # type: ignore[union-attr]
        anchored = mgr.latest()
        assert anchored is not None and anchored.key != first and anchored.key.startswith("step-0000000003.e2")
        assert [f.name for f in anchored.manifest.files] == ["tensors.safetensors", "rank-00001.safetensors"]  # type: ignore[union-attr]
        mgr.verify(key=anchored.key)  # the copy is there, with the recorded digest
