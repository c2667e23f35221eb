// The kernels of shots.h: one launch per all-reduce, dispatched once per call on the host by
// (dtype, op, one- or two-shot). The half types accumulate in float (Accum below).
#include "cuda/shot_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace railcc::cuda {

template <>
struct Accum<__half> {
  using type = float;
  __device__ static float in(__half v) { return __half2float(v); }
  __device__ static __half out(float v) { return __float2half_rn(v); }
};
template <>
struct Accum<__nv_bfloat16> {
  using type = float;
  __device__ static float in(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 out(float v) { return __float2bfloat16_rn(v); }
};

namespace {

constexpr int kShotThreads = 512;

template <typename T, typename Op, bool kTwo>
__global__ void __launch_bounds__(kShotThreads) shotKernel(ShotArgs a) {
  const ShotThreads t{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)};
  const uint64_t deadline = signalNow() + a.timeoutNs;
  const int b = static_cast<int>(blockIdx.x), blocks = static_cast<int>(gridDim.x);
  if (kTwo) twoShotBlock<T, Op>(a, b, blocks, t, deadline);
  else oneShotBlock<T, Op>(a, b, blocks, t, deadline);
}

struct Launch {
  const ShotArgs& a;
  bool two;
  int blocks;
  cudaStream_t s;
  template <typename T, typename Op>
  int run() const {
    (void)cudaGetLastError();  // what the check below reads must be this launch's
    if (two) shotKernel<T, Op, true><<<blocks, kShotThreads, 0, s>>>(a);
    else shotKernel<T, Op, false><<<blocks, kShotThreads, 0, s>>>(a);
    return static_cast<int>(cudaGetLastError());
  }
};

}  // namespace

int shotAllReduceAsync(const ShotArgs& a, DataType t, bool twoShot, int blocks, void* stream) {
  if (a.n < 1 || a.n > kMaxSignalPeers || a.me < 0 || a.me >= a.n || blocks < 1 || blocks > kMaxShotBlocks ||
      a.peers == nullptr || a.epochs == nullptr || a.chunk == 0)
    return static_cast<int>(cudaErrorInvalidValue);
  return shotDispatch<__half, __nv_bfloat16>(t, a.op, Launch{a, twoShot, blocks, static_cast<cudaStream_t>(stream)},
                                             static_cast<int>(cudaErrorInvalidValue));
}

}  // namespace railcc::cuda
