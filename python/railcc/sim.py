"""python -m railcc sim: what railcc's schedules would do in a job of any size, without running it.

    python -m railcc sim -n 1024,4096 --per-host 8              # tables, per job size
    python -m railcc sim -n 64 --per-host 8 --ops all_reduce --sizes 8,1M,256M --json

For each op and size the engine's own rule picks the algorithm and the engine's step functions
give every rank's messages (railcc._C.rules.simulate, csrc/engine/simulate.h); the ranks' steps
are played against each other for the critical path. Reported per rank (the largest over ranks):
network and same-host peers, messages and bytes sent. Sizes are the op's whole buffer as
nccl-tests counts them (an all_gather's output, a reduce_scatter's input). Set-up is a model:
store keys and bytes read per rank from the set-up code's reads (the host map gathered up a
tree of ranks, this host's records and endpoints; sizes measured on a 2-rank TCP job here),
shared memory per host and, for RDMA verbs,
memory pinned per rank (the transports' own figures, as `railcc doctor` uses them). Time per
byte, a message split across channels and one host's shared-memory rings are not modelled.
"""

import argparse
import json
import math
import sys

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
# Bytes of one rank's set-up record (peer/<r>) and TCP endpoint (ep/<r>) in the store, measured
# on a 2-rank job over TCP here (short host names; a long one adds its length to the record).
RECORD_BYTES = 29
ENDPOINT_BYTES = 101
# A host in the host map: the default host id (boot id and network namespace) is 47
# characters; a hostname of 16 is assumed.
HOST_ID_BYTES = 47
HOSTNAME_BYTES = 16

# Bounds on the arguments, checked before anything is simulated (parse_args). The engine's own
# ranges where the argument is one of its parameters (csrc/common/config.h).
MAX_RANKS = 1 << 20
MAX_JOBS = 16  # job sizes in one -n
MAX_SIZES = 64  # sizes in one --sizes
MAX_SIZE = 1 << 40  # bytes of one op
ELEM_SIZES = (1, 2, 4, 8)
BUFFSIZE_RANGE = (4096, 64 << 30)  # RAILCC_BUFFSIZE
ONESHOT_RANGE = (0, 64 << 20)  # RAILCC_ONESHOT_BYTES
CHANNELS_RANGE = (1, 64)  # RAILCC_NCHANNELS, but at least one
# What the simulation holds while it plays one op (simulate.cpp and simulate_job below), an upper
# estimate measured here: per rank its cursor, its sets of peers and its rows (about 2 KiB), per
# peer a rank hears from a queue of messages and an entry of its rows (about 750 B), and per
# message sent or received 4 to 8 bytes.
SIM_BYTES_PER_RANK = 2048
SIM_BYTES_PER_PEER = 1024
SIM_BYTES_PER_MESSAGE = 8
SIM_MAX_BYTES = 2 << 30  # and at most half the host's memory (or its cgroup's limit)


def _size(text):
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    return int(t[:-1] if mult > 1 else t) * mult


def sim_budget():
    """(bytes the simulation may plan to hold, why that much)."""
    try:
        from .bench.limits import human, memory_limit

        limit, what = memory_limit()
    except Exception:  # noqa: BLE001 - no figure: the fixed cap alone
        return SIM_MAX_BYTES, "railcc sim's cap"
    if limit // 2 < SIM_MAX_BYTES:
        return limit // 2, f"half of {what}, {human(limit)}"
    return SIM_MAX_BYTES, "railcc sim's cap"


def sim_cost(n, per_host, op, algo=""):
    """(peers, messages): an upper estimate, per rank, of the peers it hears from and the messages
    it sends in one op (the most over sizes), for the schedules the engine's rule picks (or, with
    algo, any it may be told to run). Checked against the engine in tests/python/test_cli_args.py."""
    lg = max(1, math.ceil(math.log2(n)))
    if op == "broadcast":  # a tree or a chain: a parent, a few children
        return lg + 4, lg + 4
    # One host: one shot or direct meets every peer; hier: a host's ranks, two along the rail;
    # ring and tree: two or three. Pairwise and rings (below 16 ranks only, unless algo says).
    peers = n - 1 if algo else min(n - 1, max(per_host - 1, 15) + 2 * lg + 8)
    if op != "all_reduce" or algo:
        return peers, 2 * n if op == "all_reduce" else n  # a message per rank (ring, pairwise, hier's blocks)
    # the rule's all-reduce: a ring over all (hosts of one rank), hier (a ring or pairwise along the
    # rail, twice, and the host's steps), one shot on one host, or a tree
    return peers, 2 * (n // per_host + per_host) + 2 * lg + 8


def sim_bytes(n, per_host, ops, algo=""):
    """(bytes, op): what simulating the costliest of ops at n ranks may hold, an upper estimate."""
    best = (0, None)
    for op in ops:
        peers, messages = sim_cost(n, per_host, op, algo)
        b = n * (SIM_BYTES_PER_RANK + peers * SIM_BYTES_PER_PEER + 2 * messages * SIM_BYTES_PER_MESSAGE)
        best = max(best, (b, op))
    return best


def _human_bytes(b):
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b} B"


