#pragma once

// GPU reductions for the cuda_ipc transport and the CUDA collectives (csrc/cuda). Torch-free:
// buffers are device pointers, the stream is a cudaStream_t passed as void* so that this header
// needs no CUDA include. Every call only enqueues work on `stream` and returns the launch's
// cudaError_t (0 on success); nothing here waits on another process's memory, so several ranks
// sharing one GPU can never deadlock inside these kernels.

#include <cstddef>

#include "common/types.h"

namespace railcc::cuda {

/// dst[i] = dst[i] (op) (scale * src[i]) for i < count, the semantics of railcc::reduceInto:
/// AVG reduces as SUM (divideAsync finishes it), PREMUL_SUM scales src, bool reduces logically.
/// Half types accumulate in float. src may live in a peer's memory (CUDA IPC).
int reduceAsync(void* dst, const void* src, size_t count, DataType t, ReduceOp op, double scale, void* stream);

/// out[i] = a[i] (op) b[i], with b scaled for PREMUL_SUM: the first step of a reduction that
/// reads two peers' buffers without touching either.
int reduce2Async(void* out, const void* a, const void* b, size_t count, DataType t, ReduceOp op, double scale,
                 void* stream);

/// dst[i] = scale * src[i] (floating types; dst may equal src).
int scaleCopyAsync(void* dst, const void* src, size_t count, DataType t, double scale, void* stream);

/// buf[i] /= n (floating types): finishes AVG.
int divideAsync(void* buf, size_t count, DataType t, double n, void* stream);

/// Whether (op, dtype) has a kernel; the same pairs railcc::checkReduceSupported accepts.
bool supported(ReduceOp op, DataType t);

}  // namespace railcc::cuda
