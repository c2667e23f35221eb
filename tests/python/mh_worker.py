"""One rank of a multi-host correctness run; started inside a network namespace.

Store mode (rank 0 hosts the TCPStore on --store HOST:PORT, HOST being its namespace address):

    ip netns exec NS python tests/python/mh_worker.py --rank R --world W \
        --store 10.213.X.1:PORT --backend gloo --ifname VETH [--check all|name,name,...]

torchrun mode (env:// init from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT):

    ip netns exec NS python -m torch.distributed.run ... tests/python/mh_worker.py \
        --torchrun --backend gloo --ifname VETH

--ifname sets GLOO_SOCKET_IFNAME and RAILCC_SOCKET_IFNAME unless they are already in the
environment (so the caller may also pass them through env). `railcc` is imported only when
the backend string contains "railcc". Every check compares against what torch computes
locally from the inputs every rank derives deterministically from its rank. Prints exactly
one JSON line on stdout, prefixed with MH_RESULT, and exits 0 only if every check passed.
A check that raises ends the process at once (exit 2), so that peers fail fast instead of
waiting inside the next collective.
"""

import argparse
import json
import os
import socket
import sys
import time
import traceback
import warnings
from datetime import timedelta

RESULT_TAG = "MH_RESULT "

# Sizes: odd and prime-ish so no chunking divides evenly; the big one crosses any eager limit.
BIG = 1_000_003
SMALL = (1, 7, 4099)


def _value(rank, n, salt=0):
    """Integer-valued float32 data, so sums over a few ranks are exact in float32."""
    import torch

    v = (torch.arange(n, dtype=torch.int64) * (rank + 3) + 7 * salt + rank) % 251 - 125
    return v.to(torch.float32)


def _random(rank, n, salt=0):
    import torch

    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(n, generator=g, dtype=torch.float32)


def _split(src, dst):
    """Elements rank src sends to rank dst in alltoall (uneven, includes a zero split)."""
    return 0 if (src + 2 * dst) % 5 == 4 else src + 2 * dst + 1


def _compare(got, want, exact=True):
    import torch

    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)}/{got.dtype} != {tuple(want.shape)}/{want.dtype}"
    if exact:
        ok = torch.equal(got, want)
    else:
        ok = torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    if ok:
        return None
    diff = (got.double() - want.double()).abs()
    i = int(diff.argmax())
    return f"mismatch: max |diff| {float(diff.max()):.3g} at {i} (got {float(got.flatten()[i])}, want {float(want.flatten()[i])})"


# ---- checks: each returns None on success or a string describing the mismatch ----


def check_all_reduce(dist, rank, world):
    import torch

    errs = []
    for n in SMALL + (BIG,):
        t = _value(rank, n, salt=n)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        want = sum(_value(r, n, salt=n) for r in range(world))
        e = _compare(t, want)
        if e:
            errs.append(f"n={n} int-valued: {e}")
    # Arbitrary floats: the reduction order may differ from ours, so compare with tolerance.
    for n in (5, BIG):
        t = _random(rank, n, salt=n)
        dist.all_reduce(t)
        want = torch.stack([_random(r, n, salt=n) for r in range(world)]).double().sum(0).float()
        e = _compare(t, want, exact=False)
        if e:
            errs.append(f"n={n} random: {e}")
    return "; ".join(errs) or None


