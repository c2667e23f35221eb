#!/usr/bin/env bash
# The CPU collectives on one host against their targets (docs/benchmarks.md, "Where the CPU
# targets stand"): 2 ranks each bound to a CPU of its own and 4 ranks sharing the machine's
# cores, railcc beside Open MPI (mpi4py under mpirun), gloo and c10d's own dispatch (torch's
# fake process group) in each run; RUNS alternations of the whole set (3 by default), then
# tables where each backend's cell is its best of the runs (tools/bench_tables.py --best).
# Needs the install of scripts/install.sh. Run it on an otherwise idle machine.
#
#   bash tools/bench_cpu_targets.sh [OUTDIR]      (default: docs/bench/targets)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/bench/targets}
mkdir -p "$out"
RUNS=${RUNS:-3}
OPS=all_reduce,all_gather,reduce_scatter,broadcast
for k in $(seq 1 "$RUNS"); do
  echo "== run $k of $RUNS: 2 ranks, 8 bytes, against c10d's dispatch"
  railcc-bench --backend railcc,fake --nprocs 2 --bind -o $OPS -b 8 -e 8 -n 20000 -w 1000 -c 0 \
    --json "$out/small-2-$k.json" | tee "$out/small-2-$k.txt"
  # Up to 1 MiB, 100 calls first: a FIFO's first pass makes its pages (shared memory is reserved
  # at first write), which a job pays once per FIFO and a sweep of few calls would pay per size.
  echo "== run $k of $RUNS: 2 ranks, 64 KiB .. 1 MiB"
  railcc-bench --backend railcc,openmpi,gloo,fake --nprocs 2 --bind -o $OPS -b 64K -e 1M -f 4 -n 50 -w 100 \
    --json "$out/mid-2-$k.json" | tee "$out/mid-2-$k.txt"
  echo "== run $k of $RUNS: 2 ranks, 4 MiB .. 256 MiB"
  railcc-bench --backend railcc,openmpi,gloo,fake --nprocs 2 --bind -o $OPS -b 4M -e 256M -f 4 -n 20 -w 3 \
    --json "$out/large-2-$k.json" | tee "$out/large-2-$k.txt"
  # Issue 70's small messages where ranks outnumber the cores (a CI runner testing distributed
  # code): gloo's 8-byte calls take ~1 ms here, so few calls.
  echo "== run $k of $RUNS: 4 ranks on the machine's cores, 8 B .. 32 KiB"
  railcc-bench --backend railcc,openmpi,gloo,fake --nprocs 4 -o $OPS -b 8 -e 32K -f 64 -n 300 -w 30 \
    --json "$out/small-4-$k.json" | tee "$out/small-4-$k.txt"
  # From 1 MiB four ranks on two cores move 10-40% between calls: at 1 and 4 MiB, where a call
  # is cheap, 50 calls after 10 (the median of 10 after 2 read 0.67 and 1.56 of Open MPI's
  # time for one cell in two runs of one build, 2026-12-08 in docs/benchmarks.md).
  echo "== run $k of $RUNS: 4 ranks on the machine's cores, 1 MiB .. 4 MiB"
  railcc-bench --backend railcc,openmpi,gloo,fake --nprocs 4 -o $OPS,alltoall -b 1M -e 4M -f 4 -n 50 -w 10 \
    --json "$out/large-4-$k.json" | tee "$out/large-4-$k.txt"
  echo "== run $k of $RUNS: 4 ranks on the machine's cores, 16 MiB .. 256 MiB"
  railcc-bench --backend railcc,openmpi,gloo,fake --nprocs 4 -o $OPS,alltoall -b 16M -e 256M -f 4 -n 10 -w 2 \
    --json "$out/huge-4-$k.json" | tee "$out/huge-4-$k.txt"
done
for set in small-2 mid-2 large-2 small-4 large-4 huge-4; do
  python3 tools/bench_tables.py --best "$out"/$set-*.json > "$out/$set.md"
done
echo "tables: $out/small-2.md $out/mid-2.md $out/large-2.md $out/small-4.md $out/large-4.md $out/huge-4.md"
