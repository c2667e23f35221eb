#!/usr/bin/env bash
# Regenerates the figures of docs/benchmarks.md: railcc and gloo side by side in each run.
# Needs the install of scripts/install.sh; the cross-host runs need root (network namespaces).
# Run it on an otherwise idle machine: the numbers are only as quiet as the host.
#
#   bash scripts/bench_docs.sh [OUTDIR]      (default: docs/bench)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/bench}
mkdir -p "$out"
B="railcc-bench --backend railcc,gloo"
SAME="-o all_reduce,all_gather,reduce_scatter,broadcast -b 1M -e 256M -f 4 -n 10 -w 2"

for n in 2 4; do
  echo "== same host, $n ranks: sizes 1 MiB .. 256 MiB"
  $B --nprocs $n $SAME --bound --json "$out/same-host-$n.json" --plot "$out/same-host-$n.png" | tee "$out/same-host-$n.txt"
  echo "== same host, $n ranks: 8-byte all_reduce latency"
  $B --nprocs $n -o all_reduce -b 8 -e 8 -n 2000 -w 200 | tee "$out/latency-$n.txt"
  echo "== same host, $n ranks: allreduce_coalesced of 256 tensors of 4 KiB"
  $B --nprocs $n -o allreduce_coalesced --ntensors 256 -b 4K -e 4K -n 50 -w 5 | tee "$out/coalesced-$n.txt"
done

echo "== memory: peak RSS at 8 MiB and at 256 MiB, each backend alone, no result check"
for b in railcc gloo; do
  for s in 8M 256M; do
    railcc-bench --backend $b --nprocs 2 -o all_reduce -b $s -e $s -n 3 -w 1 -c 0 | tee "$out/rss-$b-$s.txt"
  done
done

for per in 1 2; do
  echo "== two namespaces (TCP across), $per rank(s) per host"
  python3 scripts/bench_netns.py --per-host $per -- --backend railcc,gloo -o all_reduce -b 1M -e 256M -f 4 -n 10 -w 2 \
    --json "$out/netns-$((2 * per)).json" | tee "$out/netns-$((2 * per)).txt"
done
