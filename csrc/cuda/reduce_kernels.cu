// GPU reductions: one elementwise kernel per (dtype, op), dispatched once per call on the host.
// Grid-stride loops; half types widen to float for the arithmetic, as the CPU path does.
#include "cuda/reduce_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/half_accum.cuh"

namespace railcc::cuda {
namespace {

constexpr int kThreads = 512;

// Min and max propagate NaN, as torch does (reduce_ops.h); bool reduces logically.
struct LogicalAnd {
  template <typename A> __device__ static A apply(A a, A b) { return (a != 0) && (b != 0); }
};
struct LogicalOr {
  template <typename A> __device__ static A apply(A a, A b) { return (a != 0) || (b != 0); }
};
struct LogicalXor {
  template <typename A> __device__ static A apply(A a, A b) { return (a != 0) != (b != 0); }
};

// out[i] = a[i] op (scale? scale*b[i] : b[i]); out may equal a.
template <typename T, typename Op, bool kScaled>
__global__ void reduceKernel(T* out, const T* a, const T* b, size_t n, float scale) {
  using W = Accum<T>;
  using A = typename W::type;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    A y = W::in(b[i]);
    if (kScaled) y = static_cast<A>(static_cast<float>(y) * scale);
    out[i] = W::out(Op::apply(W::in(a[i]), y));
  }
}

template <typename T, typename Op, bool kScaled>
__global__ void reduceKernelF64(T* out, const T* a, const T* b, size_t n, double scale) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    T y = b[i];
    if (kScaled) y = y * scale;
    out[i] = Op::apply(a[i], y);
  }
}

template <typename T>
__global__ void scaleKernel(T* dst, const T* src, size_t n, double scale, bool divide) {
  using W = Accum<T>;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    double v = static_cast<double>(W::in(src[i]));
    dst[i] = W::out(static_cast<typename W::type>(divide ? v / scale : v * scale));
  }
}

