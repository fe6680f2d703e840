"""``DistributedCheckpointManager(keep=[...])``: keep rules on rank 0's commits, recorded in the root.

A world of 1 on gloo: the best checkpoint by a metric survives ``keep_last=1``, the manifest
records the rules, and a bare ``ckptsdk gc`` decides as the writer did.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ckptsdk import CheckpointManager, LeaseOptions, cli
from ckptsdk.checkpoint import retention
from ckptsdk.distributed import DistributedCheckpointManager
from ckptsdk.manager import Simulation


@pytest.fixture
def world_of_one(tmp_path: Path) -> Any:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / uuid.uuid4().hex}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_keep_rules_pass_through_and_are_recorded(tmp_path: Path, world_of_one: Any, capsys: Any) -> None:
    url = str(tmp_path / "root")
    rules = [retention.keep_best("val_loss", 1)]
    losses = {1: 0.5, 2: 0.1, 3: 0.4, 4: 0.9}
    with DistributedCheckpointManager(
        url, keep_last=1, keep=rules, lease_options=LeaseOptions(ttl=5), _simulation=Simulation(heartbeat=False)
    ) as dm:
        for step, loss in losses.items():
            dm.save({"w": torch.full((3,), float(step))}, step=step, metrics={"val_loss": loss})
    listed = [c for c in CheckpointManager(url, read_only=True).list() if c.valid]
    assert [c.step for c in listed] == [2, 4]  # the best (0.1) and the newest; keep_last=1 alone keeps 4
    manifest = json.loads((tmp_path / "root" / listed[-1].key / "manifest.json").read_text())
    assert manifest["keep"] == [
        {"rule": "keep_last", "n": 1},
        {"rule": "keep_best", "metric": "val_loss", "k": 1, "mode": "min"},
    ]
    assert cli.main(["gc", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["deleted"] == [] and doc["rules_from"] == "writer"
    state = {"w": torch.zeros(3)}
    with DistributedCheckpointManager(
        url, lease_options=LeaseOptions(ttl=5), _simulation=Simulation(heartbeat=False)
    ) as dm:
        assert dm.restore(state).step == 4  # type: ignore[union-attr]
    assert torch.equal(state["w"], torch.full((3,), 4.0))
