"""Child processes for the lease tests: a lease holder, a racing newcomer, and the story's writers.

Run as ``python -m tests.support._story_writer MODE URL --events FILE [...]``; every mode appends JSON
lines ({"event": ..., "t": time.monotonic(), ...}) to FILE, so the test (same machine, same
monotonic clock) can order them against its own SIGSTOP/SIGCONT/SIGKILL. Not a test by itself.

Modes:
  hold   acquire the lease, heartbeat, sleep until killed (bounded by --max-seconds).
  race   wait for --go FILE, then acquire once: "won" (then hold --hold seconds) or "held".
  train  the story's writer: open a CheckpointManager, restore, train-and-save every --interval
         seconds until LeaseLostError (A), or --saves times then wait for --check FILE and
         restore again (B).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from ckptsdk import LeaseOptions


class Events:
    """Append-only JSON-lines event log, flushed at every line (the process may be SIGKILLed)."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()  # the lease heartbeat emits from its own thread

    def emit(self, event: str, **fields: Any) -> None:
        with self._lock:
            self._f.write(json.dumps({"event": event, "t": time.monotonic(), "pid": os.getpid(), **fields}) + "\n")
            self._f.flush()


def _trace_renewals(lease: Any, ev: Events) -> None:
    """Emit "renewed" / "renew_lost" (with when each began, ``t0``) for every renewal of
    ``lease``, the heartbeat's and the saves': tests order them against other events."""
    from ckptsdk.errors import LeaseLostError

    renew = lease.renew

    def traced() -> Any:
        t0 = time.monotonic()
        try:
            record = renew()
        except LeaseLostError as exc:
            ev.emit("renew_lost", t0=t0, newer_epoch=exc.newer_epoch)
            raise
        ev.emit("renewed", t0=t0, epoch=record.epoch, renewals=record.renewals)
        return record

    lease.renew = traced


def _wait_for(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)


def _open(args: argparse.Namespace) -> Any:
    from ckptsdk.backends import open_backend

    return open_backend(args.url, **json.loads(args.options))


def hold(args: argparse.Namespace, ev: Events) -> int:
    from ckptsdk.lease.acquire import Lease

    lease = Lease(_open(args), ttl=args.ttl, wait_timeout=args.wait)
    record = lease.acquire()
    _trace_renewals(lease, ev)
    lease.start_heartbeat()
    ev.emit("acquired", epoch=record.epoch, attempt=record.attempt, nonce=record.holder.nonce)
    deadline = time.monotonic() + args.max_seconds
    while time.monotonic() < deadline and not lease.fenced:
        time.sleep(0.05)
    ev.emit("fenced" if lease.fenced else "timeout")
    lease.release()
    return 0


def race(args: argparse.Namespace, ev: Events) -> int:
    from ckptsdk.errors import LeaseHeldError
    from ckptsdk.lease.acquire import Lease

    backend = _open(args)
    ev.emit("ready")
    _wait_for(args.go, args.max_seconds)
    lease = Lease(backend, ttl=args.ttl, wait_timeout=args.wait)
    try:
        record = lease.acquire()
    except LeaseHeldError as exc:
        ev.emit("held", message=str(exc), holder=exc.holder)
        return 0
    lease.start_heartbeat()
    ev.emit("won", epoch=record.epoch, attempt=record.attempt, nonce=record.holder.nonce)
    time.sleep(args.hold)
    lease.release()
    ev.emit("released")
    return 0


def _digests(backend: Any, folder: str) -> dict[str, str]:
    return {o.key: hashlib.sha256(backend.read(o.key)).hexdigest() for o in backend.list(folder + "/")}


