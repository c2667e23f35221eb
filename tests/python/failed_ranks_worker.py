"""One rank of test_failures_told.py's failed_ranks cases:

    python failed_ranks_worker.py RANK WORLD STORE MODE

Joins over a FileStore with a 3 s group timeout, runs one all_reduce, then another that times
out: MODE "stopped", the test SIGSTOPs the last rank (it prints "ready" first); MODE "busy", the
last rank sleeps 6 s in Python before calling it (alive and reporting). Every other rank prints
one JSON line: the error's type, its ranks, railcc.failed_ranks() right after it, and the
message."""

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist

import railcc


def main():
    rank, world, store, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("railcc", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=3))
    dist.all_reduce(torch.ones(4))
    dist.barrier()
    last = rank == world - 1
    if last:
        print("ready", flush=True)
        if mode == "busy":
            time.sleep(6)  # past the others' 3 s timeout, alive and reporting throughout
        else:
            time.sleep(30)  # stopped by the test meanwhile, then let go
        return 0
    time.sleep(0.5)  # the test stops the last rank meanwhile
    out = {"rank": rank}
    try:
        dist.all_reduce(torch.ones(4))
    except railcc.RailccError as e:
        out.update(type=type(e).__name__, ranks=list(e.ranks), failed=railcc.failed_ranks(), msg=str(e))
    print(json.dumps(out), flush=True)
    time.sleep(1)  # alive while the others ask
    return 0


if __name__ == "__main__":
    sys.exit(main())
