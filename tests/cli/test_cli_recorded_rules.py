"""A bare ``ckptsdk gc URL`` / ``ls URL`` judges by the keep rules the writer recorded in the root.

Each manifest records its writer's rules (format 1.2, ``keep``); the newest non-orphan one
governs. The hazard these tests close: before, a bare gc assumed ``keep_last=3`` and deleted
checkpoints the writer's ``keep_best`` kept. Each test asserts by content digests that nothing
the writer keeps was deleted, and that gc still did its other work (a crashed save's leftover).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptsdk import LeaseOptions, SaveOptions, cli
from ckptsdk.checkpoint import retention
from ckptsdk.checkpoint.pruning.rotation import kept
from ckptsdk.checkpoint.reading.catalog import scan
from ckptsdk.errors import LeaseLostError
from ckptsdk.format.document import seal
from ckptsdk.manager import CheckpointManager, Simulation
from ckptsdk.state import TrainState
from ckptsdk.testing.faulty import FaultyBackend

REPO = Path(__file__).resolve().parents[2]
# val_loss by step: the best ones are early, so keep_last alone would let them go.
LOSSES = {10: 0.9, 20: 0.2, 30: math.nan, 40: 0.3, 50: 0.25, 60: 0.7, 70: 0.8, 80: 0.85, 90: None}
LEFTOVER = "step-0000000095.e1"


def _writer(url: str, *, force: bool = False, **kw) -> CheckpointManager:
    return CheckpointManager(
        url,
        lease_options=LeaseOptions(ttl=30, force=force),
        save_options=SaveOptions(on_signal=False),
        _simulation=Simulation(heartbeat=False),
        **kw,
    )


def _save_all(mgr: CheckpointManager, losses: dict[int, float | None], state: TrainState) -> None:
    for step, loss in losses.items():
        with torch.no_grad():
            next(state.objects["model"].parameters()).fill_(step)  # each step's bytes differ
        mgr.save(state, step=step, metrics={} if loss is None else {"val_loss": loss}, blocking=True)


def _state() -> TrainState:
    return TrainState(model=torch.nn.Linear(2, 2))


def _digests(root: Path) -> dict[str, dict[str, str]]:
    """Every committed folder's files, by sha256 of their bytes."""
    return {
        d.name: {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}
        for d in sorted(root.glob("step-*"))
        if (d / "manifest.json").exists()
    }


def _leftover(root: Path) -> None:
    """A save killed before its commit: a folder with a tensor file and no manifest."""
    (root / LEFTOVER).mkdir()
    (root / LEFTOVER / "tensors.safetensors").write_bytes(b"\0" * 64)
    os.utime(root / LEFTOVER / "tensors.safetensors", (1e9, 1e9))


