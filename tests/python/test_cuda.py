"""CUDA tensors: every collective x dtype x reduce op against torch's local result, stream
semantics, and DDP / FSDP2 training on the GPU.

These need a GPU and a CUDA build of torch; ranks share GPUs round-robin (rank % device
count), so one GPU runs 2, 3 and 4 ranks. Every collective runs both ways: through CUDA IPC (the
default when every rank is on one host) and staged through pinned host memory. Without a GPU everything here skips with the reason,
except the plugin checks at the top, which run everywhere nvcc built the plugin.
"""

import os

import pytest
import torch
import torch.distributed as dist

import railcc
from test_collectives import DTYPES, close, make_input, op_obj, ops_for, reduce_ref

INFO = railcc.cuda_info()
HAVE_GPU = torch.cuda.is_available() and INFO["devices"] > 0
PLUGIN = os.path.join(os.path.dirname(railcc.__file__), "librailcc_cuda.so")

needs_gpu = pytest.mark.skipif(
    not HAVE_GPU,
    reason=f"needs a GPU and a CUDA build of torch (torch.cuda.is_available()={torch.cuda.is_available()}, "
           f"railcc.cuda_info()={INFO})")


# ------------------------------------------------------------------------- no GPU needed

@pytest.mark.skipif(not os.path.exists(PLUGIN), reason="this build has no CUDA plugin (nvcc was not found)")
def test_plugin_loads_and_reports_devices():
    # The real plugin, loaded through the engine's dlopen path: on a machine without a GPU
    # driver it must say so, not crash.
    assert INFO["plugin"] is True, INFO
    assert INFO["runtime"].startswith("cuda runtime"), INFO
    if INFO["devices"] == 0:
        assert INFO["error"], INFO


def test_cuda_info_never_raises():
    info = railcc.cuda_info()
    assert set(info) == {"plugin", "runtime", "devices", "gpu_direct", "error"}
    # With a GPU: whether its memory exports as a dma-buf (GPUDirect RDMA), or why not.
    if info["devices"]:
        assert info["gpu_direct"].startswith("cuda:0: "), info
    else:
        assert info["gpu_direct"] is None, info


def test_the_allocators_hook_tells_the_engine_of_its_segments():
    # The glue's side of torch's CUDA caching allocator's trace hook, called as the allocator
    # calls it (TraceEntry's actions: ALLOC 0, SEGMENT_ALLOC 3, SEGMENT_FREE 4): only segments
    # are recorded, and a freed one is forgotten. Whether the hook itself attaches depends on the
    # torch: a CPU build says why not.
    C = railcc._C
    before = C._allocator_segments()
    base = 1 << 44
    C._allocator_traced(3, base, 2 << 20)
    C._allocator_traced(0, base + 512, 512)  # a tensor carved from it: not a segment
    assert C._allocator_segments() == before + 1
    C._allocator_traced(4, base, 2 << 20)
    assert C._allocator_segments() == before
    why = C._watch_allocator()
    assert isinstance(why, str)
    if not torch.cuda.is_available():
        assert why, "a torch without CUDA has no allocator to watch"


# ------------------------------------------------------------------------- rank functions

def _dev(rank):
    d = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(d)
    return d


def rk_cuda_reductions(rank, n, counts):
    dev = _dev(rank)
    bad = []
    for dt in DTYPES:
        for name in ops_for(dt):
            for count in counts:
                refs = [make_input(r, dt, count) for r in range(n)]
                exp = reduce_ref(refs, name, n)
                t = make_input(rank, dt, count).to(dev)
                dist.all_reduce(t, op=op_obj(name))
                if not close(t.cpu(), exp):
                    bad.append(f"all_reduce {dt} {name} count={count}")
                root = (count + 1) % n
                t = make_input(rank, dt, count).to(dev)
                dist.reduce(t, dst=root, op=op_obj(name))
                if rank == root and not close(t.cpu(), exp):
                    bad.append(f"reduce {dt} {name} count={count}")
                # reduce_scatter_tensor: rank r gets block r of the reduction
                full = [make_input(r, dt, count * n, salt=1) for r in range(n)]
                out = torch.empty(count, dtype=dt, device=dev)
                dist.reduce_scatter_tensor(out, full[rank].to(dev), op=op_obj(name))
                want = reduce_ref([f[rank * count:(rank + 1) * count] for f in full], name, n)
                if not close(out.cpu(), want):
                    bad.append(f"reduce_scatter_tensor {dt} {name} count={count}")
    return bad


