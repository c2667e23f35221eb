#!/usr/bin/env python
"""Small FSDP2 (``fully_shard``) training example for the railcc c10d backend, on CPU.

Same model, data and optimizer as ddp_train.py: every step draws one global batch from a
fixed seed and each rank trains on its contiguous slice, so the final parameters match (up
to float rounding) the single-process full-batch run that ``--reference`` performs without
any process group.

    torchrun --nproc-per-node 2 examples/fsdp2_train.py --backend railcc
    python examples/fsdp2_train.py --reference --save /tmp/ref.pt      # no process group

Every Linear and the root are sharded with ``fully_shard`` over a 1-D DeviceMesh, so a step
uses all_gather_into_tensor (unshard) and reduce_scatter_tensor (gradients). The gradient
reduction op FSDP2 picks for fp32 is ReduceOp.AVG; ``--grad-divide-factor F`` (F != world
size) makes it ReduceOp.PREMUL_SUM(1/F), which gloo does not implement; ``--force-sum-reduction``
makes it ReduceOp.SUM followed by a local division.

Rank 0 prints ``step N loss X`` and ``checksum X`` like ddp_train.py; ``--save PATH`` gathers
the full parameters (DTensor.full_tensor(), a collective on every rank) and writes them from
rank 0 as {name: tensor}, the same names and shapes as the unsharded model.
"""

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="railcc",
                   help='c10d backend string, e.g. "railcc", "gloo" (default: railcc)')
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save", metavar="PATH", help="rank 0 saves the final full parameters here (torch.save)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--global-batch", type=int, default=24, help="samples per step over all ranks")
    p.add_argument("--in-dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--out-dim", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--reshard-after-forward", choices=["true", "false"], default="true")
    p.add_argument("--grad-divide-factor", type=float, default=None,
                   help="FSDPModule.set_gradient_divide_factor(F): gradients become sum/F "
                        "(reduce-scatter with PREMUL_SUM(1/F) unless F == world size)")
    p.add_argument("--force-sum-reduction", action="store_true",
                   help="FSDPModule.set_force_sum_reduction_for_comms(True): only ReduceOp.SUM on the wire")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--reference", action="store_true",
                   help="single process, no process group: train on the full global batch")
    p.add_argument("--world-size", type=int, default=None,
                   help="with --reference and --grad-divide-factor: the world size to emulate")
    return p.parse_args(argv)


def make_model(args):
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    return nn.Sequential(
        nn.Linear(args.in_dim, args.hidden), nn.Tanh(),
        nn.Linear(args.hidden, args.hidden), nn.Tanh(),
        nn.Linear(args.hidden, args.out_dim),
    )


def global_batch(args, step):
    """The step's whole batch, the same on every rank (and in the reference run)."""
    g = torch.Generator().manual_seed(args.seed + 1)
    teacher = torch.randn(args.in_dim, args.out_dim, generator=g) / args.in_dim ** 0.5
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + 7919 * (step + 1))
    x = torch.randn(args.global_batch, args.in_dim, generator=g)
    y = torch.sin(x @ teacher) + 0.01 * torch.randn(args.global_batch, args.out_dim, generator=g)
    return x, y


def shard(model, args, world, device):
    mesh = init_device_mesh(device.type, (world,))
    reshard = args.reshard_after_forward == "true"
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            if args.grad_divide_factor is not None:
                m.set_gradient_divide_factor(args.grad_divide_factor)
            if args.force_sum_reduction:
                m.set_force_sum_reduction_for_comms(True)
    return model


def full_state(model):
    """{name: full CPU tensor}; DTensor.full_tensor() is a collective, so every rank calls it."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        out[name] = t.cpu().clone()
    return out


def train(args, rank, world, device):
    model = make_model(args).to(device)
    if not args.reference:
        shard(model, args, world, device)
    # With FSDP2 the optimizer sees the sharded DTensor parameters.
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = nn.MSELoss()
    per_rank = args.global_batch // world
    # FSDP2 gradients are sum/F with a divide factor F; the reference's full-batch mean
    # gradient equals sum/W, so it scales by W/F to emulate that.
    ref_grad_scale = None
    if args.reference and args.grad_divide_factor is not None:
        if not args.world_size:
            raise SystemExit("--reference with --grad-divide-factor needs --world-size")
        ref_grad_scale = args.world_size / args.grad_divide_factor
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = global_batch(args, step)
        x = x[rank * per_rank:(rank + 1) * per_rank].to(device)
        y = y[rank * per_rank:(rank + 1) * per_rank].to(device)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()  # FSDP2 reduce-scatters the gradients here
        if ref_grad_scale is not None:
            for p in model.parameters():
                p.grad.mul_(ref_grad_scale)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            report = loss.detach().clone()
            if not args.reference:  # equal slices: mean of the rank losses = global-batch loss
                dist.all_reduce(report, op=dist.ReduceOp.SUM)
                report /= world
            if rank == 0:
                print(f"step {step:4d} loss {report.item():.8f}", flush=True)
    elapsed = time.perf_counter() - t0

    state = full_state(model)  # collective: all ranks
    if rank == 0:
        checksum = sum(v.double().sum().item() for v in state.values())
        print(f"checksum {checksum:.12e}", flush=True)
        print(f"done: {args.steps} steps, world size {world}, backend "
              f"{'none (reference)' if args.reference else args.backend}, {elapsed:.2f}s", flush=True)
        if args.save:
            torch.save(state, args.save)


def main(argv=None):
    args = parse_args(argv)
    if args.reference:
        rank, world = 0, 1
    else:
        if "railcc" in args.backend:
            import railcc  # noqa: F401  (registers the "railcc" backend with c10d)
        dist.init_process_group(backend=args.backend)  # env:// (torchrun or MASTER_ADDR/PORT, RANK, WORLD_SIZE)
        rank, world = dist.get_rank(), dist.get_world_size()
        if args.global_batch % world:
            raise SystemExit(f"--global-batch {args.global_batch} is not divisible by world size {world}")
    if args.device == "cuda":
        # Ranks beyond the GPU count share GPUs (railcc supports that; NCCL does not).
        local_rank = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    train(args, rank, world, device)  # the model, optimizer and DTensors die when it returns

    if not args.reference:
        dist.barrier()
        # torch 2.13 + gloo: a ProcessGroupGloo worker thread can drop the last reference to a
        # finished Work (e.g. an all-gather whose tensors have Python objects) only after the
        # main thread has begun interpreter shutdown; taking the GIL then exits the thread
        # inside a noexcept destructor -> "terminate called without an active exception"
        # (SIGABRT) after all the work is done. Collecting garbage here, before
        # destroy_process_group, gives those references time to go while Python is alive.
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
