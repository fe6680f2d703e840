"""``verify`` while a writer rotates: a checkpoint rotated away mid-verify is gone, not corrupt (issue 47, item 8).

Deletion removes the manifest first, then the data, so a checkpoint listed a moment ago can look
torn (its tensor file missing, its manifest unreadable, a shared file gone) while it is only
being rotated out. ``verify`` exits 1 only for damage.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState, open_backend
from ckptsdk.checkpoint.reading.reader import CheckpointReader
from ckptsdk.cli import main


def _saved(root: Path, steps: range) -> None:
    state = TrainState(model=torch.nn.Linear(4, 3))
    with CheckpointManager(
        str(root), keep_last=10, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        for step in steps:
            mgr.save(state, step=step)


def _rotate_out(root: Path, key: str) -> None:
    """What rotation does to one checkpoint: manifest first, then its files."""
    b = open_backend(str(root))
    b.delete(f"{key}/manifest.json")
    for obj in b.list(f"{key}/"):
        b.delete(obj.key)


@pytest.mark.parametrize("when", ["before the re-hash", "while listing"])
def test_a_checkpoint_rotated_away_during_verify_is_gone_not_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], when: str
) -> None:
    root = tmp_path / "r"
    _saved(root, range(1, 4))
    victim = next(root.glob("step-0000000001.*")).name
    if when == "before the re-hash":
        check = CheckpointReader.check

        def rotated_first(self: CheckpointReader, info):  # type: ignore[no-untyped-def]
            if info.key == victim:
                _rotate_out(root, victim)
            return check(self, info)

        monkeypatch.setattr(CheckpointReader, "check", rotated_first)
    else:  # listed, then its manifest and tensor file go before the manifest is read
        from ckptsdk.checkpoint.reading import listing

        read = listing.read_json_object

        def rotated_first(backend, key):  # type: ignore[no-untyped-def]
            if key.startswith(victim):
                _rotate_out(root, victim)
            return read(backend, key)

        monkeypatch.setattr(listing, "read_json_object", rotated_first)
    code = main(["verify", str(root), "--all", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["ok"], doc
    (row,) = [r for r in doc["checked"] if r["key"] == victim]
    assert row["status"] == "gone" and "rotated away" in row["reason"]
    assert {r["status"] for r in doc["checked"] if r["key"] != victim} == {"ok"}


def test_verify_all_under_a_writer_rotating_every_step_never_fails(tmp_path: Path) -> None:
    """keep_last=2 and a save every step, as in the issue; each verify --all exits 0."""
    root = tmp_path / "r"
    state = TrainState(model=torch.nn.Linear(64, 64))
    stop = threading.Event()
    failures: list[BaseException] = []

    def write() -> None:
        try:
            with CheckpointManager(
                str(root), keep_last=2, lease_options=LeaseOptions(ttl=30), save_options=SaveOptions(on_signal=False)
            ) as mgr:
                step = 0
                while not stop.is_set():
                    step += 1
                    mgr.save(state, step=step)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        deadline = time.monotonic() + 60
        while not list(root.glob("step-*/manifest.json")) and time.monotonic() < deadline:
            time.sleep(0.01)
        codes = [main(["verify", str(root), "--all", "--json"]) for _ in range(30)]
    finally:
        stop.set()
        writer.join()
    assert not failures and codes == [0] * len(codes)
