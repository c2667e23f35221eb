#!/usr/bin/env python3
"""What a small call costs when it is not one of a stream: 2 ranks, each call timed on both
ranks against the one monotonic clock, after something that breaks the stream (a gloo barrier,
or each rank writing a buffer that empties its caches), beside the same call back to back and
the same setting on torch's fake group (c10d's dispatch alone).

    python3 tools/bench_gap.py                  # after a gloo barrier
    python3 tools/bench_gap.py --thrash 8M      # after writing 8 MiB on each rank
    python3 tools/bench_gap.py --no-pin -n 5000

For each setting it prints medians over the calls: from the first rank's entry to the last
rank's exit (what a benchmark that times the slowest rank reads), the skew of the two entries,
and the later rank's own call (its peer's data already waiting: the cost of the call itself).
"""

import argparse
import os
import queue
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from railcc.bench.report import parse_size


def _timed(call, n, before):
    rows = []
    for _ in range(n):
        if before:
            before()
        a = time.monotonic_ns()
        call()
        rows.append((a, time.monotonic_ns()))
    return rows


def _rank(rank, args, port, out):
    if args.pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)  # intra-op threads on a pinned CPU would take its time from the call
    import railcc  # noqa: F401  registers the backend
    __import__("torch.testing._internal.distributed.fake_pg")  # registers "fake"
    store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False)
    dist.init_process_group("railcc", rank=rank, world_size=2, store=store)
    gloo = dist.new_group(backend="gloo")
    fake = dist.new_group(backend="fake")
    t = torch.ones(max(1, args.size // 4))
    junk = torch.zeros(max(1, args.thrash // 4)) if args.thrash else None
    for _ in range(200):
        dist.all_reduce(t)
    res = {}
    for name, group in (("railcc", None), ("fake", fake)):
        call = lambda g=group: dist.all_reduce(t, group=g)  # noqa: E731
        if args.thrash:
            # Both ranks leave a real call together, then each writes its buffer.
            before = lambda: (dist.all_reduce(t), junk.add_(1.0))  # noqa: E731
        else:
            before = lambda: dist.barrier(group=gloo)  # noqa: E731
        res[name] = (_timed(call, args.iters, before), _timed(call, args.iters, None))
    both = [None, None]
    dist.all_gather_object(both, res)
    if rank == 0:
        out.put(both)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--iters", type=int, default=2000)
    p.add_argument("-s", "--size", type=parse_size, default=8, help="bytes per call (default 8)")
    p.add_argument("--thrash", type=parse_size, default=0,
                   help="instead of a gloo barrier, each rank writes this many bytes before each call")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="leave the ranks unbound")
    args = p.parse_args()
    if args.iters < 1:
        p.error(f"-n/--iters must be at least 1, got {args.iters}")
    if args.size < 4:
        p.error(f"-s/--size must be at least 4 bytes (one float), got {args.size}")
    if args.thrash < 0:
        p.error(f"--thrash must be 0 or more bytes, got {args.thrash}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # The parent holds the store: port 0 lets the kernel pick a free port with no race.
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    procs = [ctx.Process(target=_rank, args=(r, args, store.port, q)) for r in range(2)]
    for pr in procs:
        pr.start()
    both = None
    while both is None:
        try:
            both = q.get(timeout=1)
        except queue.Empty:
            failed = [pr for pr in procs if pr.exitcode not in (None, 0)]
            if failed:  # a rank died: its peer would wait for it until the group's timeout
                for pr in procs:
                    pr.kill()
                sys.exit(f"bench_gap: rank {procs.index(failed[0])} exited with {failed[0].exitcode}")
    for pr in procs:
        pr.join()
    gap = f"after writing {args.thrash} bytes" if args.thrash else "after a gloo barrier"
    med = lambda v: statistics.median(v) / 1000  # noqa: E731
    print(f"# 2 ranks{' pinned' if args.pin else ''}, all_reduce of {args.size} bytes, medians of "
          f"{args.iters} calls, us (the fake group does not wait for its peer: its first column "
          f"is not a call's time)")
    print(f"{'backend':>8} {'setting':>26} {'first in, last out':>19} {'entry skew':>11} {'later rank own':>15}")
    for name in ("railcc", "fake"):
        for k, setting in ((0, gap), (1, "back to back")):
            r0, r1 = both[0][name][k], both[1][name][k]
            span = [max(b0, b1) - min(a0, a1) for (a0, b0), (a1, b1) in zip(r0, r1)]
            skew = [abs(a0 - a1) for (a0, _), (a1, _) in zip(r0, r1)]
            later = [b1 - a1 if a1 >= a0 else b0 - a0 for (a0, b0), (a1, b1) in zip(r0, r1)]
            print(f"{name:>8} {setting:>26} {med(span):>19.1f} {med(skew):>11.1f} {med(later):>15.1f}")


if __name__ == "__main__":
    main()
