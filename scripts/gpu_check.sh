#!/usr/bin/env bash
# The first-GPU check (issue 36), one command for one call of the lent GPU machine (at most 9
# minutes; no network there; torch, nvcc, CMake, ninja, pytest already installed):
#
#   bash scripts/gpu_check.sh             # on the GPU machine, from the repository root
#   bash scripts/gpu_check.sh --dry-run   # here, without a GPU: every step's command on what
#                                         # this machine has (CPU buffers, the fake device)
#
# Steps, each under its own timeout cut to the time left, so one hang cannot eat the call:
#   env       the machine: GPU, driver, nvcc, torch, hwloc/rdma-core presence, cores
#   build     the extension and the CUDA plugin against the image's torch (ninja, every core,
#             only this GPU's architecture); then railcc.cuda_info(), railcc topo, railcc doctor
#   watchdog  a GPU op that never finishes (a kernel sleeping past the timeout) timed out
#   nccl      nccl with 2 ranks on the one GPU, its error recorded
#   bench     railcc-bench --device cuda --bound, railcc and gloo on the same CUDA tensors,
#             all_reduce/all_gather/reduce_scatter/broadcast, 8 B to 256 MiB (4x steps), 2 then 4 ranks
#   symm      torch's symmetric memory all-reduce (one-shot, two-shot), 2 ranks: the second anchor
#   bench_shots  the same for all_reduce with RAILCC_CUDA_SHOTS=1 (one kernel per tensor), 2 and 4
#             ranks; then all_reduce, all_gather and broadcast at 2 ranks on buffers from
#             allocate_tensor (--alloc backend: the heap that peers read in place)
#   bench_signals  the CUDA IPC path with RAILCC_CUDA_IPC_SIGNALS=1 (steps ordered by the streams'
#             signals, no host round), all_reduce/all_gather/broadcast at 2 ranks
#   test_cuda tests/python/test_cuda.py with the time left: by default a cross-section (every
#             collective at 2 ranks over CUDA IPC and 3 staged, stream semantics, TCP, DDP and
#             FSDP2 against a single-process reference); RAILCC_GPU_CHECK_K="not
#             watchdog_times_out" runs all 38 (2, 3 and 4 ranks, ~13 minutes)
#
# Writes at most 8 files to $OUT (default /tmp/railcc-gpu-check): summary.md (a line per step,
# written as each ends, so a cut-off run still says how far it got), env.log, build.log,
# watchdog.log, nccl.log, test_cuda.log, bench.log, bench.json. Exit status: 0 when every step
# passed, 1 otherwise. RAILCC_GPU_CHECK_BUDGET (seconds) is the whole run's limit: 520 by
# default, 1800 for --dry-run, which builds with RAILCC_BUILD_JOBS (default 1) jobs.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

DRY=0
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $a (--dry-run, --help)" >&2; exit 2 ;;
  esac
done

