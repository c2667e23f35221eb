// The kernels of shots.h: one launch per all-reduce, dispatched once per call on the host by
// (dtype, op, one- or two-shot). The half types accumulate in float (Accum below).
#include "cuda/shot_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/half_accum.cuh"

namespace railcc::cuda {

namespace {

constexpr int kShotThreads = 512;

// The reducing kinds, a kernel per (T, Op); the moving ones, a kernel per element size. No
// kernel carries code its calls never reach (nvcc's time goes with what each one holds).
template <typename T, typename Op>
__global__ void __launch_bounds__(kShotThreads) reduceKernel(ShotArgs a, ShotKind k) {
  __shared__ ShotTable<T> table;
  const ShotThreads t{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x), &table};
  const uint64_t deadline = signalNow() + a.timeoutNs;
  const int b = static_cast<int>(blockIdx.x), blocks = static_cast<int>(gridDim.x);
  if (k == ShotKind::kAllReduceOne) oneShotBlock<T, Op>(a, b, blocks, t, deadline);
  else if (k == ShotKind::kAllReduceTwo) twoShotBlock<T, Op>(a, b, blocks, t, deadline);
  else reduceScatterBlock<T, Op>(a, b, blocks, t, deadline);
}

template <typename U>
__global__ void __launch_bounds__(kShotThreads) moveKernel(ShotArgs a, ShotKind k) {
  __shared__ ShotTable<U> table;
  const ShotThreads t{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x), &table};
  const uint64_t deadline = signalNow() + a.timeoutNs;
  const int b = static_cast<int>(blockIdx.x), blocks = static_cast<int>(gridDim.x);
  if (k == ShotKind::kAllGather) allGatherBlock<U>(a, b, blocks, t, deadline);
  else if (k == ShotKind::kAllToAll) allToAllBlock<U>(a, b, blocks, t, deadline);
  else broadcastBlock<U>(a, b, blocks, t, deadline);
}

struct Launch {
  const ShotArgs& a;
  ShotKind k;
  int blocks;
  cudaStream_t s;
  template <typename T, typename Op>
  int run() const {
    (void)cudaGetLastError();  // what the check below reads must be this launch's
    reduceKernel<T, Op><<<blocks, kShotThreads, 0, s>>>(a, k);
    return static_cast<int>(cudaGetLastError());
  }
  template <typename U>
  int move() const {
    (void)cudaGetLastError();
    moveKernel<U><<<blocks, kShotThreads, 0, s>>>(a, k);
    return static_cast<int>(cudaGetLastError());
  }
};

}  // namespace

int shotAsync(const ShotArgs& a, DataType t, ShotKind k, int blocks, void* stream) {
  if (!shotArgsValid(a, k, blocks)) return static_cast<int>(cudaErrorInvalidValue);
  return shotDispatch<__half, __nv_bfloat16>(k, t, a.op, Launch{a, k, blocks, static_cast<cudaStream_t>(stream)},
                                             static_cast<int>(cudaErrorInvalidValue));
}

}  // namespace railcc::cuda
