"""python -m railcc env [--markdown]   list railcc's parameters (effective values, sources)
python -m railcc bench ...          same as railcc-bench
python -m railcc trace DIR [--json]  merge the flight-recorder dumps of all ranks into one verdict
python -m railcc doctor [--json]     check this host's GPU/RDMA/network/shm/NUMA set-up, with fixes
                                     (railcc doctor --help; --all-ranks under torchrun compares hosts)
python -m railcc topo [--json]       GPUs, NICs, PCI paths (PIX/PXB/PHB/SYS), NUMA, each local rank's
                                     NIC and rail, GPUDirect RDMA verdicts (--topo-file FILE: hwloc XML)
python -m railcc sim [-n 1024,4096]  simulate the schedules at any job size: algorithm, critical path,
                                     peers, messages and bytes per rank, set-up store reads and memory"""

import sys


def _allowed(p):
    a = p["allowed"]
    if ".." in a:
        lo, hi = a.split("..")
        return f"{lo} to {hi}"
    return a.replace("|", ", ")


def env_table(markdown=False):
    from . import params

    rows = params()
    if markdown:
        out = ["| variable | NCCL fallback | type | default | allowed | meaning |", "|---|---|---|---|---|---|"]
        for p in rows:
            out.append(f"| `{p['env']}` | {('`' + p['fallback'] + '`') if p['fallback'] else ''} | {p['type']} | "
                       f"`{p['default']}` | {_allowed(p)} | {p['description']} |")
        return "\n".join(out)
    width = max(len(p["env"]) for p in rows)
    lines = []
    for p in rows:
        lines.append(f"{p['env']:<{width}}  {p['value']!r:<14} ({p['source']})  {p['description']}")
        if p["problem"]:
            lines.append(f"{'':<{width}}  ^ REFUSED: {p['problem']}; init fails until it is fixed")
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] == "env":
        print(env_table(markdown="--markdown" in argv))
        return 0
    if argv[0] == "trace":
        from .trace import main as trace_main

        return trace_main(argv[1:])
    if argv[0] == "doctor":
        from .doctor import main as doctor_main

        return doctor_main(argv[1:])
    if argv[0] == "topo":
        from .topo import main as topo_main

        return topo_main(argv[1:])
    if argv[0] == "sim":
        from .sim import main as sim_main

        return sim_main(argv[1:])
    if argv[0] == "bench":
        from .bench import main as bench_main

        return bench_main(argv[1:])
    print(f"unknown command {argv[0]!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