def _human(b):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            v = b / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{b} B"


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m railcc sim", description=__doc__.split("\n\n")[0],
        epilog="Every argument is checked before anything is simulated (exit status 2 names the one refused). "
        "A job is simulated only where the simulation's memory, estimated from its ranks, ranks per host and "
        f"ops, stays within {_human_bytes(SIM_MAX_BYTES)} (and half of this host's memory): reduce_scatter, "
        "all_gather and all_reduce play about one message per rank and rank, so about "
        f"{_most_ranks(8, OPS, '', SIM_MAX_BYTES):,} ranks at 8 per host (all four ops), broadcast alone about "
        f"{_most_ranks(8, ['broadcast'], '', SIM_MAX_BYTES):,}; with --algo, every rank may meet every other, "
        f"about {_most_ranks(8, OPS, 'any', SIM_MAX_BYTES):,}.")
    p.add_argument("-n", "--ranks", default="1024,4096",
                   help=f"job sizes, comma-separated, at most {MAX_JOBS}, each 2 to {MAX_RANKS:,} ranks and "
                   "within the memory above (default 1024,4096)")
    p.add_argument("--per-host", type=int, default=8,
                   help="ranks per host, 1 to the job size, dividing it (default 8)")
    p.add_argument("--ops", default=",".join(OPS), help=f"ops, comma-separated: {', '.join(OPS)} (default all four)")
    p.add_argument("--sizes", default="8,1M,256M",
                   help=f"op sizes in bytes, K/M/G/T suffixes, at most {MAX_SIZES}, each 0 to "
                   f"{_human_bytes(MAX_SIZE)} (default 8,1M,256M)")
    p.add_argument("--elem-size", type=int, default=4, choices=ELEM_SIZES,
                   help="bytes per element: 1, 2, 4 or 8 (default 4: float32)")
    p.add_argument("--channels", type=int, default=2,
                   help=f"channels per connected pair, {CHANNELS_RANGE[0]} to {CHANNELS_RANGE[1]} (default 2)")
    p.add_argument("--algo", default="", help="RAILCC_ALGO to simulate (default: the rule)")
    p.add_argument("--oneshot-bytes", type=int, default=65536,
                   help=f"RAILCC_ONESHOT_BYTES, {ONESHOT_RANGE[0]} to {ONESHOT_RANGE[1]:,} (default 65536)")
    p.add_argument("--buffsize", type=int, default=4 << 20,
                   help=f"RAILCC_BUFFSIZE, {BUFFSIZE_RANGE[0]:,} to {BUFFSIZE_RANGE[1]:,} (64 GiB) (default 4 MiB)")
    p.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    a = p.parse_args(argv)

    def within(arg, value, lo, hi, what=""):
        if not lo <= value <= hi:
            p.error(f"argument {arg}: {value:,} is not allowed: must be {lo:,} to {hi:,}{what}")

    ranks = [x.strip() for x in a.ranks.split(",") if x.strip()]
    if not ranks or len(ranks) > MAX_JOBS:
        p.error(f"argument -n/--ranks: give 1 to {MAX_JOBS} job sizes (got {len(ranks)})")
    try:
        a.ranks = [int(x) for x in ranks]
    except ValueError:
        p.error(f"argument -n/--ranks: {a.ranks!r} is not a comma list of whole numbers")
    sizes = [x.strip() for x in a.sizes.split(",") if x.strip()]
    if not sizes or len(sizes) > MAX_SIZES:
        p.error(f"argument --sizes: give 1 to {MAX_SIZES} sizes (got {len(sizes)})")
    a.sizes = []
    for x in sizes:
        try:
            a.sizes.append(_size(x))
        except ValueError:
            p.error(f"argument --sizes: {x!r} is not a size (a whole number of bytes, K/M/G/T suffixes)")
    for b in a.sizes:
        within("--sizes", b, 0, MAX_SIZE, " bytes")
    a.ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    bad = [o for o in a.ops if o not in OPS]
    if bad or not a.ops:
        p.error(f"argument --ops: unknown op(s) {', '.join(bad) or '(none given)'}; railcc sim knows {', '.join(OPS)}")
    within("--buffsize", a.buffsize, *BUFFSIZE_RANGE, " bytes (RAILCC_BUFFSIZE's range)")
    within("--oneshot-bytes", a.oneshot_bytes, *ONESHOT_RANGE, " bytes (RAILCC_ONESHOT_BYTES's range)")
    within("--channels", a.channels, *CHANNELS_RANGE)
    within("--per-host", a.per_host, 1, MAX_RANKS)
    for n in a.ranks:
        within("-n/--ranks", n, 2, MAX_RANKS)
        if a.per_host > n or n % a.per_host:
            p.error(f"argument -n/--ranks: {n} ranks at {a.per_host} per host (--per-host): the ranks must fill "
                    "whole hosts (2 ranks at least)")
    if a.algo.strip():
        try:  # the engine's own parser says what it knows
            from . import _C

            _C.rules.simulate(2, 1, "broadcast", 8, 1, algo=a.algo)
        except Exception as e:  # noqa: BLE001 - any refusal is the argument's
            p.error(f"argument --algo: {e}")
    budget, why = sim_budget()
    for n in a.ranks:
        need, op = sim_bytes(n, a.per_host, a.ops, a.algo.strip())
        if need > budget:
            most = _most_ranks(a.per_host, a.ops, a.algo.strip(), budget)
            fits = (f"at most {most:,} ranks at {a.per_host} per host with these --ops" if most >= 2
                    else "not even one host at this --per-host with these --ops: fewer ranks per host")
            p.error(f"argument -n/--ranks: simulating {op} at {n:,} ranks, {a.per_host} per host"
                    f"{', RAILCC_ALGO ' + a.algo if a.algo.strip() else ''}, would hold about {_human_bytes(need)} "
                    f"(every rank's messages are played), more than the {_human_bytes(budget)} railcc sim allows "
                    f"({why}); {fits}")
    return a


