"""railcc-bench: a collective benchmark for torch.distributed backends, in the manner of nccl-tests.

Launch it under torchrun (it then rendezvouses through env://) or let it start its own ranks:

    railcc-bench --nprocs 4 --backend railcc,gloo -b 8 -e 128M -f 2 -o all_reduce,all_gather
    torchrun --nproc-per-node 4 -m railcc.bench --backend railcc -d bfloat16

Both `-o/--op` spellings take a comma list that may mix collectives (all_reduce, all_gather,
reduce_scatter, broadcast, reduce, alltoall, sendrecv, allreduce_coalesced) and at most one
reduction (sum, prod, min, max, avg): nccl-tests uses -o for the reduction, and one tool with many
collectives needs a way to pick them; the two vocabularies never overlap, so one flag serves both.

Columns and bandwidths follow nccl-tests:
  * size(B) is the whole array a rank deals with: for all_gather, reduce_scatter and alltoall that
    is count x nranks elements, where count is the per-rank piece; for allreduce_coalesced it is
    ntensors x count elements, where count is the size of one tensor (the sweep steps that size).
  * algbw = size / time, busbw = algbw x factor, the factor being 2(n-1)/n for all_reduce and
    allreduce_coalesced, (n-1)/n for all_gather, reduce_scatter and alltoall, and 1 otherwise.
  * time is the median over the timed iterations of the slowest rank's time in each iteration;
    the timed iterations run back to back after one barrier on a separate gloo group (a barrier
    before every iteration would add that barrier's exit skew, hundreds of microseconds on a busy
    host, to every small-message time). Only where a refill of 1 MiB or more precedes each
    iteration (below) is there a barrier after it, so that ranks finishing the copy at different
    times do not have that skew timed as part of the call, and one before it, so that no rank
    copies while the others are still in the previous call (where every rank reads one clock,
    these two go through the rendezvous store: see StoreBarrier). Such a barrier lets ranks go at
    different times too; when every rank reads the same clock (one host, or network namespaces
    of one host: the same kernel boot id) those iterations are therefore timed from the last
    rank's call to the last rank's return, and otherwise by the slowest rank's own clock.

torch exposes all_reduce, broadcast, reduce and all_reduce_coalesced only in place. For those the
out-of-place column runs the collective on a result buffer that is refilled from an untouched
source before each iteration (outside the timed region), so the source survives as it would with
separate send and receive buffers; the in-place column runs on one buffer over and over.
all_gather and reduce_scatter call all_gather_into_tensor / reduce_scatter_tensor (under their newer
names all_gather_single / reduce_scatter_single where torch has them) and, in place, pass a piece
of one buffer as the other, as those calls allow; alltoall and sendrecv have no in-place form (N/A).

allreduce_coalesced calls torch.distributed.all_reduce_coalesced, which goes straight to
ProcessGroup.allreduce_coalesced: the same entry point _coalescing_manager reaches for all_reduce
on backends without start/end coalescing, minus one Python call per tensor.

--device cuda puts every buffer on GPU LOCAL_RANK % device count (several ranks may share one GPU)
and calls torch.cuda.synchronize() before each clock read, so a time includes the device finishing
the work. A backend that fails there (nccl with two ranks on one GPU) is reported as "not run" for
that collective instead of stopping the run. With --bound the reference is then the device's own
copy rate B, counted as bytes read plus bytes written, and the bound column of all_reduce and
allreduce_coalesced is t_min / time with t_min = 2*N*S/B when all N ranks share one device: each
S-byte input read once and each output written once (N/A for the other collectives).

Exit status: 0; 1 when a rank failed; 2 for bad arguments; 3 when -c 1 found wrong elements.
"""

import json
import os
import socket
import sys
import time
import traceback
import warnings

if not __package__:
    # Run as a file (python path/to/railcc/bench/runner.py): make `import railcc` find this source
    # tree, but only as a last resort so an installed build wins, and drop this package's own
    # folder from the path so its module names cannot shadow others.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.append(os.path.dirname(os.path.dirname(_here)))


EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_WRONG = 0, 1, 2, 3

# The arithmetic and the table live in report.py, the clocks in timing.py. Loaded as a file
# (tests, `python path/to/railcc/bench/runner.py`), this module must not import the railcc
# package, which needs the built extension, so its siblings are then loaded by path; either way
# each is found under one name, railcc_bench_<name>.
def _sibling(name):
    alias = "railcc_bench_" + name
    if alias not in sys.modules:
        if __package__:
            import importlib

            sys.modules[alias] = importlib.import_module("." + name, __package__)
        else:
            import importlib.util

            spec = importlib.util.spec_from_file_location(
                alias, os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py"))
            sys.modules[alias] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[alias])


_sibling("report")
_sibling("timing")
_sibling("mpi")
_sibling("limits")
# Some names below are used only by the tests, which reach them through this module.
from railcc_bench_report import (  # noqa: E402
    COLLS, DTYPES, REDOPS, SHARED_BOUND_COLLS, _fmt, average_busbw, avg_tolerance, bandwidths,
    bound_formula, bound_fraction, busbw_factor, canonical_dtype, count_wrong, cuda_device_index,
    elem_count, expected_output, extra_cells, failure_reason, make_record, make_report, parse_size,
    pattern, pattern_kind, plot, ratio, shared_device_min_time_us, size_sweep, split_ops, stat_sums, stats_line,
    table_header, table_row, per_call_stats,
)
from railcc_bench_timing import (  # noqa: E402
    StoreBarrier, boot_id, device_copy_bandwidth, event_round_trip_us, iteration_times, memcpy_bandwidth, peak_rss_kib,
    quiet_barrier, shared_clock, time_collective,
)
import railcc_bench_mpi as bench_mpi  # noqa: E402
from railcc_bench_limits import die_with_parent  # noqa: E402

# The command line (its bounds, parser and checks) is args.py's.
_sibling("args")
from railcc_bench_args import REFERENCES, build_parser, check_backends, check_outputs, validate  # noqa: E402


def _torch_redop(name):
    import torch.distributed as dist

    return {
        "sum": dist.ReduceOp.SUM,
        "prod": dist.ReduceOp.PRODUCT,
        "min": dist.ReduceOp.MIN,
        "max": dist.ReduceOp.MAX,
        "avg": dist.ReduceOp.AVG,
    }[name]


_UNSET = object()


def _empty_fn(cfg, dev, td):
    """How a case makes the buffers its collectives write: torch.empty, or with --alloc backend
    the default group's allocate_tensor where its backend offers it for `dev` (railcc with
    RAILCC_CUDA_SHOTS=1: its heap, which the peers read in place)."""
    import torch

    if getattr(cfg, "alloc", "torch") == "backend":
        import torch.distributed as dist

        backend = dist.group.WORLD._get_backend(dev)
        if backend.supports_tensor_alloc(dev):
            return lambda n: backend.allocate_tensor(n, dtype=td, device=dev)
    return lambda n: torch.empty(n, dtype=td, device=dev)


