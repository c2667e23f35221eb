"""railcc-bench's arithmetic and report: the collectives and dtypes it knows, size sweeps, bus
bandwidth and the memory-bound fraction, the data patterns and the results to expect, records,
and the text table. No process, no timing, no torch.distributed: runner.py drives the runs and
uses these. Torch is imported only inside the functions that build tensors."""

import re
from dataclasses import dataclass

# name -> (torch attribute, bytes per element, is floating point)
DTYPES = {
    "int8": ("int8", 1, False),
    "uint8": ("uint8", 1, False),
    "int32": ("int32", 4, False),
    "int64": ("int64", 8, False),
    "half": ("float16", 2, True),
    "float": ("float32", 4, True),
    "double": ("float64", 8, True),
    "bfloat16": ("bfloat16", 2, True),
}
DTYPE_ALIASES = {
    "char": "int8", "byte": "uint8", "int": "int32", "long": "int64",
    "float16": "half", "fp16": "half", "float32": "float", "fp32": "float",
    "float64": "double", "fp64": "double", "bf16": "bfloat16",
}

REDOPS = ("sum", "prod", "min", "max", "avg")


@dataclass(frozen=True)
class Coll:
    reduces: bool  # takes a reduction, so the redop column means something
    rooted: bool  # takes a root, so the root column means something
    chunked: bool  # the buffer is split into one piece per rank
    inplace: bool  # has an in-place form
    min_ranks: int


COLLS = {
    "all_reduce": Coll(reduces=True, rooted=False, chunked=False, inplace=True, min_ranks=1),
    "all_gather": Coll(reduces=False, rooted=False, chunked=True, inplace=True, min_ranks=1),
    "reduce_scatter": Coll(reduces=True, rooted=False, chunked=True, inplace=True, min_ranks=1),
    "broadcast": Coll(reduces=False, rooted=True, chunked=False, inplace=True, min_ranks=1),
    "reduce": Coll(reduces=True, rooted=True, chunked=False, inplace=True, min_ranks=1),
    "alltoall": Coll(reduces=False, rooted=False, chunked=True, inplace=False, min_ranks=1),
    # torch refuses a send to oneself, so a ring needs two ranks
    "sendrecv": Coll(reduces=False, rooted=False, chunked=False, inplace=False, min_ranks=2),
    "allreduce_coalesced": Coll(reduces=True, rooted=False, chunked=False, inplace=True, min_ranks=1),
}

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


# ----------------------------------------------------------------------------------------------
# Arithmetic: pure functions, unit-tested without processes.


