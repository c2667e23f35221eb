#!/usr/bin/env python3
"""Markdown tables for docs/benchmarks.md from railcc-bench JSON reports of one sweep.

    python3 tools/bench_tables.py [--best] docs/bench/same-host-2.json [more runs of the same sweep ...]

With several runs, each cell (op, size, out-of-place or in-place) is taken whole from the run
whose railcc time is the median of them (the lower one for an even count), so that every ratio
in a cell still compares backends of one run; the bound of a cell is that run's. With --best,
each backend's time in a cell is its best (lowest) over the runs instead, and the ratios compare
those bests ("best of three alternating runs"); a bound is then the best run's of that backend.

Per collective, one table of times in microseconds (the median of the slowest rank): railcc,
each other backend of the run (gloo, openmpi, fake: c10d's dispatch floor), then
  railcc/MPI    railcc's time over Open MPI's (<= 1: railcc at least as fast);
  over floor    railcc's time minus the floor's (what railcc adds to c10d's own dispatch),
                up to 64 KiB;
  gloo/railcc   gloo's time over railcc's (how many times faster railcc is);
  bound         busbw over the single-core memcpy rate of --bound, for railcc and Open MPI.
Out-of-place first, in-place after the slash where the collective has both.
"""

import json
import sys

from railcc.bench.report import ratio

SMALL = 64 << 10


def fmt_time(t):
    if t is None:
        return "-"
    return f"{t:.0f}" if t >= 100 else f"{t:.1f}"


def fmt_size(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def pair(a, b, f):
    """'a / b' for out-of-place and in-place; one value where there is no in-place figure."""
    if b is None:
        return f(a)
    return f"{f(a)} / {f(b)}"


def fmt_ratio(x):
    return "-" if x is None else f"{x:.2f}"


def tables(report):
    results = report["results"]
    bound = report.get("bound") or {}
    rate = bound.get("memcpy_gbps")
    backends = []
    for r in results:
        if r["backend"] not in backends:
            backends.append(r["backend"])
    others = [b for b in backends if b != "railcc"]
    ops = []
    for r in results:
        if r["op"] not in ops:
            ops.append(r["op"])
    by = {(r["backend"], r["op"], r["size"], r["inplace"]): r for r in results}

    def t(b, op, size, inplace):
        r = by.get((b, op, size, inplace))
        return r["time_us"] if r else None

    def fraction(b, op, size, inplace):  # busbw over the bound of the cell's own run
        r = by.get((b, op, size, inplace))
        return ratio(r["busbw"], r.get("_rate", rate)) if r else None

    out = []
    for op in ops:
        sizes = sorted({r["size"] for r in results if r["op"] == op})
        has_inplace = any(r["inplace"] for r in results if r["op"] == op)
        cols = ["size", "railcc"] + others
        if "openmpi" in others:
            cols.append("railcc/MPI")
        if "fake" in others:
            cols.append("over floor")
        if "gloo" in others:
            cols.append("gloo/railcc")
        if rate:
            cols += ["bound railcc"] + (["bound MPI"] if "openmpi" in others else [])
        out.append(f"**{op}** (us{', out-of-place / in-place' if has_inplace else ''})")
        out.append("")
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + "---:|" * len(cols))
        for s in sizes:
            ip = [False, True] if has_inplace else [False]

            def cell(f):
                vals = [f(x) for x in ip]
                return vals[0], (vals[1] if has_inplace else None)

            row = [fmt_size(s)]
            for b in ["railcc"] + others:
                a, c = cell(lambda x: t(b, op, s, x))
                row.append(pair(a, c, fmt_time))
            if "openmpi" in others:
                a, c = cell(lambda x: ratio(t("railcc", op, s, x), t("openmpi", op, s, x)))
                row.append(pair(a, c, fmt_ratio))
            if "fake" in others:
                def over(x):  # small messages only: above that the floor is noise beside the copy
                    r, f = t("railcc", op, s, x), t("fake", op, s, x)
                    return None if r is None or f is None or s > SMALL else r - f
                a, c = cell(over)
                row.append(pair(a, c, lambda v: "-" if v is None else f"{v:+.1f}"))
            if "gloo" in others:
                a, c = cell(lambda x: ratio(t("gloo", op, s, x), t("railcc", op, s, x)))
                row.append(pair(a, c, fmt_ratio))
            if rate:
                for b in ["railcc"] + (["openmpi"] if "openmpi" in others else []):
                    a, c = cell(lambda x: fraction(b, op, s, x))
                    row.append(pair(a, c, fmt_ratio))
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    if rate:
        rates = bound.get("runs_gbps") or [rate]
        out.append(f"Bound: single-core memcpy (torch copy_) of {fmt_size(bound.get('bytes', 0))}, "
                   f"best of 5: **{' / '.join(f'{x:.2f}' for x in rates)} GB/s**"
                   f"{' (one per run; each cell against its run)' if len(rates) > 1 else ''}.")
    if report.get("runs", 1) > 1:
        if report.get("pick") == "best":
            out.append(f"Each cell: every backend's best time of {report['runs']} runs.")
        else:
            out.append(f"Each cell: the run (of {report['runs']}) whose railcc time is the median.")
    for nr in report.get("not_run", []):
        out.append(f"Not run: {nr.get('backend')} {nr.get('op', '')}: {nr.get('reason', '')}")
    return "\n".join(out)


