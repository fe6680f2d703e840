"""torch.distributed end to end: real multi-process gloo jobs checkpointing through ckptsdk.distributed.

Each job is 2 or 4 real processes (``tests/support/_dist_child.py``) on a FileStore; crashes are real
SIGKILLs, the zombie is a real SIGSTOP. Models are tiny: the cost is process start-up.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from ckptsdk import CheckpointManager
from ckptsdk.backends import open_backend
from ckptsdk.backends.posix import LOCK_NAME
from ckptsdk.distributed import export_consolidated
from tests.support.freezing import freeze
from tests.support.waiting import poll_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _refuse(*_a: Any, **_k: Any) -> Any:
    raise AssertionError("unpickling was attempted on a restore path")


class Zygote:
    """``tests.support._dist_child zygote``: imports torch once, forks every rank of every job."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support._dist_child", "zygote"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def fork(self, cfg: dict[str, Any]) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cfg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line.startswith("pid "), f"zygote said {line!r}"
        return int(line.split()[1])

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(30)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote() -> Any:
    z = Zygote()
    yield z
    z.close()


@pytest.fixture
def jobs(zygote: Zygote) -> Any:
    """Start jobs with ``jobs(out, cfg, world, env)``; every rank still running at the end is killed."""
    started: list[Job] = []

    def start(*args: Any, **kwargs: Any) -> Job:
        started.append(Job(zygote, *args, **kwargs))
        return started[-1]

    yield start
    for job in started:
        job.kill()


class Job:
    """The ranks of one job (real processes forked by the zygote); results land in ``out``."""

    def __init__(
        self, zygote: Zygote, out: Path, cfg: dict[str, Any], world: int, env: dict[str, str] | None = None
    ) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        store = f"store-{uuid.uuid4().hex[:8]}"
        self.status = [out / f"status-{rank}-{store}" for rank in range(world)]
        self.pids = [
            zygote.fork(
                {
                    **cfg,
                    "rank": rank,
                    "world": world,
                    "init": str(out / store),
                    "out": str(out),
                    "env": dict(env or {}),
                    "log": str(out / f"log-{rank}-{store}.txt"),
                    "status": str(self.status[rank]),
                }
            )
            for rank in range(world)
        ]

    def code(self, rank: int) -> int | None:
        path = self.status[rank]
        return int(path.read_text()) if path.exists() else None

    def wait_rank(self, rank: int, timeout: float) -> int | None:
        # poll_until wants a truthy value: a rank's exit code may be 0.
        found = poll_until(lambda: (code,) if (code := self.code(rank)) is not None else None, timeout)
        return None if found is None else found[0]

    def wait(self, timeout: float = 90.0) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = [self.wait_rank(r, max(0.0, deadline - time.monotonic())) for r in range(len(self.pids))]
        if None in codes:
            self.kill()
            pytest.fail(f"a rank of the job in {self.out} did not finish in {timeout} s:\n{self.logs()}")
        return codes  # type: ignore[return-value]

    def signal(self, rank: int, sig: int) -> None:
        if self.code(rank) is None:
            os.kill(self.pids[rank], sig)

    def kill(self) -> None:
        for rank in range(len(self.pids)):
            if self.code(rank) is None:
                try:
                    os.kill(self.pids[rank], signal.SIGCONT)  # a frozen rank dies only once it runs
                    os.kill(self.pids[rank], signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.wait_rank(rank, 30)

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(self.out.glob("log-*")))

    def result(self, name: str) -> Any:
        return json.loads((self.out / name).read_text())

    def wait_for(self, name: str, timeout: float = 90.0) -> None:
        def settled() -> str | None:
            ended = any(self.code(r) is not None for r in range(len(self.pids)))  # before looking
            return "there" if (self.out / name).exists() else ("ended" if ended else None)

        if poll_until(settled, timeout) != "there":
            self.kill()
            pytest.fail(f"{name} never appeared in {self.out}:\n{self.logs()}")


