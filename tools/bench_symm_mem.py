"""torch's symmetric memory, the second anchor of railcc's one-kernel all-reduce (issue 67):
torch.ops.symm_mem.one_shot_all_reduce and two_shot_all_reduce_ on local ranks that share GPUs
(TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1, rank r on GPU r % count), timed as railcc-bench
times a call (the slowest rank's mean over the timed calls, after warm-up calls), at the sizes
railcc-bench sweeps. scripts/gpu_check.sh runs it beside railcc's run on the same GPU.

    python3 tools/bench_symm_mem.py --nprocs 2 -b 8 -e 256M -f 4 -n 5 -w 2 [--json FILE]

Prints a table (size, one-shot and two-shot time in us and bus bandwidth in GB/s); --json writes
{"meta": ..., "results": [{"op", "size", "time_us", "busbw"}]}. Where symmetric memory cannot run
(no GPU, a torch without it, ranks refused on one device) it says why and exits 0: an anchor
that is missing is a line in the report, not a failed check.
"""

import argparse
import json
import os
import socket
import sys

from railcc.bench.report import busbw_factor, parse_size, size_sweep


def _rank(rank, n, port, args, queue):
    import torch
    import torch.distributed as dist

    try:
        import torch.distributed._symmetric_memory as symm_mem

        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
        group = dist.group.WORLD.group_name
        rows = []
        for size in size_sweep(args.minbytes, args.maxbytes, args.stepfactor):
            count = max(size // 4, 1)
            t = symm_mem.empty(count, dtype=torch.float32, device=dev)
            symm_mem.rendezvous(t, group)
            t.fill_(1.0)
            ops = {
                "one_shot_all_reduce": lambda: torch.ops.symm_mem.one_shot_all_reduce(t, "sum", group),
                "two_shot_all_reduce_": lambda: torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", group),
            }
            for name, call in ops.items():
                for _ in range(args.warmup_iters):
                    call()
                torch.cuda.synchronize()
                dist.barrier()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.iters):
                    call()
                end.record()
                torch.cuda.synchronize()
                us = torch.tensor([start.elapsed_time(end) * 1000.0 / args.iters])
                dist.all_reduce(us, op=dist.ReduceOp.MAX)
                busbw = busbw_factor("all_reduce", n) * count * 4 / (us.item() * 1e-6) / 1e9
                rows.append({"op": name, "size": count * 4, "time_us": us.item(), "busbw": busbw})
            del t
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, rows, None))
    except Exception as e:  # the anchor is missing, not the run broken
        queue.put((rank, None, f"{type(e).__name__}: {e}"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("-b", "--minbytes", type=parse_size, default=8)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=256 << 20)
    p.add_argument("-f", "--stepfactor", type=float, default=4.0)
    p.add_argument("-n", "--iters", type=int, default=5)
    p.add_argument("-w", "--warmup_iters", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if args.nprocs < 2 or args.minbytes < 1 or args.maxbytes < args.minbytes or args.stepfactor <= 1 or args.iters < 1:
        p.error("needs --nprocs >= 2, 1 <= -b <= -e, -f > 1 and -n >= 1")

    import multiprocessing as mp

    try:
        import torch

        if not torch.cuda.is_available():
            print("# symmetric memory did not run: no GPU (torch.cuda.is_available() is False)")
            return 0
    except ImportError as e:
        print(f"# symmetric memory did not run: {e}")
        return 0
    os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.nprocs, port, args, queue), daemon=True) for r in range(args.nprocs)]
    for pr in procs:
        pr.start()
    got = {}
    try:
        for _ in procs:
            rank, rows, err = queue.get(timeout=args.timeout)
            got[rank] = (rows, err)
    except Exception:
        print(f"# symmetric memory did not run: ranks {sorted(set(range(args.nprocs)) - set(got))} did not answer "
              f"within {args.timeout:.0f} s")
        for pr in procs:
            pr.kill()
        return 0
    for pr in procs:
        pr.join(10)
    errors = {r: e for r, (rows, e) in got.items() if e}
    if errors:
        r = min(errors)
        print(f"# symmetric memory did not run: rank {r}: {errors[r]}")
        return 0
    rows = got[0][0]
    print(f"# torch symmetric memory, {args.nprocs} ranks, float32 sum, {torch.cuda.get_device_name(0)}")
    print(f"# {'size (B)':>12} {'op':>22} {'time (us)':>12} {'busbw (GB/s)':>13}")
    for r in rows:
        print(f"  {r['size']:>12} {r['op']:>22} {r['time_us']:>12.2f} {r['busbw']:>13.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {"tool": "bench_symm_mem", "world_size": args.nprocs, "torch": torch.__version__,
                                "device": torch.cuda.get_device_name(0)}, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