def _most_ranks(per_host, ops, algo, budget):
    """The largest job, in whole hosts, whose simulation stays within budget (0: none)."""
    lo, hi = 0, MAX_RANKS // per_host  # in hosts
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid * per_host >= 2 and sim_bytes(mid * per_host, per_host, ops, algo)[0] <= budget:
            lo = mid
        elif mid * per_host < 2:
            lo = mid
        else:
            hi = mid - 1
    return lo * per_host


def simulate_job(n, a):
    from . import _C

    rules = _C.rules
    rows = []
    L = a.per_host
    # Per rank, the network peers of every op simulated (a pair counts on both ends), and of the
    # barrier, which the simulation does not play: below 16 ranks a dissemination (rank +- 2^k,
    # csrc/engine/algorithms/direct.cpp), from 16 across hosts a one-byte all-reduce (its peers
    # are the 8-byte all-reduce's). What RAILCC_RUNTIME_CONNECT=0 connects at init.
    at_init = [set() for _ in range(n)]
    barrier = [set() for _ in range(n)]
    k = 1
    while k < n and n < 16:
        for r in range(n):
            for p in ((r + k) % n, (r - k) % n):
                if p // L != r // L:
                    barrier[r].add(p)
        k *= 2
    for op in a.ops:
        for size in a.sizes:
            block = size // n if op in ("reduce_scatter", "all_gather") else size
            block -= block % a.elem_size
            if block == 0:
                block = a.elem_size  # one element per rank: the smallest op of its kind
            whole = block * (n if op in ("reduce_scatter", "all_gather") else 1)
            try:
                r = rules.simulate(n, a.per_host, op, block, a.elem_size, oneshot_bytes=a.oneshot_bytes, algo=a.algo,
                                   per_rank=True)
            except Exception as e:  # noqa: BLE001 - the engine says what it cannot model; the row says it
                rows.append({"op": op, "bytes": whole, "error": str(e)})
                continue
            # The least any algorithm sends per rank: (n-1)/n of the buffer for a reduce-scatter
            # or all-gather, twice that for an all-reduce; a broadcast's root sends it once.
            bound = {"all_reduce": 2 * (n - 1) / n * whole, "broadcast": whole}.get(op, (n - 1) / n * whole)
            for src, sent in enumerate(r.pop("sent")):
                for dst, _ in sent:
                    if dst // L != src // L:
                        at_init[src].add(dst)
                        at_init[dst].add(src)
            rows.append({"op": op, "bytes": whole, **r, "sent_vs_least": r["bytes_sent"] / bound if bound else 0})
    # Collectives use one lane of a pair (send/recv the other): its channels' rings, per peer.
    coll_peers = max(len(p) for p in at_init)
    with_barrier = max(len(p | b) for p, b in zip(at_init, barrier))
    setup = {**_setup_reads(n, L),
        "shm_bytes_per_host": L * rules.shm_segment_bytes(L * 2, a.buffsize, a.buffsize) if L > 1 else 0,
        "coll_net_peers": coll_peers,
        "coll_net_peers_with_barrier": with_barrier,
        "verbs_pinned_if_lazy": coll_peers * a.channels * rules.verbs_connection_bytes(a.buffsize, True),
    }
    return {"ranks": n, "per_host": L, "channels": a.channels, "ops": rows, "setup": setup}


