#!/usr/bin/env bash
# Regenerates the figures of docs/benchmarks.md: railcc beside its anchors (gloo, Open MPI, c10d's
# dispatch floor, the memcpy bound) in each run.
# Needs the install of scripts/install.sh; the cross-host runs need root (network namespaces).
# Run it on an otherwise idle machine: the numbers are only as quiet as the host.
#
#   bash tools/bench_docs.sh [OUTDIR]      (default: docs/bench)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/bench}
mkdir -p "$out"
B="railcc-bench --backend railcc,gloo"
# One host: railcc beside gloo, Open MPI (mpi4py under mpirun, shared memory) and c10d's own
# dispatch (torch's fake process group), every collective, 16 B .. 256 MiB.
REFS="--backend railcc,gloo,openmpi,fake"
SAME="-o all_reduce,all_gather,reduce_scatter,broadcast,reduce,alltoall -b 16 -e 256M -f 16 -n 10 -w 2"

# RUNS full runs of each (3 by default): the tables take each cell from the run whose railcc time
# is the median (tools/bench_tables.py), since one run of a shared VM has outliers of several x.
RUNS=${RUNS:-3}
for n in 2 4; do
  for k in $(seq 1 "$RUNS"); do
    echo "== same host, $n ranks: sizes 16 B .. 256 MiB (run $k of $RUNS)"
    plot=(); [ "$k" = 1 ] && plot=(--plot "$out/same-host-$n.png")
    railcc-bench $REFS --nprocs $n $SAME --bound --json "$out/same-host-$n-$k.json" "${plot[@]}" \
      | tee "$out/same-host-$n-$k.txt"
    echo "== same host, $n ranks: 8-byte all_reduce and broadcast latency (run $k of $RUNS)"
    railcc-bench $REFS --nprocs $n -o all_reduce,broadcast -b 8 -e 8 -n 2000 -w 200 --json "$out/latency-$n-$k.json" \
      | tee "$out/latency-$n-$k.txt"
  done
  python3 tools/bench_tables.py "$out"/same-host-$n-*.json > "$out/same-host-$n.md"
  python3 tools/bench_tables.py "$out"/latency-$n-*.json > "$out/latency-$n.md"
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
  python3 tools/bench_netns.py --per-host $per -- --backend railcc,gloo -o all_reduce -b 1M -e 256M -f 4 -n 10 -w 2 \
    --json "$out/netns-$((2 * per)).json" | tee "$out/netns-$((2 * per)).txt"
done