def rk_cuda_movement(rank, n, counts):
    dev = _dev(rank)
    bad = []
    for dt in DTYPES:
        for count in counts:
            mine = make_input(rank, dt, count, salt=2)
            alls = [make_input(r, dt, count, salt=2) for r in range(n)]
            out = torch.empty(count * n, dtype=dt, device=dev)
            dist.all_gather_into_tensor(out, mine.to(dev))
            if not torch.equal(out.cpu(), torch.cat(alls)):
                bad.append(f"all_gather_into_tensor {dt} count={count}")
            outs = [torch.empty(count, dtype=dt, device=dev) for _ in range(n)]
            dist.all_gather(outs, mine.to(dev))
            if not all(torch.equal(o.cpu(), a) for o, a in zip(outs, alls)):
                bad.append(f"all_gather {dt} count={count}")
            root = count % n
            b = (alls[root] if rank == root else torch.zeros(count, dtype=dt)).to(dev)
            dist.broadcast(b, src=root)
            if not torch.equal(b.cpu(), alls[root]):
                bad.append(f"broadcast {dt} count={count}")
            g = [torch.empty(count, dtype=dt, device=dev) for _ in range(n)] if rank == root else None
            dist.gather(mine.to(dev), gather_list=g, dst=root)
            if rank == root and not all(torch.equal(x.cpu(), a) for x, a in zip(g, alls)):
                bad.append(f"gather {dt} count={count}")
            s = torch.empty(count, dtype=dt, device=dev)
            dist.scatter(s, scatter_list=[a.to(dev) for a in alls] if rank == root else None, src=root)
            if not torch.equal(s.cpu(), alls[rank]):
                bad.append(f"scatter {dt} count={count}")
            # all_to_all_single with uneven splits (some empty)
            split = lambda i, j: (i * 3 + j * 5 + count) % 4  # noqa: E731
            ins = torch.cat([make_input(rank * n + j, dt, split(rank, j)) for j in range(n)])
            out = torch.empty(sum(split(j, rank) for j in range(n)), dtype=dt, device=dev)
            dist.all_to_all_single(out, ins.to(dev), [split(j, rank) for j in range(n)],
                                   [split(rank, j) for j in range(n)])
            want = torch.cat([make_input(j * n + rank, dt, split(j, rank)) for j in range(n)])
            if not torch.equal(out.cpu(), want):
                bad.append(f"all_to_all_single {dt} count={count}")
            # and with equal splits (one kernel on the "shots" path)
            ins = torch.cat([make_input(rank * n + j, dt, count) for j in range(n)])
            out = torch.empty(n * count, dtype=dt, device=dev)
            dist.all_to_all_single(out, ins.to(dev))
            if not torch.equal(out.cpu(), torch.cat([make_input(j * n + rank, dt, count) for j in range(n)])):
                bad.append(f"all_to_all_single of equal splits {dt} count={count}")
            # send/recv around a ring
            if n > 1:
                nxt, prv = (rank + 1) % n, (rank - 1) % n
                r = torch.empty(count, dtype=dt, device=dev)
                reqs = [dist.isend(mine.to(dev), nxt), dist.irecv(r, prv)]
                for q in reqs:
                    q.wait()
                if not torch.equal(r.cpu(), alls[prv]):
                    bad.append(f"send/recv {dt} count={count}")
    return bad


def rk_cuda_coalesced(rank, n):
    dev = _dev(rank)
    sizes = [0, 1, 4096, 13, 300001]
    ts = [make_input(rank, torch.float32, s, salt=i).to(dev) for i, s in enumerate(sizes)]
    dist.all_reduce_coalesced(ts)
    bad = []
    for i, (t, s) in enumerate(zip(ts, sizes)):
        want = reduce_ref([make_input(r, torch.float32, s, salt=i) for r in range(n)], "SUM", n)
        if not close(t.cpu(), want):
            bad.append(f"all_reduce_coalesced tensor {i}")
    return bad


