#pragma once
// Launches of the one-kernel all-reduces of shots.h (csrc/cuda, nvcc). Like reduce_kernels.h:
// no CUDA include, the stream a cudaStream_t passed as void*, the launch's cudaError_t returned.

#include <cstdint>

#include "cuda/shots.h"

namespace railcc::cuda {

/// One all-reduce of `args` in one kernel on `stream`, `blocks` blocks (at most kMaxShotBlocks;
/// every rank of the collective must pass the same number): one-shot (`twoShot` false: every
/// rank reads every input) or two-shot (each rank reduces its slice into every output). `args`
/// is copied into the launch; args.peers, args.epochs and the pads must be device-visible, and
/// args.failure host-mapped. A peer that does not come within args.timeoutNs, or an abort raised
/// on this rank's pads, ends the kernel with the failure recorded: it never hangs.
int shotAllReduceAsync(const ShotArgs& args, DataType t, bool twoShot, int blocks, void* stream);

}  // namespace railcc::cuda