def check_all_reduce_ops(dist, rank, world):
    """Every reduce op on several dtypes, above the one-shot size: with the same number of ranks
    on each host this is the schedule across hosts (reduce-scatter on each host, all-reduce
    along the rails, all-gather on each host). Every rank must end with the same bits."""
    import hashlib

    import torch

    def value(r, dt, n):
        i = torch.arange(n, dtype=torch.int64)
        if dt == torch.bool:
            return (i + r) % 3 != 0
        v = (i * 7 + r * 3) % 5 + 1
        return (v - 2 if dt.is_floating_point else v).to(dt)

    ops = {"SUM": dist.ReduceOp.SUM, "PRODUCT": dist.ReduceOp.PRODUCT, "MIN": dist.ReduceOp.MIN,
           "MAX": dist.ReduceOp.MAX, "AVG": dist.ReduceOp.AVG, "PREMUL_SUM": None,
           "BAND": dist.ReduceOp.BAND, "BOR": dist.ReduceOp.BOR, "BXOR": dist.ReduceOp.BXOR}
    errs, digest = [], hashlib.sha256()
    for dt in (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.uint8, torch.bool):
        if dt == torch.bool:
            names = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
        elif dt.is_floating_point:
            names = ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"]
        else:
            names = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
        n = 70_001 + 2 * world  # above RAILCC_ONESHOT_BYTES (64 KiB) even for one-byte types
        for name in names:
            t = value(rank, dt, n)
            op = dist._make_nccl_premul_sum(0.5) if name == "PREMUL_SUM" else ops[name]
            dist.all_reduce(t, op=op)
            xs = [value(r, dt, n) for r in range(world)]
            if dt == torch.bool:
                f = {"SUM": torch.logical_or, "MAX": torch.logical_or, "BOR": torch.logical_or,
                     "PRODUCT": torch.logical_and, "MIN": torch.logical_and, "BAND": torch.logical_and,
                     "BXOR": torch.logical_xor}[name]
                want = xs[0]
                for x in xs[1:]:
                    want = f(want, x)
            else:
                acc = torch.stack([x.double() if dt.is_floating_point else x.long() for x in xs])
                if name in ("SUM", "AVG", "PREMUL_SUM"):
                    want = acc.sum(0) * (0.5 if name == "PREMUL_SUM" else 1.0) / (world if name == "AVG" else 1)
                elif name == "PRODUCT":
                    want = acc.prod(0)
                elif name == "MIN":
                    want = acc.min(0).values
                elif name == "MAX":
                    want = acc.max(0).values
                else:
                    want = acc[0]
                    for x in acc[1:]:
                        want = {"BAND": want & x, "BOR": want | x, "BXOR": want ^ x}[name]
                want = want.to(dt)
            if dt.is_floating_point:
                tol = 2e-2 if dt == torch.bfloat16 else 1e-6
                ok = torch.allclose(t.double(), want.double(), rtol=tol, atol=tol)
            else:
                ok = torch.equal(t, want)
            if not ok:
                errs.append(f"{dt} {name}: {_compare(t.double(), want.double(), exact=False)}")
            digest.update(t.view(torch.uint8).numpy().tobytes() if dt != torch.bool else t.numpy().tobytes())
    EXTRA["all_reduce_ops"] = {"digest": digest.hexdigest()}
    return "; ".join(errs) or None


def check_all_gather_into_tensor(dist, rank, world):
    import torch

    errs = []
    for n in (1, 1001, 250_001):
        inp = _value(rank, n, salt=11)
        out = torch.full((world * n,), float("nan"))
        dist.all_gather_into_tensor(out, inp)
        want = torch.cat([_value(r, n, salt=11) for r in range(world)])
        e = _compare(out, want)
        if e:
            errs.append(f"n={n}: {e}")
    return "; ".join(errs) or None


def check_reduce_scatter_tensor(dist, rank, world):
    import torch

    errs = []
    for n in (1, 1001, 250_001):
        inp = _value(rank, world * n, salt=13)
        out = torch.full((n,), float("nan"))
        dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM)
        want = sum(_value(r, world * n, salt=13) for r in range(world))[rank * n:(rank + 1) * n]
        e = _compare(out, want)
        if e:
            errs.append(f"n={n}: {e}")
    return "; ".join(errs) or None


def check_broadcast(dist, rank, world):
    import torch

    root = world - 1  # non-zero root whenever world > 1
    errs = []
    for n in (3, BIG):
        t = _value(root, n, salt=17) if rank == root else torch.zeros(n)
        dist.broadcast(t, src=root)
        e = _compare(t, _value(root, n, salt=17))
        if e:
            errs.append(f"n={n} root={root}: {e}")
    return "; ".join(errs) or None


def check_alltoall_single(dist, rank, world):
    import torch

    in_splits = [_split(rank, d) for d in range(world)]
    out_splits = [_split(s, rank) for s in range(world)]

    def chunk(src, dst):
        # Encodes (src, dst, index) exactly in float32.
        return torch.arange(_split(src, dst), dtype=torch.float32) + 1000 * src + 100 * dst

    inp = torch.cat([chunk(rank, d) for d in range(world)])
    out = torch.full((sum(out_splits),), float("nan"))
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)
    want = torch.cat([chunk(s, rank) for s in range(world)])
    e = _compare(out, want)
    return f"splits in={in_splits} out={out_splits}: {e}" if e else None