def parse_size(text):
    """'64K' -> 65536. Suffixes are powers of 1024, as in nccl-tests; 'B'/'iB' may follow."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"invalid size {text!r} (expected e.g. 8, 64K, 1.5M, 2G)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value != int(value):
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    return int(value)


def size_sweep(minbytes, maxbytes, stepfactor=2.0, stepbytes=None):
    """The sizes from minbytes up to maxbytes: multiplied by stepfactor, or plus stepbytes if given."""
    if minbytes < 1:
        raise ValueError("minbytes must be at least 1")
    if minbytes > maxbytes:
        raise ValueError(f"minbytes ({minbytes}) is larger than maxbytes ({maxbytes})")
    if stepbytes is None and not stepfactor > 1:
        raise ValueError("stepfactor must be larger than 1")
    if stepbytes is not None and stepbytes < 1:
        raise ValueError("stepbytes must be at least 1")
    sizes = []
    s = minbytes
    while s <= maxbytes:
        sizes.append(s)
        # a fractional factor could round back to s; always move on
        s = s + stepbytes if stepbytes is not None else max(s + 1, int(s * stepfactor))
    return sizes


def elem_count(coll, size, elsize, nranks, ntensors=1):
    """(count, bytes) for one sweep size: count as printed, bytes = the whole array (size column).

    Sizes round down to whole elements (whole per-rank pieces for chunked collectives).
    """
    spec = COLLS[coll]
    pieces = nranks if spec.chunked else 1
    count = size // (elsize * pieces)
    nbytes = count * elsize * pieces
    if coll == "allreduce_coalesced":
        nbytes *= ntensors
    return count, nbytes


def busbw_factor(coll, nranks):
    if nranks < 1:
        raise ValueError("nranks must be at least 1")
    if coll in ("all_reduce", "allreduce_coalesced"):
        return 2.0 * (nranks - 1) / nranks
    if coll in ("all_gather", "reduce_scatter", "alltoall"):
        return (nranks - 1) / nranks
    if coll in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective {coll!r}")


def bandwidths(nbytes, time_us, coll, nranks):
    """(algbw, busbw) in GB/s (1e9 bytes per second) for nbytes moved in time_us microseconds."""
    if time_us is None or time_us <= 0:
        return None, None
    algbw = nbytes / (time_us * 1e3)
    return algbw, algbw * busbw_factor(coll, nranks)


def ratio(first, other):
    """first / other, or None where it is undefined."""
    if first is None or other is None or other == 0:
        return None
    return first / other


# the collectives whose traffic on a shared device is one read of each input and one write of each
# output, S bytes each per rank, so that 2*N*S/B bounds their time from below
SHARED_BOUND_COLLS = ("all_reduce", "allreduce_coalesced")


def shared_device_min_time_us(nbytes, nranks, copy_gbps):
    """t_min = 2*N*S/B in microseconds: N ranks on one device each read an S-byte input once and
    write an S-byte output once, at B GB/s counted as bytes read plus bytes written."""
    if nranks < 1:
        raise ValueError("nranks must be at least 1")
    if copy_gbps is None or copy_gbps <= 0:
        return None
    return 2.0 * nranks * nbytes / (copy_gbps * 1e3)


def bound_fraction(coll, nbytes, time_us, busbw, rate_gbps, device="cpu", ranks_per_device=None):
    """The bound column, or None where it is undefined.

    cpu: busbw / the single-core memcpy rate. cuda: t_min / time for the SHARED_BOUND_COLLS when
    all ranks share one device (ranks_per_device = the world size), None for anything else.
    """
    if not rate_gbps or rate_gbps <= 0:
        return None
    if device == "cpu":
        return busbw / rate_gbps if busbw is not None else None
    if coll not in SHARED_BOUND_COLLS or not ranks_per_device or time_us is None or time_us <= 0:
        return None
    return shared_device_min_time_us(nbytes, ranks_per_device, rate_gbps) / time_us


def bound_formula(device, ranks_per_device=None):
    """What the bound column is, in words, for the table and the JSON report."""
    if device == "cpu":
        return "busbw / memcpy_gbps"
    if ranks_per_device:
        return (f"t_min / time, t_min = 2*N*S/B, N = {ranks_per_device} ranks sharing one device,"
                f" S = size, B = device copy (read+write); {', '.join(SHARED_BOUND_COLLS)} only")
    return "N/A: t_min = 2*N*S/B holds for ranks sharing one device, and these ranks use several devices"


def cuda_device_index(local_rank, ndevices):
    """The GPU of a rank: ranks beyond the device count wrap around and share GPUs."""
    if ndevices < 1:
        raise ValueError("no CUDA device")
    return local_rank % ndevices


def failure_reason(exc, limit=300):
    """One line saying why a backend failed: the exception's type and the telling line of its
    message (NCCL errors put the cause after a 'Last error:' line)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if ln.startswith("Last error:"):
            cause = [ln[len("Last error:"):].strip()] + lines[i + 1:]
            cause = [c for c in cause if c]
            if cause:
                lines = cause
            break
    text = f"{type(exc).__name__}: {lines[0] if lines else 'no message'}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def count_wrong(actual, expected, tol=0.0):
    """Number of elements of actual that differ from expected by more than tol (NaN always counts)."""
    import torch

    if actual.shape != expected.shape:
        raise ValueError(f"shape {tuple(actual.shape)} does not match expected {tuple(expected.shape)}")
    if tol == 0:
        return int((actual != expected).sum())
    diff = (actual.to(torch.float64) - expected.to(torch.float64)).abs()
    return int((~(diff <= tol)).sum())


