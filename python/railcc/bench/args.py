"""railcc-bench's command line: the parser, and every argument bounded and checked before any
buffer is made or any rank starts (validate), each refusal naming its flag and range; then the
run's Config. A sibling of runner.py, found as railcc_bench_args either way runner.py is loaded
(its siblings are loaded first: see runner._sibling)."""

import argparse
import os
from dataclasses import dataclass, field

import railcc_bench_mpi as bench_mpi
from railcc_bench_limits import human, memory_limit, tasks_left
from railcc_bench_report import COLLS, DTYPES, REDOPS, canonical_dtype, parse_size, size_sweep, split_ops

# Rows that are references, not backends under test: c10d's own dispatch cost (torch's fake
# process group) and Open MPI through mpi4py.
REFERENCES = ("fake", bench_mpi.NAME)


# ----------------------------------------------------------------------------------------------
# Command line.

# Bounds on the arguments, checked before any buffer is made or any rank starts (validate).
MAX_SIZES = 64  # sizes one -b/-e/-f/-i sweep may have
MAX_ITERS = 1_000_000  # -n and -w
MAX_NTENSORS = 65536
MIN_TIMEOUT, MAX_TIMEOUT = 1.0, 86400.0  # seconds
MAX_NPROCS = 256  # and at most NPROCS_PER_CPU per CPU of this host
NPROCS_PER_CPU = 8
# A rank's memory besides its buffers: torch and the backends (about 230 MiB measured with gloo
# and railcc), and the tasks (threads) it runs: about 10 measured with railcc and gloo.
RANK_BASE_BYTES = 256 << 20
TASKS_PER_RANK = 12
MEMORY_SHARE = 0.9  # of the host's (or cgroup's) memory the run may plan to use


def max_nprocs():
    return max(1, min(MAX_NPROCS, NPROCS_PER_CPU * (os.cpu_count() or 1)))


