#include "transport/gpu_memory.h"

#include <atomic>

namespace railcc::transport {
namespace {
std::atomic<GpuMemory*> installed{nullptr};
}  // namespace

GpuMemory* gpuMemory() { return installed.load(std::memory_order_acquire); }
void setGpuMemory(GpuMemory* g) { installed.store(g, std::memory_order_release); }

}  // namespace railcc::transport