def rk_cuda_streams(rank, n):
    """The caller never synchronizes: ordering must come from railcc's events alone."""
    dev = _dev(rank)
    bad = []
    total = n * (n + 1) / 2
    for side in (False, True):
        s = torch.cuda.Stream() if side else torch.cuda.current_stream()
        with torch.cuda.stream(s):
            # 1. the op must wait for work queued before it on the caller's stream
            x = torch.zeros(1 << 20, device=dev)
            torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time ahead of the fill
            x.fill_(rank + 1)
            dist.all_reduce(x)
            y = x * 1  # queued on the caller's stream right after; no synchronize
            if not torch.all(y == total).item():
                bad.append(f"sync all_reduce (side stream={side}) read data before the caller's stream wrote it")
            # 2. async op, wait(), then use at once
            x = torch.full((1 << 20,), float(rank + 1), device=dev)
            w = dist.all_reduce(x, async_op=True)
            w.wait()
            if not torch.all((x + 0) == total).item():
                bad.append(f"async all_reduce + wait (side stream={side})")
            # 3. the caller drops its tensor before the op ran: the Work keeps it alive
            x = torch.full((1 << 20,), float(rank + 1), device=dev)
            w = dist.all_reduce(x, async_op=True)
            del x
            junk = [torch.full((1 << 20,), -7.0, device=dev) for _ in range(4)]  # would reuse the block
            w.wait()
            if not torch.all(w.result()[0] == total).item():
                bad.append(f"freed input (side stream={side})")
            del junk
            # 4. futures: then() sees the result without a synchronize
            x = torch.full((1 << 16,), float(rank + 1), device=dev)
            fut = dist.all_reduce(x, async_op=True).get_future()
            got = fut.then(lambda f: f.value()[0] * 2).wait()
            if not torch.all(got == 2 * total).item():
                bad.append(f"future.then (side stream={side})")
            # 4b. the same with the op's GPU work held back behind the caller's stream: the
            # future completes once the op is queued, and its events must be on the group's
            # stream (they once were on the completing thread's, and DDP trained on stale
            # gradients over CUDA IPC)
            x = torch.zeros(1 << 16, device=dev)
            torch.cuda._sleep(50_000_000)
            x.fill_(rank + 1)
            fut = dist.all_reduce(x, async_op=True).get_future()
            got = fut.then(lambda f: f.value()[0] * 2).wait()
            if not torch.all(got == 2 * total).item():
                bad.append(f"future.then on a late GPU (side stream={side})")
            torch.cuda._sleep(50_000_000)
            fut = dist.all_reduce(x, async_op=True).get_future()
            fut.wait()
            if not torch.all((x + 0) == total * n).item():
                bad.append(f"future.wait then use on a late GPU (side stream={side})")
            # 5. FSDP2-style synchronous all-gather into a fresh buffer, consumed at once
            shard = torch.full((1000,), float(rank), device=dev)
            out = torch.empty(1000 * n, device=dev)
            dist.all_gather_into_tensor(out, shard)
            want = torch.arange(n, device=dev, dtype=torch.float32).repeat_interleave(1000)
            if not torch.equal(out, want):
                bad.append(f"all_gather_into_tensor consumed at once (side stream={side})")
    torch.cuda.synchronize()
    return bad


def rk_cuda_errors(rank, n):
    dev = _dev(rank)
    bad = []
    try:
        dist.all_gather_into_tensor(torch.empty(4 * n, device=dev), torch.ones(4))
        bad.append("mixed cpu/cuda tensors were accepted")
    except ValueError as e:
        if "one device" not in str(e):
            bad.append(f"mixed devices: unclear message: {e}")
    return bad


def rk_cuda_shrink(rank, n):
    """A subgroup of every rank shrunk without the last (alive: it waits on the default group):
    the shrunk group all_reduces CUDA tensors, as its parent did (torch registers a shrunk
    group's backend for one device; railcc adds CUDA)."""
    dev = _dev(rank)
    bad = []
    g = dist.new_group(list(range(n)))
    dist.all_reduce(torch.ones(8, device=dev), group=g)
    if rank < n - 1:
        g2 = dist.shrink_group([n - 1], group=g)
        x = torch.full((20011,), float(rank + 1), device=dev)
        dist.all_reduce(x, group=g2)
        want = float(sum(range(1, n)))
        if not torch.all(x.cpu() == want):
            bad.append(f"shrunk all_reduce on cuda: {x[:3].tolist()} != {want}")
        dist.destroy_process_group(g2)
    dist.barrier()  # the default group: the last rank waits here for the others' shrink
    if rank == n - 1:
        dist.destroy_process_group(g)
    return bad