def check_send_recv_ring(dist, rank, world):
    import torch

    if world == 1:
        return None
    errs = []
    for n in (5, 100_003):
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        out = _value(rank, n, salt=19)
        buf = torch.full((n,), float("nan"))
        # Post the receive first; a blocking send on every rank first could deadlock.
        reqs = [dist.irecv(buf, src=prv), dist.isend(out, dst=nxt)]
        for r in reqs:
            r.wait()
        e = _compare(buf, _value(prv, n, salt=19))
        if e:
            errs.append(f"n={n} from {prv}: {e}")
    return "; ".join(errs) or None


def check_barrier(dist, rank, world):
    # The last rank arrives late; nobody may leave before it arrived. All ranks share this
    # machine's clock, so arrival/leave times are comparable; they travel through the store
    # (not a collective) so the check does not depend on the backend's dtype support.
    if rank == world - 1:
        time.sleep(0.3)
    arrive = time.time()
    dist.barrier()
    leave = time.time()
    store = dist.distributed_c10d._get_default_store()
    store.set(f"mh_worker/barrier/{rank}", json.dumps([arrive, leave]))
    times = [json.loads(store.get(f"mh_worker/barrier/{r}")) for r in range(world)]
    last_arrival = max(a for a, _ in times)
    if leave + 1e-3 < last_arrival:
        return f"left the barrier {last_arrival - leave:.3f}s before the last rank arrived"
    return None


def check_straggler_report(dist, rank, world):
    """railcc only: traffic for the link statistics, then the straggler report (in "extra")."""
    import torch

    import railcc

    t = torch.ones(1 << 18)  # 1 MiB: above the one-shot size, so the pairwise steps time each link
    for _ in range(30):
        dist.all_reduce(t)
    time.sleep(2.5)  # the watchdog checks and publishes once a second
    EXTRA["straggler_report"] = railcc.straggler_report()
    dist.barrier()
    return None


def check_cable_cut(dist, rank, world):
    """railcc only: the last rank takes its own host's link down (no FIN, no RST: a cut cable)
    while every rank waits to receive from a rank on the other host with nothing of its own in
    flight; keepalive must turn that into PeerFailureError naming the other rank within
    seconds, not the op timeout. Result in "extra"."""
    import subprocess

    import torch

    import railcc

    t = torch.ones(1 << 20)
    dist.all_reduce(t)
    dist.barrier()
    if rank == world - 1:
        ifname = os.environ["RAILCC_SOCKET_IFNAME"]
        subprocess.run(["ip", "link", "set", "dev", ifname, "down"], check=True, timeout=20)
    t0 = time.time()
    try:
        dist.recv(t, src=(rank + 1) % world)  # nobody sends: only the cable's state can end this
        EXTRA["cable_cut"] = {"error": None}
    except railcc.PeerFailureError as e:
        EXTRA["cable_cut"] = {"error": type(e).__name__, "ranks": list(e.ranks), "msg": str(e),
                              "after_s": round(time.time() - t0, 3)}
    except Exception as e:  # reported, and the test says what it expected instead
        EXTRA["cable_cut"] = {"error": type(e).__name__, "msg": str(e), "after_s": round(time.time() - t0, 3)}
    return None


def check_allreduce_disagreement(dist, rank, world):
    """railcc only: the last rank all-reduces one element more than the others, above the
    one-shot size. Every rank must raise (a mismatch where it meets that rank's header, a peer
    failure where the news comes through another rank) within seconds. Result in "extra"."""
    import torch

    import railcc

    t = torch.ones((1 << 18) + (1 if rank == world - 1 else 0))
    t0 = time.time()
    try:
        dist.all_reduce(t)
        dist.barrier()
        EXTRA["disagreement"] = {"error": None}
    except (railcc.CollectiveMismatchError, railcc.PeerFailureError) as e:
        EXTRA["disagreement"] = {"error": type(e).__name__, "msg": str(e), "after_s": round(time.time() - t0, 3)}
    return None


EXTRA = {}  # what checks hand back besides pass/fail

def check_large_all_reduce(dist, rank, world):
    """Three 32 MiB all_reduces of integer-valued floats: exact, and big enough for every
    channel of a pair to carry a share."""
    n = 8 * 1024 * 1024 + 5
    for salt in range(3):
        t = _value(rank, n, salt=salt)
        dist.all_reduce(t)
        e = _compare(t, sum(_value(r, n, salt=salt) for r in range(world)))
        if e:
            return f"salt {salt}: {e}"
    return None


