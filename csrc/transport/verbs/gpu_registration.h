#pragma once
// GPU memory registered with an RDMA device (GPUDirect RDMA), the way the decision for that GPU
// and device allows (verbs_rules.h, decideGdr): first a dma-buf of the range, exported by the
// CUDA driver and registered with ibv_reg_dmabuf_mr; then, where nvidia_peermem is loaded, the
// device address registered as if it were host memory (the peer-memory client pins the GPU's
// pages); else nothing, and the engine stages the buffer through host memory. Which way it
// went for each GPU and device is said once at INFO. Registrations are made per message and
// dropped after it: nothing here knows when GPU memory is freed (no cache, unlike MrCache).
#include <cstddef>
#include <string>

#include "transport/gpu_memory.h"
#include "transport/verbs/ibv_lib.h"
#include "transport/verbs/verbs_rules.h"

namespace railcc::transport::verbs {

struct GpuRegistration {
  ibv_mr* mr = nullptr;
  const char* how = "";  // "dma-buf", "nvidia_peermem", or "" (not registered)
  std::string why;       // what was refused on the way ("" when the first way worked)
};

/// Registers the pages holding [p, p + n) of CUDA device memory on `pd` with `access`, trying
/// what `mode` (and `peermem`, nvidia_peermem loaded) allow. Counts registrations and failures.
GpuRegistration registerGpuMemory(const IbvLib& ibv, ibv_pd* pd, GpuMemory& gm, const void* p, size_t n, GdrMode mode,
                                  bool peermem, int access);

/// The INFO line for `r` ("GPUDirect RDMA: GPU 0 memory registered with mlx5_0 through
/// dma-buf"), said once per device, GPU and outcome; returns it.
std::string sayGpuRegistration(const std::string& dev, int gpu, const GpuRegistration& r);

}  // namespace railcc::transport::verbs
