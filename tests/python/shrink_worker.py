"""One rank of tests/python/test_shrink.py (env:// from the test: MASTER_ADDR/PORT, RANK,
WORLD_SIZE). Modes:

  bad        every rank: shrink_group with an empty list, a rank out of range, itself, every
             rank, a bad flag: each refused with an error naming it, the group still usable.
  healthy    the last rank is excluded (it only waits and exits); the others shrink, check the
             new group's ranks and an all_reduce against torch, then shrink again by one.
  disagree   ranks 0 and 1 exclude the last rank, rank 2 excludes rank 1 and the last: every
             survivor's shrink fails naming both views.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

import railcc

mode = sys.argv[1]
dist.init_process_group("railcc")
me, n = dist.get_rank(), dist.get_world_size()
c10d = dist.distributed_c10d


def check_sum(tag):
    t = torch.full((1000,), float(me + 1))
    dist.all_reduce(t)
    members = c10d.get_process_group_ranks(c10d._get_default_group())
    want = float(sum(r + 1 for r in members))
    assert torch.all(t == want), (tag, t[:3], want)


def refused(ranks, flags, exc, words):
    try:
        dist.shrink_group(ranks, shrink_flags=flags)
    except exc as e:
        assert all(w in str(e) for w in words), (ranks, str(e))
        return
    raise AssertionError(f"shrink_group({ranks}) was accepted")


if mode == "bad":
    assert railcc.failed_ranks() == []
    refused([], 0, ValueError, ["empty"])
    refused([n], 0, ValueError, ["out of bounds"])
    refused([me], 0, RuntimeError, ["exclusion list"])
    refused(list(range(n)), 0, (ValueError, RuntimeError), [])
    refused([0 if me else 1], 7, ValueError, ["shrink_flags"])
    # The backend's own checks, for callers that reach it directly.
    b = railcc.backend_of()
    for bad, words in (([], "empty"), ([n], "out of range"), ([me], "this rank"), ([1, 1], "twice")):
        try:
            b.shrink(bad, 0, None)
            raise AssertionError(f"backend shrink({bad}) was accepted")
        except (ValueError, RuntimeError) as e:
            assert words in str(e), (bad, str(e))
    check_sum("after the refused shrinks")
elif mode == "healthy":
    if me == n - 1:
        time.sleep(3)  # excluded: takes no part; its group is left as it is
        os._exit(0)
    dist.shrink_group([n - 1])
    assert dist.get_world_size() == n - 1 and dist.get_rank() == me, (dist.get_rank(), dist.get_world_size())
    check_sum("after the first shrink")
    if n - 1 > 2:
        if me == n - 2:
            time.sleep(2)
            os._exit(0)
        dist.shrink_group([n - 2])
        assert dist.get_world_size() == n - 2
        check_sum("after the second shrink")
elif mode == "disagree":
    if me == n - 1:
        time.sleep(3)
        os._exit(0)
    mine = [1, n - 1] if me == 2 else [n - 1]
    try:
        dist.shrink_group(mine)
        raise AssertionError("shrinks that disagree were accepted")
    except RuntimeError as e:
        assert "every rank that stays must exclude the same ranks" in str(e), str(e)
        print(f"rank {me} refused: {e}", flush=True)
    # Rank 0 hosts the store: it leaves only once the others have read what they need from it.
    store = c10d._get_default_store()
    store.set(f"done/{me}", "1")
    if me == 0:
        store.wait([f"done/{r}" for r in range(n - 1)], __import__("datetime").timedelta(seconds=60))
    os._exit(0)
print(f"rank {me} ok", flush=True)
members = c10d.get_process_group_ranks(c10d._get_default_group())
store = c10d._get_default_store()
store.set(f"end/{me}", "1")
if me == 0:  # rank 0 hosts the store: the others finish with it first
    store.wait([f"end/{r}" for r in members], __import__("datetime").timedelta(seconds=60))
dist.destroy_process_group()
