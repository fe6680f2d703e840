"""The CIFAR job ``bench_overhead`` and ``gpu_like`` time: model, optimizer, schedule and step.

A module of its own so that each benchmark imports it, not the other benchmark (``bench_overhead``
runs ``gpu_like`` for ``--step gpu-like``, and ``gpu_like`` times this job on CUDA). Timing and
saving do not belong here.
"""

from __future__ import annotations

import warnings

import torch

from adapters.cifar10.model import build_model
from ckptsdk import TrainState

__all__ = ["Job"]


class Job:
    """The CIFAR job's model, optimizer, schedule and step, on synthetic images."""

    def __init__(
        self, width: int, batch_size: int, total_steps: int, seed: int = 0, *, device: str = "cpu", amp: bool = False
    ) -> None:
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.amp = amp and self.device.type == "cuda"  # fp16 autocast + GradScaler, as the job on CUDA
        self.model = build_model(width=width).to(self.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=0.1, total_steps=total_steps + 10)
        self.scaler = torch.amp.GradScaler(self.device.type)
        self.state = TrainState(model=self.model, optimizer=self.opt, scheduler=self.sched, scaler=self.scaler)
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(batch_size * 4, 3, 32, 32, generator=gen).to(self.device)
        self.y = torch.randint(0, 10, (batch_size * 4,), generator=gen).to(self.device)
        self.batch_size = batch_size

    def step(self, i: int) -> torch.Tensor:
        b = self.batch_size
        lo = (i % 4) * b
        x = self.x[lo : lo + b]
        if i % 2:
            x = x.flip(3)  # the job's random flip, made deterministic
        with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.amp):
            loss = torch.nn.functional.cross_entropy(self.model(x), self.y[lo : lo + b])
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.sched.step()
        return loss.detach()
