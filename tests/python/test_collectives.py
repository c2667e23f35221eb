"""Every collective x dtype x reduce op against what torch computes locally.

Each test runs one function on every rank of a real process group (see harness.py); the
function builds every rank's input deterministically, so each rank can compute the
expected result itself with plain torch and report mismatches. Pools are parameterized
over world sizes 1-4 and over both transports (shared memory, and TCP forced with
RAILCC_SHM_DISABLE=1).
"""

import copy
import os
import datetime

import pytest
import torch
import torch.distributed as dist

import harness

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
DTYPES = FLOATS + INTS + [torch.bool]
COUNTS = [0, 1, 13]

OPS = {
    "SUM": dist.ReduceOp.SUM,
    "AVG": dist.ReduceOp.AVG,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
    "BAND": dist.ReduceOp.BAND,
    "BOR": dist.ReduceOp.BOR,
    "BXOR": dist.ReduceOp.BXOR,
    "PREMUL_SUM": None,  # built per call: dist._make_nccl_premul_sum(factor)
}
PREMUL = 0.5


def ops_for(dtype):
    if dtype == torch.bool:
        return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    if dtype.is_floating_point:
        return ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]
    return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def make_input(rank, dtype, count, salt=0):
    """Small values, so sums and products are exact in every dtype."""
    i = torch.arange(count, dtype=torch.int64)
    if dtype == torch.bool:
        return ((i + rank + salt) % 3 != 0)
    v = (i * 7 + rank * 3 + salt) % 5 + 1  # 1..5
    if dtype.is_floating_point:
        v = v - 2  # -1..3, includes negatives and zero
    return v.to(dtype)


def make_ragged(rank, dtype, count, salt=0):
    """As make_input, but without a short period, so that a piece read from the wrong chunk
    or the wrong offset shows."""
    i = (torch.arange(count, dtype=torch.int64) * 7919 + salt * 104729) % 65521
    if dtype == torch.bool:
        return ((i + rank) % 3 != 0)
    v = (i * 7 + rank * 3) % 5 + 1
    if dtype.is_floating_point:
        v = v - 2
    return v.to(dtype)


def reduce_ref(inputs, name, n):
    acc = inputs[0].clone()
    if name == "PREMUL_SUM":
        acc = inputs[0].double() * PREMUL
        for x in inputs[1:]:
            acc = acc + x.double() * PREMUL
        return acc.to(inputs[0].dtype)
    for x in inputs[1:]:
        if name in ("SUM", "AVG"):
            acc = (acc | x) if acc.dtype == torch.bool else acc + x
        elif name == "PRODUCT":
            acc = (acc & x) if acc.dtype == torch.bool else acc * x
        elif name == "MIN":
            acc = torch.minimum(acc, x)
        elif name == "MAX":
            acc = torch.maximum(acc, x)
        elif name == "BAND":
            acc = acc & x
        elif name == "BOR":
            acc = acc | x
        elif name == "BXOR":
            acc = acc ^ x
    if name == "AVG":
        acc = (acc.double() / n).to(acc.dtype)
    return acc


def op_obj(name):
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(PREMUL)
    return OPS[name]


def close(a, b):
    if a.dtype in (torch.float16, torch.bfloat16):
        return torch.allclose(a.double(), b.double(), rtol=2e-2, atol=2e-2)
    if a.dtype.is_floating_point:
        return torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    return torch.equal(a, b)


# ----------------------------------------------------------------------------- rank functions
# These run on every rank and return a list of failure descriptions.


def rk_allreduce(rank, n):
    bad = []
    for dt in DTYPES:
        for name in ops_for(dt):
            for count in COUNTS:
                t = make_input(rank, dt, count)
                dist.all_reduce(t, op=op_obj(name))
                exp = reduce_ref([make_input(r, dt, count) for r in range(n)], name, n)
                if not close(t, exp):
                    bad.append(f"all_reduce {dt} {name} count={count}: {t.tolist()} != {exp.tolist()}")
    return bad


def _first_bad(got, want):
    """The first few indices where `got` differs from `want`."""
    return (got != want).nonzero()[:5].flatten().tolist()


def rk_allreduce_large(rank, n):
    # Larger than one shared-memory FIFO (4 MiB) and an odd count, so chunks wrap.
    bad = []
    for dt, count in ((torch.float32, 3_000_017), (torch.int64, 1_000_003)):
        t = make_input(rank, dt, count)
        dist.all_reduce(t)
        exp = reduce_ref([make_input(r, dt, count) for r in range(n)], "SUM", n)
        if not torch.equal(t, exp):
            bad.append(f"large all_reduce {dt}: first bad indices {_first_bad(t, exp)}")
    return bad


