"""railcc doctor: checks this host's GPU, RDMA, network, shared-memory and NUMA set-up and
says, for each problem, the exact fix.

    railcc doctor [--json] [--local-ranks N] [--world N] [--root DIR] [--all-ranks]

Exit status: 0 when no check fails, 1 otherwise (warnings do not fail). With --all-ranks,
under torchrun, every rank runs the checks and rank 0 also prints what differs between
hosts; a difference fails too. RAILCC_SYSFS_ROOT (or --root) points every read at another
sysfs/procfs tree, for tests.
"""

import argparse
import json
import os
import socket
import sys
import textwrap

from .checks import FAIL, NA, OK, WARN, Context, run_checks
from .inputs import MAX_LOCAL_RANKS, MAX_WORLD, UsageError, count, env_count, seconds, torchrun_env
from .system import System


def _railcc_facts():
    """(params, cuda info, versions) from the installed railcc, or empty ones with the reason
    when its extension does not load (the doctor must still run then)."""
    versions = {}
    try:
        import torch

        versions["torch"] = torch.__version__
    except Exception as e:  # noqa: BLE001 - reported, not raised
        versions["torch"] = f"(import failed: {e})"
    try:
        import railcc

        versions["railcc"] = railcc.__version__
        return railcc.params(), railcc.cuda_info(), versions
    except Exception as e:  # noqa: BLE001
        versions["railcc"] = f"(import failed: {e})"
        return [], None, versions


def collect(root=None, env=None, local_ranks=None, world=None, local_rank=None):
    """Runs every check. Returns the report as a dict (what --json prints)."""
    env = dict(os.environ if env is None else env)
    params, cuda, versions = _railcc_facts()
    system = System(root or env.get("RAILCC_SYSFS_ROOT"))
    ctx = Context(system, env, local_ranks=local_ranks, world=world, local_rank=local_rank, params=params, cuda=cuda)
    rows = run_checks(ctx)
    facts = dict(ctx.facts)
    facts["kernel"] = system.osrelease() or "?"
    facts.update(versions)
    return {
        "host": socket.gethostname(),
        "rank": env_count(env, "RANK", 0, MAX_WORLD - 1),
        "root": system.root,
        "checks": [r.__dict__ for r in rows],
        "facts": facts,
        "failed": sum(r.verdict == FAIL for r in rows),
        "warnings": sum(r.verdict == WARN for r in rows),
    }


def format_report(report, width=None):
    width = width or 110
    name_w = min(24, max(len(c["check"]) for c in report["checks"]))
    lines = [f"railcc doctor on {report['host']}" + (f" (tree {report['root']})" if report["root"] != "/" else ""), ""]
    lines.append(f"{'CHECK':<{name_w}}  {'VERDICT':<7}  FOUND / FIX")
    indent = " " * (name_w + 11)
    for c in report["checks"]:
        body = textwrap.wrap(c["found"], width=max(40, width - len(indent))) or [""]
        lines.append(f"{c['check']:<{name_w}}  {c['verdict'].upper():<7}  {body[0]}")
        lines.extend(indent + b for b in body[1:])
        if c["fix"]:
            fix = textwrap.wrap("fix: " + c["fix"], width=max(40, width - len(indent)))
            lines.extend(indent + b for b in fix)
    lines.append("")
    lines.append(f"{report['failed']} failed, {report['warnings']} warnings, "
                 f"{sum(c['verdict'] == OK for c in report['checks'])} ok, "
                 f"{sum(c['verdict'] == NA for c in report['checks'])} not applicable")
    return "\n".join(lines)


def _parser():
    ap = argparse.ArgumentParser(prog="railcc doctor", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--local-ranks", type=count(1, MAX_LOCAL_RANKS),
                    help=f"ranks per host the job will run, 1 to {MAX_LOCAL_RANKS} (default: LOCAL_WORLD_SIZE, else one "
                         f"per GPU)")
    ap.add_argument("--world", type=count(1, MAX_WORLD),
                    help=f"ranks in the whole job, 1 to {MAX_WORLD} (default: WORLD_SIZE, else one host)")
    ap.add_argument("--root", help="read sysfs/procfs under this directory (default: RAILCC_SYSFS_ROOT, else /)")
    ap.add_argument("--all-ranks", action="store_true",
                    help="under torchrun: every rank checks its host, rank 0 prints what differs between hosts")
    ap.add_argument("--timeout", type=seconds, default=120.0, help="seconds --all-ranks waits for the other ranks")
    return ap


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.root and not os.path.isdir(args.root):
        print(f"railcc doctor: --root {args.root!r} is not a directory", file=sys.stderr)
        return 2
    try:  # torchrun's variables first: a careless one is said before the checks run, not after
        job = torchrun_env(os.environ, "railcc doctor --all-ranks") if args.all_ranks else None
        report = collect(root=args.root, local_ranks=args.local_ranks, world=args.world)
    except UsageError as e:
        print(f"railcc doctor{' --all-ranks' if args.all_ranks else ''}: {e}", file=sys.stderr)
        return 2
    if args.all_ranks:
        from .across import gather_and_compare

        return gather_and_compare(report, args, job)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if report["failed"] else 0