def rank_bytes(coll, size, elsize, ntensors=1):
    """Host memory one rank needs for coll at a sweep size (an upper estimate): its buffers
    (Case: three of the size for the in-place-only APIs, two otherwise; allreduce_coalesced
    ntensors times that), the expected result and the copies the check makes (two more), and
    pattern()'s int64 index arithmetic (three int64 tensors of one buffer's elements)."""
    per = size * (ntensors if coll == "allreduce_coalesced" else 1)
    bufs = 3 if coll in ("all_reduce", "broadcast", "reduce", "allreduce_coalesced") else 2
    return (bufs + 2) * per + 3 * 8 * -(-size // elsize)


def sweep_length(minbytes, maxbytes, stepfactor, stepbytes, limit):
    """How many sizes size_sweep() would give, counting no further than limit + 1."""
    if stepbytes is not None:
        return min(limit + 1, (maxbytes - minbytes) // stepbytes + 1)
    n, s = 0, minbytes
    while s <= maxbytes and n <= limit:
        n += 1
        s = max(s + 1, int(s * stepfactor))
    return n


def check_outputs(cfg):
    """Raises ValueError naming --json or --plot when rank 0 could not write that file, before
    any rank starts (instead of failing the run at its end)."""
    for arg, path in (("--json", cfg.json), ("--plot", cfg.plot)):
        if not path:
            continue
        if os.path.isdir(path):
            raise ValueError(f"argument {arg}: {path} is a directory")
        existed = os.path.lexists(path)
        try:
            with open(path, "a"):  # appending changes nothing in a file that is there
                pass
        except OSError as e:
            raise ValueError(f"argument {arg}: cannot write {path}: {e.strerror or e}") from None
        if not existed:
            try:
                os.unlink(path)
            except OSError:
                pass


def _size_arg(text):
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser():
    p = argparse.ArgumentParser(
        prog="railcc-bench",
        description="Collective benchmark for torch.distributed backends (nccl-tests style).",
        epilog="Sizes take K/M/G suffixes (powers of 1024). Exit status: 0 ok, 1 a rank failed, "
        "2 bad arguments, 3 wrong results.",
    )
    p.add_argument("-b", "--minbytes", type=_size_arg, default=8, help="smallest size, at least 1 (default 8)")
    p.add_argument("-e", "--maxbytes", type=_size_arg, default=32 << 20,
                   help="largest size (default 32M); every rank's buffers at it must fit in "
                   f"{MEMORY_SHARE * 100:.0f}%% of this host's memory (or its cgroup's limit), besides "
                   f"{RANK_BASE_BYTES >> 20} MiB per rank for torch and the backends")
    p.add_argument("-f", "--stepfactor", type=float, default=None,
                   help="multiply the size by this, a finite number above 1 (default 2)")
    p.add_argument("-i", "--stepbytes", type=_size_arg, default=None,
                   help=f"add this to the size instead; a sweep has at most {MAX_SIZES} sizes")
    p.add_argument("-n", "--iters", type=int, default=20,
                   help=f"timed iterations per size, 1 to {MAX_ITERS:,} (default 20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5,
                   help=f"untimed iterations first, 0 to {MAX_ITERS:,} (default 5)")
    p.add_argument("-c", "--check", type=int, default=1, help="1: verify results and count #wrong (default 1)")
    p.add_argument("-d", "--datatype", default="float", help=f"one of {', '.join(DTYPES)} (default float)")
    p.add_argument(
        "-o",
        "--op",
        action="append",
        default=[],
        help="comma list of collectives (" + ", ".join(COLLS) + "; default all_reduce) and/or one reduction ("
        + ", ".join(REDOPS)
        + "; default sum); may be repeated",
    )
    p.add_argument("-r", "--root", type=int, default=0, help="root rank of broadcast and reduce (default 0)")
    p.add_argument(
        "--ntensors", type=int, default=256,
        help=f"tensors per allreduce_coalesced call, each of the swept size, 1 to {MAX_NTENSORS} (default 256)"
    )
    p.add_argument(
        "--backend",
        default="railcc",
        help="comma list of backends; the first is the default group and the reference of the ratio columns; "
        "also 'fake' (c10d's own dispatch cost: torch's fake process group, which sends nothing; its "
        "all_gather, reduce_scatter and alltoall copy the input locally) and 'openmpi' "
        "(the same sweep through mpi4py under mpirun, with --nprocs)",
    )
    p.add_argument("--nprocs", type=int, default=None,
                   help=f"start this many local ranks instead of using torchrun: 1 to {NPROCS_PER_CPU} per CPU, "
                   f"at most {MAX_NPROCS} (here {max_nprocs()}), and as many as this cgroup's task limit "
                   f"leaves room for at {TASKS_PER_RANK} tasks each; they die with this process")
    p.add_argument("--json", metavar="FILE", help="write every figure to FILE (checked writable before the run)")
    p.add_argument("--plot", metavar="FILE",
                   help="draw busbw against size into FILE (needs matplotlib; checked writable before the run)")
    p.add_argument("--device", type=str.lower, choices=("cpu", "cuda"), default="cpu",
                   help="where the buffers live (default cpu); with cuda rank r uses GPU LOCAL_RANK %% device count")
    p.add_argument("--alloc", choices=("torch", "backend"), default="torch",
                   help="where the buffers the collectives write come from: torch.empty (default), or the default "
                   "group's allocate_tensor where its backend offers it for the device (railcc with "
                   "RAILCC_CUDA_SHOTS=1 on CUDA: its heap, which the peers read in place; else torch.empty)")
    p.add_argument("--bound", action="store_true",
                   help="also measure single-core memcpy bandwidth (with --device cuda: the device copy rate) and compare")
    p.add_argument("--bind", action="store_true",
                   help="pin each rank to a CPU of its own (local rank r: the r-th CPU it may use, modulo their number); "
                   "openmpi runs under mpirun --bind-to core")
    p.add_argument("--bound_bytes", type=_size_arg, default=256 << 20,
                   help="buffer for --bound (default 256M); with --bound, two of it and the ranks must fit in "
                   "the host's memory (with --device cuda, two of it in the GPU's)")
    p.add_argument(
        "--stats",
        action="store_true",
        help="after each railcc row, what its transports did per call and rank (railcc.stats()): bytes the CPU "
        "copied into and out of FIFOs, sockets and rings, bytes read once by the kernel, bytes the NIC moved "
        "straight between buffers, memory registrations, and for CUDA tensors the host rounds inside an op "
        "and the one-kernel ops",
    )
    p.add_argument("--progress", action="store_true", help="show progress on stderr even when it is not a tty")
    p.add_argument("--timeout", type=float, default=300.0,
                   help=f"seconds before a stuck collective fails, {MIN_TIMEOUT:g} to {MAX_TIMEOUT:g} (default 300)")
    return p


@dataclass
class Config:
    colls: list
    redop: str
    dtype: str
    sizes: list
    backends: list
    iters: int
    warmup: int
    check: bool
    root: int
    ntensors: int
    json: str = None
    plot: str = None
    bound: bool = False
    bound_bytes: int = 256 << 20
    progress: bool = False
    timeout: float = 300.0
    argv: list = field(default_factory=list)
    minbytes: int = 0
    maxbytes: int = 0
    stepfactor: float = None
    stepbytes: int = None
    device: str = "cpu"
    mpi_times: dict = None  # the Open MPI reference's figures, "coll|bytes|inplace" -> us
    mpi_note: str = None
    stats: bool = False
    bind: bool = False


def validate(args, world_size, argv=()):
    """Namespace -> Config; raises ValueError('argument X: why') for anything that cannot run."""

    def bad(arg, msg):
        raise ValueError(f"argument {arg}: {msg}")

    try:
        colls, redop = split_ops(args.op)
    except ValueError as e:
        bad("-o/--op", e)
    try:
        dtype = canonical_dtype(args.datatype)
    except ValueError as e:
        bad("-d/--datatype", e)
    backends = [b.strip().lower() for b in args.backend.split(",") if b.strip()]
    if not backends:
        bad("--backend", "no backend given")
    for b in backends:
        if backends.count(b) > 1:
            bad("--backend", f"{b} is given twice")
    if backends[0] in REFERENCES:
        bad("--backend", f"{backends[0]} cannot be first: the first backend is the default group")
    if args.stepfactor is not None and args.stepbytes is not None:
        bad("-f/--stepfactor", "not allowed with -i/--stepbytes")
    if args.minbytes < 1:
        bad("-b/--minbytes", "must be at least 1")
    if args.minbytes > args.maxbytes:
        bad("-b/--minbytes", f"{args.minbytes} is larger than -e/--maxbytes {args.maxbytes}")
    if args.stepfactor is not None and not 1 < args.stepfactor < float("inf"):
        bad("-f/--stepfactor", f"{args.stepfactor} is not allowed: must be a finite number larger than 1")
    if args.stepbytes is not None and args.stepbytes < 1:
        bad("-i/--stepbytes", "must be at least 1")
    stepfactor = args.stepfactor if args.stepfactor is not None else (None if args.stepbytes else 2.0)
    # counted before the list is made: a sweep of a billion sizes would fill the memory first
    nsizes = sweep_length(args.minbytes, args.maxbytes, stepfactor or 2.0, args.stepbytes, MAX_SIZES)
    if nsizes > MAX_SIZES:
        step = f"-i {args.stepbytes}" if args.stepbytes is not None else f"-f {stepfactor:.12g}"
        bad("-i/--stepbytes" if args.stepbytes is not None else "-f/--stepfactor",
            f"-b {args.minbytes} -e {args.maxbytes} {step} gives more than {MAX_SIZES} sizes "
            f"(at most {MAX_SIZES}); take a larger step or a narrower range")
    sizes = size_sweep(args.minbytes, args.maxbytes, stepfactor or 2.0, args.stepbytes)
    if not 1 <= args.iters <= MAX_ITERS:
        bad("-n/--iters", f"{args.iters} is not allowed: must be 1 to {MAX_ITERS:,}")
    if not 0 <= args.warmup_iters <= MAX_ITERS:
        bad("-w/--warmup_iters", f"{args.warmup_iters} is not allowed: must be 0 to {MAX_ITERS:,}")
    if args.check not in (0, 1):
        bad("-c/--check", "must be 0 or 1")
    if not 1 <= args.ntensors <= MAX_NTENSORS:
        bad("--ntensors", f"{args.ntensors} is not allowed: must be 1 to {MAX_NTENSORS}")
    if args.nprocs is not None:
        most = max_nprocs()
        if not 1 <= args.nprocs <= most:
            bad("--nprocs", f"{args.nprocs} is not allowed: must be 1 to {most} "
                f"({NPROCS_PER_CPU} per CPU of the {os.cpu_count()} here, at most {MAX_NPROCS})")
        left, limit = tasks_left()
        if left is not None and args.nprocs * TASKS_PER_RANK > left:
            bad("--nprocs", f"{args.nprocs} ranks need about {args.nprocs * TASKS_PER_RANK} tasks "
                f"({TASKS_PER_RANK} each) and this cgroup has room for {max(left, 0)} more (pids.max {limit}); "
                f"at most {max(left, 0) // TASKS_PER_RANK} ranks")
    if not MIN_TIMEOUT <= args.timeout <= MAX_TIMEOUT:
        bad("--timeout", f"{args.timeout:g} is not allowed: must be {MIN_TIMEOUT:g} to {MAX_TIMEOUT:g} seconds")
    if args.bound_bytes < 1:
        bad("--bound_bytes", "must be at least 1")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            why = (f"this torch build ({torch.__version__}) has no CUDA support" if torch.version.cuda is None
                   else "no CUDA device is visible")
            bad("--device", f"cuda requested but torch.cuda.is_available() is False: {why}")
    if world_size < 1:
        bad("--nprocs", "world size must be at least 1")
    for c in colls:
        if world_size < COLLS[c].min_ranks:
            bad("-o/--op", f"{c} needs at least {COLLS[c].min_ranks} ranks, the world size is {world_size}")
    if any(COLLS[c].rooted for c in colls) and not 0 <= args.root < world_size:
        bad("-r/--root", f"{args.root} is not a rank of a world of {world_size}")
    if any(COLLS[c].reduces for c in colls):
        if redop == "avg" and not DTYPES[dtype][2]:
            bad("-o/--op", f"avg is defined for floating-point types only, not {dtype}")
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            bad("--plot", "needs matplotlib, which is not installed (pip install matplotlib)")
    _check_memory(bad, args, colls, dtype, sizes, world_size)
    return Config(
        colls=colls,
        redop=redop,
        dtype=dtype,
        sizes=sizes,
        backends=backends,
        iters=args.iters,
        warmup=args.warmup_iters,
        check=bool(args.check),
        root=args.root,
        ntensors=args.ntensors,
        json=args.json,
        plot=args.plot,
        bound=args.bound,
        bound_bytes=args.bound_bytes,
        progress=args.progress,
        timeout=args.timeout,
        argv=list(argv),
        minbytes=args.minbytes,
        maxbytes=args.maxbytes,
        stepfactor=stepfactor,
        stepbytes=args.stepbytes,
        device=args.device,
        stats=args.stats,
        bind=args.bind,
    )


def _check_memory(bad, args, colls, dtype, sizes, world_size):
    """The ranks on this host, their buffers at the largest size and --bound's must fit in its
    memory (and, with --device cuda, the device buffers in the GPU's) before any is made."""
    local = args.nprocs
    if local is None:
        # under a launcher the ranks on this host are torchrun's LOCAL_WORLD_SIZE; where it is not
        # set (another launcher) one per host is assumed rather than refusing a job across hosts
        env = os.environ.get("LOCAL_WORLD_SIZE", "")
        local = int(env) if env.isdigit() and int(env) > 0 else 1
    limit, what = memory_limit()
    budget = int(limit * MEMORY_SHARE)
    base = (local + 1) * RANK_BASE_BYTES  # and the process that started them
    where = f"{human(budget)} here ({MEMORY_SHARE:.0%} of {what}, {human(limit)})"
    if base > budget:
        bad("--nprocs" if args.nprocs else "--nprocs (LOCAL_WORLD_SIZE)", f"{local} ranks need about {human(base)} before any buffer ({human(RANK_BASE_BYTES)} each "
            f"for torch and the backends), more than the {where}")
    elsize = DTYPES[dtype][1]
    top = sizes[-1]
    coll = max(colls, key=lambda c: rank_bytes(c, top, elsize, args.ntensors))
    need = base + local * rank_bytes(coll, top, elsize, args.ntensors)
    if need > budget:
        # the largest size that fits: rank_bytes grows linearly with the size
        per_byte = rank_bytes(coll, 1 << 20, elsize, args.ntensors) / (1 << 20)
        fits = int((budget - base) / (local * per_byte))
        coalesced = f" ({args.ntensors} tensors of it, --ntensors)" if coll == "allreduce_coalesced" else ""
        bad("-e/--maxbytes", f"{human(top)}{coalesced} needs about {human(need)} for {local} ranks ({coll}: "
            f"{human(rank_bytes(coll, top, elsize, args.ntensors))} per rank for its buffers, the expected result "
            f"and the check, besides {human(RANK_BASE_BYTES)} for torch and the backends), more than the {where}; "
            f"at most about -e {human(fits)} for these ranks and collectives")
    if args.bound and args.device != "cuda" and base + 2 * args.bound_bytes > budget:
        bad("--bound_bytes", f"{human(args.bound_bytes)} needs {human(2 * args.bound_bytes)} (a source and a "
            f"destination) beside the ranks' {human(base)}, more than the {where}")
    if args.device == "cuda":
        import torch

        devices = max(1, torch.cuda.device_count())
        gpu = torch.cuda.get_device_properties(0).total_memory
        gpu_budget = int(gpu * MEMORY_SHARE)
        sharing = -(-local // devices)  # ranks on one GPU
        per = top * (args.ntensors if coll == "allreduce_coalesced" else 1)
        if sharing * 3 * per > gpu_budget:
            bad("-e/--maxbytes", f"{human(top)} needs about {human(sharing * 3 * per)} of GPU memory ({sharing} "
                f"ranks on a GPU, three buffers each), more than {human(gpu_budget)} ({MEMORY_SHARE:.0%} of "
                f"{human(gpu)})")
        if args.bound and 2 * args.bound_bytes > gpu_budget:
            bad("--bound_bytes", f"{human(args.bound_bytes)} needs {human(2 * args.bound_bytes)} of GPU memory, "
                f"more than {human(gpu_budget)} ({MEMORY_SHARE:.0%} of {human(gpu)})")


def check_backends(backends):
    """Raises ValueError naming --backend when a backend cannot be created here."""
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError("argument --backend: this torch build has no torch.distributed")
    if "railcc" in backends:
        try:
            import railcc  # noqa: F401  (registers the backend)
        except Exception as e:
            raise ValueError(f"argument --backend: cannot load railcc: {type(e).__name__}: {e}") from None
    if "fake" in backends:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers backend "fake")
    available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()}
    for b in backends:
        if b == bench_mpi.NAME:
            continue
        if b not in dist.Backend.backend_list or not available.get(b, True):
            known = ", ".join(x for x in dist.Backend.backend_list if available.get(x, True) and x != "undefined")
            hint = " (is the extension built?)" if b == "railcc" else ""
            raise ValueError(f"argument --backend: {b} is not available{hint}; available: {known}")


# ----------------------------------------------------------------------------------------------
# One rank.
