"""One rank of tests/python/test_single_copy.py: all-gather, all-to-all and all-reduce of
messages large enough for single copy (RAILCC_CMA_BYTES), into and out of views (offset,
sharing pages with their neighbours, in reverse order with gaps between them, tensors of their
own; a strided one is refused by name), checked against torch computing the result locally. With --refuse, this process first makes itself unreadable to its peers
(PR_SET_DUMPABLE 0; the test starts it without CAP_SYS_PTRACE), so the kernel refuses their
process_vm_readv and the FIFO must carry everything."""
import argparse
import ctypes
import os

import torch
import torch.distributed as dist

import railcc

ap = argparse.ArgumentParser()
ap.add_argument("--refuse", action="store_true")
args = ap.parse_args()
if args.refuse:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0

dist.init_process_group("railcc")
rank, n = dist.get_rank(), dist.get_world_size()


def value(r, count, dtype, salt):
    v = (torch.arange(count, dtype=torch.int64) * 7 + r * 131 + salt) % 101
    return v.to(dtype)


for dtype in (torch.float32, torch.float64, torch.int32, torch.bfloat16, torch.uint8):
    es = torch.tensor([], dtype=dtype).element_size()
    for count in (0, 4096 // es, 300001, (3 << 20) // es + 5):
        # all_gather: outputs that are views of one buffer at an odd offset
        # (each shares its first and last page with a neighbour).
        src = torch.zeros(2 * count, dtype=dtype)
        src[::2] = value(rank, count, dtype, 1)
        big = torch.full((n * count + 3,), 77, dtype=dtype)
        outs = [big[3 + i * count:3 + (i + 1) * count] for i in range(n)]
        if count > 1:  # a strided view is refused by name, never read as if contiguous
            try:
                dist.all_gather(outs, src[::2])
                raise AssertionError("a strided input was accepted")
            except ValueError as e:
                assert "must be contiguous" in str(e), e
        dist.all_gather(outs, src[::2].contiguous())
        for i in range(n):
            assert torch.equal(outs[i], value(i, count, dtype, 1)), ("all_gather", dtype, count, i)
        assert torch.all(big[:3] == 77), ("all_gather wrote before its output", dtype, count)
        # Outputs that are not one span: views of one buffer in reverse order with gaps between
        # them (each gap must stay as it was), and tensors of their own.
        gap = 7
        holes = torch.full((n * (count + gap) + gap,), 55, dtype=dtype)
        at = [gap + (n - 1 - i) * (count + gap) for i in range(n)]
        outs = [holes[a:a + count] for a in at]
        dist.all_gather(outs, value(rank, count, dtype, 5))
        for i in range(n):
            assert torch.equal(outs[i], value(i, count, dtype, 5)), ("all_gather into gaps", dtype, count, i)
        for a in [0] + [a + count for a in at]:
            assert torch.all(holes[a:a + gap] == 55), ("all_gather wrote into a gap", dtype, count)
        own = [torch.empty(count, dtype=dtype) for _ in range(n)]
        dist.all_gather(own, value(rank, count, dtype, 6))
        for i in range(n):
            assert torch.equal(own[i], value(i, count, dtype, 6)), ("all_gather into own tensors", dtype, count, i)

        # all_to_all: inputs and outputs are views at offsets of one buffer each.
        inb = torch.cat([value(rank * n + j, count, dtype, 2) for j in range(n)] + [torch.zeros(5, dtype=dtype)])
        ins = [inb[j * count:(j + 1) * count] for j in range(n)]
        outb = torch.full((n * count + 5,), 9, dtype=dtype)
        outs = [outb[5 + j * count:5 + (j + 1) * count] for j in range(n)]
        dist.all_to_all(outs, ins)
        for j in range(n):
            assert torch.equal(outs[j], value(j * n + rank, count, dtype, 2)), ("all_to_all", dtype, count, j)
        # ... and in reverse order with gaps, inputs and outputs alike.
        inh = torch.full((n * (count + gap) + gap,), 3, dtype=dtype)
        for j in range(n):
            inh[at[j]:at[j] + count] = value(rank * n + j, count, dtype, 7)
        outh = torch.full((n * (count + gap) + gap,), 4, dtype=dtype)
        dist.all_to_all([outh[a:a + count] for a in at], [inh[a:a + count] for a in at])
        for j in range(n):
            assert torch.equal(outh[at[j]:at[j] + count], value(j * n + rank, count, dtype, 7)), ("all_to_all gaps", dtype, count, j)
        for a in [0] + [a + count for a in at]:
            assert torch.all(outh[a:a + gap] == 4), ("all_to_all wrote into a gap", dtype, count)

        # all_reduce (its all-gather half passes addresses): an offset view.
        if dtype != torch.uint8:  # sums wrap
            buf = torch.zeros(count + 1, dtype=dtype)
            view = buf[1:]
            view.copy_(value(rank, count, dtype, 3) % 8)  # sums stay exact in bfloat16
            dist.all_reduce(view)
            want = sum((value(r, count, dtype, 3) % 8).to(torch.float64) for r in range(n)).to(dtype)
            assert torch.equal(view, want), ("all_reduce", dtype, count)

# An all-gather whose result is larger than the cache: each rank's own piece is written around
# the cache (and, in the direct all-gather, while the peers read theirs). The output is a view
# at an odd offset; in place, the input is this rank's piece of it.
count = (12 << 20) // 4 + 3
big = torch.full((n * count + 3,), -1.0)
out = big[3:]
mine = value(rank, count, torch.float32, 4)
want = torch.cat([value(r, count, torch.float32, 4) for r in range(n)])
dist.all_gather_into_tensor(out, mine)
assert torch.equal(out, want) and torch.all(big[:3] == -1.0), "large all_gather out of place"
out.fill_(-2.0)
out[rank * count:(rank + 1) * count].copy_(mine)
dist.all_gather_into_tensor(out, out[rank * count:(rank + 1) * count])
assert torch.equal(out, want) and torch.all(big[:3] == -1.0), "large all_gather in place"

# The transport counters (railcc.stats()) say which way an all-to-all's bytes went: read once
# by the kernel, or copied into and out of the FIFOs.
block = 1 << 20
inp, got = torch.arange(n * block, dtype=torch.float32) + rank * n * block, torch.empty(n * block)
dist.all_to_all_single(got, inp)
railcc.reset_stats()
dist.all_to_all_single(got, inp)
st = railcc.stats()["shm"]
payload = (n - 1) * block * 4
if args.refuse:
    assert st["single_copied_bytes"] == 0 and st["recv_copied_bytes"] >= payload, st
else:
    assert st["single_copied_bytes"] == payload and st["recv_copied_bytes"] < 4096, st
want = torch.cat([torch.arange(block, dtype=torch.float32) + r * n * block + rank * block for r in range(n)])
assert torch.equal(got, want)
dist.barrier()
print(f"rank {rank} ok", flush=True)
dist.destroy_process_group()