def rk_rings_in_step(rank, n):
    # With every rank on one host, all-reduce and reduce-scatter above the one-shot size move
    # their data in blocks through the broadcast rings, which broadcast and all-gather share as
    # byte streams. Small rings (see the test) give many chunks per call, blocks that skip the
    # ring's end, and streams left at odd positions by the broadcasts in between.
    bad = []
    for i, dt in enumerate(DTYPES):
        # Every op on one float and one integer type, one op (in turn) on the others: the
        # reductions are test_collective's; here the streams' positions are under test.
        ops = ops_for(dt)
        names = ops if dt in (torch.float32, torch.int32) else [ops[i % len(ops)]]
        for name in names:
            count = 20_011 + 37 * i
            t = make_ragged(rank, dt, count)
            dist.all_reduce(t, op=op_obj(name))
            exp = reduce_ref([make_ragged(r, dt, count) for r in range(n)], name, n)
            if not close(t, exp):
                bad.append(f"all_reduce {dt} {name} count={count}: first bad indices {_first_bad(t, exp)}")
            full = make_ragged(rank, dt, count * n, salt=2)
            out = torch.empty(count, dtype=dt)
            dist.reduce_scatter_tensor(out, full, op=op_obj(name))
            exp = reduce_ref([make_ragged(r, dt, count * n, salt=2) for r in range(n)], name, n)[rank * count:(rank + 1) * count]
            if not close(out, exp):
                bad.append(f"reduce_scatter {dt} {name} count={count}: first bad indices {_first_bad(out, exp)}")
        want = make_input(i % n, torch.uint8, 2_001 + i, salt=i)
        b = want.clone() if rank == i % n else torch.zeros_like(want)
        dist.broadcast(b, src=i % n)
        if not torch.equal(b, want):
            bad.append(f"broadcast after all_reduce {dt}: first bad indices {_first_bad(b, want)}")
    return bad


def rk_broadcast_large(rank, n):
    # Above the one-shot size every rank of one host shares the root's ring; past 4 MiB the
    # ring wraps, and consecutive roots check that every ring's positions stay in step.
    bad = []
    for dt, count in ((torch.uint8, 70_001), (torch.float32, 1_500_007), (torch.int64, 3)):
        for root in range(n):
            want = make_input(root, dt, count, salt=root)
            t = want.clone() if rank == root else torch.zeros(count, dtype=dt)
            dist.broadcast(t, src=root)
            if not torch.equal(t, want):
                bad.append(f"broadcast {dt} count={count} root={root}: first bad indices {_first_bad(t, want)}")
    return bad


def rk_allgather_large(rank, n):
    # Above the one-shot size every rank of one host writes its piece into its ring and reads
    # the others'; 1.5 M floats per rank wrap the 4 MiB rings.
    bad = []
    for dt, count in ((torch.uint8, 70_001), (torch.float32, 1_500_007)):
        mine = make_input(rank, dt, count, salt=7)
        out = torch.empty(count * n, dtype=dt)
        dist.all_gather_into_tensor(out, mine)
        want = torch.cat([make_input(r, dt, count, salt=7) for r in range(n)])
        if not torch.equal(out, want):
            bad.append(f"all_gather {dt} count={count}: first bad indices {_first_bad(out, want)}")
    return bad


def rk_views_at_every_page_offset(rank, n):
    # A copy's speed (and path: memcpy or railcc's own loop) depends on where its destination
    # lies past its source modulo a 4 KiB page; views at every 8-byte offset of a page move
    # each piece through both, against the stream's positions wherever they happen to be.
    # Random bytes: a piece copied a few bytes off cannot match by a repeating pattern.
    count = 20_000

    def data(k, r):
        return torch.randint(0, 256, (count,), dtype=torch.uint8, generator=torch.Generator().manual_seed(k * 31 + r))

    bad = []
    base = torch.zeros(count * n + 8192, dtype=torch.uint8)
    for k in list(range(0, 4096, 8)) + [1, 3, 4093]:
        want = data(k, k % n)
        t = base[k:k + count]
        t.copy_(want if rank == k % n else torch.zeros_like(want))
        dist.broadcast(t, src=k % n)
        if not torch.equal(t, want):
            bad.append(f"broadcast of a view at byte {k}: first bad indices {_first_bad(t, want)}")
        if k % 64 == 8 or k < 8:
            out = base[k:k + count * n]
            dist.all_gather_into_tensor(out, data(k, rank))
            want_all = torch.cat([data(k, r) for r in range(n)])
            if not torch.equal(out, want_all):
                bad.append(f"all_gather into a view at byte {k}: first bad indices {_first_bad(out, want_all)}")
    return bad


def rk_reduce(rank, n):
    bad = []
    for dt in DTYPES:
        for name in ops_for(dt):
            for count in (0, 5):
                root = (count + len(name)) % n
                t = make_input(rank, dt, count)
                orig = t.clone()
                dist.reduce(t, dst=root, op=op_obj(name))
                if rank == root:
                    exp = reduce_ref([make_input(r, dt, count) for r in range(n)], name, n)
                    if not close(t, exp):
                        bad.append(f"reduce {dt} {name} root={root}: {t.tolist()} != {exp.tolist()}")
                elif not torch.equal(t, orig):
                    bad.append(f"reduce {dt} {name}: non-root input was modified")
    return bad


def rk_reduce_scatter(rank, n):
    bad = []
    for dt in DTYPES:
        for name in ops_for(dt):
            for count in (0, 1, 3):
                full = [make_input(r, dt, count * n, salt=1) for r in range(n)]
                exp = reduce_ref(full, name, n)[rank * count:(rank + 1) * count]
                out = torch.empty(count, dtype=dt)
                dist.reduce_scatter_tensor(out, full[rank].clone(), op=op_obj(name))
                if not close(out, exp):
                    bad.append(f"reduce_scatter_tensor {dt} {name} count={count}: {out.tolist()} != {exp.tolist()}")
                out2 = torch.empty(count, dtype=dt)
                dist.reduce_scatter(out2, list(full[rank].clone().chunk(n)) if count else
                                    [torch.empty(0, dtype=dt) for _ in range(n)], op=op_obj(name))
                if not close(out2, exp):
                    bad.append(f"reduce_scatter(list) {dt} {name} count={count}: {out2.tolist()} != {exp.tolist()}")
    return bad


