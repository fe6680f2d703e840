"""Drive's ring with a kept-best among rotated checkpoints: recycle and the trash ledger stay right.

On Drive rotation runs one save late and, in ``recycle`` mode, the oldest rotated-out checkpoint
gives its tensor file to the next save. A best checkpoint that the rules keep must never be the
one recycled, and the trash ledger must count only what really went to the trash (manifests).
"""

from __future__ import annotations

import torch

from ckptsdk import CheckpointManager, LeaseOptions, Retention, TrainState
from ckptsdk.backends import open_backend
from ckptsdk.checkpoint import retention
from ckptsdk.checkpoint.pruning.usage import usage

LOSSES = {1: 0.9, 2: 0.1, 3: 0.5, 4: 0.6, 5: 0.7, 6: 0.8}


def test_recycle_skips_the_best_and_the_ledger_counts_manifests_only(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path / "drive"))
    (tmp_path / "drive").mkdir()
    model = torch.nn.Linear(8, 8)
    state = TrainState(model=model)
    weights = {}
    rules = [retention.keep_best("val_loss", 1)]
    with CheckpointManager(
        "drive://run",
        retention=Retention(keep_last=1, keep=rules, mode="recycle"),
        lease_options=LeaseOptions(ttl=5, settle=0),
    ) as mgr:
        for step, loss in LOSSES.items():
            with torch.no_grad():
                model.weight.fill_(step)
            weights[step] = model.weight.detach().clone()
            mgr.save(state, step=step, metrics={"val_loss": loss})
        # One save late: the rules judge all but the newest; 2 is best, 5 latest, 6 newest.
        assert [c.step for c in mgr.list()] == [2, 5, 6]
        assert mgr.kept() == {2: ("best val_loss #1",), 5: ("latest",), 6: ("newest",)}
        tensors = mgr.list()[-1].manifest.files[0].size  # type: ignore[union-attr]
        rotation = mgr._rotation
        # 1, 3 and 4 were rotated out, each giving its file to a later save (3, 5, 6): only their
        # manifests went to the trash; 2, kept as best among them, was never recycled.
        assert (rotation.trashed_bytes, rotation.trashed_files, rotation.recycled_bytes) == (0, 3, 3 * tensors)
    u = usage(open_backend("drive://run"))
    assert (u.trash_bytes, u.trash_files) == (0, 3)  # the ledger `ckptsdk du` reads agrees
    reader = CheckpointManager("drive://run", read_only=True)
    for step in (2, 5, 6):  # digests hold: no kept file was rewritten under another step
        assert torch.equal(reader.load(step=step)["objects"]["model"]["weight"], weights[step])
    assert reader.best("val_loss").step == 2  # type: ignore[union-attr]
