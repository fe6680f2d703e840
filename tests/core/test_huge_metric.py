"""A metric no float can hold (issue 47, item 9): ``save()`` refuses it with a clear error, and a
root that already holds one (an older ckptsdk wrote it; here written by hand) still rotates, lists
and collects: the int is ranked exactly, never through ``float()``'s OverflowError.
"""

from __future__ import annotations

import json

import pytest
import torch

from ckptsdk import CheckpointManager, TrainState, cli
from ckptsdk.checkpoint import retention
from ckptsdk.errors import ConfigError
from ckptsdk.format.document import seal
from ckptsdk.format.layout import MANIFEST

HUGE = 10**400


def test_save_refuses_a_metric_beyond_a_float(tmp_path):
    root = tmp_path / "run"
    with CheckpointManager(str(root), keep_last=2) as mgr:
        with pytest.raises(ConfigError, match=r"metrics\['acc'\] is an int of 401 digits"):
            mgr.save({"w": torch.ones(1)}, step=1, metrics={"acc": HUGE})
        mgr.save({"w": torch.ones(1)}, step=2, metrics={"acc": 10**300})  # a float holds it: fine
    assert not list(root.glob("step-0000000001*"))


def _plant(root, step: int, value: int) -> None:
    """Rewrite one committed manifest's metric by hand, sealed as a writer would seal it."""
    (manifest,) = root.glob(f"step-{step:010d}*/{MANIFEST}")
    doc = json.loads(manifest.read_bytes())
    doc["metrics"]["acc"] = value
    manifest.write_bytes(seal(doc))


def test_a_root_holding_one_rotates_lists_and_collects(tmp_path, capsys):
    root = tmp_path / "run"
    rules = dict(keep_last=1, keep=[retention.keep_best("acc", 1)])
    state = TrainState(model=torch.nn.Linear(1, 1))
    with CheckpointManager(str(root), **rules) as mgr:
        for step in (1, 2):
            mgr.save(state, step=step, metrics={"acc": 0.5})
    _plant(root, 1, HUGE)
    with CheckpointManager(str(root), **rules) as mgr:
        assert mgr.restore(state).step == 2
        for step in (3, 4, 5):  # every save rotates, ranking the planted metric
            mgr.save(state, step=step, metrics={"acc": 0.7})
        assert mgr.best("acc").step == 1  # "max" for acc: the huge int is best, exactly
    kept = sorted(int(p.name[5:15]) for p in root.glob("step-*"))
    assert kept == [1, 5]

    assert cli.main(["ls", str(root)]) == 0
    assert "best acc #1" in capsys.readouterr().out
    assert cli.main(["ls", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {r["step"] for r in doc["checkpoints"]} == {1, 5}
    assert cli.main(["gc", str(root), "--keep-last", "1", "--keep-best", "1", "--metric", "acc"]) == 0
    assert cli.main(["gc", str(root), "--keep-last", "1", "--keep-best", "1", "--metric", "acc", "--mode", "min"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert sorted(int(p.name[5:15]) for p in root.glob("step-*")) == [5]  # by min, 0.7 is best and newest
