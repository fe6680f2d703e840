"""Shared files in the stories that matter: a SIGKILL at every call of a save that writes one, a
takeover that re-homes them, and a zombie that deletes everything it owns.

The SIGKILLs are real (a forked child kills itself at its N-th backend call, on whatever thread
makes it); the restores run in the parent and compare every tensor with what was saved.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState, open_backend
from ckptsdk.backends.local import LocalBackend
from ckptsdk.checkpoint.reading.catalog import scan
from ckptsdk.errors import LeaseLostError
from ckptsdk.format.layout import SHARED_PREFIX, shared_rank
from ckptsdk.manager import Simulation
from ckptsdk.testing import OPS, FaultyBackend

N = 1024  # a 4 MiB frozen weight
REPO = Path(__file__).resolve().parents[2]


def _job(step: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, TrainState]:
    """The state every writer has at ``step`` (deterministic): the base changes once, at step 3."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(N, N), torch.nn.Linear(N, 4))
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1, momentum=0.9)
    with torch.no_grad():
        if step >= 3:
            model[0].weight.mul_(0.5)
        for _ in range(step):
            model[1].weight.add_(0.01)
    return model, opt, TrainState(model=model, optimizer=opt)


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _restores_exactly(url: str, step: int) -> None:
    model, _, state = _job(0)
    with CheckpointManager(
        url, lease_options=LeaseOptions(ttl=30, force=True), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        point = mgr.restore(state)
    assert point is not None and point.step == step
    want, _, _ = _job(step)
    for k, v in _values(want).items():
        assert torch.equal(model.state_dict()[k], v), f"{k} of step {step}: restored wrong bytes"


def _referenced(url: str) -> tuple[list[str], set[str]]:
    b = open_backend(url)
    refs = {f.name for c in scan(b).checkpoints if c.manifest for f in c.manifest.shared}
    return sorted(o.key for o in b.list(SHARED_PREFIX)), refs


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """Steps 1-3 committed: 1 and 2 refer to the shared base of step 1; 3 holds the changed base."""
    root = str(tmp_path_factory.mktemp("incr") / "base")
    with CheckpointManager(
        root, keep_last=3, save_options=SaveOptions(on_signal=False), _simulation=Simulation(heartbeat=False)
    ) as mgr:
        model, _, state = _job(1)
        mgr.save(state, step=1)
        for step in (2, 3):
            live, _, _ = _job(step)
            model.load_state_dict(live.state_dict())  # in place: what training did
            mgr.save(state, step=step)
    return root


def _kill_at(n: int):  # noqa: ANN202
    """A fail_on hook that SIGKILLs this process at its n-th backend call (1-based)."""
    seen = [0]

    def hook(op: str, key: str, _count: int) -> None:
        seen[0] += 1
        if seen[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def _save5(root: str, kill_at: int | None) -> int:
    """Open ``root`` (a takeover: the anchor re-homes), save step 4 (the base goes with the folder:
    nothing is known of it yet), then step 5 (unchanged for a save interval, the base goes to a new
    shared file); with ``kill_at``, SIGKILL this process at that backend call of the last save."""
    faulty = FaultyBackend(LocalBackend(root))
    # No heartbeat: its renewals would be counted among the calls, as many as the save's time
    # allows, and a child killed at call N would then count differently from the probe.
    mgr = CheckpointManager(
        faulty,
        keep_last=3,
        lease_options=LeaseOptions(ttl=30, force=True),
        save_options=SaveOptions(on_signal=False),
        _simulation=Simulation(heartbeat=False),
    )
    model, _, state = _job(0)
    assert mgr.restore(state).step == 3
    for step in (4, 5):
        live, _, _ = _job(step)
        model[1].load_state_dict(live[1].state_dict())  # the head trains; the base stays put
        if step == 5:
            faulty.calls.clear()
            if kill_at is not None:
                faulty.fail_on = _kill_at(kill_at)
        mgr.save(state, step=step)
        mgr.wait()
    calls = sum(faulty.calls[op] for op in OPS)
    faulty.fail_on = None
    mgr.close()
    return calls


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_at_every_call_of_a_save_that_writes_a_shared_file(base, tmp_path):
    probe = str(tmp_path / "probe")
    shutil.copytree(base, probe)
    total = _save5(probe, None)
    assert any(shared_rank(k) == (5, (2, "")) for k in _referenced(probe)[0])  # it did write one
    for n in range(1, total + 1):
        root = str(tmp_path / f"kill-{n}")
        shutil.copytree(base, root)
        # A fresh interpreter, not a fork: torch's intra-op threads do not survive a fork.
        child = subprocess.run(
            [sys.executable, "-m", "tests.stories.test_incremental_story", root, str(n)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            timeout=240,
        )
        assert child.returncode == -signal.SIGKILL, (n, child.returncode, child.stderr[-2000:])
        committed = any(c.step == 5 and c.valid for c in scan(open_backend(root)).checkpoints)
        _restores_exactly(root, 5 if committed else 4)
        # The next writer's first save tidies: nothing a killed save wrote outlives it.
        model, _, state = _job(0)
        with CheckpointManager(
            root, keep_last=3, lease_options=LeaseOptions(ttl=30, force=True), save_options=SaveOptions(on_signal=False)
        ) as mgr:
            point = mgr.restore(state)
            mgr.save(state, step=point.step + 1)
        held, refs = _referenced(root)
        assert set(held) == refs, f"kill at call {n}/{total}: unreferenced shared files {set(held) - refs}"


@pytest.mark.timeout(300)
def test_a_takeover_rehomes_the_shared_files_and_a_zombie_deleting_its_own_hurts_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTSDK_DRIVE_ROOT", str(tmp_path))
    url = "drive://r"
    zombie = CheckpointManager(
        url, keep_last=2, lease_options=LeaseOptions(ttl=60, settle=0), save_options=SaveOptions(on_signal=False)
    )
    model, _, state = _job(1)
    zombie.save(state, step=1)
    zombie.save(state, step=2)
    zombie_rank = zombie._saving.rank
    # The runtime "vanished": a new one takes over and resumes from step 2.
    new = CheckpointManager(
        url,
        keep_last=2,
        lease_options=LeaseOptions(ttl=60, settle=0, force=True),
        save_options=SaveOptions(on_signal=False),
    )
    _, _, s2 = _job(0)
    assert new.restore(s2).step == 2
    new.save(s2, step=3)
    # The zombie wakes and saves on: the listing before its upload shows the newer writer.
    with pytest.raises(LeaseLostError):
        zombie.save(state, step=3)
    held = _referenced(url)[0]
    # Every file the new writer's checkpoints refer to carries its own rank (re-homed at the anchor).
    mine = {
        f.name
        for c in scan(open_backend(url)).checkpoints
        if c.manifest and c.rank == new._saving.rank
        for f in c.manifest.shared
    }
    assert mine and all(shared_rank(k)[1] == new._saving.rank for k in mine)
    assert zombie_rank in {shared_rank(k)[1] for k in held}  # its own, still there
    # The worst a zombie can do with its own names: delete every shared file of its rank.
    b = open_backend(url)
    for key in held:
        if shared_rank(key)[1] == zombie_rank:
            b.delete(key)
    zombie._shutdown._closed = True  # it never comes back
    new.close()
    want, _, _ = _job(1)
    fresh, _, fs = _job(0)
    with CheckpointManager(
        url, lease_options=LeaseOptions(ttl=60, settle=0), save_options=SaveOptions(on_signal=False)
    ) as mgr:
        assert mgr.restore(fs).step == 3
    for k, v in _values(want).items():
        assert torch.equal(fresh.state_dict()[k], v), k


if __name__ == "__main__":  # the SIGKILL test's child: ROOT N
    _save5(sys.argv[1], int(sys.argv[2]))
    sys.exit(3)  # the kill did not come
