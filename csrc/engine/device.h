#pragma once

// Device memory for the engine: where an op's buffers live, and the GPU runtime that moves
// them (the CUDA plugin, loaded on first use). Torch-free and CUDA-header-free.

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>

#include "cuda/device_api.h"

namespace railcc::engine {

/// Where an op's buffers live. Host memory unless device >= 0.
struct Placement {
  int device = -1;           // CUDA ordinal of every buffer of the op
  void* stream = nullptr;    // cudaStream_t the op's copies run on (the communicator's stream
                             // for this device); null: the engine's own stream
  void* waitEvent = nullptr; // cudaEvent_t recorded on the caller's stream: the op reads its
                             // buffers only after it has completed on the GPU
  bool queued = false;       // with `stream`: an op whose GPU work needs no host (CUDA IPC)
                             // completes once that work is queued on `stream`, and the caller
                             // orders on the stream; otherwise once the GPU has done it
  bool onDevice() const { return device >= 0; }
};

// GPU memory behind a send or receive (Communicator::send/recv of a CUDA tensor). A transport
// that reaches the GPU's memory (GPUDirect RDMA) moves the bytes straight from or into `gpu`;
// otherwise the host buffer passed with it carries them: the engine copies the GPU's bytes
// there before a send, and the caller copies them in after a receive unless `direct`.
struct DeviceSide {
  char* gpu = nullptr;
  int device = -1;
  void* ready = nullptr;            // an event on the caller's stream: `gpu` may be touched once it is done
  std::atomic<bool> direct{false};  // the bytes moved straight from or into `gpu`
  std::shared_ptr<void> keep;       // keeps `ready`, `gpu` and the host buffer alive (held past a failure)
};

/// The GPU runtime. The first call loads the CUDA plugin (librailcc_cuda.so next to the
/// module that holds the engine, or RAILCC_CUDA_PLUGIN) and throws Error(kDevice) saying why
/// when it cannot. Thread-safe.
const cuda::DeviceApi& deviceApi();

/// For tests: use `api` instead of the plugin (nullptr restores the plugin). `api` must
/// outlive every communicator that uses it.
void setDeviceApiForTesting(const cuda::DeviceApi* api);

/// Tells the transports how to reach the GPU memory of `api`'s runtime (transport/gpu_memory.h);
/// null: of none. Called when the runtime is loaded or a test's is set.
void installGpuMemory(const cuda::DeviceApi* api);

/// Whether `device`'s memory can be exported as a dma-buf (what GPUDirect RDMA registers with a
/// NIC): a line saying so, or why not. Allocates and frees 2 MiB there. Throws like deviceApi().
std::string probeGpuDirect(int device);

/// Whether deviceApi() can be had, and if not, why (without throwing).
bool deviceApiAvailable(std::string* why);

/// Throws Error(kDevice) "<call> on cuda:<device> failed: <runtime's message> (error <err>)"
/// unless err is 0.
void checkDevice(int err, const char* call, int device);

}  // namespace railcc::engine