class Case:
    """The buffers of one collective at one size, shared by every backend, and how to run it."""

    def __init__(self, coll, count, rank, nranks, cfg, device=None):
        import torch

        self.coll, self.count, self.rank, self.n, self.cfg = coll, count, rank, nranks, cfg
        self.device = torch.device("cpu") if device is None else torch.device(device)
        dev = self.device
        self.td = getattr(torch, DTYPES[cfg.dtype][0])
        self.kind = pattern_kind(coll, cfg.redop)
        self.redop = _torch_redop(cfg.redop)
        self._expected = _UNSET  # None is a real answer (reduce on a non-root rank)
        n, td = nranks, self.td

        def pat(c, off=0):
            return pattern(rank, c, td, self.kind, off).to(dev)

        empty = _empty_fn(cfg, dev, td)

        # src is never handed to a collective that may write it, so it can refill the others
        if coll in ("all_reduce", "broadcast", "reduce"):
            self.src = pat(count)
            self.res = empty(count)
            self.ip = empty(count)
        elif coll == "all_gather":
            self.src = pat(count)
            self.res = empty(count * n)
            self.ip = empty(count * n)
        elif coll == "reduce_scatter":
            self.src = pat(count * n)
            self.res = empty(count)
            self.ip = empty(count * n)
        elif coll == "alltoall":
            self.src = pat(count * n)
            self.res = torch.empty(count * n, dtype=td, device=dev)
            self.ip = None
        elif coll == "sendrecv":
            self.src = pat(count)
            self.res = torch.empty(count, dtype=td, device=dev)
            self.ip = None
        elif coll == "allreduce_coalesced":
            # torch flags all_reduce_coalesced for deprecation; the warning says nothing about the run
            warnings.filterwarnings("ignore", message=".*all_reduce_coalesced.*", category=FutureWarning)
            # separate allocations, as DDP-bucket-sized gradients would be
            self.src = [pat(count, k * count) for k in range(cfg.ntensors)]
            self.res = [torch.empty_like(t) for t in self.src]
            self.ip = [torch.empty_like(t) for t in self.src]
        else:
            raise ValueError(coll)

    def _own_piece(self, t):
        return t.narrow(0, self.rank * self.count, self.count)

    def nbytes(self):
        """Bytes of the source buffer(s): what a refill copies."""
        srcs = self.src if isinstance(self.src, list) else [self.src]
        return sum(t.numel() * t.element_size() for t in srcs)

    def load(self, inplace):
        """Puts the inputs where the next run reads them."""
        import torch

        c = self.coll
        if c == "allreduce_coalesced":
            torch._foreach_copy_(self.ip if inplace else self.res, self.src)
        elif c in ("all_reduce", "broadcast", "reduce"):
            (self.ip if inplace else self.res).copy_(self.src)
        elif c == "all_gather" and inplace:
            self._own_piece(self.ip).copy_(self.src)
        elif c == "reduce_scatter" and inplace:
            self.ip.copy_(self.src)

    def refill(self, inplace):
        """Work to do before each out-of-place iteration of an in-place-only API, or None."""
        if inplace or self.coll not in ("all_reduce", "broadcast", "reduce", "allreduce_coalesced"):
            return None
        return lambda: self.load(False)

    def runner(self, group, inplace):
        import torch.distributed as dist

        c, op, root = self.coll, self.redop, self.cfg.root
        buf = self.ip if inplace else self.res
        if c == "all_reduce":
            return lambda: dist.all_reduce(buf, op=op, group=group)
        if c == "broadcast":
            return lambda: dist.broadcast(buf, src=root, group=group)
        if c == "reduce":
            return lambda: dist.reduce(buf, dst=root, op=op, group=group)
        if c == "allreduce_coalesced":
            return lambda: dist.all_reduce_coalesced(buf, op=op, group=group)
        if c == "all_gather":
            # recent torch renamed all_gather_into_tensor to all_gather_single and left the old
            # name as a deprecated wrapper: same call, minus a warning inside the timed loop
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            src = self._own_piece(self.ip) if inplace else self.src
            return lambda: gather(buf, src, group=group)
        if c == "reduce_scatter":
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            out = self._own_piece(self.ip) if inplace else self.res
            inp = self.ip if inplace else self.src
            return lambda: scatter(out, inp, op=op, group=group)
        if c == "alltoall":
            return lambda: dist.all_to_all_single(self.res, self.src, group=group)
        if c == "sendrecv":
            ops = [
                dist.P2POp(dist.isend, self.src, (self.rank + 1) % self.n, group),
                dist.P2POp(dist.irecv, self.res, (self.rank - 1) % self.n, group),
            ]

            def ring():
                for w in dist.batch_isend_irecv(ops):
                    w.wait()

            return ring
        raise ValueError(c)

    def _poison(self, inplace):
        """Fills what the collective must overwrite, so stale results from timing cannot pass."""
        import torch

        if self.td.is_floating_point:
            bad = float("nan")
        else:
            info = torch.iinfo(self.td)
            bad = info.max if info.min == 0 else info.min
        c = self.coll
        if c == "all_gather":
            (self.ip if inplace else self.res).fill_(bad)
        elif c in ("reduce_scatter", "alltoall", "sendrecv") and not inplace:
            self.res.fill_(bad)

    def result(self, inplace):
        import torch

        c = self.coll
        if c == "allreduce_coalesced":
            return torch.cat(self.ip if inplace else self.res)
        if c == "reduce_scatter" and inplace:
            return self._own_piece(self.ip)
        return self.ip if inplace else self.res

    def check(self, group, inplace):
        """Runs the collective once on fresh inputs; returns this rank's number of wrong elements."""
        self._poison(inplace)
        self.load(inplace)
        self.runner(group, inplace)()
        if self._expected is _UNSET:
            cfg = self.cfg
            self._expected = expected_output(
                self.coll, self.rank, self.n, self.count, self.td, cfg.redop, cfg.root, cfg.ntensors
            )
        expected = self._expected
        if expected is None:
            return 0
        tol = avg_tolerance(self.cfg.dtype, self.n) if (COLLS[self.coll].reduces and self.cfg.redop == "avg") else 0.0
        # the expected values are computed on the CPU
        return count_wrong(self.result(inplace).cpu(), expected, tol)


