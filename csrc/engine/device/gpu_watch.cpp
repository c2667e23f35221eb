#include "common/error.h"
#include "common/log.h"
#include "engine/device/device_layer.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// The watchdog for GPU work. An op through CUDA IPC completes once its GPU work is queued
// (the caller orders on its stream), so no thread of the engine waits for that work. Each
// such op records an event after its work and leaves it here; the engine drops the entries
// the GPU has finished at its next device op, and the watchdog thread, which sleeps between
// checks (at most a second), fails the group when the oldest entry is still running past the
// op's timeout: its error names the op, its sequence number, the device and the stream, and
// every later call on the group raises it (CollectiveTimeoutError), as after a host hang.

namespace {

std::string pointerText(const void* p) {
  char b[32];
  std::snprintf(b, sizeof(b), "%p", p);
  return b;
}

}  // namespace

void DeviceLayer::watchGpu(const cuda::DeviceApi& api, const DeviceOp& dv, const char* what) {
  retireGpuWork(api, nullptr, nullptr);
  void* ev = nullptr;
  {
    std::lock_guard<std::mutex> g(dev_.gpuMu);
    if (!dev_.gpuEvents.empty()) ev = dev_.gpuEvents.back(), dev_.gpuEvents.pop_back();
  }
  if (!ev) checkDevice(api.eventCreate(&ev), "cudaEventCreate", dv.device);
  int err = api.eventRecord(ev, dv.stream);
  if (err != 0) {
    api.eventDestroy(ev);
    checkDevice(err, "cudaEventRecord", dv.device);
  }
  GpuWork w{ch_.current() ? ch_.current()->fp.seq : 0, ch_.current() ? ch_.current()->kind : OpKind::kBarrier, what, dv.device,
            dv.stream, ev, Clock::now(), ch_.current() ? ch_.current()->timeout : opts_.timeout};
  std::lock_guard<std::mutex> g(dev_.gpuMu);
  dev_.gpuWork.push_back(w);
  dev_.gpuWatched.store(true, std::memory_order_relaxed);
}

std::exception_ptr DeviceLayer::retireGpuWork(const cuda::DeviceApi& api, const Clock::time_point* now,
                                           Clock::time_point* next) {
  std::lock_guard<std::mutex> g(dev_.gpuMu);
  while (!dev_.gpuWork.empty()) {
    GpuWork& w = dev_.gpuWork.front();
    int e = api.eventQuery(w.event);
    if (e == api.notReady) {
      if (!now) return nullptr;
      Clock::time_point due = w.queued + w.timeout;
      if (*now < due) {
        *next = std::min(*next, due);
        return nullptr;
      }
      const std::vector<int> late = stepLaggards(api);
      std::ostringstream os;
      os << opKindName(w.kind) << " (seq " << w.seq << ", " << w.what << ") on cuda:" << w.device
         << " did not finish on the GPU within " << w.timeout.count() << " ms: its work on stream "
         << pointerText(w.stream) << " (the group's stream, which waits for the caller's) never completed";
      if (late.empty())
        os << ". A kernel queued before it on the caller's stream is still running, or the GPU is hung";
      else
        os << lateText(late);
      Error err(ErrorCode::kTimeout, os.str());
      err.ranks = late;
      err.seq = static_cast<long long>(w.seq);
      err.op = opKindName(w.kind);
      return std::make_exception_ptr(err);
    }
    // Done, or an error that the next call on the device reports: either way not ours to wait on.
    dev_.gpuEvents.push_back(w.event);
    dev_.gpuWork.pop_front();
  }
  return nullptr;
}

std::exception_ptr DeviceLayer::checkGpuWork(Clock::time_point* next) {
  const cuda::DeviceApi* api = nullptr;
  {
    std::lock_guard<std::mutex> g(dev_.gpuMu);
    // A one-kernel op that gave up waiting for a peer names it, before any timeout of the work,
    // and even once its work has left the list (the engine drops finished work at its next op).
    if (std::exception_ptr e = shotFailure()) return e;
    if (dev_.gpuWork.empty()) return nullptr;
  }
  try {
    api = &deviceApi();
  } catch (const Error&) {
    return nullptr;
  }
  RelaxedCapture relaxed(*api);
  Clock::time_point now = Clock::now();
  return retireGpuWork(*api, &now, next);
}

void DeviceLayer::releaseGpuWork(const cuda::DeviceApi& api) {
  std::lock_guard<std::mutex> g(dev_.gpuMu);
  // CUDA frees an event destroyed before its work completes once that work is done.
  for (GpuWork& w : dev_.gpuWork) api.eventDestroy(w.event);
  dev_.gpuWork.clear();
  for (void* ev : dev_.gpuEvents) api.eventDestroy(ev);
  dev_.gpuEvents.clear();
}

}  // namespace railcc::engine
