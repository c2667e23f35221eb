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


def _size(text):
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(t[:-1] if mult > 1 else t) * mult


def _human(b):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            v = b / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{b} B"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m railcc sim", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--ranks", default="1024,4096", help="job sizes, comma-separated (default 1024,4096)")
    p.add_argument("--per-host", type=int, default=8, help="ranks per host (default 8)")
    p.add_argument("--ops", default=",".join(OPS), help="ops, comma-separated (default all four)")
    p.add_argument("--sizes", default="8,1M,256M", help="op sizes in bytes, K/M/G suffixes (default 8,1M,256M)")
    p.add_argument("--elem-size", type=int, default=4, help="bytes per element (default 4: float32)")
    p.add_argument("--channels", type=int, default=2, help="channels per connected pair (default 2)")
    p.add_argument("--algo", default="", help="RAILCC_ALGO to simulate (default: the rule)")
    p.add_argument("--oneshot-bytes", type=int, default=65536, help="RAILCC_ONESHOT_BYTES (default 65536)")
    p.add_argument("--buffsize", type=int, default=4 << 20, help="RAILCC_BUFFSIZE (default 4 MiB)")
    p.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    a = p.parse_args(argv)
    try:
        a.ranks = [int(x) for x in a.ranks.split(",") if x.strip()]
        a.sizes = [_size(x) for x in a.sizes.split(",") if x.strip()]
    except ValueError as e:
        p.error(f"bad number: {e}")
    a.ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    bad = [o for o in a.ops if o not in OPS]
    if bad:
        p.error(f"unknown op(s) {', '.join(bad)}; railcc sim knows {', '.join(OPS)}")
    for n in a.ranks:
        if n < 2 or n % a.per_host:
            p.error(f"{n} ranks at {a.per_host} per host: the ranks must fill whole hosts (2 ranks at least)")
    return a


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
    does; this host's records and endpoints; the secret). Endpoints of other hosts'
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