def state_digest(model: Any) -> str:
    """sha256 over a module's state_dict tensors, by name: the same bytes give the same digest."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _fix_nonce(prefix: str) -> None:
    """Make this process's lease nonces start with ``prefix``: its writer tag, so a test decides
    which of two writers of one epoch outranks the other (tags order them)."""
    import uuid

    import ckptsdk.lease.acquire as acquire

    class _Nonces:
        @staticmethod
        def uuid4() -> uuid.UUID:
            return uuid.UUID(hex=(prefix + uuid.uuid4().hex)[:32])

    acquire.uuid = _Nonces  # type: ignore[assignment]


def train(args: argparse.Namespace, ev: Events) -> int:
    import torch

    from ckptsdk.errors import LeaseLostError
    from ckptsdk.manager import CheckpointManager
    from ckptsdk.state import TrainState

    if args.nonce_prefix:
        _fix_nonce(args.nonce_prefix)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = TrainState(model=model, optimizer=opt)
    ev.emit("ready")
    if args.go:
        _wait_for(args.go, args.max_seconds)
    t_open = time.monotonic()
    mgr = CheckpointManager(
        args.url,
        keep_last=args.keep_last,
        lease_options=LeaseOptions(ttl=args.ttl, wait=args.wait, force=args.force, settle=args.settle),
        storage_options=json.loads(args.options),
    )
    assert mgr.lease is not None
    _trace_renewals(mgr.lease, ev)
    ev.emit("acquired", t_open=t_open, epoch=mgr.lease.epoch, attempt=mgr.lease.attempt, run_id=mgr.lease.run_id)
    pos = mgr.restore(state)
    step = pos.step if pos is not None else args.step_offset
    ev.emit(
        "restored",
        step=pos.step if pos else None,
        key=pos.key if pos else None,
        lease_epoch=pos.lease_epoch if pos else None,
    )
    deadline = time.monotonic() + args.max_seconds
    saves = 0
    while time.monotonic() < deadline and (args.saves is None or saves < args.saves):
        step += 1
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t0 = time.monotonic()
        try:
            info = mgr.save(state, step=step, metrics={"loss": loss.item()})
        except LeaseLostError as exc:
            ev.emit("lost", step=step, t0=t0, epoch=exc.epoch, newer_epoch=exc.newer_epoch, message=str(exc))
            mgr.close()
            ev.emit("closed")
            return 0
        saves += 1
        ev.emit("saved", step=step, key=info.key, epoch=info.epoch, t0=t0, state=state_digest(model))
        time.sleep(args.interval)
    if args.check:
        # "B's checkpoints": every valid checkpoint of this epoch now, with its files' digests.
        mine = {c.key: _digests(mgr.backend, c.key) for c in mgr.list() if c.valid and c.epoch == mgr.lease.epoch}
        ev.emit("mine", checkpoints=mine)
        _wait_for(args.check, args.max_seconds)
        fresh = TrainState(
            model=torch.nn.Linear(8, 4), optimizer=torch.optim.SGD(torch.nn.Linear(8, 4).parameters(), lr=0.01)
        )
        again = mgr.restore(fresh)
        ev.emit("final_restore", key=again.key if again else None, step=again.step if again else None)
    mgr.close()
    ev.emit("closed")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("mode", choices=["hold", "race", "train"])
    p.add_argument("url")
    p.add_argument("--events", required=True)
    p.add_argument("--options", default="{}", help="storage options as JSON")
    p.add_argument("--ttl", type=float, default=2.0)
    p.add_argument("--wait", type=float, default=None, help="lease wait_timeout")
    p.add_argument("--go", default=None, help="start (race/train) once this file exists")
    p.add_argument("--check", default=None, help="train: restore again once this file exists")
    p.add_argument("--hold", type=float, default=0.0, help="race: seconds the winner holds")
    p.add_argument("--saves", type=int, default=None, help="train: stop after this many saves")
    p.add_argument("--interval", type=float, default=0.2, help="train: seconds between saves")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--force", action="store_true", help="train: break the lease at once")
    p.add_argument("--settle", type=float, default=None, help="train: the lease's settle (Drive)")
    p.add_argument("--step-offset", type=int, default=0, help="train: a fresh run's first step is this + 1")
    p.add_argument("--nonce-prefix", default="", help="train: hex digits the lease nonce starts with")
    p.add_argument("--max-seconds", type=float, default=120.0, help="bound on every wait/loop")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {args.mode}[%(process)d] %(name)s %(levelname)s %(message)s",
    )
    ev = Events(args.events)
    try:
        return {"hold": hold, "race": race, "train": train}[args.mode](args, ev)
    except BaseException as exc:
        ev.emit("error", type=type(exc).__name__, message=str(exc))
        raise


if __name__ == "__main__":
    sys.exit(main())