OUT=${OUT:-/tmp/railcc-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
START=$(date +%s)
# The dry run builds with one job (small CI machines): it gets longer.
BUDGET=${RAILCC_GPU_CHECK_BUDGET:-$([ $DRY = 1 ] && echo 1800 || echo 520)}
SUMMARY="$OUT/summary.md"
FAILED=0
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# This tree's railcc, whatever else is installed.
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
WORK=$(mktemp -d /tmp/railcc-gpu-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
export DRY PY ROOT WORK arch  # the steps below run in child shells

left() { echo $((BUDGET - ($(date +%s) - START))); }

# RAILCC_GPU_CHECK_ONLY="test_cuda,bench" runs only those steps (env and build always run), for
# a second call; RAILCC_GPU_CHECK_K replaces the -k expression of the test_cuda step.
ONLY=${RAILCC_GPU_CHECK_ONLY:-}
run_step() {
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$1,"* ]]; then
    echo "| $1 | NOT RUN | 0 | not in RAILCC_GPU_CHECK_ONLY=$ONLY |" >> "$SUMMARY"
    return 0
  fi
  step "$@"
}

# step NAME MAX_SECONDS LOG COMMAND...: runs COMMAND with its output in LOG, under a timeout of
# MAX_SECONDS or what is left of the budget (keeping 10 s for the summary), and appends its line.
step() {
  local name=$1 max=$2 log=$3
  shift 3
  local t=$(( $(left) - 10 ))
  [ "$t" -gt "$max" ] && t=$max
  if [ "$t" -lt 5 ]; then
    echo "| $name | SKIPPED | 0 | no time left in the ${BUDGET} s budget |" >> "$SUMMARY"
    FAILED=1
    return 1
  fi
  local s0=$(date +%s)
  echo "### $name: $* (timeout ${t}s)" >> "$log"
  if declare -F "$1" >/dev/null; then  # a function of this script: timeout needs a program
    timeout -k 5 "$t" bash -c "$(declare -f "$1"); $*" >> "$log" 2>&1
  else
    timeout -k 5 "$t" "$@" >> "$log" 2>&1
  fi
  local rc=$?
  local took=$(( $(date +%s) - s0 ))
  local verdict=PASS detail
  detail=$(grep -v '^\s*$' "$log" | tail -1 | cut -c1-200 | tr '|' '/')
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict=TIMEOUT; detail="killed after ${t}s; last line: $detail"
  elif [ $rc -ne 0 ]; then verdict="FAIL (rc $rc)"; fi
  [ "$verdict" = PASS ] || FAILED=1
  echo "| $name | $verdict | $took | $detail |" >> "$SUMMARY"
  return $rc
}

{
  echo "# railcc GPU check"
  echo
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo '+changes'), host $(hostname)$([ $DRY = 1 ] && echo ', DRY RUN (no GPU: CPU buffers and the fake device)')"
  echo
  echo "| step | verdict | seconds | last line of its log |"
  echo "|---|---|---|---|"
} > "$SUMMARY"

# ---- env: what the machine has (never fails the run)
env_facts() {
  set +e
  nproc; uname -r
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap,clocks.max.sm --format=csv
    nvidia-smi topo -m
  else
    echo "no nvidia-smi"
  fi
  command -v nvcc >/dev/null && nvcc --version | tail -2 || echo "no nvcc"
  for t in cmake ninja ccache pkg-config gcc; do printf '%s: %s\n' "$t" "$(command -v $t || echo absent)"; done
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| gpus', torch.cuda.device_count())"
  "$PY" -c "import torch.distributed as d; print('nccl available:', d.is_nccl_available(), '| gloo:', d.is_gloo_available())"
  "$PY" -m pip list 2>/dev/null | grep -i -E "^(torch|nvidia-nccl|pybind11|pytest|mpi4py|setuptools|numpy) "
  echo "hwloc: $(ldconfig -p | grep -o 'libhwloc.so[.0-9]*' | sort -u | tr '\n' ' ')$(ls /usr/include/hwloc.h 2>/dev/null)"
  echo "rdma-core: $(ldconfig -p | grep -o 'libibverbs.so[.0-9]*' | sort -u | tr '\n' ' ')$(ls /usr/include/infiniband/verbs.h 2>/dev/null)"
  df -h /dev/shm | tail -1
  echo "MPS control daemon: $(pgrep -l nvidia-cuda-mps 2>/dev/null | tr '\n' ' ')$(command -v nvidia-cuda-mps-control >/dev/null && echo '(nvidia-cuda-mps-control present)' || echo '(nvidia-cuda-mps-control absent)')"
  return 0
}
step env 20 "$OUT/env.log" env_facts

# ---- build: against the image's torch, all cores, this GPU's architecture only
build() {
  set -e
  local jobs=$(nproc)
  [ $DRY = 1 ] && jobs=${RAILCC_BUILD_JOBS:-1}
  if "$PY" -c "import setuptools" 2>/dev/null; then
    RAILCC_BUILD_DIR="$ROOT/build/gpu" RAILCC_BUILD_JOBS=$jobs RAILCC_CMAKE_ARGS="-DRAILCC_CUDA_ARCHS=${arch:-90}" \
      "$PY" setup.py -q build_ext --inplace
  else
    echo "no setuptools: building with CMake alone"
    RAILCC_BUILD_JOBS=$jobs bash scripts/cmake_build.sh "$ROOT/build/gpu" -DRAILCC_CUDA_ARCHS="${arch:-90}"
  fi
  if [ $DRY = 0 ] && [ ! -f python/railcc/librailcc_cuda.so ]; then
    # Every CUDA test would fail: say where nvcc and the CUDA runtime are, for the next call.
    echo "the CUDA plugin was not built (CMake's lines above say why); nvcc: $(command -v nvcc)"
    ls -d "$(dirname "$(dirname "$(command -v nvcc)")")"/lib* /usr/local/cuda*/lib* 2>/dev/null
    "$PY" -c "import glob, os, torch; print(glob.glob(os.path.join(os.path.dirname(torch.__file__), '..', 'nvidia', '*', 'lib', 'libcudart*')))"
    return 3
  fi
  "$PY" -c "import railcc, torch; print('railcc', railcc.__version__, 'from', railcc.__file__, '| torch', torch.__version__); print('cuda_info', railcc.cuda_info())"
}
step build 240 "$OUT/build.log" build
rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 3 ]; then  # 3: the module built, the CUDA plugin did not (the rest still says much)
  echo "| (rest) | NOT RUN | 0 | the build failed: see build.log |" >> "$SUMMARY"
  exit 1
