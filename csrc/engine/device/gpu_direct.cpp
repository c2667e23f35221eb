// GPUDirect RDMA for sends and receives of GPU memory (Communicator::send/recv of a CUDA
// tensor). The caller hands the engine a host buffer and, beside it, the GPU buffer it stands
// for (DeviceSide). Where the transport to the peer reaches the GPU's memory (verbs, with the
// GPU registered with the NIC through dma-buf or nvidia_peermem) and the message goes by
// address anyway (rendezvous), the NIC reads the sender's GPU memory and writes the receiver's:
// no copy through host memory on either side. Otherwise the send's bytes are copied to the host
// buffer first and the receive lands there, as before. Each side decides for itself, message by
// message, so the two need not agree: a receive into host memory reads a GPU sender as well.
#include <unistd.h>

#include "engine/callback_pool.h"
#include "common/error.h"
#include "common/log.h"
#include "engine/device/device_layer.h"
#include "transport/gpu_memory.h"

namespace railcc::engine {
namespace {

// The calling thread's current device is `d` for a scope. These run on the progress thread, or
// on a caller's thread running its own op (helpRun), whose current device is the user's and is
// put back after. A runtime call made without it would create a context on device 0; a device
// that cannot be set fails the op.
struct OnDevice : DeviceScope {
  OnDevice(const cuda::DeviceApi& api, int d) : DeviceScope(api, d, !CallbackPool::onEngineThread()) {
    checkDevice(error(), "cudaSetDevice", d);
  }
};

}  // namespace

bool ChannelLayer::startDeviceSend(Channel& ch, Transfer& t) {
  DeviceSide& d = *t.device;
  OnDevice on(deviceApi(), d.device);
  if (!host_.deviceReady(d)) return deviceWaiting();
  if (sendsByAddress(ch, t) && ch.conn->exposeDeviceForRead(d.gpu, t.bytes, d.device, &t.addrKey)) {
    t.src = d.gpu;  // only its address travels
    t.byAddress = Transfer::ByAddress::kSending;
    d.direct.store(true, std::memory_order_release);
  } else {
    host_.stageDeviceSend(t);
  }
  t.device = nullptr;
  return true;
}

bool ChannelLayer::startDeviceRecv(Channel& ch, Transfer& t) {
  DeviceSide& d = *t.device;
  OnDevice on(deviceApi(), d.device);
  if (t.dst != d.gpu) {
    // Decided once: straight into the GPU's memory, or into host memory for the caller to copy
    // in (which needs no wait: the caller's copy is ordered after its stream).
    if (!ch.conn->readsIntoDevice(d.gpu, t.bytes, d.device, d.keep)) {
      t.device = nullptr;
      return true;
    }
    t.dst = d.gpu;
    d.direct.store(true, std::memory_order_release);
  }
  // The NIC writes the buffer only once the caller's earlier work on it is done.
  if (!host_.deviceReady(d)) return deviceWaiting();
  t.device = nullptr;
  return true;
}

bool DeviceLayer::deviceReady(const DeviceSide& d) {
  if (!d.ready) return true;
  const cuda::DeviceApi& api = deviceApi();
  int e = api.eventQuery(d.ready);
  if (e == api.notReady) return false;
  checkDevice(e, "cudaEventQuery (the caller's stream, before a send or receive)", d.device);
  return true;
}

void DeviceLayer::stageDeviceSend(Transfer& t) {
  const DeviceSide& d = *t.device;
  const cuda::DeviceApi& api = deviceApi();
  // Not the staging's stream and events (device_state.h): a collective may be using them.
  if (dev_.sendDev != d.device) {
    releaseSendStaging(api);
    checkDevice(api.streamCreate(&dev_.sendStream), "cudaStreamCreate", d.device);
    checkDevice(api.eventCreate(&dev_.sendEv), "cudaEventCreate", d.device);
    dev_.sendDev = d.device;
  }
  try {
    if (d.ready) checkDevice(api.streamWaitEvent(dev_.sendStream, d.ready), "cudaStreamWaitEvent (the caller's stream)", d.device);
    checkDevice(api.memcpyAsync(const_cast<char*>(t.src), d.gpu, t.bytes, dev_.sendStream),
                "cudaMemcpyAsync (a send's GPU memory to host memory)", d.device);
    checkDevice(api.eventRecord(dev_.sendEv, dev_.sendStream), "cudaEventRecord", d.device);
    deviceWait(api, dev_.sendEv, d.device, "the copy of a send's GPU memory to host memory", dev_.sendStream);
  } catch (...) {
    // The copy may still be queued: its buffers stay alive until the group's teardown has
    // drained the stream, not only until the op's failure frees them.
    dev_.sendKept.push_back(d.keep);
    throw;
  }
}

void DeviceLayer::releaseSendStaging(const cuda::DeviceApi& api) {
  if (dev_.sendEv) api.eventDestroy(dev_.sendEv), dev_.sendEv = nullptr;
  if (dev_.sendStream) api.streamDestroy(dev_.sendStream), dev_.sendStream = nullptr;
  dev_.sendDev = -1;
}

namespace {

// The transports' view of the GPU runtime (transport/gpu_memory.h), over the plugin's table.
class RuntimeGpuMemory : public transport::GpuMemory {
 public:
  explicit RuntimeGpuMemory(const cuda::DeviceApi* api) : api_(api) {}

