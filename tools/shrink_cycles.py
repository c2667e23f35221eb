#!/usr/bin/env python3
"""Shrink and grow back, many times in the same processes: does anything pile up? (issue 33)

Four ranks. Ranks 0-2 live through every cycle; the fourth is a fresh process each cycle.
A cycle: the four init a railcc default group (a store prefix of the cycle's own), all_reduce,
then the fourth SIGKILLs itself; the three survivors' next all_reduce fails, they
shrink_group(railcc.failed_ranks(), SHRINK_ABORT), all_reduce on the shrunk group (checked
against the sum torch expects), destroy it, and count what their process holds: open fds,
threads, memory mappings, and /dev/shm entries. The next cycle starts a replacement rank and
a new group. The store is this script's own TCPStore, so no rank's death takes it along.

Passes when, on every survivor, the counts after the last cycle equal those after the second
(the first cycle warms up what torch keeps for the life of the process); prints a table. Shared
memory is counted exactly (mappings of /dev/shm, and /dev/shm entries other than the semaphores
Python's multiprocessing leaves); the process's other mappings may differ by up to
MAPS_SLACK, because glibc's malloc gives large blocks mappings of their own and returns them when
it sees fit (CI once saw 360 -> 362 with nothing of railcc's left). A leak of anything railcc
maps per group (a segment per peer) shows in the exact count.

    python3 tools/shrink_cycles.py --cycles 20
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import time

MAPS_SLACK = 8
RANK = r'''
import json, os, signal, sys, time
import torch, torch.distributed as dist
import railcc
port, rank, first, last = (int(a) for a in sys.argv[1:5])
base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=__import__("datetime").timedelta(seconds=120))
c10d = dist.distributed_c10d

def counts():
    maps = open("/proc/self/maps").read().splitlines()
    shm_maps = sum(1 for m in maps if "/dev/shm/" in m)
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
            "shm_maps": shm_maps, "maps": len(maps) - shm_maps,
            "shm": sum(1 for e in os.listdir("/dev/shm") if not e.startswith("sem."))}

rows = []
for cycle in range(first, last + 1):
    store = dist.PrefixStore(f"cycle{cycle}", base)
    dist.init_process_group("railcc", store=store, rank=rank, world_size=4)
    t = torch.ones(1 << 14)
    dist.all_reduce(t)
    if rank == 3:
        store.set("killed", "1")
        os.kill(os.getpid(), signal.SIGKILL)
    store.wait(["killed"])
    try:
        while True:
            dist.all_reduce(t)
    except railcc.PeerFailureError:
        pass
    for _ in range(100):
        dead = railcc.failed_ranks()
        if dead:
            break
        time.sleep(0.05)
    dist.shrink_group(dead, shrink_flags=c10d.SHRINK_ABORT)
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    assert dead == [3] and dist.get_world_size() == 3 and torch.all(x == 6.0), (dead, x[:3])
    dist.destroy_process_group()
    rows.append(dict(cycle=cycle, **counts()))
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{r}" for r in range(3)])  # all survivors counted before the next cycle's set-up
print("CYCLES " + json.dumps(rows), flush=True)
'''


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=60, help="seconds per cycle before giving up")
    args = ap.parse_args()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=args.timeout))
    port = store.port
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def start(rank, first, last):
        return subprocess.Popen([sys.executable, "-c", RANK, str(port), str(rank), str(first), str(last)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    t0 = time.monotonic()
    stayers = [start(r, 1, args.cycles) for r in range(3)]
    try:
        for cycle in range(1, args.cycles + 1):
            victim = start(3, cycle, cycle)
            try:
                rc = victim.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                victim.kill()
                raise SystemExit(f"cycle {cycle}: the replacement rank did not finish:\n{victim.communicate()[0][-3000:]}")
            if rc != -9:
                raise SystemExit(f"cycle {cycle}: the replacement rank exited with {rc}:\n{victim.communicate()[0][-3000:]}")
            store.wait([f"cycle{cycle}/done/{r}" for r in range(3)], datetime.timedelta(seconds=args.timeout))
        outs = []
        for p in stayers:
            out, _ = p.communicate(timeout=args.timeout)
            if p.returncode != 0:
                raise SystemExit(f"a surviving rank exited with {p.returncode}:\n{out[-3000:]}")
            outs.append(out)
    finally:
        for p in stayers:
            if p.poll() is None:
                p.kill()
    took = time.monotonic() - t0
    rows = [json.loads(next(ln for ln in o.splitlines() if ln.startswith("CYCLES "))[len("CYCLES "):]) for o in outs]
    keys = ("fds", "threads", "shm_maps", "maps", "shm")
    print(f"{args.cycles} cycles of 4 -> 3 ranks and back in {took:.1f} s; what each survivor holds after each "
          "cycle's shrunk group is destroyed:\n")
    print("| cycle | " + " | ".join(f"rank {r} fds/threads/shm maps/other maps" for r in range(3))
          + " | /dev/shm entries |")
    print("|---|" + "---|" * 4)
    for i in range(args.cycles):
        cells = ["/".join(str(rows[r][i][k]) for k in keys[:4]) for r in range(3)]
        print(f"| {rows[0][i]['cycle']} | " + " | ".join(cells) + f" | {rows[0][i]['shm']} |")
    ref = 1 if args.cycles > 1 else 0
    slack = {"maps": MAPS_SLACK}
    grew = [(r, k, rows[r][ref][k], rows[r][-1][k]) for r in range(3) for k in keys
            if rows[r][-1][k] > rows[r][ref][k] + slack.get(k, 0)]
    if grew:
        print("\nGREW (rank, what, after cycle 2, after the last): " + ", ".join(map(str, grew)))
        return 1
    print(f"\nnothing grew from cycle {ref + 1} to cycle {args.cycles} on any survivor "
          f"(other mappings within {MAPS_SLACK})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