def _with_rate(record, report):
    """The record tagged with its run's memcpy rate, so that its bound is that run's."""
    rate = (report.get("bound") or {}).get("memcpy_gbps")
    return dict(record, _rate=rate) if rate else record


def _bound_of(reports):
    """The first run's bound, with every run's rate."""
    bounds = [rep.get("bound") for rep in reports if rep.get("bound")]
    return dict(bounds[0], runs_gbps=[b["memcpy_gbps"] for b in bounds]) if bounds else None


def median_runs(reports):
    """One report whose every cell comes whole from the run with the median railcc time."""
    if len(reports) == 1:
        return reports[0]
    keys = []
    per = []  # per run: cell -> its records, each tagged with that run's memcpy rate
    for rep in reports:
        cells = {}
        for r in rep["results"]:
            k = (r["op"], r["size"], r["inplace"])
            if k not in cells and k not in keys:
                keys.append(k)
            cells.setdefault(k, []).append(_with_rate(r, rep))
        per.append(cells)
    results = []
    for k in keys:
        have = [c for c in per if k in c]

        def railcc_time(cells):
            mine = [r for r in cells[k] if r["backend"] == "railcc"]
            return mine[0]["time_us"] if mine else float("inf")

        have.sort(key=railcc_time)
        results += have[(len(have) - 1) // 2][k]
    return dict(reports[0], results=results, bound=_bound_of(reports), runs=len(reports),
                not_run=reports[0].get("not_run", []))


def best_runs(reports):
    """One report whose every cell holds each backend's best (lowest) time over the runs."""
    if len(reports) == 1:
        return reports[0]
    best = {}  # (backend, op, size, inplace) -> the fastest record
    for rep in reports:
        for r in rep["results"]:
            k = (r["backend"], r["op"], r["size"], r["inplace"])
            if r.get("time_us") is not None and (k not in best or r["time_us"] < best[k]["time_us"]):
                best[k] = _with_rate(r, rep)
    return dict(reports[0], results=list(best.values()), bound=_bound_of(reports), runs=len(reports), pick="best",
                not_run=reports[0].get("not_run", []))


def main(argv):
    args = argv[1:]
    pick = median_runs
    if args and args[0] == "--best":
        pick, args = best_runs, args[1:]
    if not args:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    reports = []
    for path in args:
        with open(path) as f:
            reports.append(json.load(f))
    print(tables(pick(reports)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
