"""One rank of the pipelined distributed save's jobs (``python -m tests.distributed._pipelined_child CFG``).

The job: a DTensor-sharded Linear with SGD momentum and a replicated Linear with Adam and a big
buffer, two ``AppState`` entries, on a gloo CPU mesh. CFG (JSON) holds ``rank``, ``world``,
``init`` (a FileStore path), ``out`` (a folder) and ``scenarios``: each runs on fresh roots and
writes ``{name}-{rank}.json``; tensors are compared as hex of their bytes. Assertions live in
test_distributed_pipelined.py.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ckptsdk import LeaseOptions, SaveOptions
from ckptsdk.backends import open_backend
from ckptsdk.checkpoint.writing import staging
from ckptsdk.distributed import AppState, DistributedCheckpointManager
from ckptsdk.errors import CkptError

MAX_WAIT = 60.0  # every wait is bounded even if a test forgets to release it
BIG = 256  # the plain Linear's weight (65,536 elements) and the buffer go through memcpy


def _hex(t: torch.Tensor) -> str:
    t = t._local_tensor if isinstance(t, DTensor) else t
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes().hex()


class Job:
    def __init__(self, mesh: Any, rank: int) -> None:
        torch.manual_seed(0)
        self.mesh, self.rank = mesh, rank
        self.dt = torch.nn.Linear(64, 32)
        for name, p in list(self.dt.named_parameters()):
            local = p.detach().chunk(mesh.size(), dim=0)[rank].clone()
            setattr(self.dt, name, torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False)))
        self.plain = torch.nn.Linear(BIG, BIG)
        self.plain.register_buffer("stat", torch.zeros(40000))  # changed by every "forward"
        self.opt_dt = torch.optim.SGD(self.dt.parameters(), lr=0.1, momentum=0.9)
        self.opt_plain = torch.optim.Adam(self.plain.parameters(), lr=0.01)
        self.state = {"dt": AppState(self.dt, self.opt_dt), "plain": AppState(self.plain, self.opt_plain)}
        self.i = 0

    def forward(self) -> None:
        self.plain.stat.add_(1.0)

    def step(self) -> None:
        self.i += 1
        g = torch.Generator().manual_seed(1000 + self.i)  # the same on every rank: replicas agree
        for p in self.plain.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        for p in self.dt.parameters():
            full = torch.randn(p.shape, generator=g)
            local = full.chunk(self.mesh.size(), dim=0)[self.rank].clone()
            p.grad = DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False)
        self.forward()
        self.opt_dt.step()
        self.opt_plain.step()

    def tensors(self) -> dict[str, str]:
        """Every tensor of the state on this rank (local shards), by DCP-like name."""
        out: dict[str, str] = {}

        def walk(obj: Any, path: str) -> None:
            if isinstance(obj, torch.Tensor):
                out[path] = _hex(obj)
            elif isinstance(obj, dict):
                for k, v in obj.items():
                    walk(v, f"{path}.{k}")

        for key, app in self.state.items():
            walk(app.state_dict(), key)
        return out

    def step_only(self) -> dict[int, int]:
        """data pointer -> bytes of every parameter and optimizer-state tensor (local shards)."""
        found: dict[int, int] = {}
        for opt in (self.opt_dt, self.opt_plain):
            ts = [p for g in opt.param_groups for p in g["params"]]
            ts += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
            for t in ts:
                t = t._local_tensor if isinstance(t, DTensor) else t
                found[t.data_ptr()] = t.numel() * t.element_size()
        return found


class Held:
    """Holds staging's copies made off the main thread (the deferred ones) until ``go`` is set,
    and records every copy: (on the main thread?, source data pointer, bytes)."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.calls: list[tuple[bool, int, int]] = []
        self.real = staging.memcpy
        staging.memcpy = self  # type: ignore[assignment]

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        main = threading.current_thread() is threading.main_thread()
        if not main:
            assert self.go.wait(MAX_WAIT), "the test never released the copy"
        self.calls.append((main, src.data_ptr(), src.numel() * src.element_size()))
        self.real(dst, src)

    def undo(self) -> None:
        self.go.set()
        staging.memcpy = self.real


class Gate:
    """A backend whose write of this rank's local file in a ``marker`` folder waits for ``go``:
    the save's copies are done by then, its DCP write and commit not yet."""

    def __init__(self, inner: Any, marker: str, rank: int) -> None:
        self._inner, self._marker, self._name = inner, marker, f"local-{rank:05d}"
        self.arrived, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write(self, key: str, data: Any) -> Any:
        if self._marker in key and self._name in key and not self.go.is_set():
            self.arrived.set()
            assert self.go.wait(MAX_WAIT), "the test never released the write"
        return self._inner.write(key, data)


