#pragma once
// What a transport that registers GPU memory with a NIC (GPUDirect RDMA) needs from the GPU
// runtime, without knowing CUDA: the allocation holding a buffer, a dma-buf for a range of it,
// and a flush after the NIC wrote into it. Which buffers are GPU memory the engine says
// (Connection::exposeDeviceForRead, readsIntoDevice). The engine installs the runtime's answers
// once its CUDA plugin is loaded (engine/device/gpu_direct.cpp); until then, and in CPU-only
// processes, nothing is installed and every buffer is host memory to the transports.
#include <cstddef>
#include <string>

namespace railcc::transport {

class GpuMemory {
 public:
  virtual ~GpuMemory() = default;
  /// The device allocation holding p: false with `why` where it cannot be said.
  virtual bool allocation(const void* p, const void** base, size_t* bytes, std::string* why) = 0;
  /// A dma-buf fd for [p, p + n) of device memory (page-aligned, inside one allocation), which
  /// the caller closes; -1 with `why` where the runtime or the driver cannot give one.
  virtual int dmabufFd(const void* p, size_t n, std::string* why) = 0;
  /// Makes what the NIC wrote into `device`'s memory visible to the GPU's later work.
  virtual void flushWrites(int device) = 0;
};

/// The installed GPU runtime, or null (no CUDA buffer was ever handed to railcc). Thread-safe.
GpuMemory* gpuMemory();
/// Installs one (the engine, at its first CUDA op; tests install fakes). Not owned; it must
/// outlive every transport that may ask. Null uninstalls.
void setGpuMemory(GpuMemory* g);

}  // namespace railcc::transport