@pytest.mark.timeout(240)
def test_ddp_rank_killed_mid_save_commits_nothing_and_the_resume_is_bit_identical(tmp_path: Path, jobs: Any) -> None:
    base = {"mode": "ddp", "steps": 8, "save_every": 2, "ttl": 2.0}  # the resume waits one ttl for the dead lease
    root = str(tmp_path / "root")
    ref = jobs(tmp_path / "ref", {**base, "url": str(tmp_path / "ref-root")}, 2)
    job = jobs(tmp_path / "job", {**base, "url": root, "kill_rank": 1, "kill_step": 6}, 2)
    job.wait_for("stalled")  # rank 1 has written its share of step 6, rank 0 waits for it
    job.signal(1, signal.SIGKILL)
    assert job.wait_rank(1, 30) == -signal.SIGKILL
    # Rank 0 sees its peer gone (gloo) and fails; a preemption would kill it as well.
    if job.wait_rank(0, 20) is None:
        job.signal(0, signal.SIGKILL)
    assert job.wait_rank(0, 30) not in (0, None)

    keys = {o.key for o in open_backend(root).list("step-0000000006")}
    assert "step-0000000006.e1/rank-00001.safetensors" in keys, keys  # the kill was mid-save...
    assert not any(k.endswith("/manifest.json") for k in keys), keys  # ...and nothing committed
    assert CheckpointManager(root, read_only=True).latest().step == 4  # type: ignore[union-attr]

    # The resumed run saves in the background (async_save): the result must not change.
    resumed = jobs(tmp_path / "resume", {**base, "url": root, "no_pickle": True, "async": True}, 2)
    assert resumed.wait() == [0, 0], resumed.logs()
    assert ref.wait() == [0, 0], ref.logs()
    for rank in (0, 1):
        want, got = ref.result(f"result-{rank}.json"), resumed.result(f"result-{rank}.json")
        assert got["resumed_from"] == 4
        assert got["params"] == want["params"]  # bit-identical weights on every rank
        assert got["rng"] == want["rng"]  # each rank continued its own random stream
    audit = resumed.result("result-0.json")["audit"]
    assert audit["verdict"] == "bit-exact" and audit["overlap"] >= 2, audit
    assert audit["max_diff"]["loss"] == 0.0


@pytest.mark.timeout(300)
def test_a_corrupt_rank_1_file_makes_both_ranks_fall_back_together(tmp_path: Path, jobs: Any) -> None:
    # Before (issue 29.5): CorruptCheckpointError on every rank, no fallback.
    base = {"mode": "ddp", "save_every": 2, "ttl": 2.0}
    root = str(tmp_path / "root")
    ref = jobs(tmp_path / "ref", {**base, "steps": 8, "url": str(tmp_path / "ref-root")}, 2)
    first = jobs(tmp_path / "first", {**base, "steps": 6, "url": root}, 2)
    assert first.wait() == [0, 0], first.logs()
    backend = open_backend(root)
    (folder,) = {o.key.partition("/")[0] for o in backend.list("step-0000000006")}
    key = f"{folder}/rank-00001.safetensors"
    data = bytearray(backend.read(key))
    data[-1] ^= 0xFF  # same size: only rank 1's digest check sees it
    backend.write(key, bytes(data))

    resumed = jobs(tmp_path / "resume", {**base, "steps": 8, "url": root}, 2)
    assert resumed.wait() == [0, 0], resumed.logs()
    assert ref.wait() == [0, 0], ref.logs()
    logs = resumed.logs()
    assert key in logs and "every rank drops this checkpoint" in logs, logs
    for rank in (0, 1):
        want, got = ref.result(f"result-{rank}.json"), resumed.result(f"result-{rank}.json")
        assert got["resumed_from"] == 4  # both ranks, the same previous checkpoint
        assert got["params"] == want["params"] and got["rng"] == want["rng"]
    # The resumed run's own step 6 supersedes the damaged one, an orphan now that rotation may
    # remove (the lean commit's cleanup after its first listing does); what is left of it is never
    # repaired, and the newest checkpoint is the resumed run's, verified.
    if backend.exists(key):
        assert backend.read(key) == bytes(data)
    newest = CheckpointManager(root, read_only=True).latest()
    assert newest is not None and newest.step == 8 and newest.valid


