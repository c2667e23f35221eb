#include "common/error.h"
#include "common/log.h"
#include "engine/device/device_layer.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// Device buffers: pinned staging

DeviceLayer::DeviceLayer(ChannelLayer& ch, Algorithms& algos, const CommOptions& opts, int rank, int size,
                         const std::vector<int>& localRanks, const AlgoPlace& place)
    : ch_(ch), algos_(algos), opts_(opts), rank_(rank), size_(size), localRanks_(localRanks), place_(place) {}

void DeviceLayer::deviceWait(const cuda::DeviceApi& api, void* ev, int device, const char* what, void* stream) {
  auto t0 = Clock::now();
  Millis limit = ch_.current() ? ch_.current()->timeout : opts_.timeout;
  for (int spins = 0;; ++spins) {
    int e = api.eventQuery(ev);
    if (e == 0) return;
    if (e != api.notReady) checkDevice(e, "cudaEventQuery", device);
    ch_.checkInterrupted();
    auto waited = Clock::now() - t0;
    if (waited > limit) {
      char s[32];
      std::snprintf(s, sizeof(s), "%p", stream);
      const std::vector<int> late = stepLaggards(api);
      Error err(ErrorCode::kTimeout, std::string(what) + " on cuda:" + std::to_string(device) + " (stream " + s +
                                         ") did not finish within " + std::to_string(limit.count()) + " ms" +
                                         (late.empty() ? ": the GPU is hung, or busy with work queued before this op on the "
                                                         "caller's stream"
                                                       : lateText(late)));
      err.ranks = late;
      if (ch_.current()) {
        err.seq = static_cast<long long>(ch_.current()->fp.seq);
        err.op = opKindName(ch_.current()->kind);
      }
      throw err;
    }
    // The copies take tens of microseconds to milliseconds: poll briefly, then nap for a tenth
    // of the time waited so far, so a GPU that takes long (or never finishes) costs no CPU.
    if (spins < 64) {
      __builtin_ia32_pause();
      continue;
    }
    auto nap = std::chrono::duration_cast<std::chrono::microseconds>(waited / 10);
    std::this_thread::sleep_for(std::clamp(nap, std::chrono::microseconds(20), std::chrono::microseconds(1000)));
  }
}

