"""What a non-blocking distributed save copies at ``save()``, in a world of 1 on gloo.

The 2-rank job (test_distributed_pipelined.py) covers DTensors and the rule; here: the
optimizers are found or given, and without one every tensor is copied at ``save()``, said once.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ckptsdk import LeaseOptions, SaveOptions
from ckptsdk.distributed import AppState, DistributedCheckpointManager
from ckptsdk.errors import ConfigError
from ckptsdk.manager import Simulation

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def world_of_one(tmp_path: Path) -> Any:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / uuid.uuid4().hex}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _manager(url: str, **kw: Any) -> DistributedCheckpointManager:
    return DistributedCheckpointManager(
        url, lease_options=LeaseOptions(ttl=5), async_save=True, _simulation=Simulation(heartbeat=False), **kw
    )


def _job() -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, opt)
    return model, opt


def _step(model: torch.nn.Linear, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(2, 8)).square().mean().backward()
    opt.step()


def _nbytes(ts: Any) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def test_an_unknown_snapshot_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="snapshot must be one of 'pipelined', 'copy', got 'lazy'"):
        DistributedCheckpointManager("memory://never", save_options=SaveOptions(snapshot="lazy"))  # type: ignore[arg-type]


def test_optimizers_are_found_in_stateful_values(tmp_path: Path, world_of_one: Any) -> None:
    model, opt = _job()
    with _manager(str(tmp_path / "root")) as dm:
        dm.save({"app": AppState(model, opt)}, step=1, blocking=False)
        _step(model, opt)  # waits for the deferred copy
        dm.wait()
    momentum = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    assert dm.last_snapshot == {"at_save": 0, "deferred": _nbytes([*model.parameters(), *momentum])}


def test_without_an_optimizer_everything_is_copied_at_save_and_the_log_says_so_once(
    tmp_path: Path, world_of_one: Any, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt = _job()
    state = {"w": model.weight, "b": model.bias}  # plain tensors: no Stateful to look into
    caplog.set_level(logging.INFO, logger="ckptsdk.distributed.snapshot")
    url = str(tmp_path / "root")
    with _manager(url) as dm:
        for step in (1, 2):
            at_save = {k: v.detach().clone() for k, v in state.items()}
            dm.save(state, step=step, blocking=False)
            assert dm.last_snapshot == {"at_save": _nbytes(state.values()), "deferred": 0}
            _step(model, opt)  # not held: the copy was made at save()
            dm.wait()
    said = [r for r in caplog.records if "no optimizer found in the state dict" in r.getMessage()]
    assert len(said) == 1 and "optimizers=[...]" in said[0].getMessage()
    restored = {k: torch.zeros_like(v) for k, v in at_save.items()}
    with _manager(url) as dm:
        assert dm.restore(restored).step == 2  # type: ignore[union-attr]
    assert all(torch.equal(restored[k], v) for k, v in at_save.items())


def test_given_optimizers_defer_their_tensors_and_the_save_is_exact(tmp_path: Path, world_of_one: Any) -> None:
    model, opt = _job()
    state = {"w": model.weight, "b": model.bias, "count": 7}
    at_save = {k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    url = str(tmp_path / "root")
    with _manager(url, optimizers=[opt]) as dm:
        dm.save(state, step=1, blocking=False)
        assert dm.last_snapshot == {"at_save": 0, "deferred": _nbytes(at_save.values())}
        _step(model, opt)
        _step(model, opt)
        dm.wait()
    restored: dict[str, Any] = {k: torch.zeros_like(v) for k, v in at_save.items()} | {"count": 0}
    with _manager(url) as dm:
        assert dm.restore(restored).step == 1  # type: ignore[union-attr]
    assert all(torch.equal(restored[k], v) for k, v in at_save.items())
    assert restored["count"] == 7
