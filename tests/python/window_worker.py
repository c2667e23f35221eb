"""A rank of tests/python/test_window.py: torch 2.14's one-sided windows and abort hooks on a
railcc group under env://. argv[1]: "windows" or "abort-hooks"."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import WaitSignalOptions

import railcc  # noqa: F401

dist.init_process_group("railcc", timeout=datetime.timedelta(seconds=30))
rank, n = dist.get_rank(), dist.get_world_size()
pg = dist.group.WORLD
store = dist.distributed_c10d._get_default_store()


def refused(fn, said):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        assert said in str(e), f"expected '{said}' in: {e}"
        return
    raise AssertionError(f"accepted; expected a refusal saying '{said}'")


def windows():
    assert dist.distributed_c10d._supports_window()
    block = 5  # an odd count per rank
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.uint8):
        buf = torch.zeros(n * block, dtype=dtype)
        win = dist.distributed_c10d._new_window(buf)
        # Every rank writes its block into every window (its own included), then signals each.
        for dst in range(n):
            win.put(torch.full((block,), rank + 1, dtype=dtype), dst, rank * block, False).wait()
        for dst in range(n):
            win.signal(dst, False).wait()
        for src in range(n):
            win.wait_signal(src, False).wait()
        expected = torch.cat([torch.full((block,), r + 1, dtype=dtype) for r in range(n)])
        assert torch.equal(buf, expected), (dtype, buf)
        assert win.map_remote_tensor(rank).data_ptr() == buf.data_ptr()
        assert win.get_attr((rank + 1) % n).access_type.name == "UNIFIED"
        # A zero-element put is a no-op; a put at the very end fits.
        win.put(torch.empty(0, dtype=dtype), (rank + 1) % n, n * block, False).wait()
        win.tensor_deregister()
    print(f"rank {rank}: puts and signals ok", flush=True)

    # A large put (8 MiB) after re-registering another tensor on a fresh window, async.
    big = torch.zeros(n, 1 << 20, dtype=torch.float64)
    win = dist.distributed_c10d._new_window()
    win.tensor_register(big)
    src = torch.arange(1 << 20, dtype=torch.float64) + rank
    works = [win.put(src, dst, rank * (1 << 20), True) for dst in range(n)]
    for w in works:
        w.wait()
    for dst in range(n):
        win.signal(dst, True).wait()
    for s in range(n):
        win.wait_signal(s, True).wait()
    for r in range(n):
        assert torch.equal(big[r], torch.arange(1 << 20, dtype=torch.float64) + r), r

    # Misuse is refused by name; the window and the group keep working.
    peer = (rank + 1) % n
    refused(lambda: win.put(torch.zeros(3), peer, 0, False), "put of Float into rank")
    refused(lambda: win.put(torch.zeros(5, dtype=torch.float64), peer, n * (1 << 20) - 4, False), "elements")
    refused(lambda: win.put(torch.zeros(1, dtype=torch.float64), n + 3, 0, False), "names rank")
    refused(lambda: win.map_remote_tensor(peer), "cannot be mapped")
    opts = WaitSignalOptions()
    opts.timeout = datetime.timedelta(milliseconds=300)
    t0 = time.monotonic()
    refused(lambda: win.wait_signal(peer, False, opts), "no signal came")
    assert time.monotonic() - t0 < 5
    refused(lambda: win.tensor_register(torch.zeros(2)), "registered already")
    win.tensor_deregister()
    refused(lambda: win.put(src, peer, 0, False), "before tensor_register")
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(sum(range(n)))))
    print(f"rank {rank}: refusals ok", flush=True)
    dist.destroy_process_group()


def abort_hooks():
    assert getattr(pg, "supports_abort_hooks", True)  # asked from torch 2.15 on (2.14.1 has hooks, not the query)
    ran = []
    pg.register_abort_hook(7, lambda: ran.append("seven"))
    pg.register_abort_hook(8, lambda: ran.append("eight"))
    pg.unregister_abort_hook(8)
    seen = []
    pg.register_pre_hook(1, lambda args: seen.append(("pre", args.name.name)))
    pg.register_post_hook(1, lambda args: seen.append(("post", args.name.name)))
    t = torch.ones(2)
    dist.all_reduce(t)
    assert ("pre", "ALLREDUCE") in seen and ("post", "ALLREDUCE") in seen, seen
    assert ran == [], ran
    if rank == n - 1:  # leaves: the others' next op fails, and their hooks run before they abort
        print(f"rank {rank}: leaving", flush=True)
        os._exit(0)
    try:
        dist.all_reduce(t)
        dist.all_reduce(t)
        raise AssertionError("an all_reduce with a dead rank succeeded")
    except Exception as e:  # noqa: BLE001
        print(f"rank {rank}: failed as expected: {type(e).__name__}", flush=True)
    deadline = time.monotonic() + 10
    while not ran and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran and set(ran) == {"seven"}, ran
    before = len(ran)
    pg.abort()
    assert len(ran) == before + 1, ran  # abort() runs them once more, itself
    print(f"rank {rank}: abort hooks ran {len(ran)} times", flush=True)


{"windows": windows, "abort-hooks": abort_hooks}[sys.argv[1]]()
print(f"rank {rank} ok", flush=True)
