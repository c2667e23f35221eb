"""Soak: long seeded random sequences of collectives on 3 real ranks, and dead ranks mid-soak.

Every rank builds the same plan from a shared seed: a sequence of steps, each one collective
(all_reduce, broadcast, reduce, all_gather, all_gather_into_tensor, reduce_scatter_tensor,
all_to_all_single, gather, scatter, barrier, or a send/recv pair) with a dtype, an element
count (0 to a few MiB, mostly small, odd counts common), a reduce op valid for the dtype, a
root, a group (the world, or a subgroup of 2 of the 3 ranks; the third rank skips those
steps) and a mode (blocking, or async_op=True with several works outstanding before they are
waited on through work.wait() or work.get_future().wait()).

Every input is a function of (seed, step, rank, salt) only, so every rank regenerates the
inputs of all the others and checks its own results against torch computed locally: data
movement bit for bit (random bit patterns, NaN payloads included), integer and bool
reductions exactly, MIN/MAX exactly, and floating sums, averages, PREMUL_SUMs and products
within the rounding error of reducing n values in the dtype.

The fault test runs the same kind of soak (shorter) and kills one rank with SIGKILL at a random
point (as it reaches a random step or a random subgroup step, or from a timer thread after a
random delay, so mostly inside a collective), over shared memory and over TCP, each round a
fresh set of processes and process groups. The survivors must raise a railcc error (a
DistBackendError) naming the dead rank, by its global rank, as "rank N" in the message and
as `ranks == [N]`, within 2 s of the kill (the victim writes time.time() just before it
dies). The op timeout is torch's default (30 min), so only dead-peer detection can explain a
timely error.

Seeds: RAILCC_SOAK_SEED and RAILCC_SOAK_STEPS override the soak's; RAILCC_FAULT_SEED the fault
test's first round. Every failure message carries the seed to reproduce it.
"""

import os
import random
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import harness

N = 3
SOAK_SEED = int(os.environ.get("RAILCC_SOAK_SEED", "20240611"))
SOAK_STEPS = int(os.environ.get("RAILCC_SOAK_STEPS", "1200"))
FAULT_SEED = int(os.environ.get("RAILCC_FAULT_SEED", "7001"))
FAULT_ROUNDS = 5
# RAILCC_FAULT_ROUNDS="4" (or "1,4") replays only those rounds, to chase one failure
ONLY_ROUNDS = [int(x) for x in os.environ.get("RAILCC_FAULT_ROUNDS", "").split(",") if x.strip()]
# (how the victim dies, transport) per round: "step" kills it as it reaches a random step,
# "substep" as it reaches a random subgroup step, "timer" from a thread after a random delay
# (wherever it then is, mostly inside a collective); "tcp" forces TCP between the ranks.
ROUNDS = [("step", "shm"), ("timer", "shm"), ("substep", "shm"), ("timer", "tcp"), ("substep", "tcp")]
FAULT_STEPS = 600
DETECT_LIMIT_S = 2.0

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
DTYPES = FLOATS + INTS + [torch.bool]
HAVE_PREMUL = hasattr(dist, "_make_nccl_premul_sum")

OPS = {  # op: weight
    "all_reduce": 20,
    "broadcast": 10,
    "reduce": 8,
    "all_gather": 6,
    "all_gather_into_tensor": 8,
    "reduce_scatter_tensor": 10,
    "all_to_all_single": 8,
    "gather": 6,
    "scatter": 6,
    "barrier": 4,
    "send_recv": 8,
}
REDUCING = ("all_reduce", "reduce", "reduce_scatter_tensor")


def redops_for(dtype):
    if dtype == torch.bool:
        return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    if dtype.is_floating_point:
        return ["SUM", "AVG", "PRODUCT", "MIN", "MAX"] + (["PREMUL_SUM"] if HAVE_PREMUL else [])
    return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def redop_obj(step):
    name = step["redop"]
    if name == "PREMUL_SUM":
        f = step["factor"]
        if step["factor_tensor"]:
            return dist._make_nccl_premul_sum(torch.tensor([f], dtype=step["dtype"]))
        return dist._make_nccl_premul_sum(f)
    return getattr(dist.ReduceOp, name)


