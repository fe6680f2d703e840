"""``ckptsdk ls`` says why each checkpoint is kept; ``gc --keep-best``; ``export URL@best:METRIC``.

A local root written by a real writer with best-k on (val_loss: 0.9, 0.2, nan, 0.5, 0.7, 0.8 at
steps 10..60, no metric at 70): the command line given the writer's rules reaches the writer's
decision, and nothing it deletes is a checkpoint those rules keep.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from ckptsdk import LeaseOptions, SaveOptions, cli
from ckptsdk.checkpoint import retention
from ckptsdk.manager import CheckpointManager, Simulation
from ckptsdk.state import TrainState

LOSSES = {10: 0.9, 20: 0.2, 30: math.nan, 40: 0.5, 50: 0.7, 60: 0.8, 70: None}
WRITER_RULES = ["--keep-last", "1", "--keep-best", "2", "--metric", "val_loss"]


@pytest.fixture
def root(tmp_path) -> tuple[str, dict[int, torch.Tensor]]:
    """The root, and the model's weight at each step (to check what export wrote)."""
    url = str(tmp_path / "run")
    model = torch.nn.Linear(2, 2)
    weights = {}
    with CheckpointManager(
        url,
        keep_last=3,  # the writer keeps more than the rules below: gc then has work
        lease_options=LeaseOptions(ttl=30),
        save_options=SaveOptions(on_signal=False),
        _simulation=Simulation(heartbeat=False),
    ) as mgr:
        for step, loss in LOSSES.items():
            with torch.no_grad():
                model.weight.fill_(step)
            weights[step] = model.weight.detach().clone()
            mgr.save(TrainState(model=model), step=step, metrics={} if loss is None else {"val_loss": loss})
    return url, weights


def _json(capsys, argv: list[str]) -> dict:
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_ls_says_why_each_checkpoint_is_kept(root, capsys):
    url, _ = root
    flags = ["--keep-last", "1", "--keep-best", "1", "--metric", "val_loss", "--keep-every", "30"]
    doc = _json(capsys, ["ls", url, "--json", *flags])
    assert doc["rules"] == "keep_last=1, keep_every=30, keep_best=1 by val_loss (min)"
    # The writer (keep_last=3) had deleted 10..40 already; of what is left 50 is best, 60 nothing.
    assert {r["step"]: r["kept_by"] for r in doc["checkpoints"]} == {
        50: ["best val_loss #1"],
        60: ["every 30"],
        70: ["latest", "newest"],
    }
    assert cli.main(["ls", url, "--keep-last", "1", "--keep-best", "1", "--metric", "val_loss"]) == 0
    out = capsys.readouterr().out
    assert "KEPT BY" in out.splitlines()[0] and "latest, newest" in out and "best val_loss #1" in out
    assert "no rule: gc deletes it" in out and "keep_last=1, keep_best=1 by val_loss (min)" in out


def test_gc_with_the_writers_rules_keeps_the_best(tmp_path, capsys):
    url = str(tmp_path / "run")
    rules = [retention.keep_best("val_loss", 2)]
    state = TrainState(model=torch.nn.Linear(2, 2))
    with CheckpointManager(
        url, keep_last=1, keep=rules, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        for step, loss in LOSSES.items():
            mgr.save(state, step=step, metrics={} if loss is None else {"val_loss": loss})
        writer_kept = mgr.kept()
    assert writer_kept == {20: ("best val_loss #1",), 40: ("best val_loss #2",), 70: ("latest", "newest")}
    ls = _json(capsys, ["ls", url, "--json", *WRITER_RULES])
    assert {r["step"]: tuple(r["kept_by"]) for r in ls["checkpoints"]} == writer_kept
    dry = _json(capsys, ["gc", url, "--dry-run", "--json", *WRITER_RULES])
    assert dry["deleted"] == []  # gc with the writer's rules decides as the writer did
    # Without the best rule, keep_last=1 lets the best go: gc says which and why, and does it.
    dry = _json(capsys, ["gc", url, "--dry-run", "--json", "--keep-last", "1"])
    assert sorted(dry["deleted"]) == ["step-0000000020.e1", "step-0000000040.e1"]
    assert all(why == "beyond keep_last=1" for why in dry["reasons"].values())
    # For real, with the writer's rules: nothing goes, and the best two still read back.
    assert _json(capsys, ["gc", url, "--json", *WRITER_RULES])["deleted"] == []
    assert CheckpointManager(url, read_only=True).best("val_loss").step == 20  # type: ignore[union-attr]


def test_export_best_selector_resolves_to_the_best_step(root, capsys, tmp_path):
    url, weights = root
    out = tmp_path / "best.safetensors"
    doc = _json(capsys, ["export", f"{url}@best:val_loss", str(out), "--json"])
    # 10..40 were rotated out by the writer: of 50, 60 (and 70 without the metric) 50 is best.
    assert doc["step"] == 50
    tensors = load_file(str(out))
    assert torch.equal(next(t for k, t in tensors.items() if k.endswith("weight")), weights[50])
    doc = _json(capsys, ["export", f"{url}@best:val_loss:max", str(tmp_path / "worst.safetensors"), "--json"])
    assert doc["step"] == 60


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["gc", "{url}", "--keep-best", "2"], cli.EXIT_USAGE, "--keep-best K and --metric NAME go together"),
        (["gc", "{url}", "--metric", "val_loss"], cli.EXIT_USAGE, "--keep-best K and --metric NAME go together"),
        (["ls", "{url}", "--keep-best", "0", "--metric", "m"], cli.EXIT_USAGE, "--keep-best must be >= 1"),
        (["gc", "{url}", "--keep-every-seconds", "0"], cli.EXIT_USAGE, "--keep-every-seconds must be > 0"),
        (["export", "{url}@best:", "x.safetensors"], cli.EXIT_USAGE, "URL@best:METRIC"),
        (["export", "{url}@best:val_loss:up", "x.safetensors"], cli.EXIT_USAGE, "URL@best:METRIC"),
        (["export", "{url}@best:accuracy", "x.safetensors"], cli.EXIT_CHECKPOINT, "holds a finite 'accuracy'"),
    ],
)
def test_bad_rule_flags_and_selectors(root, capsys, tmp_path, monkeypatch, argv, code, message):
    url, _ = root
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert cli.main([a.format(url=url) for a in argv]) == code
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before  # nothing deleted
