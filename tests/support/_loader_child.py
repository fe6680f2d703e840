"""A small training job over a shuffled multi-worker DataLoader, killed by SIGKILL where asked.

Usage: ``python -m tests.support._loader_child ROOT --loader ckptsdk|stateful [--kill-after N]
[--save-every K] [--perturb] [--workers W]``. With ``--kill-after N`` the job, after step N,
waits until the run log holds step N (the flusher thread, not a save, publishes it) and
SIGKILLs itself. ``--perturb`` draws once more from torch's RNG after a restore (a divergence
the audit must catch). Used by tests/loader/test_loader_resume.py.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading

import numpy as np
import torch

import ckptsdk
from ckptsdk import LeaseOptions
from ckptsdk.runlog.audit import read_runlog

SAMPLES, BATCH, EPOCHS = 40, 8, 3  # 5 batches an epoch, 15 steps


class Augmented(torch.utils.data.Dataset):
    """Map-style; every item draws from torch, random and numpy (augmentation in the workers)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 6, generator=g)
        self.y = torch.randint(0, 3, (SAMPLES,), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.1 * torch.randn(6)
        if random.random() < 0.5:
            x = x.flip(0)
        x = x * float(np.random.uniform(0.9, 1.1))
        return x, self.y[i]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--loader", choices=["ckptsdk", "stateful"], default="ckptsdk")
    ap.add_argument("--kill-after", type=int, default=None)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--perturb", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    torch.use_deterministic_algorithms(True)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=EPOCHS * SAMPLES // BATCH)
    if args.loader == "ckptsdk":
        loader = ckptsdk.DataLoader(Augmented(), batch_size=BATCH, shuffle=True, seed=7, num_workers=args.workers)
    else:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(Augmented(), batch_size=BATCH, shuffle=True, num_workers=args.workers)
    state = ckptsdk.TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader)
    mgr = ckptsdk.CheckpointManager(
        args.root, save_every=args.save_every, keep_last=2, lease_options=LeaseOptions(ttl=2.0)
    )
    pos = mgr.restore(state)
    if pos is not None and args.perturb:
        torch.rand(1)  # one draw too many: the next dropout mask differs
    step = pos.step if pos else 0
    # ckptsdk.DataLoader knows its epoch; a StatefulDataLoader restarts at the saved epoch (after
    # a save at an epoch's last batch, its first iteration finishes that epoch empty).
    start = loader.epoch if isinstance(loader, ckptsdk.DataLoader) else (pos.epoch if pos else 0)
    for epoch in range(start, EPOCHS):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            mgr.log_step(step, loss=loss.detach())
            if mgr.should_save(step):
                if isinstance(loader, ckptsdk.DataLoader):
                    mgr.save(state, step=step)  # epoch and batch_idx come from the loader
                else:
                    mgr.save(state, step=step, epoch=epoch)
            if step == args.kill_after:
                _die_once_logged(args.root, step)
    mgr.close()
    return 0


def _die_once_logged(root: str, step: int) -> None:
    """SIGKILL this process once the run log on storage holds ``step`` (published by the flusher)."""
    backend = ckptsdk.open_backend(root)
    done = threading.Event()
    for _ in range(600):
        _, steps, _ = read_runlog(backend)
        if any(step in rows for rows in steps.values()):
            break
        done.wait(0.1)
    else:
        print(f"step {step} never reached the run log", file=sys.stderr)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
