"""railcc doctor --all-ranks: every rank of a torchrun job publishes its report through the
job's store, and rank 0 prints one table of the facts that differ between hosts (variables,
rail counts, GID indices, MTUs, driver versions): the usual cause of mixed-cluster hangs."""

import json
import os
import sys
import time
from datetime import timedelta

from .inputs import BadReport, doctor_report


def _store(job, timeout):
    """The job's store (job: inputs.torchrun_env's checked variables); rank 0 serves it unless torchrun's agent
    does."""
    from torch.distributed import TCPStore

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return TCPStore(job["addr"], job["port"], job["world"], is_master=(job["rank"] == 0 and not agent),
                    timeout=timedelta(seconds=timeout), wait_for_workers=False)


def differences(reports):
    """{fact: {value: [(host, rank), ...]}} for every fact whose value is not the same on all
    ranks (a fact one rank lacks counts as "(absent)")."""
    keys = sorted({k for r in reports for k in r["facts"]})
    out = {}
    for k in keys:
        by_value = {}
        for r in reports:
            by_value.setdefault(r["facts"].get(k, "(absent)"), []).append((r["host"], r["rank"]))
        if len(by_value) > 1:
            out[k] = by_value
    return out


def format_differences(reports, diff):
    hosts = sorted({r["host"] for r in reports})
    lines = [f"railcc doctor --all-ranks: {len(reports)} ranks on {len(hosts)} host(s)", ""]
    failed = [r for r in reports if r["failed"]]
    for r in failed:
        bad = ", ".join(c["check"] for c in r["checks"] if c["verdict"] == "fail")
        lines.append(f"rank {r['rank']} on {r['host']}: {r['failed']} failed check(s): {bad}")
    if not diff:
        lines.append("every rank sees the same facts (variables, rails, GIDs, MTUs, versions)")
        return "\n".join(lines)
    lines.append(f"{len(diff)} fact(s) differ between ranks:")
    w = max(len(k) for k in diff)
    for k, by_value in diff.items():
        for value, where in sorted(by_value.items(), key=lambda kv: -len(kv[1])):
            ranks = ",".join(str(rk) for _, rk in where)
            hs = ",".join(sorted({h for h, _ in where}))
            lines.append(f"  {k:<{w}}  {value!s:<24} on {hs} (rank {ranks})")
    return "\n".join(lines)


def gather_and_compare(report, args, job):
    """job: the torchrun variables, checked (inputs.torchrun_env)."""
    rank, world = job["rank"], job["world"]
    prefix = f"railcc-doctor/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/"
    store = _store(job, args.timeout)
    store.set(f"{prefix}{rank}", json.dumps(report))
    verdict_key = f"{prefix}verdict"
    if rank != 0:
        print(f"rank {rank} on {report['host']}: {report['failed']} failed, {report['warnings']} warnings "
              f"(rank 0 prints the comparison)")
        # Every rank exits with the job's verdict, so torchrun sees one outcome on every node.
        try:
            verdict = store.get(verdict_key)
        except Exception as e:  # noqa: BLE001 - rank 0 gone: say so, fail
            print(f"railcc doctor --all-ranks: no verdict from rank 0: {e}", file=sys.stderr)
            return 1
        if verdict not in (b"0", b"1"):
            print(f"railcc doctor --all-ranks: rank 0's verdict is {verdict[:20]!r}, expected 0 or 1", file=sys.stderr)
            return 1
        return int(verdict)
    reports, deadline = [report], time.monotonic() + args.timeout
    for r in range(1, world):
        key = f"{prefix}{r}"
        while not store.check([key]):
            if time.monotonic() > deadline:
                got = ", ".join(str(x["rank"]) for x in reports)
                print(f"railcc doctor --all-ranks: rank {r} sent no report within {args.timeout:.0f}s "
                      f"(have ranks {got})", file=sys.stderr)
                store.set(verdict_key, "1")
                return 1
            time.sleep(0.05)
        try:
            reports.append(doctor_report(store.get(key), r))
        except BadReport as e:  # another rank's record: said, and the others get a verdict instead of a timeout
            print(f"railcc doctor --all-ranks: {e}", file=sys.stderr)
            store.set(verdict_key, "1")
            return 1
    diff = differences(reports)
    if args.json:
        print(json.dumps({"reports": reports, "differences": diff}, indent=2))
    else:
        from . import format_report

        print(format_report(report))
        print()
        print(format_differences(reports, diff))
    code = 1 if diff or any(r["failed"] for r in reports) else 0
    store.set(verdict_key, str(code))
    return code
