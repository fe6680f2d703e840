"""Fault suite, part 3: a full disk, for real: a size-limited tmpfs in a private mount namespace.

``unshare --user --map-root-user --mount`` gives this test (root or not, where user namespaces
are allowed) a tmpfs of its own, so the disk really fills: no mock of ``write``. A save at every
amount of free space from 0 to 92 KiB (4 KiB steps, sync and async alternately) must either
succeed or raise a ``BackendError`` that says the disk is full; never a raw ``OSError``. Then a
fresh process restores every root: the newest committed step, exactly, and nothing lost.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support._fault_state import expected

REPO = Path(__file__).resolve().parents[2]


def _namespace_tmpfs_works(tmp_path: Path) -> str | None:
    """None if a private tmpfs can be mounted here, else why not."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    probe = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            f"mount -t tmpfs -o size=1m tmpfs {tmp_path} && touch {tmp_path}/x",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a user+mount namespace here: {probe.stderr.strip()[:200]}"
    return None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_full_disk_at_every_point_of_a_save(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    why = _namespace_tmpfs_works(mnt)
    if why is not None:
        pytest.skip(why)
    out = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            f'mount -t tmpfs -o size=4m tmpfs "{mnt}" && '
            f'exec "{sys.executable}" -m tests.support._fault_enospc "{mnt}"',
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    doc = json.loads(out.stdout.splitlines()[-1])
    reports = {r["root"]: r for r in doc["reports"]}
    failed = 0
    for trial in doc["trials"]:
        if trial["raised"] is not None:
            failed += 1
            assert trial["raised"].startswith("BackendError") and "no space left" in trial["raised"], trial
        report = reports[trial["root"]]
        valid = {int(s): d for s, d in report["valid"].items()}
        assert all(valid[s] == expected(s) for s in valid), trial
        assert {1, 2} <= set(valid), (trial, sorted(valid))  # nothing committed before is lost
        if trial["raised"] is None:
            assert 3 in valid, trial
        newest = max(valid)
        assert report["step"] == newest and report["digest"] == expected(newest), (trial, report)
    # The sweep must really have hit the full disk, and also let some saves through.
    assert 0 < failed < len(doc["trials"]), [t["raised"] for t in doc["trials"]]
    print(
        f"{len(doc['trials'])} saves on a nearly full tmpfs, {failed} refused with BackendError "
        "(disk full), 0 raw OSError, 0 torn, lost or wrong restores"
    )