def pattern_kind(coll, redop):
    if not COLLS[coll].reduces:
        return "data"
    return {"sum": "sum", "avg": "sum", "prod": "prod", "min": "minmax", "max": "minmax"}[redop]


def pattern(rank, count, dtype, kind, offset=0):
    """The values rank contributes at elements [offset, offset+count) of its input.

    Small integers, so every reduction is exact in every type (no rounding-order effects, even in
    bfloat16, for any realistic rank count) and integer wrap-around is the same modular result
    whatever order a backend combines ranks in. The rank enters every formula so that data coming
    from the wrong rank, or a rank left out, shows up as wrong elements.
    """
    import torch

    i = torch.arange(offset, offset + count, dtype=torch.int64)
    if kind == "sum":
        v = (i + rank) % 4
    elif kind == "prod":
        v = 1 + (i + rank) % 2  # only 1 and 2: products stay exact powers of two
    elif kind == "minmax":
        v = (i * 5 + rank * 3) % 11
    elif kind == "data":
        v = (i * 7 + rank * 31) % 97  # below 127: fits int8; distinct per rank for < 97 ranks
    else:
        raise ValueError(f"unknown pattern kind {kind!r}")
    return v.to(dtype)


def reduce_patterns(parts, redop, dtype):
    """Reduction of the tensors in parts, computed in dtype the way any backend must agree with.

    avg comes back in float64: its division rounds, so it is compared with a tolerance.
    """
    import torch

    parts = list(parts)
    if redop == "avg":
        acc = parts[0].to(torch.float64)
        for p in parts[1:]:
            acc = acc + p.to(torch.float64)
        return acc / len(parts)
    acc = parts[0].clone()
    for p in parts[1:]:
        if redop == "sum":
            acc = acc + p
        elif redop == "prod":
            acc = acc * p
        elif redop == "min":
            acc = torch.minimum(acc, p)
        elif redop == "max":
            acc = torch.maximum(acc, p)
        else:
            raise ValueError(f"unknown reduction {redop!r}")
    return acc.to(dtype)


def expected_output(coll, rank, nranks, count, dtype, redop="sum", root=0, ntensors=1):
    """What rank must hold after coll when every rank's input is pattern(...); None where nothing
    is defined (a non-root rank after reduce). allreduce_coalesced gives its tensors concatenated."""
    import torch

    kind = pattern_kind(coll, redop)

    def pat(r, n=count, off=0):
        return pattern(r, n, dtype, kind, off)

    if coll == "all_reduce":
        return reduce_patterns((pat(r) for r in range(nranks)), redop, dtype)
    if coll == "reduce":
        return reduce_patterns((pat(r) for r in range(nranks)), redop, dtype) if rank == root else None
    if coll == "broadcast":
        return pat(root)
    if coll == "all_gather":
        return torch.cat([pat(r) for r in range(nranks)])
    if coll == "reduce_scatter":
        return reduce_patterns((pat(r, count, rank * count) for r in range(nranks)), redop, dtype)
    if coll == "alltoall":
        return torch.cat([pat(r, count, rank * count) for r in range(nranks)])
    if coll == "sendrecv":
        return pat((rank - 1) % nranks)
    if coll == "allreduce_coalesced":
        return torch.cat(
            [reduce_patterns((pat(r, count, k * count) for r in range(nranks)), redop, dtype) for k in range(ntensors)]
        )
    raise ValueError(f"unknown collective {coll!r}")


