"""Ranks of small torch.distributed jobs for the distributed tests (``python -m tests.support._dist_child``).

``zygote`` forks one rank per JSON line on stdin (see :func:`zygote`); a single JSON argument
runs one rank in this process. A rank's config: ``mode`` ("ddp", "dtensor", "zombie"), ``rank``,
``world``, ``init`` (a FileStore path), ``url``, ``out`` (a folder for results/markers) and
mode-specific fields. Every result is a JSON file under ``out``; tensors are compared as hex of
their bytes, so "equal" means bit-identical. What to assert lives in tests/test_distributed_*.py.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ckptsdk import LeaseOptions
from ckptsdk.backends import open_backend
from ckptsdk.distributed import AppState, DistributedCheckpointManager
from ckptsdk.errors import CkptError, LeaseLostError

MAX_WAIT = 60.0  # every wait is bounded even if the parent forgets us


def _hex(t: torch.Tensor) -> str:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes().hex()


def _no_pickle() -> Any:
    """Restore paths must never unpickle: make every unpickling entry point raise.

    Returns the original ``pickle.Unpickler``: DCP's *save* exchanges its plans between ranks
    with ``all_gather_object`` (in memory, never from storage), which needs it back afterwards.
    """

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("pickle/torch.load called on a restore path")

    original = pickle.Unpickler
    pickle.load = refuse  # type: ignore[assignment]
    pickle.loads = refuse  # type: ignore[assignment]
    pickle.Unpickler = refuse  # type: ignore[assignment,misc]
    torch.load = refuse  # type: ignore[assignment]
    return original


def _write(out: str, name: str, obj: Any) -> None:
    tmp = os.path.join(out, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, os.path.join(out, name))


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + MAX_WAIT
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)


class _StallingBackend:
    """Delegates to a backend; after writing this rank's DCP file into a folder whose name holds
    ``marker``, reports it in ``signal`` and stalls (the parent SIGKILLs it: a rank dying mid-save)."""

    def __init__(self, inner: Any, marker: str, signal: str) -> None:
        self._inner, self._marker, self._signal = inner, marker, signal

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write(self, key: str, data: Any) -> Any:
        info = self._inner.write(key, data)
        if self._marker in key and "/rank-" in key:
            with open(self._signal, "w") as f:
                f.write(key)
            time.sleep(MAX_WAIT)
        return info


def ddp(cfg: dict[str, Any]) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = cfg["rank"]
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = {"app": AppState(model, opt)}
    backend: Any = open_backend(cfg["url"], **cfg.get("options", {}))
    if cfg.get("kill_rank") == rank:
        backend = _StallingBackend(backend, f"step-{cfg['kill_step']:010d}", os.path.join(cfg["out"], "stalled"))
    dm = DistributedCheckpointManager(
        backend,
        save_every=cfg["save_every"],
        lease_options=LeaseOptions(ttl=cfg.get("ttl", 30.0)),
        async_save=bool(cfg.get("async")),
    )
    torch.manual_seed(100 + rank)  # per-rank data stream; a restore brings back each rank's own
    unpickler = _no_pickle() if cfg.get("no_pickle") else None
    pos = dm.restore(state)
    if unpickler is not None:
        pickle.Unpickler = unpickler  # type: ignore[misc]
    start = pos.step + 1 if pos else 1
    if pos is not None:
        assert dm.local == {"seen": pos.step}, dm.local
    for step in range(start, cfg["steps"] + 1):
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        dm.log_step(step, loss=loss.item())
        if dm.should_save(step):
            dm.save(state, step=step, local={"seen": step})
    result: dict[str, Any] = {
        "resumed_from": pos.step if pos else None,
        "params": {k: _hex(v) for k, v in model.module.state_dict().items()},
        "rng": _hex(torch.get_rng_state()),
    }
    report = dm.audit()
    if report is not None:
        result["audit"] = {
            "verdict": report.verdict,
            "overlap": report.overlap_steps,
            "max_diff": {k: v.max_abs_diff for k, v in report.scalars.items()},
        }
    dm.close()
    _write(cfg["out"], f"result-{rank}.json", result)


def dtensor(cfg: dict[str, Any]) -> None:
    """Save a sharded model+optimizer (FSDP2 when it works here, else DTensor), or restore one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank, world = cfg["rank"], cfg["world"]
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6))
    if cfg["phase"] == "restore":
        for p in model.parameters():  # different from the saved values, so a restore must change them
            torch.nn.init.zeros_(p)
    kind = cfg["kind"]
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        for name, p in list(model.named_parameters()):
            mod_name, _, pname = name.rpartition(".")
            mod = model.get_submodule(mod_name)
            setattr(mod, pname, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"app": AppState(model, opt)}
    dm = DistributedCheckpointManager(
        cfg["url"],
        lease_options=LeaseOptions(ttl=30.0),
        **({"storage_options": cfg["options"]} if cfg.get("options") else {}),
    )
    if cfg["phase"] == "save":
        torch.manual_seed(1 + rank)
        for _ in range(3):
            x = torch.randn(5, 8)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        dm.save(state, step=3)
    else:
        _no_pickle()
        pos = dm.restore(state)
        assert pos is not None and pos.step == 3, pos
    full = _full_state(state["app"])
    dm.close()
    if rank == 0:
        _write(cfg["out"], f"{cfg['phase']}-{world}.json", {k: _hex(v) for k, v in full.items()})


