#pragma once
// Launches built on the device signals of signals.h (csrc/cuda, nvcc). Like reduce_kernels.h:
// no CUDA include, the stream a cudaStream_t passed as void*, the launch's cudaError_t returned.

#include <cstdint>

#include "cuda/signals.h"

namespace railcc::cuda {

/// A barrier among `n` ranks on `stream`: this rank (`me`) signals every peer's pad and waits,
/// at most `timeoutNs`, until each has signalled it `expected` times in all (signals.h).
/// `peers[i]`: rank i's pad as this process maps it (device-visible memory, an array in device
/// memory). A peer that does not come within the timeout, or an abort raised on this rank's
/// pad, ends the wait and is recorded in `failure` (host-mapped memory): the kernel never hangs.
int signalBarrierAsync(SignalPad* const* peers, int me, int n, uint32_t expected, uint64_t timeoutNs, uint64_t seq,
                       SignalFailure* failure, void* stream);

}  // namespace railcc::cuda