unsigned blocksFor(size_t n) {
  size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

template <typename T, typename Op>
int launch(void* out, const void* a, const void* b, size_t n, bool scaled, double scale, cudaStream_t s) {
  if (n == 0) return 0;
  (void)cudaGetLastError();  // what the launch check below reads must be this launch's
  auto* o = static_cast<T*>(out);
  auto* x = static_cast<const T*>(a);
  auto* y = static_cast<const T*>(b);
  if constexpr (std::is_same_v<T, double>) {
    if (scaled) reduceKernelF64<T, Op, true><<<blocksFor(n), kThreads, 0, s>>>(o, x, y, n, scale);
    else reduceKernelF64<T, Op, false><<<blocksFor(n), kThreads, 0, s>>>(o, x, y, n, scale);
  } else {
    if (scaled) reduceKernel<T, Op, true><<<blocksFor(n), kThreads, 0, s>>>(o, x, y, n, static_cast<float>(scale));
    else reduceKernel<T, Op, false><<<blocksFor(n), kThreads, 0, s>>>(o, x, y, n, static_cast<float>(scale));
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename Op>
int arith(void* out, const void* a, const void* b, size_t n, DataType t, bool scaled, double scale, cudaStream_t s) {
  switch (t) {
    case DataType::kFloat32: return launch<float, Op>(out, a, b, n, scaled, scale, s);
    case DataType::kFloat64: return launch<double, Op>(out, a, b, n, scaled, scale, s);
    case DataType::kFloat16: return launch<__half, Op>(out, a, b, n, scaled, scale, s);
    case DataType::kBFloat16: return launch<__nv_bfloat16, Op>(out, a, b, n, scaled, scale, s);
    case DataType::kInt8: return launch<int8_t, Op>(out, a, b, n, false, 1, s);
    case DataType::kUInt8: return launch<uint8_t, Op>(out, a, b, n, false, 1, s);
    case DataType::kInt16: return launch<int16_t, Op>(out, a, b, n, false, 1, s);
    case DataType::kInt32: return launch<int32_t, Op>(out, a, b, n, false, 1, s);
    case DataType::kInt64: return launch<int64_t, Op>(out, a, b, n, false, 1, s);
    case DataType::kBool: return launch<uint8_t, Op>(out, a, b, n, false, 1, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

template <typename Op>
int bits(void* out, const void* a, const void* b, size_t n, DataType t, cudaStream_t s) {
  switch (t) {
    case DataType::kInt8: return launch<int8_t, Op>(out, a, b, n, false, 1, s);
    case DataType::kUInt8: return launch<uint8_t, Op>(out, a, b, n, false, 1, s);
    case DataType::kInt16: return launch<int16_t, Op>(out, a, b, n, false, 1, s);
    case DataType::kInt32: return launch<int32_t, Op>(out, a, b, n, false, 1, s);
    case DataType::kInt64: return launch<int64_t, Op>(out, a, b, n, false, 1, s);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

bool isFloat(DataType t) {
  return t == DataType::kFloat32 || t == DataType::kFloat64 || t == DataType::kFloat16 || t == DataType::kBFloat16;
}

int dispatch(void* out, const void* a, const void* b, size_t n, DataType t, ReduceOp op, double scale, void* stream) {
  if (!supported(op, t)) return static_cast<int>(cudaErrorInvalidValue);
  auto s = static_cast<cudaStream_t>(stream);
  if (t == DataType::kBool) {
    switch (op) {
      case ReduceOp::kSum: case ReduceOp::kMax: case ReduceOp::kBor: return launch<uint8_t, LogicalOr>(out, a, b, n, false, 1, s);
      case ReduceOp::kProduct: case ReduceOp::kMin: case ReduceOp::kBand: return launch<uint8_t, LogicalAnd>(out, a, b, n, false, 1, s);
      default: return launch<uint8_t, LogicalXor>(out, a, b, n, false, 1, s);
    }
  }
  switch (op) {
    case ReduceOp::kSum: case ReduceOp::kAvg: return arith<ShotSum>(out, a, b, n, t, false, 1, s);
    case ReduceOp::kPremulSum: return arith<ShotSum>(out, a, b, n, t, true, scale, s);
    case ReduceOp::kProduct: return arith<ShotProd>(out, a, b, n, t, false, 1, s);
    case ReduceOp::kMin: return arith<ShotMin>(out, a, b, n, t, false, 1, s);
    case ReduceOp::kMax: return arith<ShotMax>(out, a, b, n, t, false, 1, s);
    case ReduceOp::kBand: return bits<ShotBand>(out, a, b, n, t, s);
    case ReduceOp::kBor: return bits<ShotBor>(out, a, b, n, t, s);
    case ReduceOp::kBxor: return bits<ShotBxor>(out, a, b, n, t, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

template <typename T>
int scaleLaunch(void* dst, const void* src, size_t n, double v, bool divide, cudaStream_t s) {
  if (n == 0) return 0;
  (void)cudaGetLastError();
  scaleKernel<T><<<blocksFor(n), kThreads, 0, s>>>(static_cast<T*>(dst), static_cast<const T*>(src), n, v, divide);
  return static_cast<int>(cudaGetLastError());
}

int scaleDispatch(void* dst, const void* src, size_t n, DataType t, double v, bool divide, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (t) {
    case DataType::kFloat32: return scaleLaunch<float>(dst, src, n, v, divide, s);
    case DataType::kFloat64: return scaleLaunch<double>(dst, src, n, v, divide, s);
    case DataType::kFloat16: return scaleLaunch<__half>(dst, src, n, v, divide, s);
    case DataType::kBFloat16: return scaleLaunch<__nv_bfloat16>(dst, src, n, v, divide, s);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace

bool supported(ReduceOp op, DataType t) {
  bool fl = isFloat(t);
  switch (op) {
    case ReduceOp::kAvg: case ReduceOp::kPremulSum: return fl;
    case ReduceOp::kBand: case ReduceOp::kBor: case ReduceOp::kBxor: return !fl;
    default: return true;
  }
}

int reduceAsync(void* dst, const void* src, size_t count, DataType t, ReduceOp op, double scale, void* stream) {
  return dispatch(dst, dst, src, count, t, op, scale, stream);
}

int reduce2Async(void* out, const void* a, const void* b, size_t count, DataType t, ReduceOp op, double scale,
                 void* stream) {
  return dispatch(out, a, b, count, t, op, scale, stream);
}

int scaleCopyAsync(void* dst, const void* src, size_t count, DataType t, double scale, void* stream) {
  return scaleDispatch(dst, src, count, t, scale, false, stream);
}

int divideAsync(void* buf, size_t count, DataType t, double n, void* stream) {
  return scaleDispatch(buf, buf, count, t, n, true, stream);
}

}  // namespace railcc::cuda