def _full_state(app: AppState) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optim = get_state_dict(
        app.model, app.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=False)
    )
    out = {f"model.{k}": v for k, v in model.items()}
    for pid, st in optim["state"].items():
        for k, v in st.items():
            out[f"optim.{pid}.{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def zombie(cfg: dict[str, Any]) -> None:
    """Save at step 2, report ready, wait for the parent's go, then try to save step 4."""
    rank = cfg["rank"]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    state = {"app": AppState(model, None)}
    dm = DistributedCheckpointManager(
        cfg["url"],
        lease_options=LeaseOptions(ttl=cfg["ttl"]),
        save_every=2,
        **({"storage_options": cfg["options"]} if cfg.get("options") else {}),
    )
    pos = dm.restore(state)
    start = pos.step + 1 if pos else 1
    outcome: dict[str, Any] = {"resumed_from": pos.step if pos else None, "saved": []}
    for step in range(start, cfg["steps"] + 1):
        with torch.no_grad():
            model.weight.add_(1.0)
        if step == cfg.get("pause_after", -1) + 1:
            if rank == 0:
                _write(cfg["out"], f"ready-{cfg['job']}", {"pid": os.getpid()})
            _wait_for(os.path.join(cfg["out"], f"go-{cfg['job']}"))
        if dm.should_save(step):
            try:
                outcome["saved"].append(dm.save(state, step=step))
            except LeaseLostError as exc:
                outcome["refused"] = {"step": step, "type": type(exc).__name__}
                break
    dm.close()
    _write(cfg["out"], f"{cfg['job']}-{rank}.json", outcome)


def run(cfg: dict[str, Any]) -> int:
    """One rank: join the job's FileStore, run the mode, leave. 3 when a CkptError ended it."""
    for k, v in cfg.get("env", {}).items():
        os.environ[k] = v
    dist.init_process_group("gloo", init_method=f"file://{cfg['init']}", rank=cfg["rank"], world_size=cfg["world"])
    try:
        {"ddp": ddp, "dtensor": dtensor, "zombie": zombie}[cfg["mode"]](cfg)
    except CkptError as exc:
        print(f"rank {cfg['rank']}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    finally:
        dist.destroy_process_group()
    return 0


def zygote() -> None:
    """Fork one rank per stdin line (its cfg as JSON); print ``pid N``; record each exit status.

    torch and ckptsdk are imported once here (seconds on a loaded machine), each rank is a fork:
    a real process of its own that the test can SIGKILL or SIGSTOP. Its output goes to
    ``cfg["log"]``, its exit status (negative: the signal) to ``cfg["status"]``. The zygote
    never runs a torch op nor starts a thread, so forking it is safe. It exits at end of input.
    """
    import select

    live: dict[int, str] = {}
    open_input = True
    while open_input or live:
        if open_input and select.select([sys.stdin], [], [], 0.05)[0]:
            line = sys.stdin.readline()
            if not line:
                open_input = False
                continue
            cfg = json.loads(line)
            pid = os.fork()
            if pid == 0:
                fd = os.open(cfg["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                code = 1
                try:
                    code = run(cfg)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            live[pid] = cfg["status"]
            print(f"pid {pid}", flush=True)
        elif not open_input:
            time.sleep(0.05)
        while live:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            path = live.pop(pid)
            with open(path + ".tmp", "w") as f:
                f.write(str(code))
            os.replace(path + ".tmp", path)


if __name__ == "__main__":
    if sys.argv[1:] == ["zygote"]:
        zygote()
    else:
        sys.exit(run(json.loads(sys.argv[1])))
