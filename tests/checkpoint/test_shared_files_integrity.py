"""A checkpoint's shared files are checked wherever its own files are, and a lost one never poisons later saves.

Issue 47, items 1 and 7: a shared file deleted or truncated under a live writer made every later
save commit a manifest naming it (nothing saved after the loss restored); ``ls``/``list()``/
``latest()``/``best()`` called a checkpoint whose shared file was gone "sizes ok"; a shared entry
naming an unknown digest algorithm made ``restore()`` raise ``ConfigError`` and ``verify --all``
exit 2, and an orphan whose own entry named one did too.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState, open_backend
from ckptsdk.cli import main
from ckptsdk.format.document import seal

BASE = 1024  # a 1024x1024 float32 weight: 4 MiB, shared (above SHARE_MIN_BYTES)


def _job(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, TrainState]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(BASE, BASE), torch.nn.Linear(BASE, 4))
    for p in model[0].parameters():
        p.requires_grad_(False)  # the frozen base: shared from the first save on
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    return model, opt, TrainState(model=model, optimizer=opt)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(2, BASE)).sum().backward()
    opt.step()
    opt.zero_grad()


def _manifest_path(root: Path, step: int) -> Path:
    return next(root.glob(f"step-{step:010d}.*/manifest.json"))


def _manifest(root: Path, step: int) -> dict:
    return json.loads(_manifest_path(root, step).read_text())


def _lose(path: Path, how: str) -> None:
    if how == "deleted":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:-100])  # truncated: its size is wrong


def _writer(root: Path) -> CheckpointManager:
    return CheckpointManager(
        str(root), keep_last=5, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    )


@pytest.mark.parametrize("how", ["deleted", "truncated"])
@pytest.mark.parametrize("blocking", [True, False])
def test_a_shared_file_lost_under_a_live_writer_is_written_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str, blocking: bool
) -> None:
    root = tmp_path / "r"
    model, opt, state = _job()
    with _writer(root) as mgr:
        assert mgr.restore(state) is None
        _step(model, opt)
        mgr.save(state, step=1, blocking=blocking)
        mgr.wait()
        (lost_name,) = [f["name"] for f in _manifest(root, 1)["shared"]]
        _lose(root / lost_name, how)  # a hand-made cleanup, a sync tool: the base stays unchanged
        with caplog.at_level(logging.WARNING, logger="ckptsdk.checkpoint.writing"):
            for step in (2, 3):
                _step(model, opt)
                mgr.save(state, step=step, blocking=blocking)
            mgr.wait()
        live = {k: v.clone() for k, v in model.state_dict().items()}
    # No commit after the loss names the lost file; each names files that are there, whole. (A
    # non-blocking save of step 2 may be replaced by step 3's while it waits: never committed.)
    later = [json.loads(p.read_text()) for p in root.glob("step-*/manifest.json") if "0000000001." not in str(p)]
    assert 3 in {m["step"] for m in later}
    for manifest in later:
        for entry in manifest["shared"]:
            assert entry["name"] != lost_name
            assert (root / entry["name"]).stat().st_size == entry["size"]
    assert lost_name in caplog.text and ("is missing" if how == "deleted" else "bytes, not") in caplog.text
    assert "writes its 1 tensor(s) again" in caplog.text
    # ... and the newest restores, bit-exactly.
    model2, _opt2, state2 = _job(seed=7)
    with CheckpointManager(str(root), read_only=True) as reader:
        point = reader.restore(state2)
    assert point is not None and point.step == 3
    for k, v in model2.state_dict().items():
        assert torch.equal(v, live[k]), k


@pytest.mark.parametrize("how", ["deleted", "truncated"])
def test_a_checkpoint_whose_shared_file_is_lost_is_torn_in_every_listing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    root = tmp_path / "r"
    model, opt, state = _job()
    with _writer(root) as mgr:
        for step in (1, 2):
            _step(model, opt)
            mgr.save(state, step=step, metrics={"loss": 1.0 / step})
    (name,) = {f["name"] for step in (1, 2) for f in _manifest(root, step)["shared"]}
    _lose(root / name, how)
    with CheckpointManager(str(root), read_only=True) as reader:
        rows = reader.list()
        assert [r.valid for r in rows] == [False, False]
        assert all(r.reason and r.reason.startswith("torn: shared file") and name in r.reason for r in rows)
        assert reader.latest() is None
        assert reader.best("loss") is None
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "sizes ok" not in out and "torn: shared file" in out
    assert main(["verify", str(root), "--all"]) == 1


def _reseal(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_bytes(seal(doc))  # a manifest a (newer) writer could have written: its checksum holds


def test_a_shared_entry_with_an_unknown_digest_algorithm_falls_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "r"
    model, opt, state = _job()
    with _writer(root) as mgr:
        for step in (1, 2):
            _step(model, opt)
            mgr.save(state, step=step)

    def unknown(doc: dict) -> None:
        doc["shared"][0]["algorithm"] = "blake9"

    _reseal(_manifest_path(root, 2), unknown)
    with CheckpointManager(str(root), read_only=True) as reader:
        assert [r.valid for r in reader.list()] == [True, False]
        assert "unknown digest algorithm 'blake9'" in (reader.list()[1].reason or "")
        assert reader.latest() is not None and reader.latest().step == 1  # type: ignore[union-attr]
        point = reader.restore(_job(seed=3)[2])  # falls back (it raised ConfigError)
    assert point is not None and point.step == 1
    assert main(["verify", str(root), "--all"]) == 1  # corrupt, not a usage error (2)
    assert "blake9" in capsys.readouterr().out


def test_an_orphan_with_an_unknown_digest_algorithm_is_corrupt_not_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "r"
    state = TrainState(model=torch.nn.Linear(4, 3))
    with CheckpointManager(
        str(root), keep_last=10, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        for step in (10, 20):
            mgr.save(state, step=step)
    b = open_backend(str(root))
    zombie = b.read("step-0000000020.e1/tensors.safetensors"), json.loads(b.read("step-0000000020.e1/manifest.json"))
    with CheckpointManager(
        str(root),
        keep_last=10,
        lease_options=LeaseOptions(ttl=30, force=True),
        save_options=SaveOptions(on_signal=False),
    ) as taker:
        assert taker.restore(state) is not None  # takes over from step 20
        taker.save(state, step=30)
    # The first writer never saw the takeover: its late commit of step 40 is an orphan, and its
    # own entry names an algorithm this ckptsdk does not know.
    doc = {**zombie[1], "step": 40}
    doc["files"][0]["algorithm"] = "blake9"
    b.write("step-0000000040.e1/tensors.safetensors", zombie[0])
    b.write("step-0000000040.e1/manifest.json", seal(doc))
    with CheckpointManager(str(root), read_only=True) as reader:
        assert [c.orphan for c in reader.list() if c.key == "step-0000000040.e1"] == [True]
    assert main(["verify", str(root), "--all"]) == 1
    out = capsys.readouterr().out
    assert "step-0000000040.e1" in out and "blake9" in out