def rk_allgather(rank, n):
    bad = []
    for dt in DTYPES:
        for count in COUNTS:
            inp = make_input(rank, dt, count)
            exp = torch.cat([make_input(r, dt, count) for r in range(n)])
            out = torch.empty(count * n, dtype=dt)
            dist.all_gather_into_tensor(out, inp)
            if not torch.equal(out, exp):
                bad.append(f"all_gather_into_tensor {dt} count={count}")
            outs = [torch.empty(count, dtype=dt) for _ in range(n)]
            dist.all_gather(outs, inp)
            if not torch.equal(torch.cat(outs), exp):
                bad.append(f"all_gather(list) {dt} count={count}")
            # in place: the input is this rank's slice of the output
            out3 = torch.zeros(count * n, dtype=dt)
            out3[rank * count:(rank + 1) * count] = inp
            dist.all_gather_into_tensor(out3, out3[rank * count:(rank + 1) * count])
            if not torch.equal(out3, exp):
                bad.append(f"in-place all_gather_into_tensor {dt} count={count}")
    return bad


def rk_broadcast(rank, n):
    bad = []
    for dt in DTYPES:
        # The large count (past the rings, from root 0) once per element size: broadcast moves
        # bytes, whatever they mean.
        large = [1_500_001] if dt in (torch.uint8, torch.float16, torch.float32, torch.float64) else []
        for count in COUNTS + large:
            for root in range(n):
                t = make_input(rank, dt, count)
                dist.broadcast(t, src=root)
                if not torch.equal(t, make_input(root, dt, count)):
                    bad.append(f"broadcast {dt} count={count} root={root}")
            if count > 1000:
                break
    return bad


def rk_alltoall_large(rank, n):
    # Blocks of 8 MiB and an odd count: together they outgrow the cache share, so the
    # receives from shared memory write around the cache (streaming stores) in pieces.
    bad = []
    count = 2_100_001
    inp = make_ragged(rank, torch.float32, count * n, salt=rank)
    out = torch.empty(count * n, dtype=torch.float32)
    dist.all_to_all_single(out, inp)
    want = torch.cat([make_ragged(r, torch.float32, count * n, salt=r)[rank * count:(rank + 1) * count] for r in range(n)])
    if not torch.equal(out, want):
        bad.append(f"large all_to_all: first bad indices {_first_bad(out, want)}")
    return bad


def rk_inline_boundary(rank, n):
    # Messages up to 512 bytes travel as one write of header, payload and padding; just above,
    # header and payload go separately. Sizes on both sides of that line, odd byte counts
    # included, for the collectives whose messages are that size.
    bad = []
    for dt, count in ((torch.int8, 505), (torch.int8, 511), (torch.int8, 512), (torch.int8, 513),
                      (torch.float32, 127), (torch.float32, 128), (torch.float32, 129), (torch.float64, 65)):
        t = make_input(rank, dt, count)
        dist.all_reduce(t)
        exp = reduce_ref([make_input(r, dt, count) for r in range(n)], "SUM", n)
        if not close(t, exp):
            bad.append(f"all_reduce {dt} count={count}: first bad indices {_first_bad(t, exp)}")
        root = n - 1
        t = make_input(rank, dt, count)
        dist.broadcast(t, src=root)
        if not torch.equal(t, make_input(root, dt, count)):
            bad.append(f"broadcast {dt} count={count}")
        t = make_input(rank, dt, count)
        dist.reduce(t, dst=root)
        if rank == root and not close(t, exp):
            bad.append(f"reduce {dt} count={count}")
        out = torch.empty(count * n, dtype=dt)
        dist.all_gather_into_tensor(out, make_input(rank, dt, count))
        if not torch.equal(out, torch.cat([make_input(r, dt, count) for r in range(n)])):
            bad.append(f"all_gather {dt} count={count}")
        mine = torch.empty(count, dtype=dt)
        dist.reduce_scatter_tensor(mine, make_input(rank, dt, count * n))
        want = reduce_ref([make_input(r, dt, count * n) for r in range(n)], "SUM", n)[rank * count:(rank + 1) * count]
        if not close(mine, want):
            bad.append(f"reduce_scatter {dt} count={count}")
        got = torch.empty(count * n, dtype=dt)
        dist.all_to_all_single(got, make_input(rank, dt, count * n, salt=rank))
        want = torch.cat([make_input(r, dt, count * n, salt=r)[rank * count:(rank + 1) * count] for r in range(n)])
        if not torch.equal(got, want):
            bad.append(f"all_to_all {dt} count={count}")
    return bad


def rk_sync_work(rank, n):
    # A synchronous call (asyncOp=False, as dist.all_reduce makes it) keeps only weak
    # references to its tensors and makes its future when asked: both must still answer.
    bad = []
    pg = dist.distributed_c10d._get_default_group()
    t = make_input(rank, torch.float32, 13)
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    w = pg.allreduce([t], opts)
    w.wait()
    exp = reduce_ref([make_input(r, torch.float32, 13) for r in range(n)], "SUM", n)
    if not close(t, exp):
        bad.append(f"sync all_reduce: {t.tolist()} != {exp.tolist()}")
    res = w.result()
    if len(res) != 1 or res[0].data_ptr() != t.data_ptr():
        bad.append(f"sync work result() is not the call's tensor: {res}")
    fut = w.get_future()
    val = fut.wait()
    if not fut.done() or len(val) != 1 or not torch.equal(val[0], t):
        bad.append(f"sync work future: done={fut.done()} value={val}")
    if not w.get_future().done():
        bad.append("a second get_future() is not done")
    return bad