CHECKS = {
    "all_reduce": check_all_reduce,
    "all_gather_into_tensor": check_all_gather_into_tensor,
    "reduce_scatter_tensor": check_reduce_scatter_tensor,
    "broadcast": check_broadcast,
    "alltoall_single": check_alltoall_single,
    "send_recv_ring": check_send_recv_ring,
    "barrier": check_barrier,
}
OPTIONAL_CHECKS = {"large_all_reduce": check_large_all_reduce, "straggler_report": check_straggler_report, "cable_cut": check_cable_cut,  # not in "all"
                   "all_reduce_ops": check_all_reduce_ops, "allreduce_disagreement": check_allreduce_disagreement}


def _emit(obj):
    sys.stdout.write(RESULT_TAG + json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--store", help="HOST:PORT of the TCPStore (rank 0 serves it)")
    ap.add_argument("--torchrun", action="store_true", help="init from env:// (torchrun sets the variables)")
    ap.add_argument("--ifname", help="sets GLOO_SOCKET_IFNAME / RAILCC_SOCKET_IFNAME unless already set")
    ap.add_argument("--check", default="all", help="'all' or a comma-separated subset of: " + ", ".join(CHECKS))
    ap.add_argument("--timeout", type=float, default=60.0, help="process-group timeout in seconds")
    args = ap.parse_args(argv)

    if args.ifname:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", args.ifname)
        os.environ.setdefault("RAILCC_SOCKET_IFNAME", args.ifname)
    names = list(CHECKS) if args.check == "all" else [c.strip() for c in args.check.split(",") if c.strip()]
    CHECKS.update(OPTIONAL_CHECKS) if args.check != "all" else None
    unknown = [c for c in names if c not in CHECKS]
    if unknown:
        ap.error(f"unknown checks {unknown}; known: {list(CHECKS)}")

    if args.torchrun:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        if args.rank is None or args.world is None or not args.store:
            ap.error("--rank, --world and --store are required without --torchrun")
        rank, world = args.rank, args.world

    report = {
        "rank": rank,
        "world": world,
        "backend": args.backend,
        "mode": "torchrun" if args.torchrun else "store",
        "hostname": socket.gethostname(),
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "local_rank": int(os.environ.get("LOCAL_RANK", "-1")),
        "results": {},
    }
    t_start = time.time()
    store = None
    try:
        warnings.simplefilter("ignore", FutureWarning)  # reduce_scatter_tensor & co. are "deprecated"
        import torch  # noqa: F401
        import torch.distributed as dist

        if "railcc" in args.backend:
            import railcc  # noqa: F401  (registers the backend)

        timeout = timedelta(seconds=args.timeout)
        if args.torchrun:
            dist.init_process_group(args.backend, init_method="env://", timeout=timeout)
        else:
            host, port = args.store.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), world, rank == 0, timeout=timeout, wait_for_workers=False)
            dist.init_process_group(args.backend, store=store, rank=rank, world_size=world, timeout=timeout)
        report["init_s"] = round(time.time() - t_start, 3)
    except BaseException:
        report["ok"] = False
        report["error"] = "init: " + traceback.format_exc()
        _emit(report)
        sys.stderr.write(report["error"])
        sys.stderr.flush()
        os._exit(2)

    for name in names:
        t0 = time.time()
        try:
            err = CHECKS[name](dist, rank, world)
        except BaseException:
            report["results"][name] = {"ok": False, "error": traceback.format_exc(), "s": round(time.time() - t0, 3)}
            report["ok"] = False
            _emit(report)
            sys.stderr.write(f"rank {rank}: check {name} raised:\n{report['results'][name]['error']}")
            sys.stderr.flush()
            os._exit(2)  # peers then fail fast on the broken connection instead of hanging
        report["results"][name] = {"ok": err is None, "s": round(time.time() - t0, 3)}
        if err is not None:
            report["results"][name]["error"] = err

    ok = all(r["ok"] for r in report["results"].values())
    if "cable_cut" in names:  # the network is gone: report and leave without the closing barrier
        report["ok"] = ok
        report["extra"] = EXTRA
        _emit(report)
        os._exit(0)
    try:
        dist.barrier()
        if store is not None:
            # Rank 0 serves the store: it leaves only after every rank is done with it.
            store.add("mh_worker/done", 1)
            if rank == 0:
                deadline = time.time() + args.timeout
                while store.add("mh_worker/done", 0) < world and time.time() < deadline:
                    time.sleep(0.01)
        dist.destroy_process_group()
    except BaseException:
        ok = False
        report["error"] = "shutdown: " + traceback.format_exc()
    report["ok"] = ok
    report["extra"] = EXTRA
    report["total_s"] = round(time.time() - t_start, 3)
    _emit(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
