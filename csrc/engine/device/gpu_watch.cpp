#include "engine/comm_impl.h"

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

void CommImpl::watchGpu(const cuda::DeviceApi& api, const DeviceOp& dv, const char* what) {
  retireGpuWork(api, nullptr, nullptr);
  void* ev = nullptr;
  {
    std::lock_guard<std::mutex> g(gpuMu_);
    if (!gpuEvents_.empty()) ev = gpuEvents_.back(), gpuEvents_.pop_back();
  }
  if (!ev) checkDevice(api.eventCreate(&ev), "cudaEventCreate", dv.device);
  int err = api.eventRecord(ev, dv.stream);
  if (err != 0) {
    api.eventDestroy(ev);
    checkDevice(err, "cudaEventRecord", dv.device);
  }
  GpuWork w{current_ ? current_->fp.seq : 0, current_ ? current_->kind : OpKind::kBarrier, what, dv.device,
            dv.stream, ev, Clock::now(), current_ ? current_->timeout : opts_.timeout};
  std::lock_guard<std::mutex> g(gpuMu_);
  gpuWork_.push_back(w);
  gpuWatched_.store(true, std::memory_order_relaxed);
}

std::exception_ptr CommImpl::retireGpuWork(const cuda::DeviceApi& api, const Clock::time_point* now,
                                           Clock::time_point* next) {
  std::lock_guard<std::mutex> g(gpuMu_);
  while (!gpuWork_.empty()) {
    GpuWork& w = gpuWork_.front();
    int e = api.eventQuery(w.event);
    if (e == api.notReady) {
      if (!now) return nullptr;
      Clock::time_point due = w.queued + w.timeout;
      if (*now < due) {
        *next = std::min(*next, due);
        return nullptr;
      }
      std::ostringstream os;
      os << opKindName(w.kind) << " (seq " << w.seq << ", " << w.what << ") on cuda:" << w.device
         << " did not finish on the GPU within " << w.timeout.count() << " ms: its work on stream "
         << pointerText(w.stream) << " (the group's stream, which waits for the caller's) never completed. A kernel "
         << "queued before it on the caller's stream is still running, or the GPU is hung";
      Error err(ErrorCode::kTimeout, os.str());
      err.seq = static_cast<long long>(w.seq);
      err.op = opKindName(w.kind);
      return std::make_exception_ptr(err);
    }
    // Done, or an error that the next call on the device reports: either way not ours to wait on.
    gpuEvents_.push_back(w.event);
    gpuWork_.pop_front();
  }
  return nullptr;
}

void CommImpl::checkGpuWork(Clock::time_point* next) {
  const cuda::DeviceApi* api = nullptr;
  {
    std::lock_guard<std::mutex> g(gpuMu_);
    if (gpuWork_.empty()) return;
  }
  try {
    api = &deviceApi();
  } catch (const Error&) {
    return;
  }
  Clock::time_point now = Clock::now();
  std::exception_ptr err = retireGpuWork(*api, &now, next);
  if (!err || brokenError()) return;
  fail(err);
  // Wake the progress thread wherever it waits: what is queued fails with this error.
  wakeSelf();
  uint64_t one = 1;
  if (write(wakeFd_.fd, &one, sizeof(one)) < 0) { /* best effort */ }
  cv_.notify_all();
}

void CommImpl::releaseGpuWork(const cuda::DeviceApi& api) {
  std::lock_guard<std::mutex> g(gpuMu_);
  // CUDA frees an event destroyed before its work completes once that work is done.
  for (GpuWork& w : gpuWork_) api.eventDestroy(w.event);
  gpuWork_.clear();
  for (void* ev : gpuEvents_) api.eventDestroy(ev);
  gpuEvents_.clear();
}

}  // namespace railcc::engine
