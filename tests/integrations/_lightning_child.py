"""A Lightning fit killed mid-epoch (SIGKILL) and resumed, through CkptsdkCheckpointIO (a child).

``python -m tests.integrations._lightning_child ROOT WORK OUT --loader ckptsdk|torch [--workers W]
[--kill-at STEP]``: 6 batches an epoch, 3 epochs, a checkpoint every 4 optimizer steps (so the
one at step 8 is mid-epoch: 2 batches of epoch 1 done), dropout and random augmentation (so the
RNGs matter), each step's loss in ckptsdk's step log (``io.step_logger()``). With ``--kill-at``
the process SIGKILLs itself as that step begins, once the steps before it are in the step log. At the end the
weights and the optimizer state go to OUT (safetensors). Used by test_lightning_mid_epoch.py.
"""

from __future__ import annotations

import argparse
import os
import signal

import safetensors.torch
import torch

N, BATCH = 48, 8


class Augmented(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(N, 8, generator=g)
        self.y = (self.x.sum(dim=1, keepdim=True) > 0).float()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]


def main() -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    import ckptsdk
    from ckptsdk.integrations.lightning import CkptsdkCheckpointIO
    from tests.support._integration_jobs import wait_for_logged

    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("work")
    ap.add_argument("out")
    ap.add_argument("--loader", choices=["ckptsdk", "torch", "stateful"], default="ckptsdk")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--kill-at", type=int)
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
            )

        def training_step(self, batch, batch_idx):
            if args.kill_at is not None and self.global_step == args.kill_at:
                # The steps since the last save reach storage by the step log's flusher (every
                # second): wait for the last one, so the audit has steps to compare.
                wait_for_logged(args.root, self.global_step)
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch
            return torch.nn.functional.binary_cross_entropy_with_logits(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    if args.loader == "ckptsdk":
        loader = ckptsdk.DataLoader(Augmented(), batch_size=BATCH, shuffle=True, seed=7, num_workers=args.workers)
    elif args.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        torch.manual_seed(7)  # its sampler's seed is drawn from torch's global RNG
        loader = StatefulDataLoader(Augmented(), batch_size=BATCH, shuffle=True, num_workers=args.workers)
    else:
        g = torch.Generator().manual_seed(7)
        loader = torch.utils.data.DataLoader(
            Augmented(), batch_size=BATCH, shuffle=True, generator=g, num_workers=args.workers
        )
    module = Module()
    io = CkptsdkCheckpointIO(args.root, lease_ttl=2.0)
    trainer = L.Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        default_root_dir=args.work,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[io],
        callbacks=[
            ModelCheckpoint(dirpath=f"{args.work}/ckpt", save_last=True, every_n_train_steps=4, save_top_k=-1),
            io.step_logger(),
        ],
    )
    trainer.fit(module, loader, ckpt_path="last")
    opt = trainer.optimizers[0].state_dict()["state"]
    out = {f"net.{k}": v.detach().clone() for k, v in module.net.state_dict().items()}
    out.update({f"opt.{i}.{k}": v.clone() for i, s in opt.items() for k, v in s.items() if torch.is_tensor(v)})
    safetensors.torch.save_file({k: v.contiguous() for k, v in out.items()}, args.out)


if __name__ == "__main__":
    main()
