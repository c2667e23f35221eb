#pragma once
// The 16-bit floats accumulate in float (reduce_ops.h's Accum), rounded once at the end: for
// the kernels nvcc builds (shot_kernels.cu, reduce_kernels.cu).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/reduce_ops.h"

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

}  // namespace railcc::cuda
