"""One rank of a 2-rank job (3 with `broadcast`) whose /dev/shm fills up after init (run by
test_errors.py inside a mount namespace with a small tmpfs of its own on /dev/shm). The FIFOs'
and broadcast rings' pages are reserved as they are first written, so the all_reduce (or, with
`broadcast`, the broadcast through rank 0's ring: rings are used from 3 ranks on a host) that
first needs pages the full /dev/shm cannot give must fail with an error naming /dev/shm, on
every rank, never with a SIGBUS or a wrong result.

    python shm_full_worker.py [broadcast]            # a rank (env:// variables set by the launcher)
    python shm_full_worker.py --launch [broadcast]   # starts the ranks, prints one JSON line of results
"""
import json
import os
import sys

if "--launch" in sys.argv:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness

    op = [a for a in sys.argv[1:] if a != "--launch"]
    codes, outs = harness.run_env_ranks([sys.executable, os.path.abspath(__file__)] + op, 3 if op else 2, timeout=60,
                                        env={"RAILCC_CMA_BYTES": "0", "RAILCC_ALGO": "rings"})
    print("LAUNCH " + json.dumps({"codes": codes, "outs": outs}))
    sys.exit(0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import railcc  # noqa: E402,F401

dist.init_process_group("railcc")
rank, n = dist.get_rank(), dist.get_world_size()
small = torch.full((16,), float(rank + 1))
dist.all_reduce(small)  # the FIFOs' first pages
assert bool((small == n * (n + 1) // 2).all()), small
if rank == 0:
    st = os.statvfs("/dev/shm")
    fd = os.open("/dev/shm/filler", os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize)
    except OSError:
        pass  # as much as it took: the rest of what is free
    os.close(fd)
    st = os.statvfs("/dev/shm")
    print(f"FILLED free={st.f_bavail * st.f_frsize}", flush=True)
dist.barrier()
big = torch.full((4 << 20,), float(rank + 1))  # 16 MiB: walks every FIFO (or ring) page it uses
try:
    if "broadcast" in sys.argv[1:]:
        big = big[: 512 << 10]  # 2 MiB: within the 4 MiB ring, which carries it
        dist.broadcast(big, 0)
        print(f"RESULT ok exact={bool((big == 1).all())}", flush=True)
    else:
        dist.all_reduce(big)
        print(f"RESULT ok exact={bool((big == n * (n + 1) // 2).all())}", flush=True)
except Exception as e:  # noqa: BLE001
    print("RESULT error " + str(e).replace("\n", " ")[:600], flush=True)
os._exit(0)  # the group failed: leave without a collective teardown