def rk_gather_scatter(rank, n):
    bad = []
    for dt in (torch.float32, torch.int8, torch.bool, torch.bfloat16):
        for count in (0, 3):
            root = n - 1
            inp = make_input(rank, dt, count)
            outs = [torch.empty(count, dtype=dt) for _ in range(n)] if rank == root else None
            dist.gather(inp, outs, dst=root)
            if rank == root and not torch.equal(torch.cat(outs), torch.cat([make_input(r, dt, count) for r in range(n)])):
                bad.append(f"gather {dt} count={count}")
            out = torch.empty(count, dtype=dt)
            ins = [make_input(r, dt, count, salt=2) for r in range(n)] if rank == 0 else None
            dist.scatter(out, ins, src=0)
            if not torch.equal(out, make_input(rank, dt, count, salt=2)):
                bad.append(f"scatter {dt} count={count}")
    return bad


def rk_alltoall(rank, n):
    bad = []
    for dt in (torch.float32, torch.int64, torch.float16, torch.bool):
        # equal splits
        inp = make_input(rank, dt, 2 * n)
        out = torch.empty(2 * n, dtype=dt)
        dist.all_to_all_single(out, inp)
        exp = torch.cat([make_input(r, dt, 2 * n)[2 * rank:2 * rank + 2] for r in range(n)])
        if not torch.equal(out, exp):
            bad.append(f"all_to_all_single equal {dt}")
        # uneven splits: rank r sends (r + p) % 3 rows to rank p, zero-size ones included
        def splits(src):
            return [(src + p) % 3 for p in range(n)]
        ins = splits(rank)
        outs = [splits(src)[rank] for src in range(n)]
        inp = make_input(rank, dt, sum(ins), salt=5)
        out = torch.empty(sum(outs), dtype=dt)
        dist.all_to_all_single(out, inp, output_split_sizes=outs, input_split_sizes=ins)
        pieces = []
        for src in range(n):
            s = splits(src)
            full = make_input(src, dt, sum(s), salt=5)
            off = sum(s[:rank])
            pieces.append(full[off:off + s[rank]])
        if not torch.equal(out, torch.cat(pieces)):
            bad.append(f"all_to_all_single uneven {dt}")
        # list form
        ins_l = [make_input(rank * n + p, dt, p + 1) for p in range(n)]
        outs_l = [torch.empty(rank + 1, dtype=dt) for _ in range(n)]
        dist.all_to_all(outs_l, ins_l)
        for src in range(n):
            if not torch.equal(outs_l[src], make_input(src * n + rank, dt, rank + 1)):
                bad.append(f"all_to_all list {dt} from {src}")
    return bad


def rk_p2p(rank, n):
    bad = []
    if n == 1:
        return bad
    right, left = (rank + 1) % n, (rank - 1) % n
    # blocking ring with tags; big enough to exceed a FIFO so both directions must overlap
    for count in (0, 5, 2_000_003):
        s = make_input(rank, torch.float32, count)
        r = torch.empty(count, dtype=torch.float32)
        ops = [dist.P2POp(dist.isend, s, right, tag=3), dist.P2POp(dist.irecv, r, left, tag=3)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        if not torch.equal(r, make_input(left, torch.float32, count)):
            bad.append(f"batch_isend_irecv count={count}")
    # plain isend/irecv without a batch, both directions at once
    s = make_input(rank, torch.int32, 1_200_000)
    r = torch.empty_like(s)
    w1 = dist.isend(s, right)
    w2 = dist.irecv(r, left)
    w1.wait()
    w2.wait()
    if not torch.equal(r, make_input(left, torch.int32, 1_200_000)):
        bad.append("isend/irecv")
    # receive from any source: everyone sends one tensor to rank 0
    if rank == 0:
        got = set()
        for _ in range(n - 1):
            t = torch.empty(3, dtype=torch.int64)
            src = dist.recv(t)
            if not torch.equal(t, torch.full((3,), src, dtype=torch.int64)):
                bad.append(f"recv(any) payload from {src}")
            got.add(src)
        if got != set(range(1, n)):
            bad.append(f"recv(any) sources {got}")
    else:
        dist.send(torch.full((3,), rank, dtype=torch.int64), 0)
    # a posted receive must not block a later collective (separate lanes)
    if rank == 0:
        r = torch.empty(4)
        w = dist.irecv(r, 1, tag=9)
        t = torch.ones(2)
        dist.all_reduce(t)
        w.wait()
        if not torch.equal(r, torch.full((4,), 7.0)):
            bad.append("irecv across a collective")
    else:
        t = torch.ones(2)
        dist.all_reduce(t)
        if rank == 1:
            dist.send(torch.full((4,), 7.0), 0, tag=9)
    return bad


def rk_barrier_and_zero(rank, n):
    for _ in range(3):
        dist.barrier()
    t = torch.empty(0)
    dist.all_reduce(t)
    return []


def rk_coalesced(rank, n):
    bad = []
    ts = [make_input(rank, torch.float32, k) for k in (1, 0, 1000, 33, 4096)]
    exp = [reduce_ref([make_input(r, torch.float32, t.numel()) for r in range(n)], "SUM", n) for t in ts]
    dist.all_reduce_coalesced(ts)
    for t, e in zip(ts, exp):
        if not torch.equal(t, e):
            bad.append(f"all_reduce_coalesced numel={t.numel()}")
    # through the coalescing manager, as DDP and FSDP use it
    from torch.distributed.distributed_c10d import _coalescing_manager

    ts = [make_input(rank, torch.float64, k) for k in (7, 100)]
    with _coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    for t in ts:
        if not torch.equal(t, reduce_ref([make_input(r, torch.float64, t.numel()) for r in range(n)], "SUM", n)):
            bad.append(f"coalescing manager all_reduce numel={t.numel()}")
    ins = [make_input(rank, torch.int32, k) for k in (3, 5)]
    outs = [torch.empty(k * n, dtype=torch.int32) for k in (3, 5)]
    with _coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    for o, i in zip(outs, ins):
        if not torch.equal(o, torch.cat([make_input(r, torch.int32, i.numel()) for r in range(n)])):
            bad.append("coalesced all_gather_into_tensor")
    ins = [make_input(rank, torch.float32, k * n) for k in (2, 4)]
    outs = [torch.empty(k, dtype=torch.float32) for k in (2, 4)]
    with _coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.reduce_scatter_tensor(o, i)
    cm.wait()
    for o, k in zip(outs, (2, 4)):
        full = reduce_ref([make_input(r, torch.float32, k * n) for r in range(n)], "SUM", n)
        if not torch.equal(o, full[rank * k:(rank + 1) * k]):
            bad.append("coalesced reduce_scatter_tensor")
    return bad


def rk_async_futures(rank, n):
    bad = []
    works, ts = [], []
    for k in range(4):
        t = make_input(rank, torch.float32, 100 + k)
        ts.append(t)
        works.append(dist.all_reduce(t, async_op=True))
    fut = works[-1].get_future().then(lambda f: f.value()[0] * 2)
    for w in works:
        w.wait()
    for k, t in enumerate(ts):
        if not torch.equal(t, reduce_ref([make_input(r, torch.float32, 100 + k) for r in range(n)], "SUM", n)):
            bad.append(f"async all_reduce {k}")
    if not torch.equal(fut.wait(), ts[-1] * 2):
        bad.append("future then() value")
    w = dist.broadcast(torch.ones(3), src=0, async_op=True)
    w.wait()
    if not w.is_completed() or not w.is_success():
        bad.append("work state after wait")
    return bad


def rk_subgroups(rank, n):
    bad = []
    evens = dist.new_group([r for r in range(n) if r % 2 == 0])
    odds = dist.new_group([r for r in range(n) if r % 2 == 1]) if n > 1 else None
    mine = evens if rank % 2 == 0 else odds
    members = [r for r in range(n) if r % 2 == rank % 2]
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    if t.item() != float(sum(members)):
        bad.append(f"subgroup all_reduce {t.item()} != {sum(members)}")
    # interleave with the world group: communicators in one process are independent
    w = torch.tensor([1.0])
    dist.all_reduce(w)
    if w.item() != n:
        bad.append("world all_reduce after subgroup")
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=members[-1], group=mine)
    if b.item() != members[-1]:
        bad.append("subgroup broadcast with a global root")
    for g in (evens, odds):
        if g is not None:
            dist.destroy_process_group(g)
    return bad


