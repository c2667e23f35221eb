"""railcc-bench across two "hosts": two network namespaces joined by a veth pair (needs root).

    python tools/bench_netns.py --per-host 1 -- --backend railcc,gloo -o all_reduce -b 1M -e 256M -f 4

starts torchrun in each namespace (--nnodes 2, --per-host ranks each) running railcc-bench with
the arguments after `--`, and prints what rank 0 printed. Ranks in different namespaces talk TCP
over the veth pair; ranks in one namespace use shared memory (railcc) or loopback TCP (gloo).
`--rate 1gbit` shapes host A's egress with tbf, for a slower cable.
"""

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))

from netns import netns_available, netns_unavailable_reason, two_hosts  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-host", type=int, default=1, help="ranks per namespace (default 1)")
    ap.add_argument("--rate", help="tbf rate for host A's egress, e.g. 1gbit (default: unshaped)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before everything is killed")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then railcc-bench arguments")
    args = ap.parse_args(argv)
    bench = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if not netns_available():
        print(f"bench_netns: network namespaces unavailable: {netns_unavailable_reason()}", file=sys.stderr)
        return 2
    with two_hosts(prefix="rccb", rate=args.rate) as h:
        port = 29300 + os.getpid() % 500
        procs = []
        for node in (0, 1):
            env = dict(os.environ, GLOO_SOCKET_IFNAME=h.interfaces[node], RAILCC_SOCKET_IFNAME=h.interfaces[node],
                       OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                    "--nproc-per-node", str(args.per_host), "--node-rank", str(node),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{h.addr_a}:{port}", "--rdzv-id", f"bench{port}",
                    "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}",
                    "--local-addr", h.addresses[node], "--max-restarts", "0",
                    "--module", "railcc.bench", *bench]
            procs.append(h.popen(node, argv, own_hostname=True, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + args.timeout
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(1, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                h.kill_all()
                outs.append(p.communicate()[0])
        # rank 0 runs on node 0 (torchrun orders ranks by node rank here)
        sys.stdout.write(outs[0])
        if any(p.returncode for p in procs):
            sys.stderr.write("bench_netns: a node failed; node 1 said:\n" + outs[1][-3000:])
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
