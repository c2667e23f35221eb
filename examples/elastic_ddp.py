#!/usr/bin/env python
"""DDP that keeps training when a rank dies: railcc shrinks the group, no restart.

    torchrun --nproc-per-node 4 examples/elastic_ddp.py --kill-rank 3 --kill-step 5

At step --kill-step, rank --kill-rank kills itself with SIGKILL in the middle of the step
(after its forward pass, before the gradient all-reduce). The survivors' all-reduce fails with
railcc.PeerFailureError naming it; each survivor calls ``dist.shrink_group(railcc.failed_ranks(
group_ranks=True), shrink_flags=SHRINK_ABORT)``, wraps the same module in a new DDP on the
shrunk default group, redoes the failed step and finishes the rest.

Every step's global batch comes from a fixed seed and each rank trains on its contiguous slice
of it, so after the shrink the survivors split the same global batch among fewer ranks: the
global batch, and so the learning rate, stay as they were (the step's gradient is the same
mean over the same samples). No step is lost; the failed one is redone.

Each survivor prints ``recovered in S s`` (from the victim's kill, whose time it wrote to the
store, to the first step completed on the shrunk group, one host clock) and ``checksum X``
(sum of its final parameters); the survivors all_gather their parameters at the end and every
one checks that all are bitwise identical (``parameters identical on N survivors``).
Keep the store's host alive: with plain env:// launching rank 0 hosts it, so the victim
defaults to the last rank (torchrun's agent hosts it itself).
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import railcc

SHRINK_ABORT = dist.distributed_c10d.SHRINK_ABORT


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-step", type=int, default=5)
    p.add_argument("--kill-rank", type=int, default=-1, help="default group rank to kill (-1: the last)")
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def batch(step, args):
    g = torch.Generator().manual_seed(args.seed * 100003 + step)
    x = torch.randn(args.global_batch, 16, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(args.global_batch, 1, generator=g)
    return x, y


def my_slice(n, rank, total):
    base, rem = divmod(total, n)
    start = rank * base + min(rank, rem)
    return start, start + base + (1 if rank < rem else 0)


def main():
    args = parse_args()
    dist.init_process_group("railcc")
    world = dist.get_world_size()
    me = dist.get_rank()  # default-group rank at the start: names this process throughout
    victim = args.kill_rank if args.kill_rank >= 0 else world - 1
    store = dist.distributed_c10d._get_default_store()
    torch.manual_seed(args.seed)
    module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(module.parameters(), lr=args.lr)
    model = DDP(module)
    step, recovered_at = 0, None
    while step < args.steps:
        n, r = dist.get_world_size(), dist.get_rank()
        x, y = batch(step, args)
        lo, hi = my_slice(n, r, args.global_batch)
        opt.zero_grad()
        try:
            loss = nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
            if step == args.kill_step and me == victim:
                store.set("elastic/killed_at", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()  # DDP's gradient all-reduce
        except Exception as e:  # railcc.PeerFailureError, maybe wrapped by autograd
            dead = []
            for _ in range(100):  # the error that broke the group names the dead; wait for it
                dead = railcc.failed_ranks(group_ranks=True)
                if dead:
                    break
                time.sleep(0.05)
            if not dead:
                raise
            print(f"rank {me}: step {step} failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                  f"shrinking without ranks {dead}", flush=True)
            dist.shrink_group(dead, shrink_flags=SHRINK_ABORT)
            model = DDP(module)  # the same parameters and optimizer, on the shrunk default group
            print(f"rank {me}: now rank {dist.get_rank()} of {dist.get_world_size()}; global batch and learning "
                  f"rate unchanged ({args.global_batch}, {args.lr}); redoing step {step}", flush=True)
            recovered_at = "pending"
            continue
        opt.step()
        if recovered_at == "pending":
            recovered_at = time.time()
            killed_at = float(store.get("elastic/killed_at").decode())
            print(f"rank {me}: recovered in {recovered_at - killed_at:.3f} s (kill to first step done on the "
                  f"shrunk group)", flush=True)
        step += 1
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    same = all(torch.equal(everyone[0], t) for t in everyone)
    print(f"rank {me}: checksum {flat.double().sum().item():.10f}", flush=True)
    print(f"rank {me}: parameters {'identical' if same else 'DIFFERENT'} on {len(everyone)} survivors", flush=True)
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