  bool allocation(const void* p, const void** base, size_t* bytes, std::string* why) override {
    if (!api_->allocationRange) return none(why, "this GPU runtime cannot say a buffer's allocation");
    void* b = nullptr;
    if (int e = api_->allocationRange(p, &b, bytes)) return failed(why, "cuMemGetAddressRange", e);
    *base = b;
    return true;
  }
  int dmabufFd(const void* p, size_t n, std::string* why) override {
    if (!api_->dmabufFd) return none(why, "this GPU runtime has no dma-buf export"), -1;
    int fd = -1;
    if (int e = api_->dmabufFd(p, n, &fd)) return failed(why, "cuMemGetHandleForAddressRange", e), -1;
    return fd;
  }
  void flushWrites(int device) override {
    if (!api_->flushRdmaWrites) return;
    OnDevice on(*api_, device);
    checkDevice(api_->flushRdmaWrites(), "cudaDeviceFlushGPUDirectRDMAWrites", device);
  }

 private:
  static bool none(std::string* why, const char* what) {
    if (why) *why = what;
    return false;
  }
  bool failed(std::string* why, const char* call, int e) const {
    const char* msg = api_->errorString ? api_->errorString(e) : nullptr;
    if (why) *why = std::string(call) + ": " + (msg ? msg : "error") + " (" + std::to_string(e) + ")";
    return false;
  }
  const cuda::DeviceApi* api_;
};

}  // namespace

std::string probeGpuDirect(int device) {
  const cuda::DeviceApi& api = deviceApi();
  const std::string dev = "cuda:" + std::to_string(device);
  if (!api.dmabufFd || !api.allocationRange || !api.deviceMalloc) return dev + ": this GPU runtime has no dma-buf export";
  OnDevice on(api, device);
  std::string out;
  void* p = nullptr;
  constexpr size_t kBytes = size_t(2) << 20;
  if (int e = api.deviceMalloc(&p, kBytes)) {
    out = dev + ": cannot allocate " + std::to_string(kBytes >> 20) + " MiB to try (" + api.errorString(e) + ")";
  } else {
    RuntimeGpuMemory gm(&api);
    std::string why;
    const void* base = nullptr;
    size_t bytes = 0;
    int fd = gm.allocation(p, &base, &bytes, &why) ? gm.dmabufFd(p, kBytes, &why) : -1;
    if (fd >= 0) {
      close(fd);
      out = dev + ": device memory exports as a dma-buf (GPUDirect RDMA registers it with a NIC that takes dma-buf)";
    } else {
      out = dev + ": no dma-buf export (" + why + "): GPUDirect RDMA needs nvidia_peermem on this host";
    }
    api.deviceFree(p);
  }
  return out;
}

// Called with the runtime just loaded (device_api.cpp), or a test's fake (null: none).
void installGpuMemory(const cuda::DeviceApi* api) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<RuntimeGpuMemory>> made;  // kept: a transport may still hold one
  std::lock_guard<std::mutex> g(mu);
  if (!api) return transport::setGpuMemory(nullptr);
  made.push_back(std::make_unique<RuntimeGpuMemory>(api));
  transport::setGpuMemory(made.back().get());
}

}  // namespace railcc::engine
