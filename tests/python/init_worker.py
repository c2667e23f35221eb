"""One rank of a railcc job, for tests that drive set-up from outside the rank (strangers on the
port, other pid namespaces, failed inits):

    python init_worker.py RANK WORLD STORE [--ops N] [--hold S] [--delay S] [--pause S] [--nofile SOFT:HARD]

It joins over a FileStore (STORE a file) or a TCPStore (STORE "tcp:PORT" on 127.0.0.1, rank 0
its server) after waiting `--delay` seconds, waits `--pause` seconds after init (connections
made at first use are then made later), runs N all_reduces checked against the expected sum, optionally
waits S seconds, destroys the group and prints one JSON line: {"rank", "ok", "init_s",
"error"}. Exit status 0 when ok."""

import argparse
import json
import sys
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("rank", type=int)
    p.add_argument("world", type=int)
    p.add_argument("store")
    p.add_argument("--ops", type=int, default=3)
    p.add_argument("--hold", type=float, default=0.0)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--pause", type=float, default=0.0)
    p.add_argument("--nofile", help="SOFT:HARD limits of open files, set before torch is imported")
    a = p.parse_args()
    if a.nofile:
        import resource

        soft, hard = (int(v) for v in a.nofile.split(":"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    import torch
    import torch.distributed as dist

    import railcc  # noqa: F401

    out = {"rank": a.rank, "ok": False}
    t0 = time.monotonic()
    try:
        if a.store.startswith("tcp:"):
            store = dist.TCPStore("127.0.0.1", int(a.store[4:]), a.world, is_master=a.rank == 0,
                                  timeout=__import__("datetime").timedelta(seconds=60))
        else:
            store = dist.FileStore(a.store, a.world)
        time.sleep(a.delay)
        t0 = time.monotonic()
        dist.init_process_group("railcc", store=store, rank=a.rank, world_size=a.world)
        out["init_s"] = time.monotonic() - t0
        time.sleep(a.pause)
        for i in range(a.ops):
            t = torch.full((1000 + i,), float(a.rank + 1))
            dist.all_reduce(t)
            want = a.world * (a.world + 1) / 2
            if not bool((t == want).all()):
                raise AssertionError(f"all_reduce {i}: got {t[0].item()}, want {want}")
        time.sleep(a.hold)
        dist.destroy_process_group()
        out["ok"] = True
    except Exception as e:  # reported to the test, which decides
        out["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
