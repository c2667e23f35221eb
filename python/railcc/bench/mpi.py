"""railcc-bench's Open MPI reference (`--backend railcc,openmpi`): the same sizes, collectives
and timing loop, run through mpi4py under `mpirun` over Open MPI's shared-memory transport,
before the torch ranks start. Its figures become rows of backend "openmpi" with a ratio
column, in the table, the JSON and the plot.

The launcher side (`measure`) runs in railcc-bench's parent process; the MPI side runs this
file as a script under mpirun and imports neither torch nor the railcc package (report.py
and timing.py beside it are loaded by path), so the MPI ranks start in well under a second.
"""

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

NAME = "openmpi"
_HERE = os.path.dirname(os.path.abspath(__file__))
# What each collective is in MPI, and whether it has an in-place form (MPI.IN_PLACE).
_NUMPY = {"float": "float32", "double": "float64", "half": "float16", "bfloat16": None, "int8": "int8",
          "uint8": "uint8", "int32": "int32", "int64": "int64"}
_REDOPS = {"sum": "SUM", "prod": "PROD", "min": "MIN", "max": "MAX", "avg": None}


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_railcc_bench_{name}", os.path.join(_HERE, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def missing():
    """Why no Open MPI reference can run here at all (no mpirun, no mpi4py), or ""."""
    if shutil.which("mpirun") is None:
        return "mpirun not found (apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py)"
    probe = subprocess.run([sys.executable, "-c", "import mpi4py, numpy"], capture_output=True, text=True)
    if probe.returncode != 0:
        return "mpi4py or numpy is not importable (pip install mpi4py numpy)"
    return ""


def torch_hugepages():
    """Whether torch's CPU allocator puts large tensors on transparent huge pages in this
    environment (THP_MEM_ALLOC_ENABLE=1, read by c10 at start-up; off by default)."""
    return os.environ.get("THP_MEM_ALLOC_ENABLE", "").strip().lower() in ("1", "true", "on", "yes", "y")


def launch(nprocs, argv, bind="none"):
    """The mpirun command line and environment of every Open MPI reference run: shared memory
    through the vader BTL and the ob1 PML (named, so that a UCX PML is never chosen instead).
    numpy's buffers get the pages torch's tensors get: numpy asks for transparent huge pages on
    large arrays by default and torch does not, and on huge pages a copy through the kernel
    (CMA) ran twice as fast here (all_gather of 256 MiB: 11 against 22 ms), so the reference
    would otherwise time other memory than the backends it is compared with. Run the bench with
    THP_MEM_ALLOC_ENABLE=1 to time everything on huge pages."""
    cmd = ["mpirun", "-np", str(nprocs), "--bind-to", bind, "--mca", "btl", "self,vader", "--mca", "pml", "ob1", *argv]
    env = dict(os.environ)
    env["NUMPY_MADVISE_HUGEPAGE"] = "1" if torch_hugepages() else "0"
    if os.geteuid() == 0:  # containers and CI run as root; Open MPI refuses that by default
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    return cmd, env


def why_not(cfg):
    """Why the Open MPI reference cannot run for `cfg` here, or "" when it can."""
    why = missing()
    if why:
        return why
    if _NUMPY.get(cfg.dtype) is None:
        return f"MPI has no {cfg.dtype} type"
    if _REDOPS.get(cfg.redop) is None:
        return f"MPI has no {cfg.redop} reduction"
    if "allreduce_coalesced" in cfg.colls:
        return "MPI has no coalesced all-reduce"
    if cfg.device != "cpu":
        return "the Open MPI reference runs on CPU buffers only"
    return ""


def measure(cfg, nprocs, timeout=1800):
    """Runs the sweep under mpirun. Returns ({"coll|bytes|inplace": microseconds}, note), or
    (None, why) when it could not run."""
    why = why_not(cfg)
    if why:
        return None, why
    with tempfile.TemporaryDirectory(prefix="railcc-bench-mpi-") as d:
        spec_path, out_path = os.path.join(d, "spec.json"), os.path.join(d, "out.json")
        with open(spec_path, "w") as f:
            json.dump({"colls": cfg.colls, "sizes": cfg.sizes, "dtype": cfg.dtype, "redop": cfg.redop,
                       "root": cfg.root, "iters": cfg.iters, "warmup": cfg.warmup}, f)
        cmd, env = launch(nprocs, [sys.executable, os.path.abspath(__file__), spec_path, out_path],
                          bind="core:overload-allowed" if getattr(cfg, "bind", False) else "none")
        try:
            # mpirun (and through it its ranks) ends with railcc-bench, even one killed by SIGKILL
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                               preexec_fn=_load("limits").pdeathsig_preexec())
        except subprocess.TimeoutExpired:
            return None, f"mpirun did not finish within {timeout:.0f} s"
        if p.returncode != 0 or not os.path.exists(out_path):
            tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
            return None, f"mpirun failed (exit {p.returncode}): " + " | ".join(tail)
        with open(out_path) as f:
            res = json.load(f)
    pages = "transparent huge pages" if torch_hugepages() else "4 KiB pages"
    return res["times"], f"{res['version']}; numpy buffers on {pages}, as torch's tensors"


