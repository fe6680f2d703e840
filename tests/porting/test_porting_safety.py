"""`ckptsdk export` and `ckptsdk import` never destroy or nest into a checkpoint root (issue 29.1, 29.2).

Each slip a user can make is run through the real command in a subprocess: it must exit with the
code of the CLI's table, print one line and no traceback, and leave every committed checkpoint
byte-for-byte as it was (verify still passes, restore returns the newest step). A zip bomb
dressed as a .pt is refused before torch inflates it, measured by the child's peak RSS.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, TrainState

REPO = Path(__file__).resolve().parents[2]
EXIT_USAGE = 2


def _ckptsdk(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptsdk", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def _fingerprint(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] not in ("runlog", "LEASE.json")
    }


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("porting") / "root"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with CheckpointManager(str(root), lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(TrainState(model=model), step=1)
        with torch.no_grad():
            model.weight.add_(1)
        mgr.save(TrainState(model=model), step=2)
    return root


def _refused(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == EXIT_USAGE, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()  # warnings may come first; the error is one line, the last
    assert lines and lines[-1].startswith("ckptsdk: error: ") and not any("error" in x for x in lines[:-1]), lines
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def _intact(root: Path, before: dict[str, str]) -> None:
    assert _fingerprint(root) == before
    assert _ckptsdk("verify", str(root)).returncode == 0
    with CheckpointManager(str(root), read_only=True) as mgr:
        assert mgr.restore(TrainState(model=torch.nn.Linear(4, 3))).step == 2


@pytest.mark.timeout(600)
def test_export_never_writes_inside_a_root_nor_over_a_file(committed, tmp_path):
    before = _fingerprint(committed)
    (step2,) = committed.glob("step-0000000002.e*")
    other = tmp_path / "other-root"
    with CheckpointManager(str(other), lease_options=LeaseOptions(ttl=5)) as mgr:
        mgr.save(TrainState(model=torch.nn.Linear(4, 3)), step=7)
    other_before = _fingerprint(other)
    # The two: the committed tensor file and manifest. Then the root itself, a new name in
    # a checkpoint folder, the step log's folder, and another run's root.
    for out in (
        step2 / "tensors.safetensors",
        step2 / "manifest.json",
        committed / "model.safetensors",
        step2 / "new.safetensors",
        committed / "runlog" / "model.safetensors",
        other / "model.safetensors",
    ):
        _refused(_ckptsdk("export", str(committed), str(out)), "inside the checkpoint root")
    _refused(_ckptsdk("export", str(committed), str(step2 / "tensors.safetensors"), "--force"), "inside the checkp")
    link = tmp_path / "link-to-step"
    link.symlink_to(step2)
    _refused(_ckptsdk("export", str(committed), str(link / "tensors.safetensors"), "--force"), "inside")
    _intact(committed, before)
    assert _fingerprint(other) == other_before

    # A missing folder: one line, exit 2 (it was a raw SafetensorError traceback).
    _refused(_ckptsdk("export", str(committed), str(tmp_path / "no" / "such" / "m.safetensors")), "does not exist")
    # An existing file is kept without --force, replaced with it; no temp file is left behind.
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"precious")
    _refused(_ckptsdk("export", str(committed), str(out)), "already exists", "--force")
    assert out.read_bytes() == b"precious"
    proc = _ckptsdk("export", f"{committed}@1", str(out), "--force", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["step"] == 1 and out.read_bytes()[:8] != b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link-to-step", "m.safetensors", "other-root"]
    proc = _ckptsdk("export", str(committed), str(tmp_path), "--json")
    assert proc.returncode == EXIT_USAGE and json.loads(proc.stdout)["error"]["exit_code"] == EXIT_USAGE
    _intact(committed, before)


def _small_pt(path: Path) -> None:
    torch.save({"model": torch.nn.Linear(4, 3).state_dict(), "step": 3}, path)


@pytest.mark.timeout(600)
def test_import_never_nests_into_a_root_nor_adds_to_one(committed, tmp_path):
    before = _fingerprint(committed)
    pt = tmp_path / "small.pt"
    _small_pt(pt)
    (step2,) = committed.glob("step-0000000002.e*")
    for url in (str(step2), str(committed / "imported"), str(committed / "runlog" / "x"), f"file://{step2}"):
        _refused(_ckptsdk("import", str(pt), url), "inside the checkpoint root")
    _refused(_ckptsdk("import", str(pt), str(committed)), "already holds checkpoints")
    _refused(_ckptsdk("import", str(tmp_path / "missing.pt"), str(tmp_path / "new")), "does not exist")
    _intact(committed, before)
    assert not (tmp_path / "new").exists()
    proc = _ckptsdk("import", str(pt), str(tmp_path / "new"))
    assert proc.returncode == 0, proc.stderr


def _zip_bomb(path: Path, declared: int) -> None:
    """A real torch.save file whose one storage record is `declared` zeros, deflated (~1000:1)."""
    plain = path.with_suffix(".plain")
    torch.save({"model": {"w": torch.empty(declared, dtype=torch.uint8)}, "step": 3}, plain)
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            if not info.filename.endswith("/data/0"):
                dst.writestr(info, src.read(info.filename))
                continue
            member = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            member.compress_type = zipfile.ZIP_DEFLATED
            with dst.open(member, "w", force_zip64=True) as w:
                chunk = bytes(4 << 20)
                for _ in range(declared // len(chunk)):
                    w.write(chunk)
    plain.unlink()


def _peak_rss(*args: str) -> tuple[int, str, int]:
    """Run ``ckptsdk ARGS`` and return (exit code, stderr, the child's own peak RSS in bytes)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptsdk", *args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    with proc.stderr:
        err = proc.stderr.read().decode()
    _pid, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, err, usage.ru_maxrss * 1024


@pytest.mark.timeout(600)
def test_zip_bomb_is_refused_before_anything_is_inflated(tmp_path):
    declared = 512 << 20
    bomb = tmp_path / "bomb.pt"
    _zip_bomb(bomb, declared)
    assert bomb.stat().st_size < declared // 200
    small = tmp_path / "small.pt"
    _small_pt(small)
    code, err, baseline = _peak_rss("import", str(small), str(tmp_path / "ok"))
    assert code == 0, err
    code, err, peak = _peak_rss("import", str(bomb), str(tmp_path / "bombed"))
    assert code == EXIT_USAGE and "zip bomb" in err and "Traceback" not in err, err
    # Before: torch allocated the declared 512 MiB and inflated into it (+~500 MiB over the
    # baseline of importing a small file: torch itself). Now the refusal costs no more than that.
    print(f"peak RSS: small import {baseline >> 20} MiB, bomb {peak >> 20} MiB")
    assert peak < baseline + (64 << 20), (baseline, peak)
    assert not (tmp_path / "bombed").exists()
