"""A DDP job checkpointed with ckptsdk.distributed: kill it anywhere, run it again, it resumes.

    torchrun --nproc-per-node 2 -m examples.train_ddp --url /tmp/ddp-run --steps 200

CPU and gloo (NCCL when every rank has a GPU). Each rank draws its batches from its own RNG, which
the checkpoint restores to that rank, so a resumed run ends bit-identical to an uninterrupted one.
No logic of its own beyond wiring; the checkpointing lives in ckptsdk/distributed/.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ckptsdk.distributed import AppState, DistributedCheckpointManager


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True, help="checkpoint root (path, gs://..., drive://...)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--async-save", action="store_true", help="save from a background thread")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    model = DDP(net, device_ids=[device.index] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"app": AppState(model, opt)}
    dm = DistributedCheckpointManager(args.url, save_every=args.save_every, async_save=args.async_save)
    torch.manual_seed(1000 + rank)  # this rank's data stream (restored per rank on resume)
    pos = dm.restore(state)
    start = pos.step + 1 if pos else 1
    if rank == 0:
        print(f"{'resuming after step ' + str(pos.step) if pos else 'fresh start'}; running to {args.steps}")
    for step in range(start, args.steps + 1):
        x = torch.randn(64, 32).to(device)
        y = x[:, :1].sin()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        dm.log_step(step, loss=loss.item())
        if dm.should_save(step):
            dm.save(state, step=step, metrics={"loss": loss.item()})
    if start <= args.steps and not dm.should_save(args.steps):  # the steps since the last save
        dm.save(state, step=args.steps, metrics={"loss": loss.item()})
    dm.close()
    if rank == 0:
        report = dm.audit()
        last = f", loss {loss.item():.6f}" if start <= args.steps else " (nothing left to run)"
        print(f"done at step {args.steps}{last}; audit: {report.verdict}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