namespace {

// Teardown: whether the work queued on `stream` so far finished within `bound` (a GPU that
// never finishes must not hang it). False also where the event cannot be recorded.
bool drained(const cuda::DeviceApi& api, void* ev, void* stream, Millis bound = Millis(10000)) {
  if (!stream || !ev || api.eventRecord(ev, stream) != 0) return false;
  auto until = Clock::now() + bound;
  while (api.eventQuery(ev) == api.notReady) {
    if (Clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

}  // namespace

void DeviceLayer::releaseDevice() {
  if (dev_.devOf < 0 && !dev_.stage && dev_.ipc.pool.empty() && dev_.sendDev < 0) return;
  const cuda::DeviceApi* api = nullptr;
  try {
    api = &deviceApi();
  } catch (const Error&) {
    return;
  }
  // Errors are ignored here: at process exit the CUDA runtime may already be gone. This runs
  // on the caller's thread (shutdown), whose current device is put back afterwards.
  RelaxedCapture relaxed(*api);
  int callerDevice = -1;
  api->getDevice(&callerDevice);
  if (dev_.devOf >= 0) api->setDevice(dev_.devOf);
  // IPC ops may still run on the GPU (they complete once queued): let them finish before the
  // peers' pools are unmapped (aborting first would let this rank's stream skip steps that
  // healthy peers still need), but never hang teardown on a GPU that does not. Then a
  // one-kernel op still waiting for a peer gives up, and this rank's stream is released from
  // its step waits, again each half second: a slow peer's late signal may lower a count the
  // abort raised.
  if (!drained(*api, dev_.stageEv[0], dev_.lastStream))
    for (int i = 0; i < 20; ++i) {
      abortShots();
      if (drained(*api, dev_.stageEv[0], dev_.lastStream, Millis(500))) break;
    }
  dev_.lastStream = nullptr;
  // A send's copy to host memory that failed while queued keeps its buffers until the copy is
  // done; one that never ends (a hung GPU) keeps them for the life of the process.
  if (!dev_.sendKept.empty() && !drained(*api, dev_.sendEv, dev_.sendStream))
    new std::vector<std::shared_ptr<void>>(std::move(dev_.sendKept));  // never freed, on purpose
  dev_.sendKept.clear();
  releaseSendStaging(*api);
  releaseGpuWork(*api);
  releaseIpc(*api, false);
  for (auto& ev : dev_.stageEv)
    if (ev) api->eventDestroy(ev), ev = nullptr;
  if (dev_.ownStream) api->streamDestroy(dev_.ownStream), dev_.ownStream = nullptr;
  if (dev_.stageOwner) dev_.stageOwner->freed = true;
  if (dev_.stage) api->hostFree(dev_.stage), dev_.stage = nullptr;
  dev_.stageCap = 0;
  dev_.devOf = -1;
  if (callerDevice >= 0) api->setDevice(callerDevice);
}

DeviceOp DeviceLayer::beginDevice(const Placement& where) {
  const cuda::DeviceApi& api = deviceApi();
  const int d = where.device;
  checkDevice(api.setDevice(d), "cudaSetDevice", d);
  if (dev_.devOf != d) {
    // Events and streams belong to one device; a group that moves to another starts afresh.
    for (auto& ev : dev_.stageEv)
      if (ev) api.eventDestroy(ev), ev = nullptr;
    if (dev_.ownStream) api.streamDestroy(dev_.ownStream), dev_.ownStream = nullptr;
    dev_.devOf = d;
    dev_.lastStream = nullptr;
    for (auto& ev : dev_.stageEv) checkDevice(api.eventCreate(&ev), "cudaEventCreate", d);
  }
  void* stream = where.stream;
  if (!stream) {
    if (!dev_.ownStream) checkDevice(api.streamCreate(&dev_.ownStream), "cudaStreamCreate", d);
    stream = dev_.ownStream;
  }
  if (where.waitEvent) checkDevice(api.streamWaitEvent(stream, where.waitEvent), "cudaStreamWaitEvent", d);
  // Waiting on the caller's event joins a capture the caller's stream is in: the op is then
  // recorded into the graph (shots.cpp decides what may be), and it is ordered by the graph's
  // own edges, not by an event from the stream of the op before (which a capture refuses).
  int capturing = 0;
  if (api.streamCapturing) checkDevice(api.streamCapturing(stream, &capturing), "cudaStreamIsCapturing", d);
  if (capturing) return {d, stream, true, true};
  // Ops complete once queued, and what orders one op's writes to the IPC pool after the peers'
  // reads of the op before is that op's stream: a new stream first waits for the last one.
  if (dev_.lastStream && dev_.lastStream != stream) {
    checkDevice(api.eventRecord(dev_.stageEv[1], dev_.lastStream), "cudaEventRecord", d);
    checkDevice(api.streamWaitEvent(stream, dev_.stageEv[1]), "cudaStreamWaitEvent (previous op's stream)", d);
  }
  dev_.lastStream = stream;
  return {d, stream, where.queued && where.stream != nullptr};
}

void DeviceLayer::setDeviceBody(Op& o, const Placement& where, DataType dt, DevicePlan plan) {
  o.body = [this, where, dt, p = std::move(plan)] { runDevice(where, dt, p); };
}

void DeviceLayer::runDevice(const Placement& where, DataType dt, const DevicePlan& plan) {
  RelaxedCapture relaxed(deviceApi());
  DeviceOp dv = beginDevice(where);
  if (dv.captured) return runCaptured(dv, plan);
  // ipcReady() maps the peers' pools at the group's first device op (a collective step).
  bool mapped = place_.cudaIpc && plan.ipc && ipcReady(dv.device, dv.stream);
  if (chooseDevicePath(place_, mapped, nullptr) == DevicePath::kCudaIpc) return plan.ipc(dv);
  runStaged(dv, dt, plan.slots, plan.regions, plan.host, plan.agree);
}

void DeviceLayer::runStaged(const DeviceOp& dv, DataType dt, size_t slots, std::vector<Region> regions,
                         const StagedBody& body, bool agree) {
  const cuda::DeviceApi& api = deviceApi();
  const int d = dv.device;
  void* stream = dv.stream;

  // Regions at one address are staged once, so an in-place op stays in place on the host.
  std::vector<size_t> slot(regions.size());
  std::vector<Region> uniq;
  for (size_t i = 0; i < regions.size(); ++i) {
    size_t j = 0;
    while (j < uniq.size() && !(regions[i].dev != nullptr && uniq[j].dev == regions[i].dev && uniq[j].count == regions[i].count))
      ++j;
    if (j == uniq.size()) uniq.push_back(regions[i]);
    uniq[j].in |= regions[i].in;
    uniq[j].out |= regions[i].out;
    slot[i] = j;
  }

  const size_t es = dtypeSize(dt);
  const size_t setBytes = static_cast<size_t>(std::max<int64_t>(opts_.config.cudaStagingBytes / 2, 4096));
  const size_t per = std::max<size_t>(setBytes / std::max<size_t>(slots, 1) / es, 1);  // elements per region and chunk
  const size_t stride = (per * es + 63) / 64 * 64;
  size_t maxCount = 0;
  for (auto& r : regions) maxCount = std::max(maxCount, r.count);
  if (agree && size_ > 1) {
    int64_t m = static_cast<int64_t>(maxCount);
    algos_.allreduce(reinterpret_cast<char*>(&m), 1, DataType::kInt64, ReduceOp::kMax, 1.0);
    maxCount = static_cast<size_t>(m);
  }
  const size_t chunks = std::max<size_t>(1, (maxCount + per - 1) / per);
  const size_t need = 2 * std::max<size_t>(uniq.size(), 1) * stride;
  if (dev_.stageCap < need) {
    if (dev_.stageOwner) dev_.stageOwner->freed = true;
    if (dev_.stage) checkDevice(api.hostFree(dev_.stage), "cudaFreeHost", d), dev_.stage = nullptr, dev_.stageCap = 0;
    void* p = nullptr;
    checkDevice(api.hostAlloc(&p, need), "cudaHostAlloc (pinned staging)", d);
    dev_.stage = static_cast<char*>(p);
    dev_.stageCap = need;
    dev_.stageOwner = std::make_shared<transport::FreedFlag>();
    transport::noteMemoryOwner(p, need, dev_.stageOwner);
    RAILCC_INFO(COLL, "group '", opts_.name, "': ", need >> 10, " KiB of pinned staging for cuda:", d,
                " (RAILCC_CUDA_STAGING_BYTES=", opts_.config.cudaStagingBytes, ")");
  }
  auto hostOf = [&](size_t set, size_t j) { return dev_.stage + (set * uniq.size() + j) * stride; };
  auto piece = [&](size_t count, size_t k) {
    size_t lo = k * per;
    return lo >= count ? size_t(0) : std::min(per, count - lo);
  };
  auto toHost = [&](size_t k, size_t set) {
    for (size_t j = 0; j < uniq.size(); ++j) {
      size_t n = uniq[j].in ? piece(uniq[j].count, k) : 0;
      if (n)
        checkDevice(api.memcpyAsync(hostOf(set, j), uniq[j].dev + k * per * es, n * es, stream),
                    "cudaMemcpyAsync (device to pinned host)", d);
    }
    checkDevice(api.eventRecord(dev_.stageEv[set], stream), "cudaEventRecord", d);
  };
  auto toDevice = [&](size_t k, size_t set) {
    for (size_t j = 0; j < uniq.size(); ++j) {
      size_t n = uniq[j].out ? piece(uniq[j].count, k) : 0;
      if (n)
        checkDevice(api.memcpyAsync(uniq[j].dev + k * per * es, hostOf(set, j), n * es, stream),
                    "cudaMemcpyAsync (pinned host to device)", d);
    }
  };

  std::vector<char*> host(regions.size());
  std::vector<size_t> counts(regions.size());
  toHost(0, 0);
  for (size_t k = 0; k < chunks; ++k) {
    size_t set = k & 1;
    // Stream order keeps the copy back of chunk k-1 (same set) ahead of this copy out.
    if (k + 1 < chunks) toHost(k + 1, set ^ 1);
    deviceWait(api, dev_.stageEv[set], d, "the copy of a chunk to pinned host memory", stream);
    for (size_t i = 0; i < regions.size(); ++i) {
      host[i] = hostOf(set, slot[i]);
      counts[i] = piece(regions[i].count, k);
    }
    body(host, counts);
    ch_.touch();
    toDevice(k, set);
  }
  // The op completes once its results are on the device: the staging is then free for the
  // next op, and the caller's buffers are no longer touched.
  checkDevice(api.eventRecord(dev_.stageEv[0], stream), "cudaEventRecord", d);
  deviceWait(api, dev_.stageEv[0], d, "the copy of the result back to the device", stream);
}

}  // namespace railcc::engine
