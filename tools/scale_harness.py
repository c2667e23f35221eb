#!/usr/bin/env python3
"""What one rank of a job pays for its process group as the job grows: init time, memory,
file descriptors, sockets, threads and two all-reduce latencies, per rank and as the median
and maximum over ranks, for railcc and gloo side by side, measured on one machine.

    python3 tools/scale_harness.py -n 16,32,64                    # one rank per fake host
    python3 tools/scale_harness.py -n 8 --per-host 2,4 --json out.json
    python3 tools/scale_harness.py -n 128 --jobs 2                # two jobs of 64 at once

Every rank is a process of its own, forked from this one after torch (and railcc) are
imported, so the ranks share torch's pages instead of importing it 64 times. A rank pretends
to be on a host of its own, or `--per-host K` ranks share a fake host: railcc reads the host
from RAILCC_HOST_ID (ranks of one host share memory, ranks of different hosts talk TCP over
loopback). gloo runs the same job over loopback TCP (it has no shared-memory transport).

What is measured, per rank:

  init      from a start common to all ranks to the end of the first all_reduce (4 bytes):
            init_process_group(store=...) plus that all_reduce. Each rank first connects its
            own TCPStore client to a store this process serves; once every client is
            connected, this process publishes the start time (CLOCK_MONOTONIC, the same in
            every process of the machine), so the store's connection time is not counted
            and a rank woken late is charged for it.
  init CPU  the CPU time (every thread of the process, user and system) spent over the same
            span: with more ranks than cores, the ranks' sum over the cores bounds the init time.
  memory    Private_Clean + Private_Dirty (/proc/self/smaps_rollup) and RSS added between
            just before init and after the first all_reduce (read once every rank is past
            it, so that no rank's reading costs another's init CPU). Forked ranks start sharing
            the parent's pages; a page they write becomes private, so this counts what init
            allocated and what it touched of the parent's (the parent's Python objects are
            frozen, gc.freeze, before the forks, so a garbage collection in a rank does not
            count the parent's pages it would scan). Shared memory (/dev/shm segments,
            mapped by every rank of a fake host by design) is reported per host apart.
            heap: bytes the C heap holds in use (glibc mallinfo2: arenas plus mmapped
            blocks) added over the same span, the backend's and torch's allocations apart
            from pages touched.
  fds       entries of /proc/self/fd after the first all_reduce, and how many init added.
  sockets   fds that are sockets. Of the process's TCP sockets (/proc/self/net/tcp{,6}), the
            established connections to anything but the store that init added: the measure
            of connections made ("TCP conns"); the connections to the store after init (the
            rank's own client, plus any the backend opened); the listening sockets.
  threads   entries of /proc/self/task after the first all_reduce.
  TCP conns after  the same count of connections made, after the 8 B and 1 MiB all_reduces
            (a pairwise all-reduce meets every peer; a ring two).
  8 B, 1 MiB  the median over --iters calls of one all_reduce (float32), each call after a
            barrier of the backend, timed on the calling rank.
  8 B bcast  the same for a broadcast of 8 bytes from rank 0 (its max over ranks: when the
            last rank had the payload).

The machine's topology: railcc's ranks on one machine share one hwloc discovery through a file
in TMPDIR that serves later jobs for RAILCC_TOPO_SHARE_SEC (60 s). Whether a job finds it fresh
depends on how long ago the last railcc job ran, so jobs of one run would pay the discovery or
not by chance (tens of milliseconds of one rank's CPU, and the others' wait for it). Before
every railcc job the harness sets it one way: `--topology cold` (the default) removes it, so one
rank of every job discovers, as on hosts where no job ran in the last minute; `--topology warm`
leaves it fresh (a discarded 2-rank job makes it where missing), as on hosts that just ran one.

Jobs never overlap: each backend, size and placement runs alone, one after another. A rank's
output goes to a log of its own; the report shows its error and the distinct lines the ranks
printed (torch's warnings, say). The ranks' own timeouts are 3/4 of --timeout, so a stalled job
is reported by its ranks first; a job that still runs at --timeout is killed, and once one rank
has failed the others get a few seconds to fail too before they are killed. No rank outlives
this process (each asks the kernel to kill it when its parent dies).

Growth: with more ranks than cores a job's init is bound by the ranks' summed CPU, so the
median init grows about as the job does, and how much more than that moves from run to run
(a rank's CPU at one size read 3.9 to 6.1 ms here in jobs minutes apart: more than a target
such as "64 -> 128 ranks at most 2.2x" leaves). `--repeat R` runs the whole sweep R
times, the sizes in reverse order every other time, and ends with a table of each backend's
growth from size to size: one ratio per repeat, their median, and the ratio of the sizes'
medians over the repeats.

The machine: each job also reads /proc/stat at the start clock and once every rank is
initialised, and says how the machine's CPUs spent that window (user, kernel, idle, and the time
the hypervisor gave to other guests, "stolen"). A job whose window was partly stolen ran on less
machine than its neighbours in the sweep; the growth table lists the larger steal of each
repeat's two jobs beside its ratio.
"""

import gc
import os

