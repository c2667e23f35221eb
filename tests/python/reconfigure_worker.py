"""A rank of tests/python/test_reconfigure.py (env://, so the group's store is a TCPStore)."""

import time

import torch
import torch.distributed as dist

import railcc  # noqa: F401

dist.init_process_group("railcc", enable_reconfigure=True)
rank, n = dist.get_rank(), dist.get_world_size()
store = dist.distributed_c10d._get_default_store()  # the out-of-band exchange of handles


def barrier(key):
    store.add(key, 1)
    while int(store.add(key, 0)) < n:
        time.sleep(0.01)


def window_round(size):
    """Every member puts its rank into every member's window and signals it (torch 2.14's
    windows on the group as it now is)."""
    me = dist.get_rank()
    buf = torch.zeros(size)
    win = dist.distributed_c10d._new_window(buf)
    for dst in range(size):
        win.put(torch.full((1,), float(me + 1)), dst, me, False).wait()
        win.signal(dst, False).wait()
    for src in range(size):
        win.wait_signal(src, False).wait()
    assert torch.equal(buf, torch.arange(1, size + 1, dtype=torch.float32)), buf
    win.tensor_deregister()


assert dist._supports_reconfigure()
mine = dist._get_reconfigure_handle()
assert mine == dist._get_reconfigure_handle(), "a handle is the same every time it is asked"
store.set(f"test/handle/{rank}", mine)
handles = [store.get(f"test/handle/{r}").decode() for r in range(n)]

# 1. The last rank leaves: the others take a membership of their own, in reverse order.
if rank != n - 1:
    members = list(reversed(handles[: n - 1]))
    dist._reconfigure(uuid=1, handles=members).wait()
    assert (dist.get_rank(), dist.get_world_size()) == (members.index(mine), n - 1), (dist.get_rank(), dist.get_world_size())
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(sum(range(1, n))))), t
    dist.broadcast(t, 0)
    window_round(n - 1)  # a window among the n - 1: the leaver makes none
    print(f"rank {rank}: first reconfigure ok, rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
barrier("test/phase2")

# 2. It rejoins: every rank, the handles as a set (railcc numbers them in sorted order).
dist._reconfigure(uuid=2, handles=set(handles)).wait()
assert (dist.get_rank(), dist.get_world_size()) == (sorted(handles).index(mine), n)
t = torch.full((3,), float(rank + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((3,), float(n * (n + 1) // 2))), t
window_round(n)  # windows are numbered afresh in each membership, whatever each made before
print(f"rank {rank}: rejoined, rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)

# 3. Misuse is refused by name, and the group still works.
for uuid, bad, said in ((2, handles, "was used before"), (3, [h for h in handles if h != mine], "not among"),
                        (4, handles + ["gloo 1.2.3.4:5 x"], "not a railcc handle"),
                        (5, handles + [handles[0]], "passed twice")):
    try:
        dist._reconfigure(uuid=uuid, handles=bad).wait()
        raise AssertionError(f"uuid {uuid}: accepted")
    except ValueError as e:
        assert said in str(e), str(e)
dist.all_reduce(t)
dist.destroy_process_group()
print(f"rank {rank} ok", flush=True)
