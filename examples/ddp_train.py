#!/usr/bin/env python
"""Small DDP training example for the railcc c10d backend.

Trains a tiny MLP on synthetic regression data with DistributedDataParallel. Every step
draws one global batch from a fixed seed and each rank trains on its contiguous slice, so
the result does not depend on the world size: it matches (up to float rounding) the
single-process full-batch run that ``--reference`` performs without any process group.

    torchrun --nproc-per-node 2 examples/ddp_train.py --backend railcc
    torchrun --nproc-per-node 2 examples/ddp_train.py --backend gloo --comm-hook allreduce-python
    python examples/ddp_train.py --reference --save /tmp/ref.pt        # no process group

Rank 0 prints ``step N loss X`` (loss over the whole global batch, before that step's
update) every ``--log-every`` steps and ``checksum X`` (sum of all final parameters).
``--save PATH`` writes the final parameters ({name: tensor}, CPU) from rank 0.
"""

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="railcc",
                   help='c10d backend string, e.g. "railcc", "gloo", "cpu:railcc,cuda:railcc" (default: railcc)')
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--comm-hook", choices=["none", "allreduce-python", *BUILTIN_HOOKS], default="none",
                   help="none: DDP's built-in allreduce; allreduce-python: a Python hook that calls "
                        "dist.all_reduce(async_op=True).get_future().then(divide by world size); the others "
                        "are torch's own hooks (PowerSGD from step 2, rank 1, with its own fixed seed)")
    p.add_argument("--save", metavar="PATH", help="rank 0 saves the final state_dict here (torch.save)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--global-batch", type=int, default=24, help="samples per step over all ranks")
    p.add_argument("--in-dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--out-dim", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size; small values give several buckets")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--reference", action="store_true",
                   help="single process, no process group: train on the full global batch")
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


def _builtin_hook(name):
    """(hook, state) of one of torch's DDP comm hooks."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "allreduce":
        return default_hooks.allreduce_hook, None
    if name == "fp16":
        return default_hooks.fp16_compress_hook, None
    if name == "bf16":
        return default_hooks.bf16_compress_hook, None
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                        min_compression_rate=0.5)
    return (powerSGD_hook.powerSGD_hook if name == "powersgd" else powerSGD_hook.batched_powerSGD_hook), state


BUILTIN_HOOKS = ["allreduce", "fp16", "bf16", "powersgd", "batched-powersgd"]


def allreduce_python_hook(process_group, bucket):
    """DDP comm hook: average the bucket with an async all_reduce and a Future callback."""
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()

    def divide(fut):
        value = fut.value()
        tensor = value[0] if isinstance(value, (list, tuple)) else value
        return tensor.div_(world)

    return fut.then(divide)


def train(args, rank, world, device):
    model = make_model(args).to(device)
    if args.reference:
        net = model
    else:
        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  bucket_cap_mb=args.bucket_cap_mb)
        if args.comm_hook == "allreduce-python":
            net.register_comm_hook(state=None, hook=allreduce_python_hook)
        elif args.comm_hook in BUILTIN_HOOKS:
            hook, state = _builtin_hook(args.comm_hook)
            net.register_comm_hook(state=state, hook=hook)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = nn.MSELoss()
    per_rank = args.global_batch // world
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = global_batch(args, step)
        x = x[rank * per_rank:(rank + 1) * per_rank].to(device)
        y = y[rank * per_rank:(rank + 1) * per_rank].to(device)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        loss.backward()  # DDP averages the gradients over ranks here
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            report = loss.detach().clone()
            if not args.reference:  # equal slices: mean of the rank losses = global-batch loss
                dist.all_reduce(report, op=dist.ReduceOp.SUM)
                report /= world
            if rank == 0:
                print(f"step {step:4d} loss {report.item():.8f}", flush=True)
    elapsed = time.perf_counter() - t0

    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
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

    train(args, rank, world, device)

    if not args.reference:
        dist.barrier()
        # Drop the last Python references to tensors held by in-flight/finished Work objects
        # while the interpreter is still fully alive (see the note in fsdp2_train.py).
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
