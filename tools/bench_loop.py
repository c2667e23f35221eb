#!/usr/bin/env python3
"""Per-call cost of one collective in a long loop, with each rank's CPU time and context
switches per call: where railcc-bench's slowest-rank medians say how long one call takes,
this says what a steady stream of calls costs the machine and why (a rank that yields to the
rank beside it on a shared core, a rank that sleeps, a busy process elsewhere on the host).

    python3 tools/bench_loop.py --nprocs 4 --backend railcc,fake,openmpi -o all_reduce -s 8
    python3 tools/bench_loop.py --nprocs 2 --backend railcc,openmpi --hog 1   # a busy process beside

Backends: railcc, gloo, fake (torch's fake process group: c10d's dispatch alone) and openmpi
(the same loop through mpi4py under mpirun, shared-memory transport; no torch in those ranks).
`--hog N` starts N processes that spin on the CPU for the whole run, as a data loader or a
neighbour's job would, and reports the share of a CPU they got during each backend's loop.
"""

import argparse
import importlib.util
import os
import resource
import subprocess
import sys
import time

# railcc-bench's Open MPI launcher (by path: it imports neither torch nor the railcc package)
_spec = importlib.util.spec_from_file_location(
    "_bench_mpi", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "railcc", "bench", "mpi.py"))
bench_mpi = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_mpi)

HOG_PIDS = "BENCH_LOOP_HOG_PIDS"  # the busy processes, for the ranks to read their CPU time
OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "alltoall", "reduce")


def _switches():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime, u.ru_stime, u.ru_nvcsw, u.ru_nivcsw


def _cpu_ticks(pids):
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _loop(call, iters, warmup, barrier):
    hogs = [int(p) for p in os.environ.get(HOG_PIDS, "").split(",") if p]
    for _ in range(warmup):
        call()
    barrier()
    a, h0 = _switches(), _cpu_ticks(hogs)
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    t1 = time.perf_counter()
    b, h1 = _switches(), _cpu_ticks(hogs)
    per = [(y - x) / iters for x, y in zip(a, b)]
    return {"us": (t1 - t0) / iters * 1e6, "user_us": per[0] * 1e6, "sys_us": per[1] * 1e6,
            "vol": per[2], "invol": per[3], "hog": (h1 - h0) / (t1 - t0), "secs": t1 - t0}


