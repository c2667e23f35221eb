"""railcc-bench's clocks: how one collective is timed (refills, barriers that leave nothing
running, one clock across ranks where they share it) and the reference rates (memcpy and device
copy bandwidth, peak RSS). runner.py decides what to run; this file only measures."""

import math
import statistics
import sys
import time

REALIGN_BYTES = 1 << 20  # refills at least this large are followed by a barrier before timing


def boot_id():
    """The running kernel's boot id: processes that share it read the same CLOCK_MONOTONIC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def shared_clock(ctrl):
    """True when every rank of `ctrl` reads the same monotonic clock (time.perf_counter_ns)."""
    import torch.distributed as dist

    ids = [None] * dist.get_world_size(ctrl)
    dist.all_gather_object(ids, boot_id(), group=ctrl)
    return ids[0] is not None and len(set(ids)) == 1


class StoreBarrier:
    """A barrier through the rendezvous store: each rank adds to a counter, and the last one
    sets a key that the others block on in a socket read. A gloo barrier keeps helper threads
    busy on every rank after its callers have left it, and the ranks that return first from a
    timed call enter the next one while the others are still in it: on cores shared by several
    ranks those threads take the cores from the call being timed. This one leaves nothing
    running. Its exit skew is larger, which only matters where ranks are timed by their own
    clocks, so it serves only where every rank reads the same clock."""

    def __init__(self, store, world, prefix="railcc-bench/barrier"):
        self.store, self.world, self.prefix, self.gen = store, world, prefix, 0

    def __call__(self):
        self.gen += 1
        key = f"{self.prefix}/{self.gen}"
        if self.store.add(key, 1) == self.world:
            self.store.set(key + "/done", "1")
            if self.gen > 1:  # everyone has arrived here, so everyone has left the one before
                self.store.delete_key(f"{self.prefix}/{self.gen - 1}")
                self.store.delete_key(f"{self.prefix}/{self.gen - 1}/done")
        self.store.wait([key + "/done"])


def quiet_barrier(world):
    """A StoreBarrier on the default group's store, or None where torch does not expose it."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    return StoreBarrier(store, world)


def time_collective(case, group, inplace, iters, warmup, ctrl, same_clock=False, quiet=None):
    """Median over iterations of the slowest rank's time, in microseconds; with `same_clock`,
    iterations that follow a barrier run from the last rank's call to the last rank's return,
    and those barriers are `quiet` (a StoreBarrier) when given."""
    import torch
    import torch.distributed as dist

    # In place, each run reduces the previous result again. The patterns are non-negative, so the
    # values only grow (at worst to inf or wrapping integers) and never reach the denormals that
    # would slow CPU arithmetic down and skew the timing.
    case.load(inplace)
    refill = case.refill(inplace)
    run = case.runner(group, inplace)
    # On a GPU the calls only queue work: the clock is read once the device is idle again, and the
    # loads, warm-up and refills are drained first so that none of them is timed with a call.
    sync = (lambda: torch.cuda.synchronize(case.device)) if case.device.type == "cuda" else None
    for _ in range(warmup):
        if refill:
            refill()
        run()
    if sync:
        sync()
    starts = [0.0] * iters
    ends = [0.0] * iters
    clock = time.perf_counter_ns
    # A refill copies the whole buffer on every rank, and ranks sharing cores finish it at
    # different times; without lining up again that skew would be timed as part of the next
    # call. Large refills are therefore followed by a barrier (small ones cost less than the
    # barrier's own exit skew).
    realign = refill is not None and case.nbytes() >= REALIGN_BYTES
    # After a barrier the ranks leave it at different times, and the first one out would time
    # its wait for the last one; on one clock the call is timed from the last rank's entry.
    entry_aligned = realign and same_clock
    if entry_aligned and quiet is not None:
        align = quiet
    else:
        def align():
            dist.barrier(group=ctrl)
    dist.barrier(group=ctrl)
    for i in range(iters):
        if refill:
            if realign and i > 0:
                # Nobody refills before every rank has returned: on shared cores the copy of a
                # rank that finished early would be timed as part of the others' call.
                align()
            refill()
            if sync:
                sync()
            if realign:
                align()
        t0 = clock()
        run()
        if sync:
            sync()
        starts[i], ends[i] = t0, clock()
    mine = torch.tensor([starts, ends], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(ctrl))]
    dist.all_gather(every, mine, group=ctrl)
    return statistics.median(
        iteration_times([t[0].tolist() for t in every], [t[1].tolist() for t in every], entry_aligned))


def iteration_times(starts, ends, entry_aligned):
    """Per-iteration times in microseconds from each rank's clock readings in nanoseconds
    (starts[rank][i], ends[rank][i]): the slowest rank's own time, or with `entry_aligned`
    (one clock for all) the time from the last rank's start to the last rank's end."""
    iters = range(len(starts[0]))
    if entry_aligned:
        return [(max(e[i] for e in ends) - max(s[i] for s in starts)) / 1e3 for i in iters]
    return [max(e[i] - s[i] for s, e in zip(starts, ends)) / 1e3 for i in iters]


def memcpy_bandwidth(nbytes, repeats=5):
    """Best single-thread torch copy_ bandwidth over nbytes, in GB/s."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in before timing
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(prev)
    return nbytes / best / 1e9


def device_copy_bandwidth(nbytes, device, repeats=5):
    """Best torch copy_ rate between two buffers on one CUDA device, in GB/s of bytes read plus
    bytes written (2 x nbytes per copy); 0.0 when the copy is too quick to time."""
    import torch

    with torch.cuda.device(device):
        src = torch.ones(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)  # the first launch pays for setup
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = math.inf
        for _ in range(repeats):
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)  # ms -> s
        del src, dst
    return 2 * nbytes / best / 1e9 if 0 < best < math.inf else 0.0


def event_round_trip_us(device, repeats=200):
    """One process's own round trip through the GPU: a tiny kernel queued and an event after it
    waited for from the host, the median of `repeats`, in us (issue 67's floor for an 8-byte op)."""
    import torch

    with torch.cuda.device(device):
        x = torch.zeros(2, device=device)
        ev = torch.cuda.Event()
        x.add_(1)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.add_(1)
            ev.record()
            ev.synchronize()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def peak_rss_kib():
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss // 1024 if sys.platform == "darwin" else rss  # macOS reports bytes, Linux KiB
