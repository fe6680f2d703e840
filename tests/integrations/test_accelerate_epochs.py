"""Accelerate's documented resume loop, SIGKILLed mid-epoch, shuffles as an uninterrupted run
(issue 47, item 6).

The loop: ``accelerator.skip_first_batches`` for the rest of the killed epoch, then the original
prepared loader, no ``set_epoch``. ``AcceleratorCheckpoints`` owns the loader's epoch: the epoch
after the resumed one is shuffled as that epoch, not as the killed one again. A loader whose
order it cannot give back (a shuffle drawn from the global RNG) is refused before anything runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("accelerate")


def _run(url: str, order: Path, *flags: str, kill_at: int | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tests.support._accelerate_epoch_child", url, str(order), *flags]
    if kill_at is not None:
        cmd += ["--kill-at", str(kill_at)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def _order(path: Path) -> dict[int, tuple[int, list[int]]]:
    """Step -> (epoch, sample ids); a step run twice keeps its last run."""
    out = {}
    for line in path.read_text().splitlines():
        step, epoch, *ids = map(int, line.split())
        out[step] = (epoch, ids)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_epoch_after_a_resumed_one_is_shuffled_as_itself(tmp_path):
    ref = _run(str(tmp_path / "ref"), tmp_path / "ref.txt")
    assert ref.returncode == 0, ref.stderr[-3000:]
    url = str(tmp_path / "root")
    # Saves at steps 4 and 8 (epoch 1, 2 batches done); killed as step 10 begins.
    killed = _run(url, tmp_path / "run.txt", kill_at=10)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = _run(url, tmp_path / "run.txt")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = _order(tmp_path / "ref.txt"), _order(tmp_path / "run.txt")
    assert sorted(got) == sorted(want) == list(range(1, 19))
    assert [got[s] for s in range(9, 13)] == [want[s] for s in range(9, 13)]  # the rest of epoch 1
    assert [got[s] for s in range(13, 19)] == [want[s] for s in range(13, 19)]  # epoch 2, all of it
    # Each epoch is a permutation of its own: epoch 2 is not epoch 1 again.
    assert [want[s][1] for s in range(7, 13)] != [want[s][1] for s in range(13, 19)]


def test_a_loader_that_draws_its_start_from_the_global_rng_is_refused(tmp_path):
    proc = _run(str(tmp_path / "root"), tmp_path / "run.txt", "--no-generator")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ckptsdk.errors.ConfigError:") and "generator=" in last, proc.stderr[-2000:]
    assert not (tmp_path / "run.txt").exists() and not (tmp_path / "root").exists()
