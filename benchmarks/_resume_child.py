"""The processes ``bench_resume.py`` times: run as ``python benchmarks/_resume_child.py ROLE URL``.

``writer``: the CIFAR ResNet-18 job on synthetic data, saving every ``--every`` steps, printing
``committed STEP`` once each save has committed, until it is SIGKILLed (``MAX_STEPS`` bounds it).
``resume``: what a fresh process does after its predecessor died: import, build the job, open
the manager (the lease), restore, one training step, printing ``at PHASE MONOTONIC [STEP]``
after each phase; then it closes and exits. ``--torch``: the same with ``torch.save`` (to a temp
name, then ``os.replace``) and ``torch.load`` instead of ckptsdk, which is then never imported.

ckptsdk is imported inside functions only: the torch row must not pay for it, and
``bench_resume --code PATH`` puts another checkout first on PYTHONPATH, so ckptsdk (and
``adapters``) come from there; ``code PATH`` names the ckptsdk a child runs. Nothing of the
parent (``bench_resume``) belongs here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any

import torch

from adapters.cifar10.model import build_model

MAX_STEPS = 100_000  # a writer the parent forgot to kill still ends


def say(line: str) -> None:
    """One protocol line on stdout, unbuffered (the parent reads it as it comes)."""
    os.write(1, (line + "\n").encode())


class Job:
    """The CIFAR job's state and step (SGD momentum + OneCycleLR + GradScaler), synthetic images.

    The step is ``benchmarks.overhead_job.Job.step`` on the CPU; that module imports ckptsdk at
    its top, which the torch row must not, hence this copy of a dozen lines.
    """

    def __init__(self, width: int, batch_size: int, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = build_model(width=width)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=0.1, total_steps=MAX_STEPS + 10)
        self.scaler = torch.amp.GradScaler("cpu")
        self.objects: dict[str, Any] = {
            "model": self.model,
            "optimizer": self.opt,
            "scheduler": self.sched,
            "scaler": self.scaler,
        }
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(batch_size * 4, 3, 32, 32, generator=gen)
        self.y = torch.randint(0, 10, (batch_size * 4,), generator=gen)
        self.batch_size = batch_size

    def step(self, i: int) -> float:
        b = self.batch_size
        lo = (i % 4) * b
        x = self.x[lo : lo + b]
        if i % 2:
            x = x.flip(3)
        loss = torch.nn.functional.cross_entropy(self.model(x), self.y[lo : lo + b])
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.sched.step()
        return float(loss)

    def tree(self) -> dict[str, Any]:
        return {k: v.state_dict() for k, v in self.objects.items()}

    def load(self, tree: dict[str, Any]) -> None:
        for k, v in self.objects.items():
            v.load_state_dict(tree[k])


def torch_save(job: Job, path: str, step: int) -> None:
    tree = job.tree()
    tree["step"] = step
    tmp = path + ".tmp"
    torch.save(tree, tmp)
    os.replace(tmp, path)  # a kill inside torch.save leaves the previous file whole


def writer(args: argparse.Namespace) -> None:
    job = Job(args.width, args.batch_size)
    if args.torch:
        for i in range(1, MAX_STEPS):
            job.step(i)
            if i % args.every == 0:
                torch_save(job, args.url, i)
                say(f"committed {i}")
        return
    ckptsdk = _ckptsdk()
    state = ckptsdk.TrainState(**job.objects)
    mgr = ckptsdk.CheckpointManager(args.url)  # default lease options: what a user writes
    pos = mgr.restore(state)
    first = (pos.step if pos else 0) + 1
    for i in range(first, MAX_STEPS):
        job.step(i)
        if i % args.every == 0:
            mgr.save(state, step=i)
            mgr.wait()
            say(f"committed {i}")
    mgr.close()


def _ckptsdk() -> Any:
    import ckptsdk

    say(f"code {os.path.dirname(os.path.dirname(os.path.abspath(ckptsdk.__file__)))}")
    return ckptsdk


def resume(args: argparse.Namespace) -> None:
    ckptsdk = None if args.torch else _ckptsdk()
    say(f"at import {time.monotonic():.6f}")
    job = Job(args.width, args.batch_size)
    state = None if ckptsdk is None else ckptsdk.TrainState(**job.objects)
    say(f"at build {time.monotonic():.6f}")
    mgr = None if ckptsdk is None else ckptsdk.CheckpointManager(args.url)  # default lease options
    say(f"at open {time.monotonic():.6f}")  # torch: nothing to open; the phases stay aligned
    if mgr is None:
        step = 0
        if os.path.exists(args.url):
            tree = torch.load(args.url, weights_only=False)
            job.load(tree)
            step = int(tree["step"])
    else:
        pos = mgr.restore(state)
        step = pos.step if pos else 0
    say(f"at restore {time.monotonic():.6f} {step}")
    job.step(step + 1)
    say(f"at step {time.monotonic():.6f}")
    if mgr is not None:
        mgr.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", choices=("writer", "resume"))
    ap.add_argument("url", help="checkpoint root (ckptsdk) or file (--torch)")
    ap.add_argument("--torch", action="store_true", help="torch.save/torch.load instead of ckptsdk")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--every", type=int, default=2, help="writer: save every this many steps")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.role == "writer":
            writer(args)
        else:
            resume(args)
    except BaseException as exc:  # the parent reports it in the row instead of waiting it out
        say(f"error {type(exc).__name__}: {exc}".replace("\n", " ")[:2000])
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