def rk_cuda_split(rank, n):
    """ProcessGroup.split_group (what dist.split_group calls once the default group is bound to
    a device): the child of ranks [0, n-1) serves CUDA tensors with the same backend as CPU."""
    dev = _dev(rank)
    bad = []
    members = list(range(n - 1))
    child = dist.group.WORLD.split_group(members)
    if (child is None) != (rank not in members):
        return [f"split_group({members}) gave {child} on rank {rank}"]
    if child is not None:
        x = torch.full((20011,), float(rank + 1), device=dev)
        child.allreduce([x]).wait()
        torch.cuda.synchronize(dev)
        want = float(sum(r + 1 for r in members))
        if not torch.all(x.cpu() == want):
            bad.append(f"split all_reduce on cuda: {x[:3].tolist()} != {want}")
        child.shutdown()
    dist.barrier()
    return bad


def rk_cuda_shot_missing_peer(rank, n):
    """RAILCC_CUDA_SHOTS=1: the last rank stops calling after one all_reduce. The others' kernels
    wait on the device, give up within the group's timeout instead of hanging the GPU, and the
    error names the missing rank; their GPU is usable afterwards."""
    import time
    from datetime import timedelta

    dev = _dev(rank)
    bad = []
    g = dist.new_group(list(range(n)), timeout=timedelta(seconds=4))
    t = torch.ones(4096, device=dev)
    dist.all_reduce(t, group=g)
    torch.cuda.synchronize()
    if not torch.all(t.cpu() == n):
        bad.append(f"first all_reduce: {t[:3].tolist()} != {n}")
    missing = n - 1
    if rank != missing:
        start = time.monotonic()
        try:
            dist.all_reduce(t, group=g)
            torch.cuda.synchronize()
            # A queued op returns at once; the watchdog fails the group when the kernel gives up.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                time.sleep(0.5)
                dist.all_reduce(torch.ones(1, device=dev), group=g)
            bad.append("no error within 30 s of a rank that stopped calling")
        except (railcc.CollectiveTimeoutError, railcc.PeerFailureError, RuntimeError) as e:
            if f"rank {missing}" not in str(e):
                bad.append(f"the error does not name rank {missing}: {e}")
            if time.monotonic() - start > 30:
                bad.append(f"the error came after {time.monotonic() - start:.0f} s")
        torch.cuda.synchronize()  # the kernel ended: the GPU is not hung
    torch.ones(1, device=dev).add_(1).cpu()
    dist.barrier()
    return bad