fi
{ "$PY" -m railcc topo; "$PY" -m railcc doctor; } >> "$OUT/env.log" 2>&1

# pytest.ini asks for pytest-timeout (--timeout), which the GPU image may lack: the ini's
# options are replaced, and per-test timeouts are kept only where the plugin is there. The
# dry run goes without it, as the image may.
PYTEST=("$PY" -m pytest -o addopts=-ra -p no:cacheprovider)
if [ $DRY = 1 ]; then PYTEST+=(-p no:timeout)
elif "$PY" -c "import pytest_timeout" 2>/dev/null; then PYTEST+=(--timeout=300); fi

# ---- watchdog: a GPU op that never finishes
if [ $DRY = 1 ]; then
  # No GPU: the same watchdog on the fake device (tests/cpp/staging_test.cpp), when the C++
  # tests are built (python3 -m pytest tests/python/test_cpp_engine.py builds them).
  # The GPU test itself is selected the same way, and skips.
  watchdog_dry() {
    set -e
    local gt="$ROOT/build/cpp/railcc_tests"
    if [ -x "$gt" ]; then "$gt" --gtest_filter='StagedErrors.GpuWorkThatNeverFinishesIsTimedOutByTheWatchdog'
    else echo "build/cpp/railcc_tests not built: the fake-device test did not run"; fi
    "$@" tests/python/test_cuda.py -v -rfEs -k watchdog_times_out
  }
  run_step watchdog 120 "$OUT/watchdog.log" watchdog_dry "${PYTEST[@]}"
else
  run_step watchdog 60 "$OUT/watchdog.log" "${PYTEST[@]}" tests/python/test_cuda.py -v -rfEs -k watchdog_times_out
fi

# ---- nccl: 2 ranks on one GPU; its error is the result
nccl_try() {
  local dev=cuda
  [ $DRY = 1 ] && dev=cpu
  "$PY" -m railcc bench --device $dev --nprocs 2 --backend nccl -o all_reduce -b 8 -e 1M -f 16 -n 3 -w 1 --timeout 30
  local rc=$?
  echo "nccl with 2 ranks on one GPU: exit status $rc (NCCL refuses ranks that share a GPU; the lines above say how)"
  return 0
}
run_step nccl 45 "$OUT/nccl.log" nccl_try

# ---- bench: railcc and gloo on the same CUDA tensors, the device copy rate in the same run
bench() {
  # Sizes 4x apart: the first H100 run (2026-11-26) finished 2 ranks and half of 4 ranks'
  # all_reduce in 110 s with sizes 2x apart.
  local dev=cuda max=256M iters="-n 5 -w 2" bound=256M
  [ $DRY = 1 ] && dev=cpu max=64K iters="-n 2 -w 1" bound=64M
  for n in 2 4; do
    "$PY" -m railcc bench --device $dev --nprocs $n --backend railcc,gloo --bound --bound_bytes $bound \
      -o all_reduce,all_gather,reduce_scatter,broadcast -b 8 -e $max -f 4 $iters --timeout 60 --stats \
      --json "$WORK/bench$n.json" || return $?
  done
}
run_step bench 110 "$OUT/bench.log" bench

