"""Reads railcc-bench JSON reports (scripts/gpu_check.sh) and prints, per report, the all_reduce
row at the largest size against issue 36's targets: at least 40% of the 2NS/B bound, and at
least 10x gloo on the same CUDA tensors. Also merges the reports into one file.

    python3 scripts/gpu_check_targets.py OUT.json [LABEL=]REPORT.json [[LABEL=]REPORT.json ...]

A LABEL (for example shots=, for RAILCC_CUDA_SHOTS=1) starts the report's line. The label symm=
names a report of tools/bench_symm_mem.py (torch's symmetric memory): its line compares it, at
8 bytes and at its largest size, with the railcc rows of the first shots= report of as many ranks
(issue 67: railcc at least equal).

Prints one markdown line per report; exits 0 (the figures are the result, not a verdict).
"""

import json
import sys

BOUND_TARGET = 0.40
GLOO_TARGET = 10.0


def summarize(report):
    """One line: ranks, size, railcc's fraction of the bound and its ratio to gloo."""
    meta = report.get("meta", {})
    rows = [r for r in report.get("results", []) if r["op"] == "all_reduce" and r["backend"] == "railcc"]
    if not rows:
        return f"no railcc all_reduce row ({len(report.get('not_run', []))} not run)"
    size = max(r["size"] for r in rows)
    best = min((r for r in rows if r["size"] == size), key=lambda r: r["time_us"] or float("inf"))
    frac = None
    for f in (report.get("bound") or {}).get("fractions", []):
        if f["backend"] == "railcc" and f["op"] == "all_reduce" and f["size"] == size and f["fraction"] is not None:
            frac = f["fraction"] if frac is None else max(frac, f["fraction"])
    ratio = None
    for r in report.get("ratios", []):
        if r["op"] == "all_reduce" and r["size"] == size and r["vs"] == "gloo" and r["ratio"] is not None:
            ratio = r["ratio"]
    ranks = meta.get("world_size", meta.get("nranks", "?"))
    bound_txt = "n/a" if frac is None else f"{frac:.0%} ({'meets' if frac >= BOUND_TARGET else 'below'} 40%)"
    ratio_txt = "n/a" if ratio is None else f"{ratio:.1f}x ({'meets' if ratio >= GLOO_TARGET else 'below'} 10x)"
    return (f"{ranks} ranks, all_reduce {size} B: {best['time_us']:.0f} us, busbw {best['busbw']:.1f} GB/s; "
            f"of the 2NS/B bound: {bound_txt}; vs gloo: {ratio_txt}")


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
        print(f"- {label + ': ' if label else ''}{summarize(report)}")
    with open(argv[0], "w") as f:
        json.dump(merged, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