def rk_split(rank, n):
    # ProcessGroup.split_group, the call under dist.split_group (which itself insists on an
    # accelerator, so the C++ ProcessGroup's method is called here): the parent's halves form
    # child groups among themselves; a rank left out gets None; a rank outside the parent is
    # refused by name.
    bad = []
    world = dist.group.WORLD
    be = world._get_backend(torch.device("cpu"))
    if not be.supports_splitting:
        bad.append("supports_splitting is false")
    if copy.deepcopy(be.options) is not None:  # what dist.split_group does with it
        bad.append("options are not None")
    members = [r for r in range(n) if r % 2 == rank % 2]
    child = world.split_group(members[::-1], timeout=datetime.timedelta(seconds=60))
    if child is None or child.size() != len(members) or child.rank() != members.index(rank):
        return bad + [f"child group {child} of {members}"]
    # torch 2.13 splits once per device type the parent serves (railcc: cpu and cuda): one
    # child must serve both, not two children racing on one store prefix.
    cpu_be, cuda_be = child._get_backend(torch.device("cpu")), child._get_backend(torch.device("cuda"))
    if cpu_be is not cuda_be:
        bad.append(f"two children for one split: {cpu_be} and {cuda_be}")
    t = torch.tensor([float(rank + 1)] * 5)
    child.allreduce([t]).wait()
    if not torch.equal(t, torch.full((5,), float(sum(r + 1 for r in members)))):
        bad.append(f"child all_reduce {t.tolist()} over {members}")
    b = torch.full((3,), float(rank))
    child.broadcast([b], dist.BroadcastOptions()).wait()  # root 0 of the child: its lowest rank
    if not torch.equal(b, torch.full((3,), float(members[0]))):
        bad.append(f"child broadcast {b.tolist()}")
    lone = world.split_group([0])
    if (lone is None) != (rank != 0) or (lone is not None and lone.size() != 1):
        bad.append(f"split_group([0]) gave {lone}")
    w = torch.ones(2)
    dist.all_reduce(w)  # the parent goes on working
    if not torch.equal(w, torch.full((2,), float(n))):
        bad.append("parent all_reduce after the splits")
    try:
        world.split_group([0, n])
        bad.append("a rank outside the parent was accepted")
    except ValueError as e:
        if f"rank {n} is not a rank of it" not in str(e):
            bad.append(f"unclear refusal: {e}")
    except RuntimeError as e:  # torch's own check when the list is longer than the group
        if n > 1:
            bad.append(f"refused by torch, not railcc: {e}")
    for secs in (0, -5):  # a timeout that could never be met (it once said "no progress for -5000 ms")
        try:
            world.split_group(members, timeout=datetime.timedelta(seconds=secs))
            bad.append(f"a split timeout of {secs} s was accepted")
        except ValueError as e:
            if "give a positive timeout" not in str(e):
                bad.append(f"unclear refusal of a {secs} s timeout: {e}")
    for g in (child, lone):
        if g is not None:
            g.shutdown()
    return bad


