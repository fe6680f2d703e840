"""A training job for the preemption tests (run as ``python -m tests.support._preempt_child ROOT MAX_STEP``).

A small model trained deterministically on CPU, a manager with ``save_on_signal`` on (the
default in the main thread) and save_every far away, so the only saves are the ones a signal asks
for. It prints ``step N`` after each step (flushed), so the parent signals at a step it chose.
``CKPT_SLOW_WRITE=S`` sleeps S seconds before each tensor-file write (printing ``writing``), to
signal again during the save; ``CKPT_SLOW_ALL=S`` makes every storage call after restore take S
seconds (a slow store); ``CKPT_DEADLINE`` sets ``signal_deadline``. At the end it prints
``done DIGEST`` with a digest of the final parameters. ``CKPT_HOLD_AT=N`` holds step N (up to
60 s) until a signal has asked for a save, so a busy machine cannot let the job run past the step
the parent aims at before its signal lands.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

import torch

from ckptsdk import CheckpointManager, LeaseOptions, SaveOptions, TrainState, open_backend
from ckptsdk.testing import FaultyBackend

_ARMED = [False]  # slow writes only after restore (a takeover's anchor writes at full speed)


def _slow(op: str, key: str, n: int) -> None:
    if _ARMED[0] and os.environ.get("CKPT_SLOW_ALL"):
        time.sleep(float(os.environ["CKPT_SLOW_ALL"]))  # a slow store: every call, every thread
    elif _ARMED[0] and op == "write" and key.endswith("tensors.safetensors"):
        print("writing", flush=True)
        time.sleep(float(os.environ["CKPT_SLOW_WRITE"]))
    return None


def main(root: str, max_step: int) -> None:
    # A shell starts background jobs with SIGINT ignored, and children inherit that, so under a
    # backgrounded CI run Python would leave it ignored (and so would ckptsdk, rightly). This job
    # stands in for an interactive one: Ctrl-C raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = TrainState(model=model, optimizer=opt)
    backend: object = root
    if os.environ.get("CKPT_SLOW_WRITE") or os.environ.get("CKPT_SLOW_ALL"):
        backend = FaultyBackend(open_backend(root), fail_on=_slow)
    mgr = CheckpointManager(
        backend,  # type: ignore[arg-type]
        lease_options=LeaseOptions(ttl=5, wait=30),
        save_options=SaveOptions(every=10**9, signal_deadline=float(os.environ.get("CKPT_DEADLINE", "10"))),
    )
    pos = mgr.restore(state)
    print(f"resumed={None if pos is None else pos.step}", flush=True)
    start = 1 if pos is None else pos.step + 1
    _ARMED[0] = True
    hold_at = int(os.environ.get("CKPT_HOLD_AT", "-1"))
    for step in range(start, max_step + 1):
        gen = torch.Generator().manual_seed(step)  # data and noise from (seed, step): resumable
        x = torch.randn(8, 16, generator=gen)
        y = torch.randint(0, 4, (8,), generator=gen)
        x = x + 0.01 * torch.randn(8, 16)  # draws from the global RNG, restored on resume
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mgr.log_step(step, loss=loss.item())
        print(f"step {step}", flush=True)
        time.sleep(0.02)  # a step long enough for the parent to aim at
        if step == hold_at:
            for _ in range(6000):  # bounded: 60 s
                if mgr.should_save(step):
                    break
                time.sleep(0.01)
        if mgr.should_save(step):
            mgr.save(state, step=step)
    mgr.close()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.state_dict().values()))
    print(f"done {digest.hexdigest()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
