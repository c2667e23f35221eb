"""Reads railcc-bench JSON reports (scripts/gpu_check.sh) and prints, per report and op
(all_reduce, all_gather, broadcast, those it has), the railcc row at the largest size against
issue 67's targets: 2 ranks, all_reduce at least 25% of its bound (2NS/B, from the device copy
rate of the same run) and 20x gloo, all_gather and broadcast at least 40% of theirs; 4 ranks,
all_reduce at least 15%; and at 2 ranks an 8-byte op at most 2x one process's own event round
trip (measured with the bound). Also merges the reports into one file.

    python3 scripts/gpu_check_targets.py OUT.json [LABEL=]REPORT.json [[LABEL=]REPORT.json ...]

A LABEL (for example shots=, for RAILCC_CUDA_SHOTS=1) starts the report's lines. The label symm=
names a report of tools/bench_symm_mem.py (torch's symmetric memory): its line compares it, at
8 bytes and at its largest size, with the railcc rows of the first shots= report of as many ranks
(issue 67: railcc at least equal).

Prints markdown lines; exits 0 (the figures are the result, not a verdict).
"""

import json
import sys

# (op, ranks) -> (fraction of the bound, ratio to gloo); None: no target for it
TARGETS = {("all_reduce", 2): (0.25, 20.0), ("all_reduce", 4): (0.15, None),
           ("all_gather", 2): (0.40, None), ("broadcast", 2): (0.40, None)}
OPS = ("all_reduce", "all_gather", "broadcast")


def summarize(report):
    """Lines, one per op: ranks, size, railcc's fraction of the bound and its ratio to gloo."""
    meta = report.get("meta", {})
    ranks = meta.get("world_size", meta.get("nranks", "?"))
    lines = []
    for op in OPS:
        rows = [r for r in report.get("results", []) if r["op"] == op and r["backend"] == "railcc"]
        if not rows:
            continue
        size = max(r["size"] for r in rows)
        best = min((r for r in rows if r["size"] == size), key=lambda r: r["time_us"] or float("inf"))
        frac = None
        for f in (report.get("bound") or {}).get("fractions", []):
            if f["backend"] == "railcc" and f["op"] == op and f["size"] == size and f["fraction"] is not None:
                frac = f["fraction"] if frac is None else max(frac, f["fraction"])
        ratio = None
        for r in report.get("ratios", []):
            if r["op"] == op and r["size"] == size and r["vs"] == "gloo" and r["ratio"] is not None:
                ratio = r["ratio"]
        bound_target, gloo_target = TARGETS.get((op, ranks), (None, None))
        bound_txt = "n/a" if frac is None else (
            f"{frac:.0%}" if bound_target is None else
            f"{frac:.0%} ({'meets' if frac >= bound_target else 'below'} {bound_target:.0%})")
        ratio_txt = "n/a" if ratio is None else f"{ratio:.1f}x" + (
            "" if gloo_target is None else f" ({'meets' if ratio >= gloo_target else 'below'} {gloo_target:.0f}x)")
        lines.append(f"{ranks} ranks, {op} {size} B: {best['time_us']:.0f} us, busbw {best['busbw']:.1f} GB/s; "
                     f"of the 2NS/B bound: {bound_txt}; vs gloo: {ratio_txt}")
    rtt = (report.get("bound") or {}).get("event_round_trip_us")
    small = [r for r in report.get("results", []) if r["backend"] == "railcc" and r["size"] <= 8 and r["time_us"]]
    if rtt and small and ranks == 2:
        for op in OPS:
            mine = [r["time_us"] for r in small if r["op"] == op]
            if mine:
                t = min(mine)
                lines.append(f"{ranks} ranks, {op} 8 B: {t:.1f} us, {t / rtt:.2f}x one process's event round trip "
                             f"({rtt:.1f} us; {'meets' if t <= 2 * rtt else 'above'} 2x)")
    if not lines:
        return [f"no railcc all_reduce, all_gather or broadcast row ({len(report.get('not_run', []))} not run)"]
    return lines


def compare_symm(symm, shots_reports):
    """One line: torch's one-shot and two-shot all-reduce beside railcc's one-kernel rows."""
    n = symm.get("meta", {}).get("world_size")
    rows = symm.get("results", [])
    if not rows:
        return f"{n} ranks: no symmetric-memory rows"
    ours = next((r for r in shots_reports if r.get("meta", {}).get("world_size") == n), None)
    mine = {} if ours is None else {
        r["size"]: r["time_us"] for r in ours.get("results", [])
        if r["op"] == "all_reduce" and r["backend"] == "railcc" and r["time_us"]}
    parts = []
    for size, op in ((min(r["size"] for r in rows), "one_shot_all_reduce"),
                     (max(r["size"] for r in rows), "two_shot_all_reduce_")):
        theirs = [r["time_us"] for r in rows if r["size"] == size and r["op"] == op]
        if not theirs:
            continue
        t = min(theirs)
        if size in mine:
            ratio = t / mine[size]
            parts.append(f"{size} B: {op} {t:.1f} us, railcc {mine[size]:.1f} us, symm/railcc {ratio:.2f} "
                         f"({'meets' if ratio >= 1.0 else 'below'} 1.0)")
        else:
            parts.append(f"{size} B: {op} {t:.1f} us (no railcc row at this size)")
    return f"{n} ranks, torch symmetric memory: " + "; ".join(parts)


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    merged, shots = [], []
    for arg in argv[1:]:
        label, _, path = arg.rpartition("=")
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, ValueError) as e:
            print(f"- {path}: no report ({e})")
            continue
        merged.append(report)
        if label == "symm":
            print(f"- symm: {compare_symm(report, shots)}")
            continue
        if label == "shots":
            shots.append(report)
        for line in summarize(report):
            print(f"- {label + ': ' if label else ''}{line}")
    with open(argv[0], "w") as f:
        json.dump(merged, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
