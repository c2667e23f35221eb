#!/usr/bin/env python
"""DeepSpeed ZeRO on railcc: a tiny regression model, fixed seeds, CPU.

DeepSpeed takes the backend by name (`deepspeed.init_distributed(dist_backend=...)`); on a
machine without a GPU it runs on its CPU accelerator (DS_ACCELERATOR=cpu, set here when unset).

    torchrun --nproc-per-node 2 examples/deepspeed_zero.py --backend railcc --stage 2
    torchrun --nproc-per-node 2 examples/deepspeed_zero.py --backend gloo --stage 2   # the same losses

Rank 0 prints ``step N loss X`` (the mean over ranks of each rank's batch loss) and
``checksum X`` (the sum of the final parameters, gathered where ZeRO-3 partitions them).
"""

import argparse
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import railcc  # noqa: E402,F401  registers the "railcc" backend
import deepspeed  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="railcc")
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    a = p.parse_args()
    deepspeed.init_distributed(dist_backend=a.backend)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "zero_optimization": {"stage": a.stage},
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(1)
    for step in range(a.steps):
        x, y = torch.randn(8 * world, 16, generator=g), torch.randn(8 * world, 4, generator=g)
        mine = slice(8 * rank, 8 * (rank + 1))
        loss = nn.functional.mse_loss(engine(x[mine]), y[mine])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        if rank == 0:
            print(f"step {step} loss {total.item() / world:.6f}", flush=True)
    if a.stage == 3:  # parameters are partitioned: gather them to sum them
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            checksum = sum(q.sum().item() for q in engine.module.parameters())
    else:
        checksum = sum(q.sum().item() for q in engine.module.parameters())
    if rank == 0:
        print(f"backend {torch.distributed.get_backend()}", flush=True)
        print(f"checksum {checksum:.6f}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