def avg_tolerance(dtype_name, nranks):
    """Slack for avg: a backend may divide before or after summing; patterns stay below 4."""
    import torch

    return (nranks + 1) * 4 * torch.finfo(getattr(torch, DTYPES[dtype_name][0])).eps


def make_record(backend, coll, size, count, dtype, redop, root, inplace, time_us, algbw, busbw, wrong):
    """One JSON result; redop/root as printed ("none" and -1 where the collective takes neither)."""
    return {
        "backend": backend,
        "op": coll,
        "size": int(size),
        "count": int(count),
        "type": dtype,
        "redop": redop,
        "root": int(root),
        "inplace": bool(inplace),
        "time_us": time_us,
        "algbw": algbw,
        "busbw": busbw,
        "wrong": wrong,
    }


def make_report(meta, results, bound=None, peak_rss_kib=(), ratios=(), not_run=()):
    """not_run: {"backend", "op", "size", "reason"} for each backend and collective that failed."""
    return {
        "meta": dict(meta),
        "results": list(results),
        "bound": bound,
        "peak_rss_kib": [int(x) for x in peak_rss_kib],
        "ratios": list(ratios),
        "not_run": list(not_run),
    }


def average_busbw(records, backend, coll=None):
    """Mean busbw over the sizes and both placements measured for backend (and coll)."""
    vals = [
        r["busbw"]
        for r in records
        if r["backend"] == backend and (coll is None or r["op"] == coll) and r["busbw"] is not None
    ]
    return sum(vals) / len(vals) if vals else None


def split_ops(tokens):
    """-o/--op tokens -> (collectives, reduction), checking the names."""
    colls, redops = [], []
    for tok in tokens:
        for name in tok.split(","):
            name = name.strip().lower()
            if not name:
                continue
            if name in COLLS:
                if name not in colls:
                    colls.append(name)
            elif name in REDOPS:
                if name not in redops:
                    redops.append(name)
            else:
                raise ValueError(
                    f"unknown operation {name!r} (collectives: {', '.join(COLLS)}; reductions: {', '.join(REDOPS)})"
                )
    if len(redops) > 1:
        raise ValueError(f"give at most one reduction, got {', '.join(redops)}")
    return colls or ["all_reduce"], redops[0] if redops else "sum"


def canonical_dtype(name):
    name = name.strip().lower()
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unknown datatype {name!r} (choose from {', '.join(DTYPES)})")
    return name


# ----------------------------------------------------------------------------------------------
# Table layout.

