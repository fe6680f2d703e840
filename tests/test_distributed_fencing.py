"""Fencing of a distributed save, in one process (a world of 1 on gloo): a takeover seen before
the save writes nothing; one that happens while the ranks write leaves nothing committed.
The multi-process zombie (SIGSTOP) is in test_distributed_dcp.py."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ckptsdk import CheckpointManager
from ckptsdk.backends import open_backend
from ckptsdk.distributed import DistributedCheckpointManager
from ckptsdk.errors import LeaseLostError


@pytest.fixture
def world_of_one(tmp_path: Path) -> Any:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / uuid.uuid4().hex}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _TakeoverOnWrite:
    """A backend that lets a new writer take the lease (force) once step 2's rank file is written."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.newcomer: CheckpointManager | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write(self, key: str, data: Any) -> Any:
        info = self._inner.write(key, data)
        if key.startswith("step-0000000002") and "/rank-" in key and self.newcomer is None:
            self.newcomer = CheckpointManager(self._inner.url, force=True, lease_ttl=5, heartbeat=False)
        return info


@pytest.mark.timeout(60)
def test_a_takeover_during_the_write_commits_nothing(tmp_path: Path, world_of_one: Any) -> None:
    url = str(tmp_path / "root")
    backend = _TakeoverOnWrite(open_backend(url))
    dm = DistributedCheckpointManager(backend, lease_ttl=5, heartbeat=False)
    state = {"w": torch.arange(6.0)}
    assert dm.restore(state) is None
    dm.save(state, step=1)
    with pytest.raises(LeaseLostError):
        dm.save(state, step=2)  # the newcomer took over after the rank file, before the commit
    assert backend.newcomer is not None
    keys = {o.key for o in open_backend(url).list("step-0000000002")}
    assert keys and not any(k.endswith("/manifest.json") for k in keys), keys
    with pytest.raises(LeaseLostError):
        dm.save(state, step=3)  # fenced for good: refused before anything is written
    assert not open_backend(url).list("step-0000000003")
    assert [c.step for c in CheckpointManager(url, read_only=True).list() if c.valid] == [1]
    backend.newcomer.close()
    dm.close()