def rk_seqnum(rank, n):
    # ProcessGroup refuses this query for custom backends; the backend answers it.
    be = dist.group.WORLD._get_backend(torch.device("cpu"))
    be._set_sequence_number_for_group()
    before = be._get_sequence_number_for_group()
    for _ in range(3):
        dist.all_reduce(torch.ones(1))
    after = be._get_sequence_number_for_group()
    return [] if after - before == 3 else [f"sequence number moved {before}->{after}"]


def _sockets():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


_LAZY_RUNS = [0]  # store keys of their own per run: a pool's store outlives a test


def _all_to_all_meets_everyone(rank, n, g, key, connections):
    """An all-to-all on `g`, checked against its expected values; afterwards `connections()`
    must count a connection to every peer. Returns what went wrong."""
    bad = []
    ins = [torch.full((7,), float(rank * 100 + j)) for j in range(n)]
    outs = [torch.empty(7) for _ in range(n)]
    dist.all_to_all(outs, ins, group=g)
    harness.store_barrier(f"{key}/a2a", n)
    if any(not torch.equal(outs[j], torch.full((7,), float(j * 100 + rank))) for j in range(n)):
        bad.append("all_to_all result")
    if connections() != n - 1:
        bad.append(f"after an all_to_all {connections()} connections, not {n - 1}")
    harness.store_barrier(f"{key}/a2a-counted", n)
    return bad


def rk_lazy_connections(rank, n):
    """Connections between hosts made at first use (RAILCC_RUNTIME_CONNECT=1, TCP for every
    peer): a ring all-reduce connects the two neighbours only, an all-to-all then everyone,
    send/recv its own lane, a receive from any source whoever sends."""
    bad = []
    _LAZY_RUNS[0] += 1
    run = _LAZY_RUNS[0]
    g = dist.new_group(list(range(n)))  # a group of its own: nothing connected yet
    before = _sockets()
    x = make_input(rank, torch.float32, 300_001)
    dist.all_reduce(x, group=g)
    harness.store_barrier(f"lazy/{run}/ring", n)  # counted before a faster rank dials for the next op
    if not close(x, reduce_ref([make_input(r, torch.float32, 300_001) for r in range(n)], "SUM", n)):
        bad.append("ring all_reduce result")
    ring = _sockets() - before
    harness.store_barrier(f"lazy/{run}/ring-counted", n)
    if ring != min(2, n - 1):
        bad.append(f"a ring all_reduce made {ring} connections, not {min(2, n - 1)} (its neighbours)")
    bad += _all_to_all_meets_everyone(rank, n, g, f"lazy/{run}", lambda: _sockets() - before)
    # send/recv on its own lane: a ring, then everyone to rank 0 from any source
    right, left = (rank + 1) % n, (rank - 1) % n
    r = torch.empty(5)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((5,), float(rank)), right, group=g),
                                     dist.P2POp(dist.irecv, r, left, group=g)]):
        w.wait()
    if not torch.equal(r, torch.full((5,), float(left))):
        bad.append("send/recv ring")
    if rank == 0:
        got = set()
        for _ in range(n - 1):
            t = torch.empty(2, dtype=torch.int64)
            src = dist.recv(t, group=g)
            got.add(src)
            if not torch.equal(t, torch.full((2,), src, dtype=torch.int64)):
                bad.append(f"recv from any source: payload from {src}")
        if got != set(range(1, n)):
            bad.append(f"recv from any source heard {sorted(got)}")
    else:
        dist.send(torch.full((2,), rank, dtype=torch.int64), 0, group=g)
    dist.barrier(group=g)
    dist.destroy_process_group(g)
    return bad


def _collective_peers_ring(rank, n):
    """Independent of railcc's code: the peers a rank's collectives meet with RAILCC_ALGO=ring
    on ranks in rank order: the ring's neighbours (all-reduce, reduce-scatter, all-gather), the
    chain broadcast's (its neighbours; the tail tells the root, its neighbour too), and the
    barrier's dissemination partners (rank +- 2^k)."""
    peers = {(rank + 1) % n, (rank - 1) % n}
    k = 1
    while k < n:
        peers |= {(rank + k) % n, (rank - k) % n}
        k *= 2
    return peers - {rank}


def rk_connected_at_init(rank, n):
    """RAILCC_RUNTIME_CONNECT=0 over TCP: a new group is connected, before it returns, to exactly
    the peers its collectives meet; those collectives then make no connection; an all-to-all
    connects the rest at first use."""
    bad = []
    _LAZY_RUNS[0] += 1
    run = _LAZY_RUNS[0]
    before = _sockets()
    g = dist.new_group(list(range(n)))
    harness.store_barrier(f"eager/{run}/init", n)  # every rank's init over: its dials arrived
    made = _sockets() - before - 1  # the group's listener, kept for first-use connections
    want = _collective_peers_ring(rank, n)
    if made != len(want):
        bad.append(f"init made {made} connections, not {len(want)} (peers {sorted(want)})")
    x = make_input(rank, torch.float32, 300_001)
    dist.all_reduce(x, group=g)
    if not close(x, reduce_ref([make_input(r, torch.float32, 300_001) for r in range(n)], "SUM", n)):
        bad.append("all_reduce result")
    b = torch.arange(1001, dtype=torch.float64) if rank == 0 else torch.zeros(1001, dtype=torch.float64)
    dist.broadcast(b, 0, group=g)
    if not torch.equal(b, torch.arange(1001, dtype=torch.float64)):
        bad.append("broadcast from rank 0")
    outs = [torch.empty(1000) for _ in range(n)]
    dist.all_gather(outs, torch.full((1000,), float(rank)), group=g)
    if any(not torch.equal(outs[j], torch.full((1000,), float(j))) for j in range(n)):
        bad.append("all_gather result")
    dist.barrier(group=g)
    harness.store_barrier(f"eager/{run}/ops", n)
    if _sockets() - before - 1 != made:
        bad.append(f"the collectives made {_sockets() - before - 1 - made} more connections")
    harness.store_barrier(f"eager/{run}/ops-counted", n)
    bad += _all_to_all_meets_everyone(rank, n, g, f"eager/{run}", lambda: _sockets() - before - 1)
    dist.destroy_process_group(g)
    return bad


