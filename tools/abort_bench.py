#!/usr/bin/env python3
"""How long railcc.abort(group) takes on each rank, and what it leaves behind (issue 33, point 3).

4 ranks on this host (shared memory; --hosts 2 puts them on two fake hosts, TCP between them).
In each case ranks 0-2 have an all_reduce pending when they call railcc.abort(), then destroy the
group; the last rank is:

  dead       SIGKILLed before the op
  stopped    SIGSTOPped before the op (continued and killed afterwards)
  busy       in the same 256 MiB all_reduce as everyone, aborted 50 ms in (it aborts too)
  absent     alive, never calls the op (it aborts later, once the others have)

Printed per case: each aborting rank's abort() time and its threads, fds and railcc shared-memory
mappings before the group was made and after it was destroyed.

    python3 tools/abort_bench.py [--hosts 2]
"""
import argparse
import json
import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r'''
import json, os, signal, sys, time
import torch, torch.distributed as dist
import railcc
case = sys.argv[1]
def census():
    maps = sum(1 for l in open("/proc/self/maps") if "railcc-" in l)
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")), "shm_maps": maps}
torch.zeros(1)  # torch's own threads start before the census
before = census()
dist.init_process_group("railcc")
me, n = dist.get_rank(), dist.get_world_size()
last = me == n - 1
store = dist.distributed_c10d._get_default_store()
dist.barrier()
big = case == "busy"
t = torch.ones((64 << 20) if big else 1024)
if last and case == "dead":
    os.kill(os.getpid(), signal.SIGKILL)
if last and case == "stopped":
    store.set("stopped_pid", str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)
if last and case == "absent":
    store.wait(["aborted"], __import__("datetime").timedelta(seconds=60))
    railcc.abort(); dist.destroy_process_group(); sys.exit(0)
work = dist.all_reduce(t, async_op=True)
time.sleep(0.05 if big else 0.3)
t0 = time.monotonic()
railcc.abort()
took = time.monotonic() - t0
try:
    work.wait()
    raised = "none"
except Exception as e:
    raised = type(e).__name__
if me == 0:
    store.set("aborted", "1")
dist.destroy_process_group()
import gc; gc.collect(); time.sleep(0.2)
print("RESULT " + json.dumps({"rank": me, "abort_s": took, "wait_raised": raised, "before": before, "after": census()}), flush=True)
'''


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(case, hosts, work):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="4",
               PYTHONPATH=os.path.join(REPO, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, work, case], env=dict(env, RANK=str(r), RAILCC_HOST_ID=f"abort-h{r * hosts // 4}"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(4)]
    outs = []
    for r, p in enumerate(procs):
        if case == "stopped" and r == 3:
            continue
        outs.append(p.communicate(timeout=120)[0])
    if case == "stopped":  # continue it, so it can see the others gone, then make sure it ends
        procs[3].send_signal(18)  # SIGCONT
        try:
            procs[3].communicate(timeout=10)
        except subprocess.TimeoutExpired:
            procs[3].kill()
    results = [json.loads(line[7:]) for o in outs for line in o.splitlines() if line.startswith("RESULT ")]
    if len(results) < 3:
        raise RuntimeError(f"{case}: missing results\n" + "\n".join(o[-2000:] for o in outs))
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=1, choices=(1, 2))
    a = ap.parse_args()
    work = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"railcc-abort-worker-{os.getpid()}.py")
    with open(work, "w") as f:
        f.write(WORKER)
    try:
        print(f"4 ranks, {a.hosts} host(s); abort() per aborting rank; threads/fds/railcc shm mappings before init -> after destroy\n")
        print("| last rank | abort() per rank (s) | pending op raised | threads | fds | shm mappings |")
        print("|---|---|---|---|---|---|")
        for case in ("dead", "stopped", "busy", "absent"):
            res = sorted(run(case, a.hosts, work), key=lambda d: d["rank"])
            res = [d for d in res if d["rank"] < 3]
            fmt = lambda k: ", ".join(f"{d['before'][k]}->{d['after'][k]}" for d in res)  # noqa: E731
            took = ", ".join("%.4f" % d["abort_s"] for d in res)
            raised = ", ".join(sorted({d["wait_raised"] for d in res}))
            print(f"| {case} | {took} | {raised} | {fmt('threads')} | {fmt('fds')} | {fmt('shm_maps')} |", flush=True)
    finally:
        os.unlink(work)


if __name__ == "__main__":
    main()
