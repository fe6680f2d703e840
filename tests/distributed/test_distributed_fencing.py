"""Fencing and damaged files of distributed checkpoints, in one process (a world of 1 on gloo).

A takeover while the ranks write leaves nothing committed and the next save writes nothing; a
torn rank file makes restore fall back, and so does a corrupt one (every rank together, with a
warning). The multi-process zombie (SIGSTOP) and the SIGKILLed rank are in test_distributed_dcp.py.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ckptsdk import CheckpointManager, LeaseOptions
from ckptsdk.backends import open_backend
from ckptsdk.distributed import DistributedCheckpointManager
from ckptsdk.errors import LeaseLostError
from ckptsdk.manager import Simulation


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
            self.newcomer = CheckpointManager(
                self._inner.url, lease_options=LeaseOptions(force=True, ttl=5), _simulation=Simulation(heartbeat=False)
            )
        return info


@pytest.mark.timeout(60)
def test_a_takeover_during_the_write_commits_nothing(tmp_path: Path, world_of_one: Any) -> None:
    url = str(tmp_path / "root")
    backend = _TakeoverOnWrite(open_backend(url))
    dm = DistributedCheckpointManager(
        backend, lease_options=LeaseOptions(ttl=5), _simulation=Simulation(heartbeat=False)
    )
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


@pytest.mark.timeout(60)
def test_a_torn_rank_file_is_skipped_and_a_corrupt_one_falls_back(
    tmp_path: Path, world_of_one: Any, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(tmp_path / "root")
    with DistributedCheckpointManager(
        url, lease_options=LeaseOptions(ttl=5), _simulation=Simulation(heartbeat=False)
    ) as dm:
        for step in (1, 2, 3):
            dm.save({"w": torch.full((4,), float(step))}, step=step)
    backend = open_backend(url)
    backend.delete("step-0000000003.e1/rank-00000.safetensors")  # torn: restore falls back to step 2
    state = {"w": torch.zeros(4)}
    with DistributedCheckpointManager(
        url, lease_options=LeaseOptions(ttl=5), _simulation=Simulation(heartbeat=False)
    ) as dm:
        assert dm.restore(state).step == 2  # type: ignore[union-attr]
    assert torch.equal(state["w"], torch.full((4,), 2.0))

    # The newest restorable step (a clean handover on local disk writes no anchor: step 2 of e1).
    newest = max((c for c in CheckpointManager(url, read_only=True).list() if c.valid), key=lambda c: (c.step, c.rank))
    key = f"{newest.key}/rank-00000.safetensors"
    data = bytearray(backend.read(key))
    data[-1] ^= 0xFF  # same size, other bytes: only the digest sees it
    backend.write(key, bytes(data))
    # Before (issue 29.5): CorruptCheckpointError on every rank, no fallback. Now every rank drops
    # it together, says which file, and resumes from the previous one; the lineage starts there.
    state = {"w": torch.zeros(4)}
    with caplog.at_level(logging.WARNING, logger="ckptsdk"):
        with DistributedCheckpointManager(
            url, lease_options=LeaseOptions(ttl=5), _simulation=Simulation(heartbeat=False)
        ) as dm:
            point = dm.restore(state)
            # The next one down: here step 2 of e1 (the intact original of e2's anchor copy).
            assert point is not None and point.key != newest.key and point.step <= newest.step
            assert dm._core is not None and dm._core.resumed_from is not None
            assert dm._core.resumed_from.key == point.key  # the lineage starts where every rank loaded
    assert torch.equal(state["w"], torch.full((4,), float(point.step)))
    assert any(key in r.getMessage() and "every rank drops" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
    assert backend.read(key) == bytes(data)  # nothing was deleted or rewritten


@pytest.mark.timeout(60)
def test_the_export_command_consolidates_a_distributed_checkpoint(tmp_path: Path, world_of_one: Any) -> None:
    """`ckptsdk export` sees a distributed checkpoint and writes every entry at full size."""
    from safetensors.torch import load_file

    from ckptsdk.cli import main

    url = str(tmp_path / "root")
    with DistributedCheckpointManager(
        url, lease_options=LeaseOptions(ttl=5), _simulation=Simulation(heartbeat=False)
    ) as dm:
        dm.save({"w": torch.arange(6.0)}, step=1)
        dm.save({"w": torch.arange(6.0) * 2}, step=2)
    out = tmp_path / "out.safetensors"
    assert main(["export", f"{url}@1", str(out)]) == 0
    assert torch.equal(load_file(str(out))["w"], torch.arange(6.0))
    assert main(["export", url, str(out), "--object", "objects/model"]) == 2  # usage: not for DCP
    assert torch.equal(load_file(str(out))["w"], torch.arange(6.0))  # the earlier file is intact
