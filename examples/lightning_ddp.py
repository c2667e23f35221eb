#!/usr/bin/env python
"""PyTorch Lightning DDP on railcc: a tiny regression model, fixed seeds, CPU.

Lightning takes the backend by name through its DDP strategy; `import railcc` registers it.

    torchrun --nproc-per-node 2 examples/lightning_ddp.py --backend railcc
    torchrun --nproc-per-node 2 examples/lightning_ddp.py --backend gloo     # the same losses

Rank 0 prints ``step N loss X`` for every step (the mean over ranks of each rank's batch loss)
and ``checksum X`` (the sum of the final parameters), so two runs can be compared line by line.
"""

import argparse
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import railcc  # noqa: F401  registers the "railcc" backend

try:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:  # the older package name
    import pytorch_lightning as L
    from pytorch_lightning.strategies import DDPStrategy


class Regression(L.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        self.lr = lr

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        # The mean over ranks, reduced through the process group: one all_reduce per step.
        self.log("loss", loss, sync_dist=True, on_step=True, prog_bar=False)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        loss = outputs["loss"].detach().clone()
        torch.distributed.all_reduce(loss)
        if self.global_rank == 0:
            print(f"step {batch_idx} loss {loss.item() / self.trainer.world_size:.6f}", flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="railcc")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8 * a.steps * world, 16), torch.randn(8 * a.steps * world, 4))
    L.seed_everything(0, verbose=False)
    model = Regression(a.lr)
    trainer = L.Trainer(accelerator="cpu", devices=world, num_nodes=1, max_steps=a.steps,
                        strategy=DDPStrategy(process_group_backend=a.backend), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    # Lightning adds a DistributedSampler: each rank takes its own part of every epoch.
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=False))
    if trainer.global_rank == 0:
        print(f"backend {torch.distributed.get_backend()}", flush=True)
        print(f"checksum {sum(p.sum().item() for p in model.parameters()):.6f}", flush=True)


if __name__ == "__main__":
    main()
