// The device side of signals.h, compiled for the GPUs railcc builds for: a barrier among the
// ranks of one collective, the first and last step of the one-kernel ops (one-shot and
// two-shot all-reduce), which wait for their peers' data with these same signals.
#include "cuda/signal_kernels.h"

#include <cuda_runtime.h>

#include "cuda/signals.h"

namespace railcc::cuda {

namespace {

// Thread i of block 0 signals rank i and waits for rank i's signal: one round trip per peer,
// all at once. `peers[i]` is rank i's pad as mapped here (its own for i == me).
__global__ void signalBarrierKernel(SignalPad* const* peers, int me, int n, uint32_t expected, uint64_t timeoutNs,
                                    uint64_t seq, SignalFailure* failure) {
  const int i = static_cast<int>(threadIdx.x);
  if (i >= n || i == me) return;
  signalPeer(peers[i], me);
  const uint64_t deadline = signalNow() + timeoutNs;
  signalWait(peers[me], i, expected, deadline, seq, failure);
}

}  // namespace

int signalBarrierAsync(SignalPad* const* peers, int me, int n, uint32_t expected, uint64_t timeoutNs, uint64_t seq,
                       SignalFailure* failure, void* stream) {
  if (n < 1 || n > kMaxSignalPeers || me < 0 || me >= n) return static_cast<int>(cudaErrorInvalidValue);
  signalBarrierKernel<<<1, kMaxSignalPeers, 0, static_cast<cudaStream_t>(stream)>>>(peers, me, n, expected, timeoutNs, seq,
                                                                                     failure);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace railcc::cuda