def _gc(*args: str) -> subprocess.CompletedProcess[str]:
    """``ckptsdk gc`` in its own process, as a user runs it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, "-m", "ckptsdk", "gc", *args], env=env, capture_output=True, text=True, timeout=120
    )


def _json(capsys, argv: list[str]) -> tuple[dict, str]:
    capsys.readouterr()
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err


def _kept_steps(root: Path) -> set[int]:
    return {c.step for c in CheckpointManager(str(root), read_only=True).list() if c.valid}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("best_k", "last_n", "expected"), [(2, 1, {20, 50, 90}), (3, 2, {20, 40, 50, 80, 90})])
def test_a_bare_gc_keeps_exactly_what_the_writer_keeps(tmp_path, capsys, best_k, last_n, expected):
    root = tmp_path / "run"
    with _writer(str(root), keep_last=last_n, keep=[retention.keep_best("val_loss", best_k)]) as mgr:
        _save_all(mgr, LOSSES, _state())
        writer_kept = mgr.kept()
    assert set(writer_kept) == expected  # best val_loss: 20 (0.2), 50 (0.25), 40 (0.3)
    manifest = json.loads((root / "step-0000000090.e1" / "manifest.json").read_text())
    assert manifest["format"] == "ckptsdk.checkpoint/1.2"  # no shared files: every 1.x reader reads it
    assert manifest["keep"] == [
        {"rule": "keep_last", "n": last_n},
        {"rule": "keep_best", "metric": "val_loss", "k": best_k, "mode": "min"},
    ]
    _leftover(root)
    before = _digests(root)

    proc = _gc(str(root), "--grace", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # the writer's rules, nothing to warn about
    assert f"{LEFTOVER}" in proc.stdout and "deleted 1 item(s)" in proc.stdout  # gc did its other work
    assert f"keep_last={last_n}, keep_best={best_k} by val_loss (min) (the writer's, recorded in " in proc.stdout
    assert _kept_steps(root) == set(writer_kept)
    assert _digests(root) == before  # every kept checkpoint, byte for byte
    assert not (root / LEFTOVER).exists()

    # ls without flags shows the writer's decision, reason by reason.
    doc, err = _json(capsys, ["ls", str(root), "--json"])
    assert err == "" and doc["rules_from"] == "writer"
    assert {r["step"]: tuple(r["kept_by"]) for r in doc["checkpoints"]} == writer_kept

    # The old default (keep_last=3) would have deleted a best one wherever the writer keeps more.
    old_default = set(kept(scan(CheckpointManager(str(root), read_only=True).backend), [retention.keep_last(3)]))
    assert (old_default != set(writer_kept)) == (best_k + last_n > 3)
    # Flags override the recorded rules: gc says they differ, and names what the writer keeps.
    proc = _gc(str(root), "--keep-last", "3", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    dry = json.loads(proc.stdout)
    lost = sorted(set(writer_kept) - old_default)
    assert sorted(int(k[5:15]) for k in dry["deleted"]) == lost and dry["rules_from"] == "flags"
    assert "differ from the writer's (keep_last=" in proc.stderr
    if lost:
        assert "the writer's rules keep: step-0000000020.e1" in proc.stderr
    assert _digests(root) == before  # a dry run


@pytest.mark.timeout(300)
def test_after_a_takeover_the_newest_writers_rules_govern_and_a_zombies_never_do(tmp_path, capsys, caplog):
    """Writer A (keep_last=1, best 2) is taken over by B (keep_last=4) just before A commits step
    60: A's step 60 is a zombie's orphan whose manifest records A's rules, moved to step 90 (the
    highest). B's rules govern: a bare gc removes the orphan and keeps B's four; A's rules would
    have deleted two of them."""
    root = tmp_path / "run"
    url = str(root)
    state = _state()
    a_rules = [retention.keep_best("val_loss", 2)]
    zombie = _writer(url, keep_last=1, keep=a_rules)
    newcomer: list[CheckpointManager] = []

    def take_over_before_the_commit(op: str, key: str, _n: int) -> BaseException | None:
        if op == "write" and key.startswith("step-0000000060.") and key.endswith("/manifest.json") and not newcomer:
            newcomer.append(_writer(url, keep_last=4, force=True))
            with caplog.at_level(logging.WARNING, logger="ckptsdk.checkpoint.retention"):
                newcomer[0].restore(_state())  # resumes from step 50: 60 is not committed yet
        return None

    try:
        _save_all(zombie, {10: 0.9, 20: 0.2, 30: 0.3, 40: 0.8, 50: 0.7}, state)
        assert set(zombie.kept()) == {20, 30, 50}
        zombie.backend = FaultyBackend(zombie.backend, fail_on=take_over_before_the_commit)
        with contextlib.suppress(LeaseLostError):  # it commits; its rotation then sees epoch 2
            _save_all(zombie, {60: 0.1}, state)
        b = newcomer[0]
        # The restart said that its rules differ from those it resumed from.
        assert "was kept by its previous writer's rules (keep_last=1, keep_best=2 by val_loss (min)" in caplog.text
        assert "this writer's are keep_last=4" in caplog.text
        _save_all(b, {70: 0.6, 80: 0.5}, state)
        b_kept = b.kept()
    finally:
        for m in (zombie, *newcomer):
            with contextlib.suppress(LeaseLostError):
                m.close()
    # Where a zombie can still commit late (Drive: no compare-and-swap), its newest orphan may
    # carry the highest step in the root: move A's orphan to step 90, beyond B's newest.
    doc = json.loads((root / "step-0000000060.e1" / "manifest.json").read_text())
    (root / "step-0000000060.e1").rename(root / "step-0000000090.e1")
    (root / "step-0000000090.e1" / "manifest.json").write_bytes(seal({**doc, "step": 90}))
    orphan = next(c for c in scan(CheckpointManager(url, read_only=True).backend).checkpoints if c.step == 90)
    assert orphan.orphan and orphan.manifest is not None and orphan.manifest.keep is not None
    assert set(b_kept) == {30, 50, 70, 80}
    cat = scan(CheckpointManager(url, read_only=True).backend)
    a_would_keep = set(kept(cat, [retention.keep_last(1), *a_rules]))
    assert a_would_keep != set(b_kept)  # the test has teeth: governed by A, gc would delete 50 and 70
    before = {k: v for k, v in _digests(root).items() if k != orphan.key}

    proc = _gc(url, "--grace", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "keep_last=4 (the writer's, recorded in step-0000000080.e2" in proc.stdout
    assert orphan.key in proc.stdout and "deleted 1 item(s)" in proc.stdout  # only the zombie's orphan
    assert _kept_steps(root) == set(b_kept)
    assert _digests(root) == before


def _unrecord(root: Path) -> None:
    """Make every manifest what ckptsdk 0.1.0 wrote: format 1.1, no ``keep``."""
    for path in root.glob("step-*/manifest.json"):
        doc = json.loads(path.read_text())
        del doc["keep"]
        path.write_bytes(seal({**doc, "format": "ckptsdk.checkpoint/1.1"}))


@pytest.mark.timeout(300)
def test_a_root_that_records_no_rules_loses_nothing_to_a_bare_gc(tmp_path, capsys):
    root = tmp_path / "run"
    with _writer(str(root), keep_last=5) as mgr:
        _save_all(mgr, {s: None for s in (10, 20, 30, 40, 50)}, _state())
    _unrecord(root)
    _leftover(root)
    before = _digests(root)

    proc = _gc(str(root), "--grace", "0")
    assert proc.returncode == 0, proc.stderr
    assert "the writer's keep rules are not recorded under" in proc.stderr and "--force" in proc.stderr
    assert "deleted 1 item(s)" in proc.stdout and LEFTOVER in proc.stdout  # only the leftover
    assert _kept_steps(root) == {10, 20, 30, 40, 50}  # keep_last=3 would have deleted 10 and 20
    assert _digests(root) == before

    doc, err = _json(capsys, ["ls", str(root), "--json"])
    assert "not recorded" in err and doc["rules_from"] == "unrecorded"
    assert cli.main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "the writer's rules, not recorded: not judged here" in out and "no rule: gc deletes it" not in out

    # --force applies the manager's default, and says so; explicit flags apply as given.
    proc = _gc(str(root), "--force", "--dry-run", "--json")
    assert json.loads(proc.stdout)["deleted"] == ["step-0000000010.e1", "step-0000000020.e1"]
    assert "--force: the writer's keep rules are not recorded" in proc.stderr
    proc = _gc(str(root), "--keep-last", "4", "--json")
    assert json.loads(proc.stdout)["deleted"] == ["step-0000000010.e1"] and proc.stderr == ""
    assert _kept_steps(root) == {20, 30, 40, 50}


@pytest.mark.timeout(300)
def test_a_custom_predicate_is_named_and_a_bare_gc_never_judges_it(tmp_path, capsys):
    root = tmp_path / "run"
    thirties = retention.keep_if(lambda c: c.step % 30 == 0, "thirties")
    with _writer(str(root), keep_last=1, keep=[thirties, retention.keep_best("val_loss", 1)]) as mgr:
        _save_all(mgr, LOSSES, _state())
        writer_kept = mgr.kept()
    assert set(writer_kept) == {20, 30, 60, 90}
    keep = json.loads((root / "step-0000000090.e1" / "manifest.json").read_text())["keep"]
    assert {"rule": "custom", "name": "thirties"} in keep
    before = _digests(root)

    proc = _gc(str(root))
    assert proc.returncode == 0, proc.stderr
    assert "include keep_if 'thirties', which only the writer can judge" in proc.stderr
    assert "nothing to delete" in proc.stdout
    assert _digests(root) == before

    doc, _ = _json(capsys, ["ls", str(root), "--json"])
    rows = {r["step"]: r["kept_by"] for r in doc["checkpoints"]}
    assert rows[30] == ["keep_if 'thirties': not judged here"] and "best val_loss #1" in rows[20]
    assert cli.main(["ls", str(root)]) == 0
    assert "keep_if 'thirties': not judged here" in capsys.readouterr().out

    # --force judges by the rules that can be judged here: the predicate's steps go, with a warning.
    proc = _gc(str(root), "--force", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["deleted"] == ["step-0000000030.e1", "step-0000000060.e1"]
    assert "--force: judging without the writer's keep_if 'thirties'" in proc.stderr
    assert _kept_steps(root) == {20, 90}


@pytest.mark.timeout(300)
def test_a_read_only_manager_given_no_rules_judges_by_the_recorded_ones(tmp_path, caplog):
    """The same hazard through the Python API: ``CheckpointManager(url, read_only=True).gc()``
    used to judge by its own default keep_last=3 and delete the writer's best checkpoints."""
    root = tmp_path / "run"
    with _writer(str(root), keep_last=1, keep=[retention.keep_best("val_loss", 2)]) as mgr:
        _save_all(mgr, LOSSES, _state())
        writer_kept = mgr.kept()
    assert set(writer_kept) == {20, 50, 90}
    _leftover(root)
    before = _digests(root)

    reader = CheckpointManager(str(root), read_only=True)
    assert reader.kept() == writer_kept
    assert reader.rules() == "keep_last=1, keep_best=2 by val_loss (min)"
    report = reader.gc(grace=0)
    assert list(report.deleted) == [LEFTOVER]  # its other work, and nothing the writer keeps
    assert _digests(root) == before and _kept_steps(root) == set(writer_kept)
    # Rules given to the call still replace them (the caller asked): keep_last=1 alone.
    assert set(reader.kept(keep_last=1)) == {90}
    # A reader given rules of its own judges by those, as before.
    assert set(CheckpointManager(str(root), read_only=True, keep_last=1).kept()) == {90}

    # A root that records no rules (ckptsdk 0.1.0's): nothing is let go, and a warning says so.
    _unrecord(root)
    before = _digests(root)
    with caplog.at_level(logging.WARNING, logger="ckptsdk.checkpoint.pruning.recorded"):
        report = CheckpointManager(str(root), read_only=True).gc(grace=0)
    assert list(report.deleted) == [] and _digests(root) == before
    assert "keep rules are not recorded under" in caplog.text and "no checkpoint is let go" in caplog.text
