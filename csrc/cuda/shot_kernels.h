#pragma once
// Launches of the one-kernel all-reduces of shots.h (csrc/cuda, nvcc). Like reduce_kernels.h:
// no CUDA include, the stream a cudaStream_t passed as void*, the launch's cudaError_t returned.

#include <cstdint>

#include "cuda/shots.h"

namespace railcc::cuda {

/// One collective of kind `k` (shots.h) in one kernel on `stream`, `blocks` blocks (at most
/// kMaxShotBlocks; every rank of the collective must pass the same number). `args` is copied
/// into the launch; args.peers, args.epochs and the scratch and pads must be device-visible,
/// args.failure and args.abort host-mapped. A peer that does not come within args.timeoutNs, or
/// the host's abort, ends the kernel with the failure recorded: it never hangs. Arguments that
/// shotArgsValid() refuses, and (dtype, op) pairs shots do not reduce, are cudaErrorInvalidValue.
int shotAsync(const ShotArgs& args, DataType t, ShotKind k, int blocks, void* stream);

}  // namespace railcc::cuda