def _count(nbytes, world):
    """Float elements per rank's input: `nbytes` rounded to a whole number per rank, at least one each."""
    return max(1, nbytes // 4) // world * world or world


def _torch_rank(rank, world, backend, op, nbytes, iters, warmup, port, out, pin):
    if pin:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    import torch
    import torch.distributed as dist
    if backend == "railcc":
        import railcc  # noqa: F401
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    else:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group(backend, rank=rank, world_size=world)
    n = _count(nbytes, world)
    t = torch.ones(n)
    big, part, o = torch.empty(n * world), torch.empty(n // world), torch.empty(n)
    # Under the names torch now gives them, as railcc-bench calls them: the old ones warn on
    # every call (about 3 us of an 8 KiB call on torch 2.13, paid by every torch backend alike).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    call = {"all_reduce": lambda: dist.all_reduce(t), "broadcast": lambda: dist.broadcast(t, 0),
            "reduce": lambda: dist.reduce(t, 0),
            "all_gather": lambda: gather(big, t),
            "reduce_scatter": lambda: scatter(part, t),
            "alltoall": lambda: dist.all_to_all_single(o, t)}[op]
    barrier = (lambda: None) if backend == "fake" else dist.barrier
    r = _loop(call, iters, warmup, barrier)
    out.put((rank, r))
    barrier()
    dist.destroy_process_group()


def _mpi_rank(op, nbytes, iters, warmup):
    import numpy as np
    from mpi4py import MPI
    c = MPI.COMM_WORLD
    n = _count(nbytes, c.size)
    a, b = np.ones(n, np.float32), np.empty(n, np.float32)
    big, part = np.empty(n * c.size, np.float32), np.empty(n // c.size, np.float32)
    call = {"all_reduce": lambda: c.Allreduce(a, b), "broadcast": lambda: c.Bcast(a, 0),
            "reduce": lambda: c.Reduce(a, b, root=0), "all_gather": lambda: c.Allgather(a, big),
            "reduce_scatter": lambda: c.Reduce_scatter_block(a, part), "alltoall": lambda: c.Alltoall(a, b)}[op]
    r = _loop(call, iters, warmup, c.Barrier)
    rows = c.gather(r, root=0)
    if c.rank == 0:
        print(repr(rows), flush=True)


def _run_torch(backend, a):
    import queue
    import socket
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_torch_rank, args=(r, a.nprocs, backend, a.op, a.size, a.iters, a.warmup, port, out, a.pin))
             for r in range(a.nprocs)]
    for p in procs:
        p.start()
    rows, deadline = {}, time.monotonic() + a.timeout
    try:
        while len(rows) < len(procs):
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                return f"not run (rank(s) {dead} exited with an error)" if dead else f"not run (over {a.timeout:.0f} s)"
            try:
                rank, r = out.get(timeout=0.5)
                rows[rank] = r
            except queue.Empty:
                pass
        for p in procs:
            p.join(a.timeout)
        return [rows[r] for r in sorted(rows)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def _run_mpi(a):
    why = bench_mpi.missing()
    if why:
        return f"not run ({why})"
    cmd, env = bench_mpi.launch(a.nprocs, [sys.executable, os.path.abspath(__file__), "--mpi-rank", "-o", a.op,
                                           "-s", str(a.size), "-n", str(a.iters), "-w", str(a.warmup)],
                                bind="core" if a.pin else "none")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"not run ({e})"
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("[")]
    if p.returncode != 0 or not lines:
        return f"not run (mpirun exit {p.returncode}: {p.stderr.strip()[-200:]})"
    import ast
    return ast.literal_eval(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--backend", default="railcc,fake")
    ap.add_argument("-o", "--op", default="all_reduce", choices=OPS)
    ap.add_argument("-s", "--size", type=int, default=8, help="bytes per rank's input (default 8)")
    ap.add_argument("-n", "--iters", type=int, default=20000)
    ap.add_argument("-w", "--warmup", type=int, default=200)
    ap.add_argument("--hog", type=int, default=0, help="busy processes running beside the ranks")
    ap.add_argument("--pin", action="store_true", help="bind rank r to CPU r mod the CPU count (default: unbound)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--mpi-rank", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.mpi_rank:
        return _mpi_rank(a.op, a.size, a.iters, a.warmup)
    if a.nprocs < 1 or a.iters < 1 or a.size < 0 or a.hog < 0:
        ap.error("--nprocs and -n must be at least 1, -s and --hog at least 0")
    unknown = [b for b in a.backend.split(",") if b not in ("railcc", "gloo", "fake", "openmpi")]
    if unknown:
        ap.error(f"--backend: unknown {', '.join(unknown)} (choose from railcc, gloo, fake, openmpi)")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.hog)]
    os.environ[HOG_PIDS] = ",".join(str(h.pid) for h in hogs)
    try:
        print(f"# {a.op}, {a.size} B per rank, {a.nprocs} ranks on {os.cpu_count()} CPUs, {a.iters} calls"
              + (f", {a.hog} busy process(es) beside" if a.hog else "") + (", ranks bound to CPUs" if a.pin else ""))
        print(f"# {'backend':>8} {'us/call':>9} {'user us':>8} {'sys us':>7} {'invol':>6} {'vol':>6}"
              "   (us/call: the slowest rank; the rest: per call, mean over ranks)"
              + ("   busy processes' CPUs during the loop" if a.hog else ""))
        for backend in a.backend.split(","):
            rows = _run_mpi(a) if backend == "openmpi" else _run_torch(backend, a)
            if isinstance(rows, str):
                print(f"  {backend:>8} {rows}")
                continue
            mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("user_us", "sys_us", "invol", "vol")}
            # The busy processes' CPU time is read in clock ticks (10 ms): over a short loop it says nothing.
            secs = rows[0]["secs"]
            share = "" if not hogs else f"   {rows[0]['hog']:.2f}" if secs >= 0.5 else \
                f"   -   (a {secs * 1e3:.0f} ms loop: -n more for the scheduler to show)"
            print(f"  {backend:>8} {max(r['us'] for r in rows):9.1f} {mean['user_us']:8.1f} {mean['sys_us']:7.1f} "
                  f"{mean['invol']:6.2f} {mean['vol']:6.2f}{share}", flush=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()


if __name__ == "__main__":
    sys.exit(main())