def _setup_reads(n, L):
    """Store reads per rank at set-up, the most over ranks, from set-up's own code
    (railcc._C.rules.simulate_setup: the host map combined in groups of 16 and encoded as set-up
    does; this host's records and endpoints; the secret and rank 0's algorithm settings). Endpoints of other hosts'
    ranks are read at the pair's first use; rank 0's rail check (one endpoint per other host,
    only where rails were found) is apart."""
    from . import _C

    reads = _C.rules.simulate_setup(n, L, HOST_ID_BYTES, HOSTNAME_BYTES, RECORD_BYTES, ENDPOINT_BYTES)
    written = reads.pop("store_writes")
    return {**reads, "store_keys_written": written,
            "rank0_rail_check_bytes": (n // L - 1) * ENDPOINT_BYTES}


def format_job(job):
    n, L = job["ranks"], job["per_host"]
    out = [f"## {n} ranks, {L} per host ({n // L} hosts)", "",
           "| op | size | algorithm | critical path (steps) | network peers | same-host peers | messages sent | "
           "bytes sent | of the least |", "|---|---|---|---|---|---|---|---|---|"]
    for r in job["ops"]:
        if "error" in r:
            out.append(f"| {r['op']} | {_human(r['bytes'])} | {r['error']} | | | | | | |")
            continue
        out.append(f"| {r['op']} | {_human(r['bytes'])} | {r['algo']} | {r['steps']} | {r['net_peers']} | "
                   f"{r['local_peers']} | {r['messages']} | {_human(r['bytes_sent'])} | {r['sent_vs_least']:.2f}x |")
    s = job["setup"]
    ch = job["channels"]
    out += ["", f"Set-up per rank: at most {s['store_keys_read']} store keys in {s['store_reads']} reads, "
                f"{_human(s['store_bytes_read'])} over TCP (the host map and this host's records; another host's "
                f"endpoint at the pair's first use, where the transport between verbs and TCP is chosen), "
                f"{s['store_keys_written']} written. Shared memory per host: "
                f"{_human(s['shm_bytes_per_host'])} mapped (a FIFO's pages reserved as it is first written). "
                f"RDMA verbs, pinned per rank: {_human(s['verbs_pinned_if_lazy'])} for the "
                f"{s['coll_net_peers']} network peers (at most, per rank) that all the ops above meet together, "
                f"{ch} channels each on the collectives' lane; their queue pairs are made when a pair first "
                f"meets, or at init with RAILCC_RUNTIME_CONNECT=0, which also connects the barrier's "
                f"({s['coll_net_peers_with_barrier']} network peers with the ops'); send/recv and all-to-all add "
                f"their own peers at first use."]
    return "\n".join(out)


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    jobs = [simulate_job(n, a) for n in a.ranks]
    if a.json:
        print(json.dumps({"jobs": jobs}, indent=1))
    else:
        print("\n\n".join(format_job(j) for j in jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