# ---- bench_shots: all_reduce as one kernel per tensor (RAILCC_CUDA_SHOTS=1: device signals,
# no host round per chunk), beside gloo and the copy rate again, into the same log
bench_shots() {
  local dev=cuda max=256M iters="-n 5 -w 2" bound=256M
  [ $DRY = 1 ] && dev=cpu max=64K iters="-n 2 -w 1" bound=64M
  for n in 2 4; do
    RAILCC_CUDA_SHOTS=1 "$PY" -m railcc bench --device $dev --nprocs $n --backend railcc,gloo --bound \
      --bound_bytes $bound -o all_reduce -b 8 -e $max -f 4 $iters --timeout 60 --stats --json "$WORK/shots$n.json" || return $?
  done
  # The heap holds a size's two result buffers (256 MiB each at the top); the stats line says
  # per call how many ops read their input in place.
  RAILCC_CUDA_SHOTS=1 RAILCC_CUDA_HEAP_BYTES=1073741824 "$PY" -m railcc bench --device $dev --nprocs 2 \
    --backend railcc,gloo --bound --bound_bytes $bound -o all_reduce,all_gather,broadcast -b 64K -e $max -f 16 \
    $iters --timeout 60 --stats --alloc backend --json "$WORK/heap2.json" || return $?
}
run_step bench_shots 150 "$OUT/bench.log" bench_shots
# ---- bench_signals: the CUDA IPC path (copy engines, reduction kernels) with its steps ordered
# by the streams' signals instead of host rounds (RAILCC_CUDA_IPC_SIGNALS=1), 2 ranks
bench_signals() {
  local dev=cuda max=64M iters="-n 5 -w 2" bound=256M
  [ $DRY = 1 ] && dev=cpu max=64K iters="-n 2 -w 1" bound=64M
  RAILCC_CUDA_IPC_SIGNALS=1 "$PY" -m railcc bench --device $dev --nprocs 2 --backend railcc,gloo --bound \
    --bound_bytes $bound -o all_reduce,all_gather,broadcast -b 8 -e $max -f 16 $iters --timeout 60 --stats \
    --json "$WORK/signals2.json"
}
run_step bench_signals 60 "$OUT/bench.log" bench_signals
# ---- symm: torch's symmetric memory (one-shot and two-shot all-reduce) on the same GPU, the
# second anchor of the one-kernel all-reduce; where it cannot run, the log says why
symm() {
  local max=256M
  [ $DRY = 1 ] && max=64K
  "$PY" tools/bench_symm_mem.py --nprocs 2 -b 8 -e $max -f 4 -n 5 -w 2 --json "$WORK/symm2.json"
}
run_step symm 60 "$OUT/bench.log" symm
"$PY" scripts/gpu_check_targets.py "$OUT/bench.json" "$WORK"/bench2.json "$WORK"/bench4.json \
  "shots=$WORK/shots2.json" "shots=$WORK/shots4.json" "shots, heap=$WORK/heap2.json" "signals=$WORK/signals2.json" "symm=$WORK/symm2.json" \
  > "$WORK/targets" 2>&1
# One row per report and op: the largest size against issue 67's targets (scripts/gpu_check_targets.py).
sed 's/^- //; s/|/\//g; s/^/| bench target | INFO | 0 | /; s/$/ |/' "$WORK/targets" >> "$SUMMARY"

# ---- test_cuda.py last, with what is left: a cross-section by default (each test starts its
# ranks and CUDA afresh, about 20 s each on the H100: all 38 need ~13 minutes, more than a
# session's device time), every kind of test once: 2 ranks over CUDA IPC, 3 staged through
# host memory, TCP, DDP and FSDP2. RAILCC_GPU_CHECK_K="not watchdog_times_out" runs them all.
# -v lists each case as it ends, so a run cut short still says which passed.
K_DEFAULT="plugin or info or 2-ipc or 3-staged or 2-shots or (movement and 2-signals) or [2] or shrunk or split"
run_step test_cuda 250 "$OUT/test_cuda.log" "${PYTEST[@]}" tests/python/test_cuda.py -v -rfEs --durations=15 -k "${RAILCC_GPU_CHECK_K:-$K_DEFAULT}"

echo "$(ls "$OUT" | wc -l) files in \$OUT; $(( $(date +%s) - START )) s in all; exit status $FAILED" >> "$SUMMARY"
cat "$SUMMARY"
exit $FAILED