def _edit(job: Job, how: str) -> None:
    w = job.plain.weight
    with torch.no_grad():
        if how == "add_-under-no_grad":
            w.add_(1)
        elif how == "copy_":
            w.copy_(torch.zeros_like(w))
        elif how == "detach-then-mul_":
            w.detach().mul_(2)
        elif how == "a-slice-fill_":
            w[0].fill_(3)
        elif how == "nn.init":
            torch.nn.init.zeros_(w)
        elif how == "foreach_add_":
            torch._foreach_add_(list(job.plain.parameters()), 1.0)
        elif how == "set_":
            w.set_(torch.zeros(BIG, BIG))
        elif how == "dtensor-add_":
            job.dt.weight.add_(1)
        elif how == "optimizer-state":
            job.opt_plain.state[w]["exp_avg"].zero_()
        elif how == "data-add_":
            w.data.add_(1)
    if how == "model.load_state_dict":
        job.plain.load_state_dict({k: torch.zeros_like(v) for k, v in job.plain.state_dict().items()})
    elif how.startswith("other-optimizer"):
        for p in job.plain.parameters():
            p.grad = torch.ones_like(p)
        torch.optim.SGD(job.plain.parameters(), lr=0.5, foreach=how.endswith("foreach")).step()
    elif how == "data-assigned":
        w.data = torch.zeros(BIG, BIG)
    elif how == "new-parameter":
        job.plain.weight = torch.nn.Parameter(torch.zeros(BIG, BIG))
    elif how == "optimizer.load_state_dict":
        job.opt_plain.load_state_dict(job.opt_plain.state_dict())


def _manager(url: Any, snapshot: Any = "pipelined", **kw: Any) -> DistributedCheckpointManager:
    saves = SaveOptions(asynchronous=True, snapshot=snapshot)
    return DistributedCheckpointManager(url, lease_options=LeaseOptions(ttl=30.0), save_options=saves, **kw)


def _restored(mesh: Any, rank: int, url: str) -> tuple[int | None, dict[str, str]]:
    fresh = Job(mesh, rank)
    fresh.step()  # optimizer state exists, with other values than any saved one
    with _manager(url) as dm:
        pos = dm.restore(fresh.state)
    return (pos.step if pos else None), fresh.tensors()


def exact(cfg: dict[str, Any], mesh: Any, rank: int) -> dict[str, Any]:
    """Async save with training right after it, against a blocking save of the same state."""
    job = Job(mesh, rank)
    for _ in range(3):
        job.step()
    url_async, url_block = (os.path.join(cfg["out"], f"exact-{k}") for k in ("async", "block"))
    at_save = job.tensors()
    with _manager(url_block) as dm:
        dm.save(job.state, step=3, blocking=True)
    held = Held()
    try:
        dm = _manager(url_async)
        dm.save(job.state, step=3, blocking=False)
        pause = [c for c in held.calls if c[0]]  # the copies on the training thread, before any step
        snapshot = dict(dm.last_snapshot)
        job.forward()  # changes the buffer before the step, as a forward does
        held.go.set()
        job.step()  # waits for the deferred copy, then changes parameters and optimizer state
        job.step()
        dm.wait()
        dm.close()
    finally:
        held.undo()
    step_only = job.step_only()
    background = [c for c in held.calls if not c[0]]
    results = {}
    for name, url in (("async", url_async), ("block", url_block)):
        results[name] = _restored(mesh, rank, url)
    return {
        "at_save": at_save,
        "async": results["async"],
        "block": results["block"],
        "pause_bytes": sum(c[2] for c in pause),
        "pause_step_only": [c[1] in step_only for c in pause],
        "background_step_only": [c[1] in step_only for c in background],
        "background_bytes": sum(c[2] for c in background),
        "step_only_bytes": sum(step_only.values()),
        "snapshot": snapshot,
    }


def broken(cfg: dict[str, Any], mesh: Any, rank: int, how: str, editor: int, snapshot: str) -> dict[str, Any]:
    """Commit step 1; save step 2 in the background and ``how``-edit on rank ``editor`` meanwhile."""
    job = Job(mesh, rank)
    job.step()
    url = os.path.join(cfg["out"], f"root-{how}-{editor}-{snapshot}")
    late = how.startswith("after-copy:")
    edit = how.removeprefix("after-copy:")
    backend: Any = open_backend(url)
    gate = Gate(backend, "step-0000000002", rank) if late else None
    dm = _manager(gate or backend, snapshot=snapshot)
    dm.save(job.state, step=1, blocking=True)
    first = job.tensors()
    job.step()
    at_save = job.tensors()
    error: dict[str, Any] | None = None
    held = None if late else Held()
    try:
        dm.save(job.state, step=2, blocking=False)
        if gate is not None:
            assert gate.arrived.wait(MAX_WAIT)
        if rank == editor:
            _edit(job, edit)
        if gate is not None:
            if rank == editor:
                job.step()  # its pre-hook records the counters the commit compares with
            gate.go.set()
        if held is not None:
            held.go.set()
        try:
            dm.wait()
        except CkptError as exc:
            error = {"type": type(exc).__name__, "message": str(exc)}
    finally:
        if held is not None:
            held.undo()
        dm.close()
    step, restored = _restored(mesh, rank, url)
    return {"error": error, "first": first, "at_save": at_save, "restored_step": step, "restored": restored}


def main() -> int:
    cfg = json.loads(sys.argv[1])
    rank, world = cfg["rank"], cfg["world"]
    dist.init_process_group("gloo", init_method=f"file://{cfg['init']}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    try:
        for sc in cfg["scenarios"]:
            t0 = time.monotonic()
            if sc["kind"] == "exact":
                result = exact(cfg, mesh, rank)
            else:
                result = broken(cfg, mesh, rank, sc["how"], sc["editor"], sc.get("snapshot", "pipelined"))
            result["seconds"] = time.monotonic() - t0
            path = os.path.join(cfg["out"], f"{sc['name']}-{rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(result, f)
            os.replace(path + ".tmp", path)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