# ----------------------------------------------------------------------------------------------
# The MPI side: one rank under mpirun.


def _run(spec_path, out_path):
    import time

    import numpy as np
    from mpi4py import MPI

    report, timing = _load("report"), _load("timing")
    with open(spec_path) as f:
        spec = json.load(f)
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    dt = np.dtype(_NUMPY[spec["dtype"]])
    op = getattr(MPI, _REDOPS[spec["redop"]])
    root = spec["root"]
    times = {}
    clock = time.perf_counter_ns  # CLOCK_MONOTONIC: one clock for every rank of this host
    for coll in spec["colls"]:
        info = report.COLLS[coll]
        seen = set()
        for size in spec["sizes"]:
            count, nbytes = report.elem_count(coll, size, dt.itemsize, n)
            if count == 0 or count in seen or n < info.min_ranks:
                continue
            seen.add(count)
            whole = count * n if info.chunked else count
            src = np.ones(whole if coll in ("reduce_scatter", "alltoall") else count, dtype=dt)
            res = np.zeros(whole if coll in ("all_gather", "alltoall") else count, dtype=dt)
            ip = np.ones(whole, dtype=dt)
            for inplace in (False, True):
                if inplace and not info.inplace:
                    continue
                run = _runner(comm, MPI, coll, op, root, rank, n, src, res, ip, inplace)
                # As railcc-bench times torch: large buffers that torch must refill before an
                # out-of-place call line up behind a barrier, and are timed on the one clock.
                refilled = not inplace and coll in ("all_reduce", "broadcast", "reduce")
                realign = refilled and src.nbytes >= timing.REALIGN_BYTES
                # MPI's broadcast, like torch's, has no separate send buffer: out of place, its
                # buffer is refilled from the source before each call, outside the timed region,
                # as railcc-bench does for torch (the root then sends freshly written data, not
                # the same lines every call, which a reader may still hold in its own cache).
                refill = (lambda: np.copyto(res, src)) if not inplace and coll == "broadcast" else None
                for _ in range(spec["warmup"]):
                    if refill:
                        refill()
                    run()
                starts, ends = [0] * spec["iters"], [0] * spec["iters"]
                comm.Barrier()
                for i in range(spec["iters"]):
                    if refill:
                        if realign and i > 0:
                            comm.Barrier()
                        refill()
                    if realign:
                        comm.Barrier()
                    t0 = clock()
                    run()
                    starts[i], ends[i] = t0, clock()
                every = comm.gather((starts, ends), root=0)
                if rank == 0:
                    per = timing.iteration_times([s for s, _ in every], [e for _, e in every], realign)
                    times[f"{coll}|{nbytes}|{int(inplace)}"] = statistics.median(per)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"times": times, "version": MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]}, f)


def _runner(comm, MPI, coll, op, root, rank, n, src, res, ip, inplace):
    # all_reduce, broadcast and reduce: src, res and ip all hold `count` elements
    if coll == "all_reduce":
        return (lambda: comm.Allreduce(MPI.IN_PLACE, ip, op=op)) if inplace else (lambda: comm.Allreduce(src, res, op=op))
    if coll == "broadcast":  # in place only, in MPI as in torch
        buf = ip if inplace else res
        return lambda: comm.Bcast(buf, root=root)
    if coll == "reduce":
        if inplace:
            return lambda: comm.Reduce(MPI.IN_PLACE if rank == root else ip, ip, op=op, root=root)
        return lambda: comm.Reduce(src, res, op=op, root=root)
    if coll == "all_gather":
        return (lambda: comm.Allgather(MPI.IN_PLACE, ip)) if inplace else (lambda: comm.Allgather(src, res))
    if coll == "reduce_scatter":
        return (lambda: comm.Reduce_scatter_block(MPI.IN_PLACE, ip, op=op)) if inplace else \
            (lambda: comm.Reduce_scatter_block(src, res, op=op))
    if coll == "alltoall":
        return lambda: comm.Alltoall(src, res)
    if coll == "sendrecv":
        return lambda: comm.Sendrecv(src, (rank + 1) % n, 0, res, (rank - 1) % n, 0)
    raise ValueError(coll)


if __name__ == "__main__":
    _run(sys.argv[1], sys.argv[2])