def rk_pair_reduce(rank, n):
    # Two ranks reduce each other's block in whichever order (a op b on one, b op a on the other)
    # rather than in rank order: both must still end with the same bits, so the values here are
    # not exact in half precision. Counts around 8 KiB: the test's FIFOs are 16 KiB.
    bad = []
    gen = torch.Generator().manual_seed(rank)
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.int32):
        for count in (2047, 8192 // dt.itemsize, 8192 // dt.itemsize + 1, 3001):
            mine = (torch.randn(count, generator=gen) * 100).to(dt) if dt.is_floating_point else \
                torch.randint(-1000, 1000, (count,), generator=gen, dtype=dt)
            every = [torch.empty_like(mine) for _ in range(n)]
            dist.all_gather(every, mine)
            for name in ops_for(dt):
                exp = reduce_ref(every, name, n)
                t = mine.clone()
                dist.all_reduce(t, op=op_obj(name))
                theirs = [torch.empty_like(t) for _ in range(n)]
                dist.all_gather(theirs, t)
                if not torch.equal(theirs[0].view(torch.uint8), theirs[1].view(torch.uint8)):
                    bad.append(f"all_reduce {dt} {name} count={count}: the ranks' results differ in their bits")
                if name in ("SUM", "MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR") and not torch.equal(t, exp):
                    bad.append(f"all_reduce {dt} {name} count={count}: first bad indices {_first_bad(t, exp)}")
                elif not close(t, exp):
                    bad.append(f"all_reduce {dt} {name} count={count}: first bad indices {_first_bad(t, exp)}")
            # reduce_scatter out of place, and into the input's own block (the block sent is the
            # other one, which the send must have taken before the result is written)
            full = torch.cat([mine, mine.flip(0)])
            both = [torch.cat([e, e.flip(0)]) for e in every]
            exp = reduce_ref(both, "SUM", n)[rank * count:(rank + 1) * count]
            out = torch.empty_like(mine)
            dist.reduce_scatter_tensor(out, full)
            view = full.clone()
            dist.reduce_scatter_tensor(view[rank * count:(rank + 1) * count], view)
            for what, got in (("out of place", out), ("into its own block", view[rank * count:(rank + 1) * count])):
                if not torch.equal(got, exp):
                    bad.append(f"reduce_scatter {dt} {what} count={count}: first bad indices {_first_bad(got, exp)}")
    # Many in flight at once: more than the FIFO holds, each send waiting for the peer to take
    # the ones before it.
    ts = [torch.full((2048,), float(rank + i), dtype=torch.float32) for i in range(40)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in works:
        w.wait()
    for i, t in enumerate(ts):
        if not torch.equal(t, torch.full_like(t, float(2 * i + 1))):
            bad.append(f"async all_reduce {i} of 40: first bad indices {_first_bad(t, torch.full_like(t, 2 * i + 1.0))}")
    return bad


def rk_oneshot_into_own_block(rank, n):
    # The one-shot reduction keeps its running result in the output (rank 0) or in the scratch
    # area (the others) and reads the rank's own block where it is: a reduce_scatter whose
    # output is the input's own block must still see that block unreduced.
    bad = []
    for dt in (torch.float32, torch.bfloat16, torch.int32):
        for name in ops_for(dt):
            count = 1001
            full = make_ragged(rank, dt, count * n, salt=5)
            exp = reduce_ref([make_ragged(r, dt, count * n, salt=5) for r in range(n)], name, n)
            own = full[rank * count:(rank + 1) * count]
            dist.reduce_scatter_tensor(own, full, op=op_obj(name))
            if not close(own, exp[rank * count:(rank + 1) * count]):
                bad.append(f"reduce_scatter into its own block {dt} {name}: first bad indices "
                           f"{_first_bad(own, exp[rank * count:(rank + 1) * count])}")
    return bad


# ----------------------------------------------------------------------------- tests

SIZES = [1, 2, 3, 4]
TRANSPORTS = {"shm": {}, "tcp": {"RAILCC_SHM_DISABLE": "1"}}


def pool_for(pools, n, transport):
    return pools(n, **TRANSPORTS[transport])


def check(pool, fn, timeout=120):
    results = pool.run(fn, timeout=timeout)
    bad = [f"rank {r}: {msg}" for r, lst in enumerate(results) for msg in lst]
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "fn",
    [rk_allreduce, rk_reduce, rk_reduce_scatter, rk_allgather, rk_broadcast, rk_gather_scatter, rk_alltoall,
     rk_p2p, rk_barrier_and_zero, rk_coalesced, rk_async_futures, rk_subgroups, rk_split, rk_seqnum, rk_inline_boundary,
     rk_sync_work],
    ids=lambda f: f.__name__[3:],
)
def test_collective(pools, n, transport, fn):
    check(pool_for(pools, n, transport), fn)


@pytest.mark.parametrize("algo,n", [("ring", 3), ("tree", 3), ("tree", 4), ("tree", 5)])
def test_ring_and_tree_over_tcp(pools, algo, n):
    # RAILCC_ALGO=ring / tree over TCP: every dtype and reduce op, odd counts and zero size
    # (rk_allreduce), the ring all-gather (rk_allgather) and the tree broadcast from every root
    # (rk_broadcast), against torch's own results.
    pool = pools(n, RAILCC_ALGO=algo, RAILCC_SHM_DISABLE="1")
    for fn in (rk_allreduce, rk_allgather) + ((rk_broadcast,) if algo == "tree" else ()):
        check(pool, fn)


@pytest.mark.parametrize("n", [2, 5])
def test_lazy_connections(pools, n):
    check(pools(n, RAILCC_ALGO="ring", RAILCC_SHM_DISABLE="1", RAILCC_RUNTIME_CONNECT="1"), rk_lazy_connections)


@pytest.mark.parametrize("n", [2, 8])
def test_runtime_connect_0_connects_the_collectives_peers_at_init(pools, n):
    # At 8 ranks the ring, the chain and the barrier meet 5 of each rank's 7 peers.
    check(pools(n, RAILCC_ALGO="ring", RAILCC_SHM_DISABLE="1", RAILCC_RUNTIME_CONNECT="0"), rk_connected_at_init)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_allreduce_larger_than_fifo(pools, n, transport):
    check(pool_for(pools, n, transport), rk_allreduce_large, timeout=180)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_views_at_every_page_offset(pools, n, transport):
    check(pool_for(pools, n, transport), rk_views_at_every_page_offset, timeout=180)


@pytest.mark.parametrize("n", [3, 4])
def test_reductions_through_small_rings(pools, n):
    check(pools(n, RAILCC_BUFFSIZE="65536", RAILCC_ONESHOT_BYTES="1024"), rk_rings_in_step, timeout=180)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_allgather_larger_than_fifo(pools, n, transport):
    check(pool_for(pools, n, transport), rk_allgather_large, timeout=180)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_alltoall_larger_than_cache_share(pools, n, transport):
    check(pool_for(pools, n, transport), rk_alltoall_large, timeout=180)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_broadcast_larger_than_fifo(pools, n, transport):
    check(pool_for(pools, n, transport), rk_broadcast_large, timeout=180)


def test_device_map_string(pools):
    check(pools(2, backend="cpu:railcc"), rk_barrier_and_zero)


def rk_debug_level(rank, n):
    # torch reads the variable at import, which in a pool's rank was in the fork server.
    return [] if dist.get_debug_level() == dist.DebugLevel.DETAIL else [f"debug level {dist.get_debug_level()}"]


def test_debug_detail_wrapper(pools):
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend and checks sequence numbers and
    # shapes with extra collectives on every call.
    check(pools(2, TORCH_DISTRIBUTED_DEBUG="DETAIL"), rk_debug_level)
    check(pools(2, TORCH_DISTRIBUTED_DEBUG="DETAIL"), rk_seqnum)
    check(pools(2, TORCH_DISTRIBUTED_DEBUG="DETAIL"), rk_async_futures)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("fn", [rk_allreduce, rk_reduce_scatter], ids=lambda f: f.__name__[3:])
def test_reductions_without_oneshot(pools, n, fn):
    # The matrix above is small enough for the one-shot path; this runs the same checks through
    # the schedules used for larger messages (pairwise for 2 ranks, through the rings for more).
    check(pools(n, RAILCC_ONESHOT_BYTES="0"), fn)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_ranks_reduce_in_either_order(pools, transport):
    # Small FIFOs (16 KiB): the 40 all_reduces in flight fill them. Every count is one-shot.
    env = dict(TRANSPORTS[transport], RAILCC_SHM_FIFO_BYTES="16384", RAILCC_ONESHOT_BYTES="65536")
    check(pools(2, **env), rk_pair_reduce)


@pytest.mark.parametrize("n", [3, 4])
def test_oneshot_into_own_block(pools, n):
    check(pools(n), rk_oneshot_into_own_block)


def test_small_all_reduce_over_hosts_of_one_rank_each():
    # 16 fake hosts of one rank each: the small all-reduce is one binary tree over all ranks
    # (3 network peers; recursive doubling would meet 4), and the barrier with it. Every dtype
    # and reduce op at the test's counts (the large ones take the ring), against torch's own.
    pool = harness.RankPool(16, rank_env=lambda r: {"RAILCC_HOST_ID": f"h{r}"})
    try:
        check(pool, rk_allreduce, timeout=180)
    finally:
        pool.kill()


@pytest.mark.parametrize("hosts,per_host", [(3, 2), (2, 3)], ids=["3x2", "2x3"])
def test_broadcast_along_rails(hosts, per_host):
    # Fake hosts with equal rank counts: a broadcast between hosts runs along the root's rail and
    # then through each host (schedule::railChain), forwarding as bytes arrive. Every root, every
    # dtype at zero, one and odd counts, and 70 KB-6 MB payloads, against the root's tensor.
    pool = harness.RankPool(hosts * per_host, rank_env=lambda r: {"RAILCC_HOST_ID": f"h{r // per_host}"})
    try:
        check(pool, rk_broadcast)
        check(pool, rk_broadcast_large, timeout=180)
    finally:
        pool.kill()