@pytest.mark.gcs
@pytest.mark.timeout(240)
def test_fsdp2_on_4_ranks_restores_on_2_and_1_with_every_tensor_equal_on_gcs(
    tmp_path: Path, make_backend_target: Any, jobs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = make_backend_target("gcs")
    cfg = {"mode": "dtensor", "kind": "fsdp2", "url": target.url, "options": target.options}
    save = jobs(tmp_path / "save", {**cfg, "phase": "save"}, 4, env=target.env)
    assert save.wait() == [0, 0, 0, 0], save.logs()
    saved = save.result("save-4.json")
    for world in (2, 1):  # restores run with pickle.load(s) and torch.load patched to raise
        job = jobs(tmp_path / f"restore-{world}", {**cfg, "phase": "restore"}, world, env=target.env)
        assert job.wait() == [0] * world, job.logs()
        restored = job.result(f"restore-{world}.json")
        assert sorted(restored) == sorted(saved) and len(saved) == 16
        assert all(restored[k] == saved[k] for k in saved), [k for k in saved if restored[k] != saved[k]]

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, _refuse)
    monkeypatch.setattr(torch, "load", _refuse)
    out = tmp_path / "export" / "model.safetensors"
    assert export_consolidated(target.url, out, storage_options=target.options) == 3
    exported = safetensors.torch.load_file(str(out))
    for name in ("model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"):
        t = exported[f"app.{name}"]
        assert t.reshape(-1).view(torch.uint8).numpy().tobytes().hex() == saved[name]


@pytest.mark.timeout(240)
def test_a_frozen_rank0_zombie_is_refused_on_every_rank_and_touches_nothing(tmp_path: Path, jobs: Any) -> None:
    root = str(tmp_path / "root")
    base = {"mode": "zombie", "url": root, "ttl": 1.0}
    old = jobs(tmp_path / "jobs", {**base, "job": "old", "steps": 4, "pause_after": 2}, 2)
    old.wait_for("ready-old")  # step 2 committed; both ranks are about to run step 3
    # rank 0 (lease holder, heartbeat and all) freezes, outside the root's flock (freezing.py)
    freeze(old.pids[0], Path(root) / LOCK_NAME)
    try:
        new = jobs(tmp_path / "jobs", {**base, "job": "new", "steps": 8}, 2)
        assert new.wait() == [0, 0], new.logs()
        assert new.result("new-0.json") == {
            "resumed_from": 2,
            "saved": ["step-0000000004.e2", "step-0000000006.e2", "step-0000000008.e2"],
        }
        backend = open_backend(root)
        before = {(o.key, o.size, o.version) for o in backend.list("step-")}
        (tmp_path / "jobs" / "go-old").write_text("go")
    finally:
        old.signal(0, signal.SIGCONT)
    assert old.wait() == [0, 0], old.logs()
    for rank in (0, 1):  # the decision reached every rank: none wrote anything for step 4
        assert old.result(f"old-{rank}.json")["refused"] == {"step": 4, "type": "LeaseLostError"}
    assert {(o.key, o.size, o.version) for o in backend.list("step-")} == before
    assert not [o.key for o in backend.list("step-0000000004.e1")]
    reader = CheckpointManager(root, read_only=True)
    assert [c.key for c in reader.list() if c.valid] == [
        "step-0000000004.e2",
        "step-0000000006.e2",
        "step-0000000008.e2",
    ]
