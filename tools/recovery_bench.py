#!/usr/bin/env python3
"""Recovery from a dead rank, measured two ways on this machine, same model and data (issue 33):

  shrink   examples/elastic_ddp.py: 4 ranks, one SIGKILLed mid-step; the survivors shrink the
           group and redo the step. Time: from the kill to the first step completed on the
           shrunk group (as the example prints it).
  restart  the usual way out: `torchrun --standalone --nproc-per-node 4 --max-restarts 1`, the
           same DDP training with a checkpoint (model, optimizer, step) written by rank 0 after
           every step; the same rank SIGKILLs itself at the same step; torchrun tears every
           worker down and starts them again, they load the checkpoint and go on. Time: from the
           kill to the first step completed after the restart (one host clock, through files).

Both use railcc. Steps lost: completed steps done again (0 for the shrink; for the restart, the
steps since the last checkpoint, 0 here as it checkpoints every step, at the cost of a save per
step). Prints a markdown table; --runs N repeats each way and reports the median.

    python3 tools/recovery_bench.py --runs 3
"""
import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RESTART_WORKER = r'''
import os, signal, sys, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
import railcc
work, kill_step, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("railcc")
me, n = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.SGD(module.parameters(), lr=0.05)
ckpt, step = os.path.join(work, "ckpt.pt"), 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    module.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); step = state["step"]
model = DDP(module)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
first = True
while step < steps:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(24, 16, generator=g); y = x[:, :4].sum(dim=1, keepdim=True)
    lo, hi = me * 24 // n, (me + 1) * 24 // n
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
    if attempt == 0 and step == kill_step and me == n - 1:
        with open(os.path.join(work, "killed_at"), "w") as f: f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward(); opt.step(); step += 1
    if me == 0:
        torch.save({"model": module.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
    if attempt > 0 and first and me == 0:
        with open(os.path.join(work, "recovered_at"), "w") as f: f.write(repr(time.time()))
    first = False
dist.destroy_process_group()
'''


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env():
    return dict(os.environ, PYTHONPATH=os.path.join(REPO, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run_shrink(kill_step, steps):
    e = dict(env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="4")
    procs = [subprocess.Popen([sys.executable, os.path.join(REPO, "examples", "elastic_ddp.py"),
                               "--kill-step", str(kill_step), "--steps", str(steps)],
                              env=dict(e, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(4)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    times = [float(m.group(1)) for o in outs for m in re.finditer(r"recovered in ([0-9.]+) s", o)]
    if len(times) != 3:
        raise RuntimeError("shrink run: expected 3 recovered survivors\n" + "\n".join(o[-1500:] for o in outs))
    return max(times)  # the step is done when the last survivor has done it


def run_restart(kill_step, steps):
    with tempfile.TemporaryDirectory(prefix="railcc-restart-") as work:
        script = os.path.join(work, "worker.py")
        with open(script, "w") as f:
            f.write(RESTART_WORKER)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "--max-restarts", "1", "--monitor-interval", "0.1", script, work, str(kill_step), str(steps)]
        p = subprocess.run(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        if p.returncode != 0 or not os.path.exists(os.path.join(work, "recovered_at")):
            raise RuntimeError(f"restart run failed (exit {p.returncode}):\n{p.stdout[-3000:]}")
        read = lambda name: float(open(os.path.join(work, name)).read())  # noqa: E731
        return read("recovered_at") - read("killed_at")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kill-step", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    shrink, restart = [], []
    for i in range(a.runs):  # alternating, so drift on the machine hits both alike
        shrink.append(run_shrink(a.kill_step, a.steps))
        restart.append(run_restart(a.kill_step, a.steps))
        print(f"run {i + 1}: shrink {shrink[-1]:.3f} s, torchrun restart {restart[-1]:.3f} s", flush=True)
    s, r = statistics.median(shrink), statistics.median(restart)
    print(f"\n4 ranks on one host (shm), railcc, kill at step {a.kill_step}, median of {a.runs} alternating runs\n")
    print("| way out | kill -> first completed step | steps lost |")
    print("|---|---|---|")
    print(f"| shrink_group (examples/elastic_ddp.py) | {s:.3f} s (runs: {', '.join(f'{t:.3f}' for t in shrink)}) | 0 (the failed step is redone) |")
    print(f"| torchrun --max-restarts 1 + checkpoint every step | {r:.3f} s (runs: {', '.join(f'{t:.3f}' for t in restart)}) | 0 (checkpointed every step) |")
    print(f"\nshrink is {r / s:.1f}x faster")


if __name__ == "__main__":
    main()
