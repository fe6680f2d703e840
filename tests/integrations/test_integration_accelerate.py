"""``AcceleratorCheckpoints(keep=[...])``: keep rules for an Accelerate job, recorded in the root.

In one process on the CPU: the best checkpoint by a metric survives ``keep_last=1``, the manifest
records the rules, and a bare ``ckptsdk gc`` decides as the writer did. (The kill-and-resume
runs of Accelerate jobs are in test_integration_hf.py.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptsdk import CheckpointManager, cli
from ckptsdk.checkpoint import retention

accelerate = pytest.importorskip("accelerate")


@pytest.fixture
def acc() -> Any:
    yield accelerate.Accelerator(cpu=True)
    # Accelerate's state is a process-wide singleton: leave none for the next test (the Trainer's).
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.timeout(120)
def test_keep_rules_pass_through_and_are_recorded(tmp_path: Path, capsys: Any, acc: Any) -> None:
    from ckptsdk.integrations.accelerate import AcceleratorCheckpoints

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    url = str(tmp_path / "root")
    losses = {1: 0.5, 2: 0.1, 3: 0.4, 4: 0.9}
    rules = [retention.keep_best("val_loss", 1)]
    with AcceleratorCheckpoints(acc, url, keep_last=1, keep=rules, lease_ttl=30) as ckpt:
        for step, loss in losses.items():
            ckpt.save(step, metrics={"val_loss": loss})
        assert ckpt.manager.kept() == {2: ("best val_loss #1",), 4: ("latest", "newest")}
    listed = [c for c in CheckpointManager(url, read_only=True).list() if c.valid]
    assert [c.step for c in listed] == [2, 4]  # keep_last=1 alone would keep 4 only
    manifest = json.loads((tmp_path / "root" / listed[-1].key / "manifest.json").read_text())
    assert {"rule": "keep_best", "metric": "val_loss", "k": 1, "mode": "min"} in manifest["keep"]
    assert cli.main(["gc", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["deleted"] == [] and doc["rules_from"] == "writer"
    assert CheckpointManager(url, read_only=True).best("val_loss").step == 2  # type: ignore[union-attr]