def premul_factor(step):
    """The factor the ranks use, as the dtype of a tensor factor rounds it."""
    if step["factor_tensor"]:
        return torch.tensor([step["factor"]], dtype=step["dtype"]).double().item()
    return step["factor"]


# ----------------------------------------------------------------------------- the plan


def _count(rng, itemsize):
    """Element count: mostly small, some up to a few MiB, odd counts common."""
    u = rng.random()
    if u < 0.08:
        return 0
    if u < 0.43:
        c = rng.randint(1, 64)
    elif u < 0.68:
        c = rng.randint(65, 4096)
    elif u < 0.87:
        c = rng.randint(4097, max(4098, (64 << 10) // itemsize))
    elif u < 0.97:
        c = rng.randint((64 << 10) // itemsize, (1 << 20) // itemsize)
    else:
        c = rng.randint((1 << 20) // itemsize, (3 << 20) // itemsize)
    if rng.random() < 0.5:
        c |= 1
    return c


def _splits(rng, total, parts):
    cuts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    edges = [0] + cuts + [total]
    return [edges[i + 1] - edges[i] for i in range(parts)]


def make_plan(seed, steps, n, victim=None):
    """(subgroup ranks, steps). With `victim` (the fault test), every op involves the victim: the
    subgroup includes it and send/recv pairs have it at one end. Otherwise a survivor could
    wait in a subgroup op or a send on the other survivor, which (alive, but done with the plan
    once it has caught the error) would never call it: a hang of the test, not of railcc."""
    rng = random.Random(seed)
    if victim is None:
        sub_ranks = sorted(rng.sample(range(n), 2))
    else:
        sub_ranks = sorted([victim, rng.choice([r for r in range(n) if r != victim])])
    names = list(OPS)
    weights = [OPS[k] for k in names]
    plan = []
    for i in range(steps):
        op = rng.choices(names, weights)[0]
        dtype = rng.choice(DTYPES)
        isub = rng.random() < 0.2
        members = sub_ranks if isub else list(range(n))
        s = {
            "i": i, "op": op, "dtype": dtype, "group": "sub" if isub else "world", "members": members,
            "count": _count(rng, dtype.itemsize if dtype != torch.bool else 1),
            "root": rng.choice(members), "redop": None, "factor": None, "factor_tensor": False,
            "async": rng.random() < 0.35, "how": rng.choice(["wait", "future"]),
            "flush": rng.random() < 0.3, "max_pending": rng.randint(1, 6), "reverse": rng.random() < 0.3,
            "tag": rng.randint(0, 7),
        }
        if op in REDUCING:
            s["redop"] = rng.choice(redops_for(dtype))
            if s["redop"] == "PREMUL_SUM":
                s["factor"] = rng.choice([0.5, 0.25, 1.0 / 3.0, 2.0, -1.5, 0.1])
                s["factor_tensor"] = rng.random() < 0.3
        if op == "send_recv":
            s["src"], s["dst"] = rng.sample(members, 2)
            if victim is not None and victim not in (s["src"], s["dst"]):
                s["src"] = victim
        if op == "all_to_all_single":
            k = len(members)
            if rng.random() < 0.3:  # equal splits, no split sizes passed
                per = s["count"] // k + (1 if s["count"] % k else 0)
                s["splits"] = None
                s["a2a"] = [[per] * k for _ in range(k)]
            else:
                s["splits"] = True
                s["a2a"] = [_splits(rng, max(0, s["count"] + rng.randint(-3, 3)), k) for _ in range(k)]
        if op in ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "gather", "scatter",
                  "all_to_all_single"):
            # these move count * group size elements: keep the totals at a few MiB
            s["count"] = min(s["count"], (2 << 20) // max(1, dtype.itemsize))
        plan.append(s)
    return sub_ranks, plan


def describe(seed, s):
    d = (f"seed={seed} step={s['i']} op={s['op']} dtype={str(s['dtype']).replace('torch.', '')} "
         f"count={s['count']} group={s['group']}{s['members']} async={s['async']}")
    if s["redop"]:
        d += f" redop={s['redop']}"
        if s["redop"] == "PREMUL_SUM":
            d += f"(factor={s['factor']}{', tensor' if s['factor_tensor'] else ''})"
    if s["op"] in ("broadcast", "reduce", "gather", "scatter"):
        d += f" root={s['root']}"
    if s["op"] == "send_recv":
        d += f" src={s['src']} dst={s['dst']} tag={s['tag']}"
    if s["op"] == "all_to_all_single":
        d += f" splits={s['a2a'] if s['splits'] else 'equal'}"
    return d


# ----------------------------------------------------------------------------- inputs and references


def _int_bounds(dtype, n, kind):
    info = torch.iinfo(dtype)
    if kind == "sum":
        hi = info.max // n
        return (0 if info.min == 0 else -hi), hi
    # product of n values must not overflow
    c = int(round(info.max ** (1.0 / n)))
    while c ** n > info.max:
        c -= 1
    return (0 if info.min == 0 else -c), c


def make_input(seed, step, rank, dtype, count, redop=None, salt=0, n=N):
    """Input of `rank` at `step`: a function of its arguments only, so every rank can rebuild
    every other rank's. Data-movement ops get random bit patterns; reductions get values for
    which the reduction cannot overflow."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step * 10_007 + rank * 101 + salt * 7) % (1 << 62))
    if dtype == torch.bool:
        return torch.randint(0, 2, (count,), generator=g, dtype=torch.bool)
    if redop is None or (redop in ("MIN", "MAX", "BAND", "BOR", "BXOR") and not dtype.is_floating_point):
        bits = torch.randint(0, 256, (count * dtype.itemsize,), generator=g, dtype=torch.uint8)
        return bits.view(dtype)
    if dtype.is_floating_point:
        if redop == "PRODUCT":
            mag = torch.rand(count, generator=g, dtype=torch.float64) * 1.5 + 0.5
            sign = torch.randint(0, 2, (count,), generator=g, dtype=torch.float64) * 2 - 1
            return (mag * sign).to(dtype)
        if redop in ("MIN", "MAX"):
            scale = 100.0 if dtype == torch.float16 else 1000.0
            return (torch.randn(count, generator=g, dtype=torch.float64) * scale).to(dtype)
        return (torch.randn(count, generator=g, dtype=torch.float64) * 4).to(dtype)
    lo, hi = _int_bounds(dtype, n, "prod" if redop == "PRODUCT" else "sum")
    return torch.randint(lo, hi + 1, (count,), generator=g, dtype=dtype)


def _exact_reduce(ins, name):
    acc = ins[0].clone()
    for x in ins[1:]:
        if acc.dtype == torch.bool:
            if name in ("SUM", "MAX", "BOR"):
                acc = acc | x
            elif name in ("PRODUCT", "MIN", "BAND"):
                acc = acc & x
            else:
                acc = acc ^ x
            continue
        if name == "SUM":
            acc = acc + x
        elif name == "PRODUCT":
            acc = acc * x
        elif name == "MIN":
            acc = torch.minimum(acc, x)
        elif name == "MAX":
            acc = torch.maximum(acc, x)
        elif name == "BAND":
            acc = acc & x
        elif name == "BOR":
            acc = acc | x
        elif name == "BXOR":
            acc = acc ^ x
        else:
            raise AssertionError(name)
    return acc


def check_reduction(got, ins, name, factor):
    """None if `got` is the reduction of `ins` (in the dtype, by `name`), else what differs."""
    dt = got.dtype
    if got.numel() != ins[0].numel():
        return f"result has {got.numel()} elements, expected {ins[0].numel()}"
    if got.numel() == 0:
        return None
    if not dt.is_floating_point or name in ("MIN", "MAX"):
        want = _exact_reduce(ins, name)
        if torch.equal(got, want):
            return None
        bad = (got != want).nonzero().flatten()
        k = bad[:4].tolist()
        return (f"{bad.numel()} elements differ (exact compare); first at {k}: got {got[k].tolist()} "
                f"expected {want[k].tolist()} inputs {[x[k].tolist() for x in ins]}")
    n = len(ins)
    x = torch.stack([t.double() for t in ins])
    if name == "SUM":
        ref, mag = x.sum(0), x.abs().sum(0)
    elif name == "AVG":
        ref, mag = x.sum(0) / n, x.abs().sum(0) / n
    elif name == "PREMUL_SUM":
        ref, mag = (x * factor).sum(0), (x * factor).abs().sum(0)
    elif name == "PRODUCT":
        ref = x.prod(0)
        mag = ref.abs()
    else:
        raise AssertionError(name)
    info = torch.finfo(dt)
    # n - 1 roundings of partial results, one more for the scale or the division, each at most
    # eps / 2 of the magnitude: (n + 1) * eps leaves a factor of two.
    tol = (n + 1) * info.eps * mag + info.tiny
    err = (got.double() - ref).abs()
    ok = err <= tol  # False for NaN
    if bool(ok.all()):
        return None
    bad = (~ok).nonzero().flatten()
    k = bad[:4].tolist()
    return (f"{bad.numel()} elements out of tolerance; first at {k}: got {got[k].tolist()} expected "
            f"{ref[k].tolist()} (tol {tol[k].tolist()}) inputs {[t[k].tolist() for t in ins]}")


def check_bits(got, want):
    """None if equal bit for bit."""
    if got.numel() != want.numel():
        return f"result has {got.numel()} elements, expected {want.numel()}"
    if got.dtype != want.dtype:
        return f"result dtype {got.dtype}, expected {want.dtype}"
    if got.numel() == 0:
        return None
    a, b = got.view(torch.uint8), want.view(torch.uint8)
    if torch.equal(a, b):
        return None
    es = 1 if got.dtype == torch.bool else got.dtype.itemsize
    bad = ((a != b).nonzero().flatten() // es).unique()
    k = bad[:4].tolist()
    return (f"{bad.numel()} elements differ (bitwise); first at {k}: got {got[k].tolist()} "
            f"expected {want[k].tolist()}")


def junk(dtype, count):
    """An output buffer whose contents no correct result shares by chance (0xA5 bytes)."""
    if dtype == torch.bool:
        return torch.ones(count, dtype=torch.bool)
    return torch.full((count * dtype.itemsize,), 0xA5, dtype=torch.uint8).view(dtype)


# ----------------------------------------------------------------------------- one step


def issue(seed, s, rank, groups):
    """Issues step `s` on this rank; returns (work or None, check), check() returning None or
    what is wrong once the op has completed; None if this rank has no part in the step. Inputs
    are often temporaries, as in user code: an async op's backend must keep them alive."""
    members = s["members"]
    if rank not in members:
        return None
    g = groups[s["group"]]
    k = len(members)
    me = members.index(rank)
    dt, count, red, a, i = s["dtype"], s["count"], s["redop"], s["async"], s["i"]
    op = s["op"]

    def inp(r, c=count, salt=0):
        return make_input(seed, i, r, dt, c, red, salt)

    if op == "all_reduce":
        t = inp(rank)
        w = dist.all_reduce(t, op=redop_obj(s), group=g, async_op=a)
        return w, lambda: check_reduction(t, [inp(r) for r in members], red, s["factor"] and premul_factor(s))
    if op == "reduce":
        t = inp(rank)
        w = dist.reduce(t, dst=s["root"], op=redop_obj(s), group=g, async_op=a)

        def chk():
            if rank == s["root"]:
                return check_reduction(t, [inp(r) for r in members], red, s["factor"] and premul_factor(s))
            e = check_bits(t, inp(rank))
            return e and "non-root input was modified: " + e
        return w, chk
    if op == "reduce_scatter_tensor":
        full = inp(rank, count * k)
        out = junk(dt, count)
        w = dist.reduce_scatter_tensor(out, full, op=redop_obj(s), group=g, async_op=a)
        return w, lambda: check_reduction(
            out, [inp(r, count * k)[me * count:(me + 1) * count] for r in members], red,
            s["factor"] and premul_factor(s))
    if op == "broadcast":
        t = inp(rank) if rank == s["root"] else junk(dt, count)
        w = dist.broadcast(t, src=s["root"], group=g, async_op=a)
        return w, lambda: check_bits(t, inp(s["root"]))
    if op == "all_gather":
        outs = [junk(dt, count) for _ in members]
        w = dist.all_gather(outs, inp(rank), group=g, async_op=a)
        return w, lambda: check_bits(torch.cat(outs), torch.cat([inp(r) for r in members]))
    if op == "all_gather_into_tensor":
        out = junk(dt, count * k)
        w = dist.all_gather_into_tensor(out, inp(rank), group=g, async_op=a)
        return w, lambda: check_bits(out, torch.cat([inp(r) for r in members]))
    if op == "gather":
        outs = [junk(dt, count) for _ in members] if rank == s["root"] else None
        w = dist.gather(inp(rank), outs, dst=s["root"], group=g, async_op=a)
        return w, lambda: (check_bits(torch.cat(outs), torch.cat([inp(r) for r in members]))
                           if rank == s["root"] else None)
    if op == "scatter":
        ins = None
        if rank == s["root"]:
            ins = list(inp(rank, count * k).split(count)) if count else [inp(rank, 0) for _ in members]
        out = junk(dt, count)
        w = dist.scatter(out, ins, src=s["root"], group=g, async_op=a)
        return w, lambda: check_bits(out, inp(s["root"], count * k)[me * count:(me + 1) * count])
    if op == "all_to_all_single":
        sp = s["a2a"]
        inp_t = inp(rank, sum(sp[me]))
        outs = [sp[src][me] for src in range(k)]
        out = junk(dt, sum(outs))
        if s["splits"]:
            w = dist.all_to_all_single(out, inp_t, output_split_sizes=outs, input_split_sizes=sp[me], group=g,
                                       async_op=a)
        else:
            w = dist.all_to_all_single(out, inp_t, group=g, async_op=a)

        def chk():
            pieces = []
            for src in range(k):
                full = inp(members[src], sum(sp[src]))
                off = sum(sp[src][:me])
                pieces.append(full[off:off + sp[src][me]])
            return check_bits(out, torch.cat(pieces))
        return w, chk
    if op == "barrier":
        w = dist.barrier(group=g, async_op=a)
        return w, lambda: None
    if op == "send_recv":
        if rank == s["src"]:
            t = inp(rank)
            w = (dist.isend if a else dist.send)(t, dst=s["dst"], group=g, tag=s["tag"])
            return (w if a else None), lambda: None
        if rank == s["dst"]:
            t = junk(dt, count)
            w = (dist.irecv if a else dist.recv)(t, src=s["src"], group=g, tag=s["tag"])
            return (w if a else None), lambda: check_bits(t, inp(s["src"]))
        return None
    raise AssertionError(op)


class StepFailed(Exception):
    def __init__(self, desc, exc):
        super().__init__(f"{desc}: {type(exc).__name__}: {exc}")
        self.desc, self.exc = desc, exc


def run_plan(rank, seed, plan, groups, fails, counts, kill=None, progress=None):
    """Runs the plan on this rank, appending failures to `fails` (the first 20; the plan runs to
    its end regardless, or the ranks would fall out of step). An exception from railcc is
    re-raised as StepFailed naming the step it came from (for async ops, the step that issued the
    op being waited on). `kill(step)` is called before every step (the fault test's hook); the
    step about to run is written to the file `progress`, so that a hang can say where."""
    pending = []  # (work, how, check, desc)

    def flush(reverse):
        order = pending[::-1] if reverse else list(pending)
        for w, how, _, desc in order:
            try:
                if how == "future":
                    w.get_future().wait()
                else:
                    w.wait()
            except Exception as e:
                raise StepFailed(desc, e) from e
        for _, _, chk, desc in pending:
            note(desc, chk())
        pending.clear()

    def note(desc, err):
        if err:
            counts["mismatches"] = counts.get("mismatches", 0) + 1
            if len(fails) < 20:
                fails.append(f"{desc} rank={rank}: {err}")

    for s in plan:
        if kill is not None:
            kill(s["i"])
        desc = describe(seed, s)
        if progress:
            with open(progress, "w") as f:
                f.write(desc)
        try:
            got = issue(seed, s, rank, groups)
        except Exception as e:
            raise StepFailed(desc, e) from e
        if got is None:
            continue
        counts[s["op"]] = counts.get(s["op"], 0) + 1
        w, chk = got
        if w is None or not s["async"]:
            note(desc, chk())
        else:
            pending.append((w, s["how"], chk, desc))
            if s["flush"] or len(pending) >= s["max_pending"]:
                flush(s["reverse"])
    flush(False)


def _abort_all(groups):
    import railcc

    for g in groups.values():
        try:
            railcc.abort(g)
        except Exception:
            pass


# ----------------------------------------------------------------------------- the soak


def _quiet():
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renamed collectives


def rk_soak(rank, n, seed, steps, progress_dir):
    _quiet()
    sub_ranks, plan = make_plan(seed, steps, n)
    groups = {"world": dist.group.WORLD, "sub": dist.new_group(sub_ranks)}
    fails, counts = [], {}
    error = None
    t0 = time.monotonic()
    try:
        run_plan(rank, seed, plan, groups, fails, counts, progress=os.path.join(progress_dir, f"rank{rank}"))
        dist.barrier()
    except StepFailed as e:
        error = f"rank {rank}: {e}"
        _abort_all(groups)  # the peers waiting on this rank fail instead of hanging
    secs = time.monotonic() - t0
    if error is None:
        dist.destroy_process_group(groups["sub"])
    return {"fails": fails, "counts": counts, "secs": secs, "error": error, "sub": sub_ranks}


def _where(prefix):
    out = []
    for r in range(N):
        try:
            out.append(f"rank {r} last started [{open(prefix + str(r)).read()}]")
        except OSError:
            out.append(f"rank {r}: no step started")
    return "; ".join(out)


@pytest.mark.timeout(400)
def test_soak_random_collectives_three_ranks(tmp_path):
    pool = harness.RankPool(N)
    try:
        t0 = time.monotonic()
        try:
            got = pool.run_raw(rk_soak, SOAK_SEED, SOAK_STEPS, str(tmp_path), timeout=300)
        except harness.TaskError as e:
            codes = [p.exitcode for p in pool._procs]
            raise harness.TaskError(f"soak seed={SOAK_SEED} steps={SOAK_STEPS}: {e} (exit codes {codes}); "
                                    f"{_where(str(tmp_path / 'rank'))}") from e
        wall = time.monotonic() - t0
    finally:
        pool.kill()
    problems = []
    for r in range(N):
        status, v = got[r]
        if status != "ok":
            problems.append(f"rank {r}: {status}: {v}")
            continue
        if v["counts"].get("mismatches"):
            problems.append(f"rank {r}: {v['counts']['mismatches']} wrong results in all (the first 20 follow)")
        problems += v["fails"]
        if v["error"]:
            problems.append(v["error"])
    assert not problems, (f"soak seed={SOAK_SEED} steps={SOAK_STEPS} (rerun with RAILCC_SOAK_SEED):\n"
                          + "\n".join(problems[:30]))
    v0 = got[0][1]
    print(f"\nsoak seed={SOAK_SEED}: {SOAK_STEPS} steps, subgroup {v0['sub']}, "
          f"ops per rank {[sum(got[r][1]['counts'].values()) for r in range(N)]}, "
          f"rank 0 by op {dict(sorted(v0['counts'].items()))}, "
          f"loop {[round(got[r][1]['secs'], 1) for r in range(N)]} s, task wall {wall:.1f} s")


# ----------------------------------------------------------------------------- the fault


def rk_fault(rank, n, seed, steps, victim, mode, kill_step, delay, time_file):
    import railcc

    _quiet()
    sub_ranks, plan = make_plan(seed, steps, n, victim)
    groups = {"world": dist.group.WORLD, "sub": dist.new_group(sub_ranks)}
    fails, counts = [], {}
    state = {"step": None}

    def die():
        with open(time_file + ".tmp", "w") as f:
            f.write(repr(time.time()))
        os.replace(time_file + ".tmp", time_file)
        os.kill(os.getpid(), signal.SIGKILL)

    def hook(i):
        state["step"] = i
        if rank == victim and mode in ("step", "substep") and i == kill_step:
            die()

    dist.barrier()
    if rank == victim and mode == "timer":
        threading.Timer(delay, die).start()
    t0 = time.monotonic()
    try:
        run_plan(rank, seed, plan, groups, fails, counts, kill=hook, progress=f"{time_file}.rank{rank}")
        if rank == victim:
            time.sleep(60)  # the timer fires before the plan would end; wait for it regardless
        dist.barrier()
    except StepFailed as e:
        caught = time.time()
        exc = e.exc
        return {"error": type(exc).__name__, "railcc": isinstance(exc, railcc.RailccError),
                "dist": isinstance(exc, dist.DistBackendError), "msg": str(exc),
                "ranks": list(getattr(exc, "ranks", ()) or ()), "at": e.desc, "caught": caught,
                "fails": fails, "loop_s": time.monotonic() - t0, "step": state["step"]}
    return {"error": None, "fails": fails, "loop_s": time.monotonic() - t0, "step": state["step"]}


@pytest.mark.timeout(600)
def test_killed_rank_is_named_by_survivors_within_two_seconds(tmp_path):
    problems, lines = [], []
    for rnd in range(FAULT_ROUNDS):
        if ONLY_ROUNDS and rnd not in ONLY_ROUNDS:
            continue
        seed = FAULT_SEED + rnd
        rng = random.Random(seed)
        victim = rng.randrange(N)
        mode, transport = ROUNDS[rnd % len(ROUNDS)]
        kill_step = rng.randint(30, FAULT_STEPS - 100)
        delay = rng.uniform(0.3, 2.5)
        if mode == "substep":  # the step is a subgroup op: its other member waits there on the victim
            _, plan = make_plan(seed, FAULT_STEPS, N, victim)
            kill_step = rng.choice([s["i"] for s in plan[30:FAULT_STEPS - 100] if s["group"] == "sub"])
        time_file = str(tmp_path / f"killed-{rnd}")
        what = (f"round {rnd} seed={seed} {transport} victim=rank {victim} mode={mode} "
                + (f"delay={delay:.2f}s" if mode == "timer" else f"kill_step={kill_step}"))
        pool = harness.RankPool(N, env={"RAILCC_SHM_DISABLE": "1"} if transport == "tcp" else None)
        try:
            got = pool.run_raw(rk_fault, seed, FAULT_STEPS, victim, mode, kill_step, delay, time_file,
                               timeout=120, allow_dead=(victim,))
        except harness.TaskError as e:
            codes = [p.exitcode for p in pool._procs]
            problems.append(f"{what}: survivors did not answer: {e} (exit codes {codes}); "
                            f"{_where(time_file + '.rank')}")
            continue
        finally:
            pool.kill()
        try:
            killed = float(open(time_file).read())
        except OSError:
            problems.append(f"{what}: the victim never reached its kill point ({got})")
            continue
        for r in range(N):
            if r == victim:
                continue
            status, g = got[r]
            if status != "ok":
                problems.append(f"{what}: rank {r}: {status}: {g}")
                continue
            if g["fails"]:
                problems.append(f"{what}: rank {r}: wrong results before the kill: {g['fails'][:3]}")
            if g["error"] is None:
                problems.append(f"{what}: rank {r} raised nothing (last step {g['step']})")
                continue
            late = g["caught"] - killed
            head = f"{what}: rank {r} at [{g['at']}] raised {g['error']} {late:.3f}s after the kill"
            lines.append(f"{head}; ranks={g['ranks']}; msg={g['msg'][:200]!r}")
            if not (g["railcc"] and g["dist"]):
                problems.append(f"{head}: not a railcc DistBackendError: {g['msg']}")
            if f"rank {victim}" not in g["msg"]:
                problems.append(f"{head}: message does not name rank {victim}: {g['msg']}")
            if g["ranks"] != [victim]:
                problems.append(f"{head}: ranks attribute {g['ranks']}, expected [{victim}]: {g['msg']}")
            if not late < DETECT_LIMIT_S:
                problems.append(f"{head}: later than {DETECT_LIMIT_S}s: {g['msg']}")
    print("\n" + "\n".join(lines))
    assert not problems, "\n".join(problems)
