"""An Accelerate job in the loop its docs show, for the epoch tests (run as a child process).

``python -m tests.support._accelerate_epoch_child URL ORDER [--kill-at STEP] [--no-generator]``:
a prepared, shuffled DataLoader (``use_seedable_sampler=True``); on resume
``accelerator.skip_first_batches`` for the rest of the killed epoch, then the original loader,
and no ``set_epoch`` anywhere. Each step appends ``step epoch ids`` to ORDER before it trains;
with ``--kill-at`` the process SIGKILLs itself as that step begins. Not a test: the parent's side
is tests/integrations/test_accelerate_epochs.py.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch

N, BATCH, EPOCHS = 24, 4, 3  # 6 steps an epoch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("order")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--no-generator", action="store_true")
    args = p.parse_args()

    from accelerate import Accelerator, DataLoaderConfiguration

    from ckptsdk.integrations.accelerate import AcceleratorCheckpoints

    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    x = torch.randn(N, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(x, torch.arange(N))
    generator = None if args.no_generator else torch.Generator().manual_seed(5)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, generator=generator)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, loader = acc.prepare(model, opt, loader)
    with AcceleratorCheckpoints(acc, args.url, save_every=4, lease_ttl=2.0) as ckpt:
        pos = ckpt.restore()
        step, first_epoch, done = (0, 0, 0) if pos is None else (pos.step, pos.epoch, pos.batch_idx)
        for epoch in range(first_epoch, EPOCHS):
            batches = acc.skip_first_batches(loader, done) if done else loader
            for i, (xb, ids) in enumerate(batches, start=done + 1):
                step += 1
                if step == args.kill_at:
                    ckpt.manager.wait()  # the last save is committed: the resume point is known
                    os.kill(os.getpid(), signal.SIGKILL)
                with open(args.order, "a", encoding="utf-8") as f:
                    f.write(f"{step} {epoch} {' '.join(map(str, ids.tolist()))}\n")
                loss = model(xb).pow(2).mean()
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
                ckpt.log_step(step, loss=loss.item())
                if ckpt.should_save(step):
                    ckpt.save(step, epoch=epoch, batch_idx=i)
            done = 0


if __name__ == "__main__":
    main()