# One intra-op thread per rank: set before torch is imported, so no rank starts an OpenMP pool
# sized for the machine (the thread counts measured are the backends' own).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

FAIL_GRACE_S = 5.0  # after a rank fails, how long the others may take to report before they are killed
EXIT_GRACE_S = 20.0  # after every rank has reported, how long teardown may take
RANK_TIMEOUT_SHARE = 0.75  # the ranks' store, process-group and set-up timeouts, as a share of --timeout
PR_SET_PDEATHSIG = 1

# (key, column title, format) of the per-rank table, in order
COLUMNS = [
    ("init_ms", "init ms", "{:.1f}"),
    ("first_op_ms", "of it 1st op ms", "{:.1f}"),
    ("cpu_ms", "init CPU ms", "{:.1f}"),
    ("first_op_cpu_ms", "of it 1st op CPU ms", "{:.1f}"),
    ("sys_cpu_ms", "of it in the kernel ms", "{:.1f}"),
    ("page_faults", "page faults", "{:.0f}"),
    ("waits", "times it blocked", "{:.0f}"),
    ("private_mib", "private +MiB", "{:.1f}"),
    ("rss_mib", "RSS +MiB", "{:.1f}"),
    ("heap_kib", "heap +KiB", "{:.0f}"),
    ("fds", "fds", "{:d}"),
    ("fds_added", "+fds", "{:d}"),
    ("sockets", "sockets", "{:d}"),
    ("tcp_conns", "TCP conns", "{:d}"),
    ("store_conns", "store conns", "{:d}"),
    ("tcp_listen", "TCP listen", "{:d}"),
    ("threads", "threads", "{:d}"),
    ("ar8_us", "8 B us", "{:.1f}"),
    ("bc8_us", "8 B bcast us", "{:.1f}"),
    ("ar1m_ms", "1 MiB ms", "{:.2f}"),
    ("tcp_conns_ops", "TCP conns after", "{:d}"),
]
METRICS = [c[0] for c in COLUMNS]