class Progress:
    def __init__(self, enabled, total):
        self.enabled, self.total, self.done = enabled, total, 0
        self.tty = sys.stderr.isatty()
        self.shown = False

    def step(self, label):
        if not self.enabled:
            return
        self.done += 1
        msg = f"[{self.done}/{self.total}] {label}"
        if self.tty:
            sys.stderr.write("\r\033[K" + msg)
            self.shown = True
        else:
            sys.stderr.write(msg + "\n")
        sys.stderr.flush()

    def clear(self):
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.shown = False


def run_rank(cfg, rank, world_size, store=None):
    """Benchmarks on one rank; returns its exit status. Only rank 0 prints."""
    import datetime

    import torch.distributed as dist

    if "railcc" in cfg.backends:
        import railcc  # noqa: F401  (registers the backend)

    device = None
    # torchrun numbers the ranks of a node by LOCAL_RANK; ranks started here are all local
    local_rank = int(os.environ.get("LOCAL_RANK", rank)) if store is None else rank
    if cfg.bind:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[local_rank % len(cpus)]})
    if cfg.device == "cuda":
        import torch

        device = torch.device("cuda", cuda_device_index(local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)  # before any tensor or communicator takes the current device
    timeout = datetime.timedelta(seconds=cfg.timeout)
    if store is None:
        dist.init_process_group(cfg.backends[0], init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(cfg.backends[0], store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        return _bench(cfg, rank, world_size, timeout, device)
    finally:
        dist.destroy_process_group()


def run_agreed(fn, ctrl, nranks):
    """fn() on every rank; (its result, None), or (None, reason) on every rank when it raised on any,
    so that all ranks drop a failed backend together and stay in step."""
    import torch.distributed as dist

    try:
        out, reason = fn(), None
    except Exception as e:
        out, reason = None, failure_reason(e)
    reasons = [None] * nranks
    dist.all_gather_object(reasons, reason, group=ctrl)
    reason = next((r for r in reasons if r), None)
    return (None, reason) if reason else (out, None)


def _bench(cfg, rank, n, timeout, device=None):
    import torch
    import torch.distributed as dist

    groups = {cfg.backends[0]: dist.group.WORLD}
    if "fake" in cfg.backends:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers backend "fake")
    for b in cfg.backends[1:]:
        if b != bench_mpi.NAME:  # measured before the ranks started (spawn)
            groups[b] = dist.new_group(backend=b, timeout=timeout)
    # barriers and the max over ranks go over their own gloo group so they never queue behind,
    # or share connections with, the traffic being measured
    ctrl = dist.new_group(backend="gloo", timeout=timeout)
    lead = rank == 0

    def say(line=""):
        if lead:
            progress.clear()
            print(line, flush=True)

    total_steps = sum(len(cfg.sizes) for _ in cfg.colls) * len(cfg.backends)
    progress = Progress(lead and (cfg.progress or sys.stderr.isatty()), total_steps)

    who = [None] * n
    dist.all_gather_object(who, (socket.gethostname(), os.getpid()), group=ctrl)
    same_clock = shared_clock(ctrl)
    quiet = quiet_barrier(n) if same_clock else None
    timing = ("median over iterations of the slowest rank in each; iterations back to back after one barrier"
              + ("; after a refill barrier, from the last rank's call to the last rank's return (one clock)"
                 + ("; refill barriers through the store" if quiet is not None else "")
                 if same_clock else ""))
    cuda = device is not None and device.type == "cuda"
    device_name, rank_devices, ranks_per_device = "cpu", None, None
    if cuda:
        props = torch.cuda.get_device_properties(device)
        # the uuid tells GPUs apart even where ranks see different CUDA_VISIBLE_DEVICES
        ident = str(getattr(props, "uuid", device.index))
        devs = [None] * n
        dist.all_gather_object(devs, (socket.gethostname(), ident, str(device), props.name), group=ctrl)
        device_name = f"cuda:{devs[0][3]}"
        rank_devices = [f"{d} ({name})" for _, _, d, name in devs]
        if len({(h, i) for h, i, _, _ in devs}) == 1:
            ranks_per_device = n
    meta = {
        "world_size": n,
        "backends": cfg.backends,
        "op": cfg.colls,
        "dtype": cfg.dtype,
        "redop": cfg.redop,
        "hostname": socket.gethostname(),
        "hosts": [h for h, _ in who],
        "torch_version": torch.__version__,
        "argv": cfg.argv,
        "minbytes": cfg.minbytes,
        "maxbytes": cfg.maxbytes,
        "stepfactor": cfg.stepfactor,
        "stepbytes": cfg.stepbytes,
        "iters": cfg.iters,
        "warmup_iters": cfg.warmup,
        "check": cfg.check,
        "root": cfg.root,
        "ntensors": cfg.ntensors,
        "timing": timing,
        "same_clock": same_clock,
        "coalesced_api": "torch.distributed.all_reduce_coalesced",
        "device": device_name,
    }
    if bench_mpi.NAME in cfg.backends:
        meta["openmpi"] = {"library": cfg.mpi_note, "launch": f"mpirun --bind-to {'core' if cfg.bind else 'none'} "
                           "--mca btl self,vader",
                           "timing": "the same loop (railcc.bench.timing.iteration_times), mpi4py on numpy buffers "
                           "on the pages torch's tensors get (railcc.bench.mpi.torch_hugepages)"}
    if cuda:
        meta["rank_devices"] = rank_devices
        meta["ranks_per_device"] = ranks_per_device
        meta["device_sync"] = "torch.cuda.synchronize() after the warm-up, each refill and each timed iteration"
    say(f"# railcc-bench  backends: {', '.join(cfg.backends)}  world size: {n}  torch {torch.__version__}"
        + (f"  device: {device_name}" if cuda else ""))
    step = f"-f {cfg.stepfactor:g}" if cfg.stepbytes is None else f"-i {cfg.stepbytes}"
    say(
        f"# -b {cfg.minbytes} -e {cfg.maxbytes} {step} -n {cfg.iters} -w {cfg.warmup} -c {int(cfg.check)}"
        f" -d {cfg.dtype} -o {cfg.redop} -r {cfg.root}" + (" --device cuda" if cuda else "")
    )
    say(f"# time: {timing}" + ("; torch.cuda.synchronize() before each clock read" if cuda else ""))
    for r, (h, pid) in enumerate(who):
        say(f"#  rank {r:3d}  pid {pid:7d}  on {h}" + (f"  {rank_devices[r]}" if cuda else ""))
    if bench_mpi.NAME in cfg.backends:
        say(f"# {bench_mpi.NAME}: {cfg.mpi_note}")

    bound = None
    if cfg.bound:
        bw = rtt = 0.0
        if lead:  # alone, so the other ranks neither share the core nor the memory bus
            bw = device_copy_bandwidth(cfg.bound_bytes, device) if cuda else memcpy_bandwidth(cfg.bound_bytes)
            rtt = event_round_trip_us(device) if cuda else 0.0
        t = torch.tensor([bw, rtt], dtype=torch.float64)
        dist.broadcast(t, src=0, group=ctrl)
        bw, rtt = float(t[0]), float(t[1])
        formula = bound_formula(cfg.device, ranks_per_device)
        bound = {
            "method": "torch copy_, 1 thread, best of 5",
            "bytes": cfg.bound_bytes,
            "memcpy_gbps": bw,  # the rate the bound column uses: on cuda B, bytes read plus written
            "fractions": [],
            "device": device_name,
            "formula": formula,
        }
        if cuda:
            bound["method"] = f"torch copy_ on {rank_devices[0]}, device to device, best of 5, cuda events"
            bound["device_copy_gbps"] = bw
            bound["counts"] = "bytes read + bytes written"
            bound["ranks_per_device"] = ranks_per_device
            bound["event_round_trip_us"] = rtt
            say(f"# bound: device copy (read+write) of {cfg.bound_bytes} B on {rank_devices[0]}: {bw:.2f} GB/s;"
                f" bound column = {formula}; one process's event round trip: {rtt:.1f} us")
        else:
            say(f"# bound: single-core memcpy of {cfg.bound_bytes} B: {bw:.2f} GB/s; bound column = busbw / that")

    records, ratio_rows, not_run = [], [], []
    failed = set()  # (backend, collective) that raised on cuda: skipped at the larger sizes
    total_wrong = 0
    elsize = DTYPES[cfg.dtype][1]
    for coll in cfg.colls:
        spec = COLLS[coll]
        redop_col = cfg.redop if spec.reduces else "none"
        root_col = cfg.root if spec.rooted else -1
        say("#")
        say(f"# {coll}" + (f": {cfg.ntensors} tensors of count elements each, size is their total"
                           if coll == "allreduce_coalesced" else ""))
        if cuda and cfg.bound:
            say("# bound column: " + (bound["formula"] if coll in SHARED_BOUND_COLLS else
                                      f"N/A, 2*N*S/B bounds {', '.join(SHARED_BOUND_COLLS)} only"))
        for line in table_header(cfg.backends, cfg.bound):
            say(line)
        seen = set()
        for size in cfg.sizes:
            count, nbytes = elem_count(coll, size, elsize, n, cfg.ntensors)
            if count == 0 or count in seen:
                for _ in cfg.backends:
                    progress.step(f"{coll} {size} B (skipped)")
                continue
            seen.add(count)
            case = Case(coll, count, rank, n, cfg, device)
            pending_stats = []  # --stats lines, said under the size's rows

            def measure(b):
                """Both placements on backend b: (table sides, records, wrong elements)."""
                sides, recs, wrong_sum = [], [], 0
                for inplace in (False, True):
                    if inplace and not spec.inplace:
                        sides.append((None, None, None, None))
                        continue
                    if b == bench_mpi.NAME:
                        t = cfg.mpi_times.get(f"{coll}|{nbytes}|{int(inplace)}")
                        if t is None:
                            sides.append((None, None, None, None))
                            continue
                    else:
                        counting = cfg.stats and b == "railcc"
                        if counting:
                            import railcc
                            railcc.reset_stats()
                        t = time_collective(case, groups[b], inplace, cfg.iters, cfg.warmup, ctrl, same_clock, quiet)
                        if counting:
                            sums = torch.tensor(stat_sums(railcc.stats()), dtype=torch.float64)
                            dist.all_reduce(sums, group=ctrl)
                            per_call = per_call_stats(sums.tolist(), cfg.iters + cfg.warmup, n)
                            pending_stats.append(stats_line(coll, nbytes, inplace, per_call))
                    algbw, busbw = bandwidths(nbytes, t, coll, n)
                    wrong = None
                    if cfg.check and b not in REFERENCES:  # fake sends nothing; MPI checked nothing
                        w = torch.tensor([case.check(groups[b], inplace)], dtype=torch.int64)
                        dist.all_reduce(w, op=dist.ReduceOp.SUM, group=ctrl)
                        wrong = int(w[0])
                        wrong_sum += wrong
                    sides.append((t, algbw, busbw, wrong))
                    recs.append(
                        make_record(b, coll, nbytes, count, cfg.dtype, redop_col, root_col, inplace, t, algbw, busbw,
                                    wrong)
                    )
                return sides, recs, wrong_sum

            rows = {}
            for b in cfg.backends:
                progress.step(f"{coll} {b} {nbytes} B")
                rows[b] = None
                if (b, coll) in failed:
                    continue
                if not cuda:
                    out = measure(b)
                else:
                    # a backend may not take device buffers, or not this way (nccl refuses two ranks
                    # on one GPU): report it and go on with the others
                    out, reason = run_agreed(lambda: measure(b), ctrl, n)
                    if reason:
                        failed.add((b, coll))
                        not_run.append({"backend": b, "op": coll, "size": nbytes, "reason": reason})
                        say(f"# {b}: not run ({reason})")
                        continue
                rows[b], recs, wrong_sum = out
                records.extend(recs)
                total_wrong += wrong_sum
            # algbw and busbw differ by the same factor for every backend, so their ratios agree;
            # algbw keeps the ratio defined on one rank, where busbw is 0
            first = rows[cfg.backends[0]]
            ratios = {
                b: ratio(first[0][1] if first else None, rows[b][0][1] if rows[b] else None)
                for b in cfg.backends[1:]
            }
            for b, r in ratios.items():
                ratio_rows.append({"op": coll, "size": nbytes, "backend": cfg.backends[0], "vs": b, "ratio": r})
            for b in cfg.backends:
                if rows[b] is None:
                    continue
                frac = None
                if bound is not None:
                    t, _, busbw, _ = rows[b][0]
                    frac = bound_fraction(coll, nbytes, t, busbw, bound["memcpy_gbps"], cfg.device, ranks_per_device)
                    bound["fractions"].append({"backend": b, "op": coll, "size": nbytes, "fraction": frac})
                say(
                    table_row(nbytes, count, cfg.dtype, redop_col, root_col, rows[b][0], rows[b][1])
                    + extra_cells(cfg.backends, cfg.bound, b, ratios, frac)
                )
            for line in pending_stats:
                say(line)
            del case
        for b in cfg.backends:
            avg = average_busbw(records, b, coll)
            tag = f"  ({b})" if len(cfg.backends) > 1 else ""
            say(f"# Avg bus bandwidth : {_fmt(avg, 4)}{tag}")
    say("#")
    if cfg.check:
        say(f"# #wrong in total : {total_wrong}")

    rss = torch.tensor([peak_rss_kib()], dtype=torch.int64)
    all_rss = [torch.zeros_like(rss) for _ in range(n)]
    dist.all_gather(all_rss, rss, group=ctrl)
    rss_list = [int(x[0]) for x in all_rss]
    say("# Peak RSS (MiB) per rank : " + "  ".join(f"{r}:{k / 1024:.1f}" for r, k in enumerate(rss_list)))

    if lead:
        progress.clear()
        report = make_report(meta, records, bound, rss_list, ratio_rows, not_run)
        if cfg.json:
            with open(cfg.json, "w") as f:
                json.dump(report, f, indent=1, allow_nan=False)
                f.write("\n")
        if cfg.plot:
            plot(cfg.plot, records, cfg.backends, cfg.colls)
    dist.barrier(group=ctrl)  # nobody tears down while rank 0 still writes
    return EXIT_WRONG if total_wrong else EXIT_OK


# ----------------------------------------------------------------------------------------------
# Launch.


def _worker(rank, world_size, cfg, port, parent=None):
    """Entry point of a spawned rank."""
    if parent is not None:
        # a rank never outlives the railcc-bench that started it, even one killed by SIGKILL
        die_with_parent(parent)
    try:
        import datetime

        import torch
        import torch.distributed as dist

        # As torchrun does for several ranks per node: intra-op worker threads of every rank would
        # otherwise spin on the same cores after each refill copy and slow every backend down.
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
        store = dist.TCPStore(
            "127.0.0.1", port, world_size=None, is_master=False, timeout=datetime.timedelta(seconds=cfg.timeout)
        )
        code = run_rank(cfg, rank, world_size, store=store)
    except KeyboardInterrupt:
        code = EXIT_FAILED
    except BaseException:
        sys.stderr.write(f"railcc-bench: rank {rank} failed:\n{traceback.format_exc()}")
        code = EXIT_FAILED
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def supervise(procs, grace=3.0):
    """Waits for started processes. When one fails the others get grace seconds to report and are
    then killed, so a dead rank cannot leave its peers hanging. Returns the exit status to use."""
    from multiprocessing.connection import wait

    pending = {p.sentinel: (r, p) for r, p in enumerate(procs)}
    status = EXIT_OK
    deadline = None
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait(list(pending), timeout=left)
        if not ready:  # grace is over
            for _, p in pending.values():
                p.kill()
            for _, p in pending.values():
                p.join()
            break
        for s in ready:
            r, p = pending.pop(s)
            p.join()
            code = p.exitcode
            if code == EXIT_WRONG:
                status = status or EXIT_WRONG
            elif code != 0:
                if code != EXIT_FAILED:
                    # a rank that died without saying why (a signal, os._exit)
                    sys.stderr.write(f"railcc-bench: rank {r} exited with status {code}\n")
                status = EXIT_FAILED
                if deadline is None:
                    deadline = time.monotonic() + grace
    return status


def spawn(cfg, nprocs):
    import multiprocessing as mp

    import torch.distributed as dist

    # The parent holds the store: port 0 lets the kernel pick a free port with no race.
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, nprocs, cfg, store.port, os.getpid()), daemon=False)
             for r in range(nprocs)]
    started = []
    try:
        for p in procs:
            p.start()
            started.append(p)
        return supervise(procs)
    except (KeyboardInterrupt, OSError) as e:
        if isinstance(e, OSError):  # fork refused: out of tasks or memory
            sys.stderr.write(f"railcc-bench: could not start rank {len(started)} of {nprocs}: {e}\n")
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join()
        return EXIT_FAILED
    finally:
        del store


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", "0")) if under_torchrun else 0

    def error(msg):
        if rank != 0:  # one copy of the message, not one per rank
            sys.exit(EXIT_USAGE)
        parser.error(msg)

    if rank != 0:
        # argparse prints to stderr on its own; keep the other ranks quiet
        parser.error = lambda msg: sys.exit(EXIT_USAGE)
    args = parser.parse_args(argv)
    if under_torchrun:
        if args.nprocs is not None:
            error("argument --nprocs: not allowed under torchrun (RANK and WORLD_SIZE are set)")
        world_size = int(os.environ["WORLD_SIZE"])
    else:
        world_size = args.nprocs or 1
    try:
        cfg = validate(args, world_size, ["railcc-bench"] + argv)
        if rank == 0:  # the rank that writes them
            check_outputs(cfg)
        check_backends(cfg.backends)
    except ValueError as e:
        error(str(e))
    if bench_mpi.NAME in cfg.backends:
        times, note = bench_mpi.measure(cfg, world_size) if not under_torchrun else (None, "needs --nprocs")
        if times is None:
            if rank == 0:
                print(f"# {bench_mpi.NAME}: not run ({note})", flush=True)
            cfg.backends = [b for b in cfg.backends if b != bench_mpi.NAME]
        cfg.mpi_times, cfg.mpi_note = times, note
    if under_torchrun:
        return run_rank(cfg, rank, world_size)
    return spawn(cfg, world_size)


if __name__ == "__main__":
    sys.exit(main())