def rk_cuda_graph(rank, n):
    """RAILCC_CUDA_SHOTS=1: all_reduce (one-shot and two-shot), broadcast and
    all_gather_into_tensor captured once with torch.cuda.graph after a warm-up, then replayed 100
    times with new inputs, each replay checked against torch's own result; an op a graph cannot
    replay (gather) is refused by name. On groups of their own: the refusal fails its group."""
    dev = _dev(rank)
    bad = []
    g = dist.new_group(list(range(n)))
    small = torch.zeros(37, device=dev)
    large = torch.zeros(3 << 20, device=dev)  # 12 MiB: two-shot, several chunks of the scratch
    bc = torch.zeros(1001, device=dev)
    mine = torch.zeros(500, dtype=torch.int32, device=dev)
    gathered = torch.zeros(500 * n, dtype=torch.int32, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: the group's set-up
        for t in (small, large, bc):
            dist.all_reduce(t, group=g)
        dist.all_gather_into_tensor(gathered, mine, group=g)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(small, group=g)
        dist.all_reduce(large, op=dist.ReduceOp.MAX, group=g)
        dist.broadcast(bc, src=n - 1, group=g)
        dist.all_gather_into_tensor(gathered, mine, group=g)
    ar = torch.arange(large.numel(), device=dev, dtype=torch.float32)
    for k in range(100):
        small.copy_(torch.arange(37, device=dev, dtype=torch.float32) + rank + k)
        large.copy_((ar * 7 + rank * 13 + k) % 1000)
        bc.copy_(torch.arange(1001, device=dev, dtype=torch.float32) + k if rank == n - 1 else torch.full_like(bc, -1))
        mine.copy_(torch.arange(500, device=dev, dtype=torch.int32) + rank * 1000 + k)
        graph.replay()
        torch.cuda.synchronize()
        want_small = (torch.arange(37, dtype=torch.float32) + k) * n + n * (n - 1) / 2
        want_large = torch.stack([(ar.cpu() * 7 + r * 13 + k) % 1000 for r in range(n)]).max(0).values
        want_gathered = torch.cat([torch.arange(500, dtype=torch.int32) + r * 1000 + k for r in range(n)])
        for name, got, want in (("all_reduce", small, want_small), ("all_reduce MAX", large, want_large),
                                ("broadcast", bc, torch.arange(1001, dtype=torch.float32) + k),
                                ("all_gather_into_tensor", gathered, want_gathered)):
            if not torch.equal(got.cpu(), want):
                bad.append(f"replay {k}: {name} differs from torch's result")
        if bad:
            break
    h = dist.new_group(list(range(n)))
    dist.all_reduce(small, group=h)  # set up outside the capture
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            dist.gather(small, [torch.zeros_like(small) for _ in range(n)] if rank == 0 else None, dst=0, group=h)
        bad.append("a gather was captured without an error")
    except Exception as e:  # the capture fails with railcc's error, then torch's own
        if "cannot be captured into a CUDA graph" not in str(e) and "cannot be captured" not in repr(e.__context__):
            bad.append(f"a captured gather failed without saying why: {e!r}")
    return bad


def rk_cuda_heap(rank, n):
    """RAILCC_CUDA_SHOTS=1: allocate_tensor on CUDA carves the group's heap (what FSDP2 asks for);
    collectives on those tensors are right and are read in place (stats device_in_place)."""
    dev = _dev(rank)
    bad = []
    b = railcc.backend_of()
    if not b.supports_tensor_alloc(dev):
        return ["supports_tensor_alloc(cuda) is false with RAILCC_CUDA_SHOTS=1"]
    railcc.reset_stats()
    t = b.allocate_tensor(1 << 20, dtype=torch.float32, device=dev)
    t.copy_(torch.arange(1 << 20, dtype=torch.float32, device=dev) * (rank + 1))
    dist.all_reduce(t)
    if not torch.equal(t.cpu(), torch.arange(1 << 20, dtype=torch.float32) * (n * (n + 1) // 2)):
        bad.append("all_reduce on a heap tensor differs from torch's result")
    g = b.allocate_tensor(n * 1000, dtype=torch.int64, device=dev)
    dist.all_gather_into_tensor(g, g.narrow(0, rank * 1000, 1000).fill_(rank))
    if not torch.equal(g.cpu(), torch.arange(n).repeat_interleave(1000)):
        bad.append("all_gather_into_tensor in place on a heap tensor differs")
    torch.cuda.synchronize()
    if railcc.stats()["device"]["device_in_place"] < 2:
        bad.append(f"ops not read in place: {railcc.stats()['device']}")
    return bad


def rk_cuda_allocator_segments(rank, n):
    """RAILCC_CUDA_SHOTS=1: tensors of torch's caching allocator (what a DDP bucket is) are read
    in place once every peer has mapped their segment, and stay right; torch.cuda.empty_cache()
    frees segments that peers map (each closes them first) and later ops are still right."""
    import time
    dev = _dev(rank)
    bad = []
    early = torch.full((1 << 20,), float(rank), device=dev)  # made before the group's first CUDA call
    dist.all_reduce(early)  # the first CUDA call attaches the allocator's hook
    why = railcc._C._watch_allocator()
    if why:
        return [f"the allocator's hook is not attached: {why}"]
    railcc.reset_stats()
    for it in range(8):
        for count in (1000, 1 << 20):  # one-shot (input read through the scratch: in place), two-shot
            t = torch.full((count,), float(rank + 1 + it), device=dev)
            dist.all_reduce(t)
            want = float(sum(r + 1 + it for r in range(n)))
            if not torch.equal(t.cpu(), torch.full((count,), want)):
                bad.append(f"all_reduce of {count} from torch's allocator, round {it}, differs")
        dist.all_reduce(early)  # a segment made before the hook: found through the allocator
        time.sleep(0.02)  # the peers' watchers map the segments offered meanwhile
    torch.cuda.synchronize()
    if railcc.stats()["device"]["device_in_place"] < 1:
        bad.append(f"no op read a tensor of torch's allocator in place: {railcc.stats()['device']}")
    # An op still queued on the GPU when its tensor's segment is freed: the free waits for it,
    # then for the peers to close the segment.
    t = torch.full((1 << 22,), 1.0, device=dev)
    dist.all_reduce(t)
    del t, early
    torch.cuda.empty_cache()
    dist.barrier()
    t = torch.full((1 << 20,), float(rank), device=dev)
    dist.all_reduce(t)
    if not torch.equal(t.cpu(), torch.full((1 << 20,), float(sum(range(n))))):
        bad.append("all_reduce after empty_cache differs")
    return bad


def rk_cuda_gpu_hang(rank, n):
    """A kernel that sleeps past the op's timeout on the caller's stream, then an all_reduce:
    the call returns (through CUDA IPC it completes once its GPU work is queued), the watchdog
    fails the group after the timeout naming the op and the stream, with no core busy while it
    waits, and the next call raises CollectiveTimeoutError."""
    import resource
    import time
    from datetime import timedelta

    dev = _dev(rank)
    bad = []
    g = dist.new_group(list(range(n)), timeout=timedelta(seconds=3))
    t = torch.ones(1024, device=dev)
    dist.all_reduce(t, group=g)  # maps the peers' pools
    torch.cuda.synchronize()
    start = time.monotonic()
    torch.cuda._sleep(50_000_000)
    torch.cuda.synchronize()
    cycles_per_s = 50_000_000 / (time.monotonic() - start)
    torch.cuda._sleep(int(cycles_per_s * 9))  # past the 3 s timeout and the wait below
    dist.all_reduce(t, group=g)  # returns: nothing waits for the GPU
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0, wall0 = usage.ru_utime + usage.ru_stime, time.monotonic()
    time.sleep(5.5)  # the timeout, and the watchdog's check at most a second after it
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime - cpu0
    if cpu > 0.5 * (time.monotonic() - wall0):
        bad.append(f"{cpu:.2f} s of CPU over {time.monotonic() - wall0:.1f} s while the GPU op hung: a core spins")
    try:
        dist.all_reduce(t, group=g)
        bad.append("the call after a GPU op that never finished did not raise")
    except railcc.CollectiveTimeoutError as e:
        for want in ("allreduce (seq", "did not finish on the GPU within 3000 ms", "stream 0x"):
            if want not in str(e):
                bad.append(f"timeout message lacks {want!r}: {e}")
    except railcc.PeerFailureError as e:  # the peer's watchdog was first and told this rank
        if "did not finish on the GPU" not in str(e):
            bad.append(f"peer failure without the GPU timeout: {e}")
    torch.cuda.synchronize()  # the sleeping kernel ends
    dist.destroy_process_group(g)
    return bad


# ------------------------------------------------------------------------- tests

# Small buffers, so that ops cross many chunks; "ipc" is the default path for ranks of one host,
# "staged" forces pinned host staging for everything.
SMALL_STAGING = {"RAILCC_CUDA_STAGING_BYTES": "65536", "RAILCC_CUDA_IPC_BYTES": "262144"}
# "shots": all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single
# of equal splits in one kernel per tensor through the IPC pools (RAILCC_CUDA_SHOTS), the other
# ops as "ipc".
# "signals": the IPC path with its steps ordered by the streams' signals (RAILCC_CUDA_IPC_SIGNALS).
PATHS = {"ipc": {}, "staged": {"RAILCC_CUDA_IPC": "0"}, "shots": {"RAILCC_CUDA_SHOTS": "1"},
         "signals": {"RAILCC_CUDA_IPC_SIGNALS": "1"}}


def run_all(pool, fn, *args, timeout=600):
    """Runs fn on every rank; each returns a list of failures."""
    results = pool.run(fn, *args, timeout=timeout)
    bad = [f"rank {r}: {m}" for r, lst in enumerate(results) for m in lst]
    assert not bad, "\n".join(bad[:30])


@needs_gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_cuda_reductions(pools, n, path):
    run_all(pools(n, **SMALL_STAGING, **PATHS[path]), rk_cuda_reductions, [0, 1, 13, 20011], timeout=600)


@needs_gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_cuda_movement(pools, n, path):
    run_all(pools(n, **SMALL_STAGING, **PATHS[path]), rk_cuda_movement, [0, 1, 13, 20011], timeout=600)


@needs_gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("fn", [rk_cuda_coalesced, rk_cuda_streams, rk_cuda_errors], ids=lambda f: f.__name__[3:])
def test_cuda_semantics(pools, n, fn, path):
    run_all(pools(n, **PATHS[path]), fn, timeout=300)


@needs_gpu
@pytest.mark.parametrize("n", [2, 3])
def test_cuda_over_tcp(pools, n):
    run_all(pools(n, RAILCC_SHM_DISABLE="1", **SMALL_STAGING), rk_cuda_movement, [13, 20011], timeout=600)


@needs_gpu
def test_cuda_tensors_on_a_shrunk_group(pools):
    run_all(pools(3), rk_cuda_shrink, timeout=120)


@needs_gpu
def test_cuda_tensors_on_a_split_group(pools):
    run_all(pools(3), rk_cuda_split, timeout=120)


@needs_gpu
@pytest.mark.parametrize("n", [2])
def test_cuda_watchdog_times_out_a_gpu_op_that_never_finishes(pools, n):
    run_all(pools(n), rk_cuda_gpu_hang, timeout=120)


@needs_gpu
@pytest.mark.parametrize("n", [2, 3])
def test_cuda_shots_name_a_peer_that_stops_calling(pools, n):
    run_all(pools(n, RAILCC_CUDA_SHOTS="1"), rk_cuda_shot_missing_peer, timeout=120)


@needs_gpu
@pytest.mark.parametrize("n", [2, 3])
def test_cuda_graph_replays_captured_collectives(pools, n):
    run_all(pools(n, RAILCC_CUDA_SHOTS="1"), rk_cuda_graph, timeout=180)


@needs_gpu
@pytest.mark.parametrize("n", [2, 3])
def test_cuda_heap_tensors_are_read_in_place(pools, n):
    run_all(pools(n, RAILCC_CUDA_SHOTS="1"), rk_cuda_heap, timeout=120)


@needs_gpu
@pytest.mark.parametrize("n", [2, 3])
def test_cuda_allocator_tensors_are_read_in_place(pools, n):
    run_all(pools(n, RAILCC_CUDA_SHOTS="1"), rk_cuda_allocator_segments, timeout=120)


def train_on_cuda(script, world_size, extra, tmp_path, monkeypatch):
    """Runs an example on CUDA and compares it with the single-process CPU reference."""
    import test_training
    from test_training import STEPS, assert_same_training, launch, run_reference, _load
    # cuBLAS and the CPU reference round differently; a bad reduction is off by far more.
    monkeypatch.setattr(test_training, "RTOL", 1e-4)
    monkeypatch.setattr(test_training, "ATOL", 1e-5)
    save = tmp_path / "final.pt"
    out = launch(script, world_size, "railcc", [*STEPS, "--device", "cuda", *extra, "--save", str(save)],
                 tmp_path / "job")
    ref_out, ref_state = run_reference(script, list(STEPS), tmp_path / "ref")
    assert_same_training(out, _load(save), ref_out, ref_state, f"{script} on cuda x{world_size}")


@needs_gpu
@pytest.mark.parametrize("world_size", [2, 3])
def test_cuda_ddp_matches_reference(world_size, tmp_path, monkeypatch):
    train_on_cuda("ddp_train.py", world_size, ["--bucket-cap-mb", "0.001"], tmp_path, monkeypatch)


@needs_gpu
@pytest.mark.parametrize("world_size", [2, 3])
def test_cuda_fsdp2_matches_reference(world_size, tmp_path, monkeypatch):
    train_on_cuda("fsdp2_train.py", world_size, [], tmp_path, monkeypatch)