_LEFT = [("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 9), ("redop", "", 6), ("root", "", 5)]
_SIDE = [("time", "(us)", 10), ("algbw", "(GB/s)", 8), ("busbw", "(GB/s)", 8), ("#wrong", "", 7)]


def _fmt_time(t):
    if t is None:
        return "N/A"
    return f"{t:.2f}" if t < 1e4 else f"{t:.1f}" if t < 1e5 else f"{t:.0f}"


def _fmt(x, digits=2):
    return "N/A" if x is None else f"{x:.{digits}f}"


def table_columns(backends, bound):
    """The extra columns after the nccl-tests ones: the backend and ratios when comparing."""
    extra = []
    if len(backends) > 1:
        extra.append(("backend", "", max(8, max(len(b) for b in backends) + 1)))
        for b in backends[1:]:
            name = f"{backends[0]}/{b}"
            extra.append((name, "(busbw)", max(9, len(name) + 1)))
    if bound:
        extra.append(("bound", "(frac)", 7))
    return extra


def table_header(backends, bound):
    extra = table_columns(backends, bound)
    left_w = sum(w + 1 for _, _, w in _LEFT)
    side_w = sum(w + 1 for _, _, w in _SIDE)
    groups = "#" + " " * (left_w - 1) + "out-of-place".center(side_w) + "in-place".center(side_w)
    names = "#"
    units = "#"
    first = True
    for name, unit, w in _LEFT + _SIDE + _SIDE + extra:
        w = w - 1 if first else w  # the leading '#' takes a column of the first field
        names += " " + name.rjust(w)
        units += " " + unit.rjust(w)
        first = False
    return [groups.rstrip(), names, units.rstrip()]


def table_row(size, count, dtype, redop, root, oop, inp, extra=()):
    """oop / inp: (time_us, algbw, busbw, wrong) with None for N/A; extra: preformatted cells."""
    cells = [str(size), str(count), dtype, redop, str(root)]
    for side in (oop, inp):
        t, a, b, wr = side
        cells += [_fmt_time(t), _fmt(a), _fmt(b), "N/A" if wr is None else str(wr)]
    out = ""
    for (name, _, w), cell in zip(_LEFT + _SIDE + _SIDE, cells):
        out += " " + cell.rjust(w)
    return out


def extra_cells(backends, bound, backend, ratios, bound_frac):
    cells = []
    cols = table_columns(backends, bound)
    vals = []
    if len(backends) > 1:
        vals.append(backend)
        for b in backends[1:]:
            vals.append(_fmt(ratios.get(b)) if backend == backends[0] else "-")
    if bound:
        vals.append(_fmt(bound_frac, 3))
    for (_, _, w), v in zip(cols, vals):
        cells.append(" " + v.rjust(w))
    return "".join(cells)


STAT_KEYS = ("send_copied_bytes", "recv_copied_bytes", "single_copied_bytes", "rdma_zero_copy_bytes",
             "registrations", "registration_cache_hits", "gpu_direct_bytes", "host_rounds", "device_kernels",
             "device_in_place")


def stat_sums(stats):
    """railcc.stats() summed over transports, in STAT_KEYS order."""
    return [float(sum(row.get(k, 0) for row in stats.values())) for k in STAT_KEYS]


def per_call_stats(sums, calls, n):
    """Sums over the ranks of stat_sums(), per call and rank."""
    return {k: float(v) / (calls * n) for k, v in zip(STAT_KEYS, sums)}


def stats_line(coll, nbytes, inplace, s):
    """One line under a railcc row: what its transports did per call and rank."""
    def per_byte(k):
        return f"{s[k] / nbytes:.2f}" if nbytes else "-"
    return (f"#   stats {coll} {nbytes} B{' in place' if inplace else ''}, per call and rank: CPU copied "
            f"{s['send_copied_bytes']:.0f} B in ({per_byte('send_copied_bytes')}/B) and "
            f"{s['recv_copied_bytes']:.0f} B out ({per_byte('recv_copied_bytes')}/B); kernel single copy "
            f"{s['single_copied_bytes']:.0f} B; RDMA zero-copy {s['rdma_zero_copy_bytes']:.0f} B "
            f"(GPU memory {s['gpu_direct_bytes']:.0f} B); "
            f"registrations {s['registrations']:.2f}, cache hits {s['registration_cache_hits']:.2f}; "
            f"GPU: host rounds {s['host_rounds']:.2f}, one-kernel ops {s['device_kernels']:.2f} "
            f"(in place {s['device_in_place']:.2f})")


def plot(path, records, backends, colls):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError(f"--plot needs matplotlib ({e}); pip install matplotlib") from None
    # One panel per collective, log-log, one colour per backend. The fake group moves nothing:
    # its "bandwidth" is not one, so it is left out of the picture (it is in the tables).
    shown = [b for b in backends if b != "fake"]
    cols = min(len(colls), 3)
    rows = (len(colls) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.6 * rows), squeeze=False)
    for i, c in enumerate(colls):
        ax = axes[i // cols][i % cols]
        for j, b in enumerate(shown):
            pts = sorted(
                (r["size"], r["busbw"])
                for r in records
                if r["op"] == c and r["backend"] == b and not r["inplace"] and r["busbw"]
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b, color=f"C{j}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (B)")
        ax.set_ylabel("busbw (GB/s), out-of-place")
        ax.set_title(c)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    for k in range(len(colls), rows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