def _int_list(text):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nranks", type=_int_list, default=[16],
                   help="ranks per job; a list runs each size in turn (16,32,64)")
    p.add_argument("--per-host", type=_int_list, default=[1],
                   help="ranks per fake host (RAILCC_HOST_ID); a list runs each in turn (default 1)")
    p.add_argument("--backends", default="railcc,gloo",
                   help="backends to measure, one after the other (default railcc,gloo; fake: torch's "
                        "fake process group, c10d's and the process's own share, its ops not timed)")
    p.add_argument("--iters", type=int, default=10, help="timed calls of each all_reduce size per rank (default 10)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one job (a backend at one size) may take before its ranks are killed; the ranks' "
                        "store, process-group and RAILCC_INIT_TIMEOUT timeouts are 3/4 of it (default 300)")
    p.add_argument("--topology", choices=("cold", "warm"), default="cold",
                   help="the host's shared topology before every railcc job: cold removes it (one rank "
                        "discovers), warm leaves it fresh (none does); default cold")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the whole sweep this many times, the sizes in reverse order every other time, "
                        "and report each backend's init growth from size to size per repeat and its median "
                        "(default 1)")
    p.add_argument("--jobs", type=int, default=1,
                   help="split each size's ranks into this many independent jobs of equal size, all started "
                        "together (each its own process group on its own store prefix): N processes on the "
                        "machine, each in a job of N/jobs ranks, to tell what N processes cost the machine "
                        "apart from what a job's size costs each of its ranks (default 1)")
    p.add_argument("--json", metavar="OUT", help="write every rank's raw numbers to this file")
    p.add_argument("--summary-only", action="store_true", help="leave the per-rank rows out of the tables (median and max only)")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in args.backends if b not in ("railcc", "gloo", "fake")]
    if bad or not args.backends:
        p.error(f"--backends takes railcc, gloo and/or fake, got {args.backends}")
    if args.iters < 1:
        p.error("--iters must be at least 1")
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    for n in args.nranks:
        for k in args.per_host:
            if n % args.jobs or (n // args.jobs) % k:
                p.error(f"--jobs {args.jobs}: {n} ranks do not split into {args.jobs} jobs of whole hosts of {k}")
    return args


# ----------------------------------------------------------------------------- inside a rank


def _memory_kib():
    """Private (clean + dirty) and resident memory of this process, in KiB."""
    got = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Rss", "Private_Clean", "Private_Dirty"):
                got[key] = int(value.split()[0])
    return {"private": got["Private_Clean"] + got["Private_Dirty"], "rss": got["Rss"], "heap": _heap_kib()}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _heap_kib():
    """Bytes of the C heap in use (glibc's mallinfo2: allocated in arenas plus mmapped), KiB."""
    try:
        f = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return 0.0
    f.restype = _MallInfo2
    m = f()
    return (m.uordblks + m.hblkhd) / 1024


def _fd_links():
    links = []
    for name in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:  # the descriptor listdir itself used, closed by now
            pass
    return links


def _tcp_sockets():
    """{socket inode: (TCP state, remote port)} for every TCP socket of this network namespace."""
    sockets = {}
    for path in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for row in f:
                    cols = row.split()
                    sockets[cols[9]] = (cols[3], int(cols[2].rsplit(":", 1)[1], 16))
        except OSError:
            pass
    return sockets


def _descriptors(store_port):
    """fds, sockets, and this process's TCP sockets: established ones to peers and to the store
    (port store_port), and listening ones."""
    links = _fd_links()
    inodes = [link[8:-1] for link in links if link.startswith("socket:[")]
    tcp = _tcp_sockets()
    mine = [tcp[i] for i in inodes if i in tcp]
    return {
        "fds": len(links),
        "sockets": len(inodes),
        "tcp_peers": sum(1 for state, port in mine if state == "01" and port != store_port),
        "tcp_store": sum(1 for state, port in mine if state == "01" and port == store_port),
        "tcp_listen": sum(1 for state, _ in mine if state == "0A"),
    }


def _shm_mappings():
    """[[device:inode, bytes mapped, bytes reserved]] for each /dev/shm file this process maps
    (railcc unlinks its segments once every peer has mapped them, so most show as deleted).
    Reserved: the file's allocated blocks, through /proc/self/map_files (None where that is
    not readable)."""
    sizes, used = {}, {}
    with open("/proc/self/maps") as f:
        for line in f:
            cols = line.split(None, 5)
            if len(cols) < 6 or not cols[5].startswith("/dev/shm/"):
                continue
            start, end = (int(x, 16) for x in cols[0].split("-"))
            key = f"{cols[3]}:{cols[4]}"
            sizes[key] = sizes.get(key, 0) + end - start
            try:
                used[key] = os.stat(f"/proc/self/map_files/{cols[0]}").st_blocks * 512
            except OSError:
                used.setdefault(key, None)
    return [[k, v, used.get(k)] for k, v in sorted(sizes.items())]


# The descriptors this process had before its first job; see _close_fds_opened_since_start.
_START_FDS = set()


def _open_fds():
    return {int(name) for name in os.listdir("/proc/self/fd")}


def _close_fds_opened_since_start(keep):
    """In a rank just forked: closes what this process opened since it started (the go pipe's
    write end, and descriptors an earlier job's store server left behind, such as libuv's signal
    pipe), so that every job's ranks start with the same descriptors and the fd counts compare."""
    if not _START_FDS:  # main() did not run (a caller of Job's own): close nothing
        return
    for fd in _open_fds() - _START_FDS - {keep}:
        try:
            os.close(fd)
        except OSError:  # the descriptor listdir used, closed by now
            pass


def _die_with_parent(parent):
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the request was made
        os._exit(3)


def _write_json(path, doc):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def _timed_broadcast(dist, t, iters, rank):
    """Median seconds of one broadcast of t from rank 0, each call after a barrier; every call
    checked (rank 0 holds 7s, the others zeros before it). A rank's time ends when its own part
    is done: the max over ranks is when the last rank had the payload (or the root its answer)."""
    samples = []
    for k in range(iters + 1):  # the first: warm-up (connections of the broadcast's peers)
        t.fill_(7 if rank == 0 else 0)
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(t, 0)
        if k:
            samples.append(time.perf_counter() - t0)
        if not bool((t == 7).all()):
            raise RuntimeError(f"the 8 B broadcast gave {t.unique().tolist()[:4]}, not 7")
    return statistics.median(samples)


def _timed_all_reduce(dist, t, iters, refill):
    """Median seconds of one all_reduce of t, each call after a barrier; t holds ones again
    after every call (outside the timing), so the result can be checked."""
    dist.all_reduce(t)  # warm-up: buffers and connections of this size
    refill(t)
    samples = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        samples.append(time.perf_counter() - t0)
        last = t.clone() if len(samples) == iters else None
        refill(t)
    return statistics.median(samples), last


def rank_main(job, rank, go_fd):
    """One rank: waits for the store, measures, writes its result file, exits."""
    import torch
    import torch.distributed as dist

    backend = job["backend"]
    # With --jobs, this rank's job is one of several of n ranks each, on a store prefix of its own.
    n = job["nranks"] // job["jobs"]
    which, rank_in_job = divmod(rank, n)
    host = f"h{rank // job['per_host']}"
    result = {"rank": rank, "host": host, "pid": os.getpid()}
    out_path = os.path.join(job["dir"], f"rank{rank}.json")
    # A rank's own timeouts expire before the harness's, so a stall is reported by the ranks
    # (railcc names the ranks it waited for) rather than only seen as a kill.
    timeout = datetime.timedelta(seconds=job["timeout"] * RANK_TIMEOUT_SHARE)
    os.environ.update({"RANK": str(rank_in_job), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank % job["per_host"]),
                       "LOCAL_WORLD_SIZE": str(job["per_host"]), "RAILCC_HOST_ID": host})
    if backend == "fake":  # torch's fake process group: what c10d and the process cost alone
        import torch.testing._internal.distributed.fake_pg  # noqa: F401
    if backend == "railcc":
        os.environ["RAILCC_SOCKET_IFNAME"] = "lo"
        os.environ.setdefault("RAILCC_INIT_TIMEOUT", str(max(1, int(timeout.total_seconds()))))
    else:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        # The go byte is written once the store serves; end of file means the harness gave up.
        if os.read(go_fd, 1) != b"g":
            os._exit(3)
        os.close(go_fd)
        with open(os.path.join(job["dir"], "port")) as f:
            port = int(f.read())
        store = dist.TCPStore("127.0.0.1", port, n, is_master=False, timeout=timeout, wait_for_workers=False)
        desc0, mem0 = _descriptors(port), _memory_kib()
        store.add("connected", 1)
        store.wait(["go"])
        t_go = float(store.get("go"))
        t_wake, cpu0, ru0 = time.monotonic(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        pg_store = store if job["jobs"] == 1 else dist.PrefixStore(f"job{which}/", store)
        dist.init_process_group(backend, store=pg_store, rank=rank_in_job, world_size=n, timeout=timeout)
        t_group, cpu_group = time.monotonic(), time.process_time()
        t = torch.ones(1, dtype=torch.float32)  # 4 bytes
        dist.all_reduce(t)
        t_done, cpu1, ru1 = time.monotonic(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        if t.item() != n and backend != "fake":
            raise RuntimeError(f"the first all_reduce gave {t.item()}, not {n}")
        # Reading /proc costs CPU that ranks still in init would miss (smaps_rollup of a process
        # that maps torch takes milliseconds): wait for all of them, then measure.
        store.add("inited", 1)
        store.wait(["measure"])
        mem1 = _memory_kib()
        desc1 = _descriptors(port)
        result.update({
            "init_ms": (t_done - t_go) * 1e3,
            "wake_ms": (t_wake - t_go) * 1e3,
            "first_op_ms": (t_done - t_group) * 1e3,
            "cpu_ms": (cpu1 - cpu0) * 1e3,
            "first_op_cpu_ms": (cpu1 - cpu_group) * 1e3,
            "sys_cpu_ms": (ru1.ru_stime - ru0.ru_stime) * 1e3,
            "page_faults": ru1.ru_minflt - ru0.ru_minflt,
            "waits": ru1.ru_nvcsw - ru0.ru_nvcsw,
            "private_mib": (mem1["private"] - mem0["private"]) / 1024,
            "rss_mib": (mem1["rss"] - mem0["rss"]) / 1024,
            "heap_kib": mem1["heap"] - mem0["heap"],
            "private_before_mib": mem0["private"] / 1024,
            "fds": desc1["fds"],
            "fds_added": desc1["fds"] - desc0["fds"],
            "sockets": desc1["sockets"],
            "tcp_conns": desc1["tcp_peers"] - desc0["tcp_peers"],
            "store_conns": desc1["tcp_store"],
            "tcp_listen": desc1["tcp_listen"],
            "threads": len(os.listdir("/proc/self/task")),
            "shm": _shm_mappings(),
        })
        if backend == "fake":  # c10d's own floor: its ops move nothing, so nothing to time
            result.update({"ar8_us": 0.0, "bc8_us": 0.0, "ar1m_ms": 0.0, "tcp_conns_ops": 0})
            _write_json(out_path, result)
            store.add("reported", 1)
            store.wait(["exit"])
            os._exit(0)
        small = torch.ones(2, dtype=torch.float32)  # 8 bytes
        big = torch.ones(1 << 18, dtype=torch.float32)  # 1 MiB
        s8, last8 = _timed_all_reduce(dist, small, job["iters"], lambda x: x.fill_(1))
        s1m, last1m = _timed_all_reduce(dist, big, job["iters"], lambda x: x.fill_(1))
        for name, last in (("8 B", last8), ("1 MiB", last1m)):
            if not bool((last == n).all()):
                raise RuntimeError(f"the {name} all_reduce gave {last.unique().tolist()[:4]}, not {n}")
        b8 = _timed_broadcast(dist, torch.zeros(2, dtype=torch.float32), job["iters"], rank_in_job)
        result.update({"ar8_us": s8 * 1e6, "bc8_us": b8 * 1e6, "ar1m_ms": s1m * 1e3,
                       "tcp_conns_ops": _descriptors(port)["tcp_peers"] - desc0["tcp_peers"]})
        _write_json(out_path, result)
        # Tear down together, once every rank has reported: no rank leaves while a peer still
        # reads its last bytes.
        store.add("reported", 1)
        store.wait(["exit"])
        dist.destroy_process_group()
    except BaseException as e:
        # The report prints the error (and the first failing rank's traceback) from the result,
        # so the rank's log keeps only what it printed itself.
        tb = traceback.format_exc()
        result.update({"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                       "traceback": tb})
        try:
            _write_json(out_path, result)
        except OSError:
            pass
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------------------ the harness


# The store counters every rank adds 1 to at the end of a phase, and the key this process sets
# once all have, which the ranks wait for: store client connected -> start the clock; first
# all_reduce done -> read /proc; results written -> tear down.
PHASES = [("connected", "go"), ("inited", "measure"), ("reported", "exit")]


def _topology_share_files():
    """railcc's shared topology on this machine (csrc/topology/shared.cpp names it by user and
    boot): the files a job's ranks read instead of discovering, not the lock."""
    tmp = os.environ.get("TMPDIR") or "/tmp"
    prefix = f"railcc-topo-{os.getuid()}-"
    try:
        names = os.listdir(tmp)
    except OSError:
        return []
    return [os.path.join(tmp, f) for f in names
            if f.startswith(prefix) and (f.endswith(".txt") or f.endswith(".xml"))]


def set_topology_share(mode, args):
    """Before a railcc job: cold removes the shared topology, warm makes it fresh (see --topology)."""
    if mode == "cold":
        for f in _topology_share_files():
            try:
                os.unlink(f)
            except FileNotFoundError:
                pass
        return
    if not _topology_share_files():
        Job("railcc", 2, 1, args).run()  # its first rank discovers and leaves the files
    now = time.time()
    for f in _topology_share_files():
        os.utime(f, (now, now))


class Job:
    """One backend at one size and placement: forks the ranks, serves their store, paces
    their phases and collects their results; never leaves a rank behind."""

    def __init__(self, backend, nranks, per_host, args):
        self.backend, self.nranks, self.per_host, self.args = backend, nranks, per_host, args
        self.dir = tempfile.mkdtemp(prefix="railcc-scale-")
        self.pids = {}  # pid -> rank, of ranks not yet reaped
        self.status = {}  # rank -> exit status (or negative signal)
        self.killed = []
        self.problems = []
        self.mem_available_gib = None  # the machine's MemAvailable once every rank had initialised
        self.machine = None  # what the machine's CPUs did from the start clock to every rank initialised
        self._stat_go = None

    def run(self):
        job = {"nranks": self.nranks, "per_host": self.per_host, "backend": self.backend,
               "dir": self.dir, "timeout": self.args.timeout, "iters": self.args.iters, "jobs": self.args.jobs}
        go_r, go_w = os.pipe()
        store = None
        t_start = time.monotonic()
        try:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
                parent = os.getpid()
                for rank in range(self.nranks):
                    pid = os.fork()
                    if pid == 0:  # the rank: its output goes to its own log, in place of fds 1 and 2
                        try:
                            _close_fds_opened_since_start(keep=go_r)
                            _die_with_parent(parent)
                            log = os.open(os.path.join(self.dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
                            os.dup2(log, 1)
                            os.dup2(log, 2)
                            os.close(log)
                            rank_main(job, rank, go_r)
                        finally:
                            os._exit(4)
                    self.pids[pid] = rank
                os.close(go_r)
                go_r = None
                import torch.distributed as dist

                timeout = datetime.timedelta(seconds=self.args.timeout)
                store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
                _write_json(os.path.join(self.dir, "port"), store.port)  # a bare number is valid JSON
                os.write(go_w, b"g" * self.nranks)
                os.close(go_w)
                go_w = None
                self._pace(store, t_start)
            finally:  # on every way out, an exception or ^C included: no rank is left running
                for fd in (go_r, go_w):
                    if fd is not None:
                        os.close(fd)
                self._kill_all()
                store = None
            return self._report(time.monotonic() - t_start)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _reap(self):
        for pid, rank in list(self.pids.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del self.pids[pid]
                self.status[rank] = os.waitstatus_to_exitcode(status)

    def _kill_all(self):
        self._reap()  # ranks that exited by themselves are not counted as killed
        for pid, rank in list(self.pids.items()):
            try:
                os.kill(pid, signal.SIGKILL)
                self.killed.append(rank)
            except ProcessLookupError:
                pass
        for pid, rank in list(self.pids.items()):
            _, status = os.waitpid(pid, 0)
            self.status[rank] = os.waitstatus_to_exitcode(status)
            del self.pids[pid]

    def _pace(self, store, t_start):
        """Releases the ranks phase by phase (start clock, measurement, teardown) and returns
        when all have exited, or once the job has failed or run out of time."""
        deadline = t_start + self.args.timeout
        phases = list(PHASES)
        failed_at = reported_at = None
        while True:
            self._reap()
            now = time.monotonic()
            while phases and store.add(phases[0][0], 0) >= self.nranks:
                if phases[0][1] == "measure":  # every rank is initialised: how much room is left
                    self.mem_available_gib = _mem_available_gib()
                    self.machine = _machine_share(self._stat_go, _cpu_ticks())
                if phases[0][1] == "go":
                    self._stat_go = _cpu_ticks()
                # the start clock's value is the time it was given
                store.set(phases[0][1], repr(time.monotonic()))
                phases.pop(0)
            if not phases and reported_at is None:
                reported_at = now
            if not self.pids:
                return
            if failed_at is None and any(code != 0 for code in self.status.values()):
                failed_at = now
            if failed_at is not None and now - failed_at > FAIL_GRACE_S:
                self.problems.append(f"a rank failed; the {len(self.pids)} ranks still running "
                                     f"{FAIL_GRACE_S:.0f} s later were killed")
                return
            if reported_at is not None and now - reported_at > EXIT_GRACE_S:
                self.problems.append(f"{len(self.pids)} ranks had not exited {EXIT_GRACE_S:.0f} s after every rank "
                                     f"reported (teardown) and were killed")
                return
            if now > deadline:
                counts = ", ".join(f"{key} {store.add(key, 0)}/{self.nranks}" for key, _ in PHASES)
                self.problems.append(f"the job ran past --timeout {self.args.timeout:.0f} s (ranks {counts}); "
                                     f"the {len(self.pids)} ranks still running were killed")
                return
            time.sleep(0.02)

    def _report(self, wall_s):
        ranks, errors = [], {}
        for r in range(self.nranks):
            path = os.path.join(self.dir, f"rank{r}.json")
            try:
                with open(path) as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                code = self.status.get(r)
                if r in self.killed:
                    why = "killed by the harness"
                elif code is not None and code < 0:
                    why = f"killed by signal {-code}, without a result"
                else:
                    why = f"exited with status {code} without a result"
                errors[r] = f"no result ({why})"
                continue
            if "error" in doc:
                errors[r] = doc["error"]
            ranks.append(doc)
        lines = {}  # distinct lines the ranks printed, with how many ranks printed each
        for r in range(self.nranks):
            try:
                with open(os.path.join(self.dir, f"rank{r}.log"), errors="replace") as f:
                    for line in dict.fromkeys(f.read().splitlines()):  # each once, in order
                        if line.strip():
                            lines[line] = lines.get(line, 0) + 1
            except OSError:
                pass
        ok = not errors and len(ranks) == self.nranks
        return {
            "backend": self.backend, "nranks": self.nranks, "per_host": self.per_host, "jobs": self.args.jobs, "ok": ok,
            "wall_s": wall_s, "mem_available_gib": self.mem_available_gib, "machine": self.machine, "errors": {str(r): e for r, e in sorted(errors.items())},
            "killed": sorted(self.killed), "problems": self.problems,
            "rank_output": [{"line": k, "ranks": v} for k, v in sorted(lines.items(), key=lambda kv: -kv[1])],
            "ranks": sorted(ranks, key=lambda d: d["rank"]),
            "shm_per_host": _shm_per_host(ranks),
        }


def _shm_per_host(ranks):
    """{host: {"segments", "mib"}}: the /dev/shm files mapped by the host's ranks, each once."""
    per_host, reserved = {}, {}
    for doc in ranks:
        seen = per_host.setdefault(doc["host"], {})
        held = reserved.setdefault(doc["host"], {})
        for key, size, *rest in doc.get("shm", []):
            seen[key] = max(seen.get(key, 0), size)
            if rest and rest[0] is not None:
                held[key] = max(held.get(key, 0), rest[0])
    order = sorted(per_host, key=lambda h: int(h[1:]))  # h0, h1, ..., h10 in number order
    return {h: {"segments": len(per_host[h]), "mib": sum(per_host[h].values()) / 2**20,
                "reserved_mib": sum(reserved[h].values()) / 2**20 if reserved[h] else None} for h in order}


def _cpu_ticks():
    """(monotonic seconds, the machine's CPU time so far by kind, in clock ticks) from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return time.monotonic(), {"user": v[0] + v[1], "sys": v[2] + v[5] + v[6], "idle": v[3] + v[4], "steal": v[7]}


def _machine_share(before, after):
    """What the machine's CPUs did between two _cpu_ticks readings, as shares of their time (a
    rank's CPU for the same work moves with what else the machine does: time the hypervisor gave
    another guest is neither the job's nor idle)."""
    if before is None or after is None:
        return None
    d = {k: after[1][k] - before[1][k] for k in after[1]}
    total = sum(d.values())
    share = {f"{k}_pct": (100.0 * v / total if total else 0.0) for k, v in d.items()}
    return {"window_ms": (after[0] - before[0]) * 1e3, "ticks": total, **share}


def _machine_text(m):
    if not m:
        return "the machine's CPU time not read"
    return (f"the machine's CPUs from the start clock to every rank initialised ({m['window_ms']:.0f} ms, "
            f"{m['ticks']} ticks): user {m['user_pct']:.0f}%, kernel {m['sys_pct']:.0f}%, idle {m['idle_pct']:.0f}%, "
            f"stolen by the hypervisor {m['steal_pct']:.0f}%")


def _mem_available_gib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return None


# -------------------------------------------------------------------------------- reporting


def _fmt(fmt, v):
    if v is None:
        return "-"
    if fmt == "{:d}" and isinstance(v, float):
        return f"{v:g}" if v != int(v) else str(int(v))
    return fmt.format(v)


def _measured(run):
    """The results of the ranks that measured everything (a failed rank's partial numbers are
    left out of the tables, kept in the JSON)."""
    return [d for d in run["ranks"] if "error" not in d]


def _stats(run):
    """{metric: (median, max)} over the ranks that measured everything."""
    out = {}
    for key in METRICS:
        values = [d[key] for d in _measured(run)]
        out[key] = (statistics.median(values), max(values)) if values else (None, None)
    return out


def rank_table(run, per_rank=True):
    head = ["rank", "host"] + [c[1] for c in COLUMNS]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if per_rank:
        for d in _measured(run):
            cells = [str(d["rank"]), d["host"]] + [_fmt(f, d.get(k)) for k, _, f in COLUMNS]
            rows.append("| " + " | ".join(cells) + " |")
    stats = _stats(run)
    for i, label in ((0, "median"), (1, "max")):
        rows.append("| " + " | ".join([f"**{label}**", ""] + [_fmt(f, stats[k][i]) for k, _, f in COLUMNS]) + " |")
    return "\n".join(rows)


def shm_line(run):
    hosts = run["shm_per_host"]
    mibs = [h["mib"] for h in hosts.values()]
    if not mibs or max(mibs) == 0:
        return f"/dev/shm mapped per host: none ({len(hosts)} hosts)"
    segs = [h["segments"] for h in hosts.values()]
    held = [h["reserved_mib"] for h in hosts.values() if h.get("reserved_mib") is not None]
    reserved = (f"; reserved after the first all_reduce: median {statistics.median(held):.1f} MiB, total "
                f"{sum(held):.1f} MiB" if held else "")
    return (f"/dev/shm mapped per host (each segment once): median {statistics.median(mibs):.1f} MiB "
            f"({statistics.median(segs):g} segments), max {max(mibs):.1f} MiB, total {sum(mibs):.1f} MiB over "
            f"{len(hosts)} hosts{reserved}")


def failure_lines(run):
    out = [f"- rank {r}: {e}" for r, e in run["errors"].items()]
    out += [f"- {p}" for p in run["problems"]]
    first = next((d for d in run["ranks"] if "traceback" in d), None)
    if first is not None:
        out.append(f"\nTraceback of rank {first['rank']}:\n")
        out += ["    " + line for line in first["traceback"].rstrip().splitlines()]
    return out


def summary_table(runs):
    """Metric by metric: each backend's median and max, and railcc/gloo of both."""
    backends = [r["backend"] for r in runs]
    stats = {r["backend"]: _stats(r) for r in runs}
    head = ["metric"] + [f"{b} {s}" for b in backends for s in ("median", "max")]
    ratio = "railcc" in stats and "gloo" in stats
    if ratio:
        head += ["railcc/gloo median", "railcc/gloo max"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, title, fmt in COLUMNS:
        cells = [title]
        for b in backends:
            cells += [_fmt(fmt, stats[b][key][0]), _fmt(fmt, stats[b][key][1])]
        if ratio:
            for i in (0, 1):
                a, g = stats["railcc"][key][i], stats["gloo"][key][i]
                cells.append(f"{a / g:.2f}" if a is not None and g else "-")
        rows.append("| " + " | ".join(cells) + " |")
    shm = ["/dev/shm MiB mapped per host"]
    for r in runs:
        mibs = [h["mib"] for h in r["shm_per_host"].values()] or [0.0]
        shm += [f"{statistics.median(mibs):.1f}", f"{max(mibs):.1f}"]
    if ratio:
        shm += ["-", "-"]
    rows.append("| " + " | ".join(shm) + " |")
    held = ["/dev/shm MiB reserved per host"]
    for r in runs:
        mibs = [h["reserved_mib"] for h in r["shm_per_host"].values() if h.get("reserved_mib") is not None] or [0.0]
        held += [f"{statistics.median(mibs):.1f}", f"{max(mibs):.1f}"]
    if ratio:
        held += ["-", "-"]
    rows.append("| " + " | ".join(held) + " |")
    return "\n".join(rows)


def growth_rows(runs):
    """Each backend's median init at one size over the next smaller size of the sweep, per
    placement: one ratio per repeat (jobs of one repeat ran minutes apart at most) and their
    median, and the ratio of the sizes' medians over the repeats."""
    jobs = {}  # (backend, per host) -> size -> repeat -> the job's run
    for r in runs:
        if r["ok"]:  # every rank measured
            jobs.setdefault((r["backend"], r["per_host"]), {}).setdefault(r["nranks"], {})[r.get("repeat", 0)] = r

    def init(r):
        return statistics.median(d["init_ms"] for d in r["ranks"])

    def stolen(r):
        return r["machine"]["steal_pct"] if r.get("machine") else None

    rows = []
    for (backend, k), by_n in jobs.items():
        sizes = sorted(by_n)
        for small, big in zip(sizes, sizes[1:]):
            reps = sorted(set(by_n[small]) & set(by_n[big]))
            if not reps:
                continue
            pairs = [(by_n[small][i], by_n[big][i]) for i in reps]
            ratios = [init(b) / init(a) for a, b in pairs]
            # the larger share of the two jobs' CPU time the hypervisor took, per repeat
            steal = [max((x for x in map(stolen, pair) if x is not None), default=None) for pair in pairs]
            rows.append({
                "backend": backend, "per_host": k, "from": small, "to": big, "ratios": ratios, "stolen_pct": steal,
                "median": statistics.median(ratios),
                "of_medians": statistics.median(init(b) for _, b in pairs) / statistics.median(init(a) for a, _ in pairs),
            })
    return rows


def growth_table(rows, repeats):
    head = ["backend", "per host", "sizes", "size ratio", "init growth, each repeat", "median of them", "of the sizes' medians",
            "stolen by the hypervisor, % (the larger of the two jobs), each repeat"]
    out = [f"## growth of the median init from size to size ({repeats} repeat{'s' if repeats != 1 else ''})\n",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in rows:
        out.append(f"| {g['backend']} | {g['per_host']} | {g['from']} -> {g['to']} | {g['to'] / g['from']:.2f} | "
                   + ", ".join(f"{x:.2f}" for x in g["ratios"]) + f" | {g['median']:.2f} | {g['of_medians']:.2f} | "
                   + ", ".join("-" if x is None else f"{x:.0f}" for x in g["stolen_pct"]) + " |")
    return "\n".join(out)


NOTES = """\
Notes: init = init_process_group(store=...) + a first 4-byte all_reduce, from a start common to
all ranks, after every rank's store client had connected. private/RSS = memory added across it
(forked ranks: includes parent pages that init wrote to). TCP conns = established TCP
connections, other than to the store, that the process gained across init: the measure of
connections made; store conns = its connections to the store after init (its own client
included); TCP listen = listening sockets after; TCP conns after = connections made by the end of
the timed all_reduces. 8 B / 1 MiB = median over the calls of one
all_reduce, each after a barrier. Ratios are railcc/gloo (below 1: railcc smaller or faster)."""


def print_group(runs, per_rank):
    n, k = runs[0]["nranks"], runs[0]["per_host"]
    hosts = -(-n // k)
    jobs = runs[0].get("jobs", 1)
    apart = f", as {jobs} jobs of {n // jobs} ranks started together" if jobs > 1 else ""
    print(f"\n## {n} ranks, {k} per fake host ({hosts} hosts){apart}\n", flush=True)
    for run in runs:
        state = "ok" if run["ok"] else "FAILED"
        measured = len(_measured(run))
        room = run["mem_available_gib"]
        room = f", {room:.1f} GiB of memory available with every rank initialised" if room is not None else ""
        print(f"### {run['backend']}: {state}, {measured}/{n} ranks measured, {run['wall_s']:.1f} s wall{room}\n")
        print(_machine_text(run.get("machine")) + "\n")
        fails = failure_lines(run)
        if fails:
            print("\n".join(fails) + "\n")
        if measured:
            print(rank_table(run, per_rank) + "\n")
            print(shm_line(run) + "\n")
        if run["rank_output"]:
            total = len(run["rank_output"])
            print(f"Ranks printed {total} distinct line{'s' if total != 1 else ''}; the most frequent:")
            for item in run["rank_output"][:8]:
                print(f"    [{item['ranks']} ranks] {item['line'][:300]}")
            print()
    if any(_measured(r) for r in runs):
        print(f"### summary, {n} ranks, {k} per host\n")
        print(summary_table([r for r in runs if _measured(r)]) + "\n")
    sys.stdout.flush()


def main(argv=None):
    args = parse_args(argv)
    import torch  # noqa: F401  (imported once here; the ranks fork from this process)
    import torch.distributed  # noqa: F401

    where = ""
    if "railcc" in args.backends:
        import railcc  # registers the backend

        where = f", railcc from {os.path.dirname(railcc.__file__)}"

    _START_FDS.update(_open_fds())
    # The objects made so far (torch's) move out of the collector's reach, as a fork server
    # does: a collection in a rank would otherwise write to the parent's pages it scans and
    # make them private, adding 0.1-0.5 MiB to one run's "private" and not another's.
    gc.collect()
    gc.freeze()
    # A SIGTERM unwinds like an error: Job.run's finally kills its ranks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"# railcc scale harness: {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{args.iters} timed calls per size, timeout {args.timeout:.0f} s per job{where}"
          + (f", topology share {args.topology} before each railcc job" if "railcc" in args.backends else ""))
    print(NOTES)
    all_runs = []
    for rep in range(args.repeat):
        # Every other repeat runs the sizes the other way round, so that a machine that slows or
        # speeds up over the sweep does not always favour the same size.
        sizes = args.nranks if rep % 2 == 0 else args.nranks[::-1]
        if args.repeat > 1:
            print(f"\n# repeat {rep + 1} of {args.repeat}: sizes {','.join(map(str, sizes))}", flush=True)
        for n in sizes:
            for k in args.per_host:
                runs = []
                for b in args.backends:
                    if b == "railcc":
                        set_topology_share(args.topology, args)
                    runs.append(dict(Job(b, n, k, args).run(), repeat=rep))
                all_runs += runs
                print_group(runs, not args.summary_only)
    growth = growth_rows(all_runs)
    if growth:
        print(growth_table(growth, args.repeat) + "\n", flush=True)
    if args.json:
        _write_json(args.json, {
            "argv": sys.argv if argv is None else argv, "cpus": os.cpu_count(), "torch": torch.__version__,
            "iters": args.iters, "timeout_s": args.timeout, "topology": args.topology, "jobs": args.jobs, "metrics": METRICS,
            "repeat": args.repeat, "growth": growth, "runs": all_runs,
        })
    failed = [f"{r['backend']} n={r['nranks']} per-host={r['per_host']}" for r in all_runs if not r["ok"]]
    if failed:
        sys.stdout.flush()
        print("FAILED: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
