#include <cstring>
#include <mutex>
#include <sstream>

#include "common/error.h"
#include "common/log.h"
#include "cuda/shots.h"
#include "engine/device/device_layer.h"
#include "transport/stats.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// One-kernel collectives (RAILCC_CUDA_SHOTS): cuda/shots.h launched through the plugin. Set up
// once with the CUDA IPC pools (cuda_ipc.cpp): a rank's pool is its scratch, and the pool's
// tail holds its signal pads, so the one IPC handle per rank that the pools exchange already
// maps everything. Per op there is one launch and no host round: ranks meet on the device.

// The pool's tail: the signal pads, then the where records (cuda/shots.h), zeroed together.
size_t DeviceLayer::shotPadBytes() {
  return ((sizeof(cuda::SignalPad) + sizeof(cuda::ShotWhere)) * cuda::kMaxShotBlocks + 255) / 256 * 256;
}

bool DeviceLayer::shotSetup(const cuda::DeviceApi& api, void* stream, std::string* why) {
  ShotState& s = dev_.shot;
  auto attempt = [&](int err, const char* call) {
    if (err != 0 && why->empty()) *why = std::string(call) + " failed: " + (api.errorString ? api.errorString(err) : "?");
    return err == 0;
  };
  cuda::ShotPeers host{};
  for (size_t q = 0; q < static_cast<size_t>(size_); ++q) {
    host.scratch[q] = dev_.ipc.pool[q];
    char* tail = dev_.ipc.pool[q] + 4 * dev_.ipc.chunk;
    host.pads[q] = reinterpret_cast<cuda::SignalPad*>(tail);
    host.where[q] = reinterpret_cast<cuda::ShotWhere*>(tail + sizeof(cuda::SignalPad) * cuda::kMaxShotBlocks);
    host.heap[q] = q < dev_.ipc.heaps.size() ? dev_.ipc.heaps[q] : nullptr;
  }
  host.segs = s.segTableInUse;
  std::vector<uint32_t> zeros(cuda::kMaxShotBlocks, 0);
  void* p = nullptr;
  bool ok = attempt(api.deviceMalloc(&s.table, sizeof(cuda::ShotPeers)), "cudaMalloc (shot table)") &&
            attempt(api.deviceMalloc(&p, zeros.size() * sizeof(uint32_t)), "cudaMalloc (shot epochs)");
  s.epochs = static_cast<uint32_t*>(p);
  ok = ok && attempt(api.hostAlloc(&s.failure, sizeof(cuda::SignalFailure)), "cudaHostAlloc (shot failure record)");
  p = nullptr;
  ok = ok && attempt(api.hostAlloc(&p, sizeof(uint32_t)), "cudaHostAlloc (shot abort flag)");
  s.abort = static_cast<uint32_t*>(p);
  if (ok) {
    std::memset(s.failure, 0, sizeof(cuda::SignalFailure));
    __atomic_store_n(s.abort, 0u, __ATOMIC_RELEASE);
    ok = attempt(api.memcpyAsync(s.table, &host, sizeof(host), stream), "cudaMemcpyAsync (shot table)") &&
         attempt(api.memcpyAsync(s.epochs, zeros.data(), zeros.size() * sizeof(uint32_t), stream),
                 "cudaMemcpyAsync (shot epochs)") &&
         attempt(api.streamSynchronize(stream), "cudaStreamSynchronize (shot set-up)");
  }
  if (!ok) shotRelease(api);
  return ok;
}

void DeviceLayer::shotRelease(const cuda::DeviceApi& api) {
  ShotState& s = dev_.shot;
  segsRelease(api);
  std::lock_guard<std::mutex> g(dev_.gpuMu);  // the watchdog reads the failure record under it
  if (s.table) api.deviceFree(s.table);
  if (s.epochs) api.deviceFree(s.epochs);
  if (s.failure) api.hostFree(s.failure);
  if (s.abort) api.hostFree(s.abort);
  s.ready = false;
  s.table = s.failure = nullptr;
  s.epochs = s.abort = nullptr;
  s.failureSeen = false;
}

void DeviceLayer::abortShots() {
  std::lock_guard<std::mutex> g(dev_.gpuMu);
  if (dev_.shot.abort) __atomic_store_n(dev_.shot.abort, 1u, __ATOMIC_RELEASE);
  abortSteps();  // and a stream waiting on a step's signal passes it
}

std::exception_ptr DeviceLayer::shotFailure() {
  ShotState& s = dev_.shot;
  if (!s.failure || s.failureSeen.load()) return nullptr;
  const auto* f = static_cast<const cuda::SignalFailure*>(s.failure);
  const uint32_t state = __atomic_load_n(&f->state, __ATOMIC_ACQUIRE);
  if (state != cuda::kTimedOut && state != cuda::kAborted) return nullptr;  // none, or being written
  if (s.failureSeen.exchange(true)) return nullptr;
  const char* op = "collective";
  for (const auto& [seq, kind] : s.launched)
    if (seq == f->seq) op = opKindName(kind);
  std::ostringstream os;
  if (state == cuda::kAborted) {
    os << op << " (seq " << f->seq << ", one kernel on the GPU) was aborted while it waited for "
       << ch_.rankName(f->peer);
  } else {
    os << op << " (seq " << f->seq << ", one kernel on the GPU) timed out: " << ch_.rankName(f->peer)
       << " did not signal within the op's timeout (" << f->count << " of " << f->expected
       << " signals seen); it stopped calling, died, or runs a different op";
  }
  Error err(state == cuda::kAborted ? ErrorCode::kAborted : ErrorCode::kTimeout, os.str());
  err.seq = static_cast<long long>(f->seq);
  err.op = op;
  if (state == cuda::kTimedOut) err.ranks = {f->peer};
  return std::make_exception_ptr(err);
}

bool DeviceLayer::shotUsable(DataType dt, ReduceOp op) const {
  return dev_.shot.ready && cuda::shotSupported(dt, op);
}

bool DeviceLayer::shotMoves(const std::vector<char*>& blocks, size_t count, DataType dt) const {
  if (!dev_.shot.ready || blocks.size() != static_cast<size_t>(size_)) return false;
  for (size_t r = 1; r < blocks.size(); ++r)  // one tensor of n blocks, as the *_tensor calls pass
    if (blocks[r] != blocks[0] + r * count * dtypeSize(dt)) return false;
  return true;
}

void DeviceLayer::launchShot(const DeviceOp& dv, cuda::ShotKind k, const char* in, char* out, size_t count, int root,
                             DataType dt, ReduceOp op, double scale) {
  if (count == 0) return;  // every rank passes the same count, so all skip it
  const cuda::DeviceApi& api = deviceApi();
  const OpStamp* cur = ch_.current();
  const Millis timeout = cur ? cur->timeout : opts_.timeout;
  cuda::ShotArgs a{};
  a.peers = static_cast<const cuda::ShotPeers*>(dev_.shot.table);
  a.input = in;
  a.output = out;
  a.me = rank_;
  a.n = size_;
  a.root = root;
  a.count = count;
  // The scratch holds 4 chunks' bytes; a chunk of elements starts on a multiple of 16.
  a.chunk = std::max<size_t>(4 * dev_.ipc.chunk / dtypeSize(dt) / 16 * 16, 16);
  a.epochs = dev_.shot.epochs;
  // The device gives up a tenth before the host would (deviceWait, the watchdog's look at the
  // GPU work), so that the error names the peer that did not come.
  a.timeoutNs = static_cast<uint64_t>(timeout.count()) * 900000ull;
  a.seq = cur ? cur->fp.seq : 0;
  a.failure = static_cast<cuda::SignalFailure*>(dev_.shot.failure);
  a.abort = dev_.shot.abort;
  a.scale = scale;
  a.op = op;
  // A block per 128 KiB a rank moves, up to RAILCC_CUDA_SHOT_BLOCKS: small calls meet at few
  // pads, large ones use enough of the GPU to reach its memory's speed. Every rank computes the
  // same number (the counts agree), and a block's counts only move in ops that use it.
  // Where peers find my data: in place where it lies in my heap, which they all mapped at
  // set-up, or in a registered segment of torch's allocator (segPlace), and the kind allows it
  // (cuda::shotPublishAt); else through my scratch.
  const size_t es = dtypeSize(dt), n = static_cast<size_t>(size_);
  const bool a2a = k == cuda::ShotKind::kAllToAll;
  const size_t inBytes = count * es * (k == cuda::ShotKind::kReduceScatter || a2a ? n : 1);
  const size_t outBytes = count * es * (k == cuda::ShotKind::kAllGather || a2a ? n : 1);
  const char* heap = dev_.ipc.heaps.empty() ? nullptr : dev_.ipc.heaps[static_cast<size_t>(rank_)];
  const size_t heapBytes = heap ? dev_.heap.heap->bytes() : 0;  // heap set: every peer mapped it
  cuda::shotPublishAt(
      k, rank_, in, inBytes, out, outBytes,
      [&](const void* p, size_t b) {
        const uint64_t at = cuda::shotOffsetIn(heap, heapBytes, p, b);
        return at != cuda::kInScratch ? at : segPlace(p, b);
      },
      &a.inHeap, &a.outHeap);
  if (a.inHeap != cuda::kInScratch)
    transport::addStat(transport::StatKind::kDevice, transport::Stat::kDeviceInPlace, 1);
  const size_t bytes = count * es, per = size_t(128) << 10;
  const int blocks = static_cast<int>(std::min<size_t>((bytes + per - 1) / per, static_cast<size_t>(opts_.config.cudaShotBlocks)));
  {
    std::lock_guard<std::mutex> g(dev_.gpuMu);
    dev_.shot.launched[dev_.shot.nextLaunched++ % dev_.shot.launched.size()] = {a.seq, cur ? cur->kind : OpKind::kAllreduce};
  }
  checkDevice(api.shotAsync(&a, dt, k, std::max(blocks, 1), dv.stream), "one-kernel collective", dv.device);
  if (SegmentRegistry* r = dev_.shot.segs.get()) {  // a segment it reads is freed only after it ran
    r->used(a.inHeap, dv.stream);
    r->used(a.outHeap, dv.stream);
  }
  transport::addStat(transport::StatKind::kDevice, transport::Stat::kDeviceKernels, 1);
}

void DeviceLayer::finishShot(const DeviceOp& dv, const char* what) {
  const cuda::DeviceApi& api = deviceApi();
  ch_.touch();
  // Captured: nothing runs now, so there is nothing to watch; a replay that gives up still
  // leaves its failure record, which the watchdog reads (checkGpuWork).
  if (dv.captured) return;
  if (dv.queued) return watchGpu(api, dv, what);
  checkDevice(api.eventRecord(dev_.stageEv[0], dv.stream), "cudaEventRecord", dv.device);
  deviceWait(api, dev_.stageEv[0], dv.device, what, dv.stream);
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> g(dev_.gpuMu);
    e = shotFailure();
  }
  if (e) std::rethrow_exception(e);
}

void DeviceLayer::runShotAllreduce(const DeviceOp& dv, const std::vector<std::pair<char*, size_t>>& segs, DataType dt,
                                   ReduceOp op, double scale) {
  for (auto& [p, count] : segs) {
    const auto k = algos_.oneshot(count * dtypeSize(dt)) ? cuda::ShotKind::kAllReduceOne : cuda::ShotKind::kAllReduceTwo;
    launchShot(dv, k, p, p, count, 0, dt, op, scale);
  }
  finishShot(dv, "the one-kernel all-reduce");
}

void DeviceLayer::runShotAllgather(const DeviceOp& dv, const char* in, size_t count, DataType dt, char* out) {
  launchShot(dv, cuda::ShotKind::kAllGather, in, out, count, 0, dt, ReduceOp::kSum, 1.0);
  finishShot(dv, "the one-kernel all-gather");
}

void DeviceLayer::runShotReduceScatter(const DeviceOp& dv, const char* in, char* out, size_t count, DataType dt,
                                       ReduceOp op, double scale) {
  launchShot(dv, cuda::ShotKind::kReduceScatter, in, out, count, 0, dt, op, scale);
  finishShot(dv, "the one-kernel reduce-scatter");
}

void DeviceLayer::runShotAlltoall(const DeviceOp& dv, const char* in, char* out, size_t count, DataType dt) {
  launchShot(dv, cuda::ShotKind::kAllToAll, in, out, count, 0, dt, ReduceOp::kSum, 1.0);
  finishShot(dv, "the one-kernel all-to-all");
}

void DeviceLayer::runShotBroadcast(const DeviceOp& dv, char* buf, size_t count, DataType dt, int root) {
  launchShot(dv, cuda::ShotKind::kBroadcast, buf, buf, count, root, dt, ReduceOp::kSum, 1.0);
  finishShot(dv, "the one-kernel broadcast");
}

// ---------------------------------------------------------------------------------------
// The heap (heap.h): carved by allocate_tensor, mapped by every peer at the IPC set-up.

std::shared_ptr<DeviceHeap> DeviceLayer::heapLocked(const cuda::DeviceApi& api, int device) {
  HeapState& hs = dev_.heap;
  if (!hs.heap && hs.share.load() == HeapShare::kUndecided && opts_.config.cudaHeapBytes > 0)
    hs.heap = makeHeap(api, device);
  return hs.heap;
}

std::shared_ptr<DeviceHeap> DeviceLayer::makeHeap(const cuda::DeviceApi& api, int device) {
  int was = -1;
  if (api.getDevice(&was) != 0 || api.setDevice(device) != 0) return nullptr;
  void* p = nullptr;
  const size_t bytes = static_cast<size_t>(opts_.config.cudaHeapBytes);
  const int err = api.deviceMalloc(&p, bytes);
  api.setDevice(was);
  if (err != 0) {
    RAILCC_WARN(COLL, "group '", opts_.name, "': no ", bytes >> 20, " MiB heap on cuda:", device,
                " (RAILCC_CUDA_HEAP_BYTES): cudaMalloc failed: ", api.errorString ? api.errorString(err) : "?",
                "; its communication buffers come from torch's allocator");
    return nullptr;
  }
  const cuda::DeviceApi* a = &api;
  return std::make_shared<DeviceHeap>(static_cast<char*>(p), bytes, device, [a](char* q) { a->deviceFree(q); });
}

bool DeviceLayer::offersShared() const {
  return opts_.config.cudaShots && opts_.config.cudaIpc && opts_.config.cudaHeapBytes > 0 && size_ >= 2 &&
         static_cast<int>(localRanks_.size()) == size_ && dev_.heap.share.load() != HeapShare::kNotShared;
}

std::shared_ptr<void> DeviceLayer::allocateShared(int device, size_t bytes) {
  if (bytes == 0 || !offersShared()) return nullptr;
  std::string why;
  if (!deviceApiAvailable(&why)) return nullptr;  // torch then allocates it, and the op says why
  const cuda::DeviceApi& api = deviceApi();
  if (device < 0 && api.getDevice(&device) != 0) return nullptr;  // "cuda": the current device
  std::shared_ptr<DeviceHeap> h;
  {
    std::lock_guard<std::mutex> g(dev_.heap.mu);
    h = heapLocked(api, device);
  }
  if (!h || h->device() != device) return nullptr;
  char* p = h->take(bytes);
  if (!p) return nullptr;
  return std::shared_ptr<void>(p, [h](void* q) { h->give(static_cast<char*>(q)); });
}

void DeviceLayer::heapExport(const cuda::DeviceApi& api, int device, char* blob) {
  std::memset(blob, 0, kHeapBlob);
  dev_.ipc.heaps.assign(static_cast<size_t>(size_), nullptr);
  std::lock_guard<std::mutex> g(dev_.heap.mu);
  HeapState& hs = dev_.heap;
  if (!heapLocked(api, device)) return;
  if (hs.heap->device() != device) {
    RAILCC_INFO(COLL, "group '", opts_.name, "': its heap is on cuda:", hs.heap->device(), ", its ops on cuda:", device,
                ": the one-kernel ops copy every buffer into the scratch");
    return;
  }
  if (api.ipcGetMemHandle(blob, hs.heap->base()) != 0) return;  // peers then see none
  const uint64_t bytes = hs.heap->bytes();
  std::memcpy(blob + cuda::kIpcHandleBytes, &bytes, sizeof(bytes));
  dev_.ipc.heaps[static_cast<size_t>(rank_)] = hs.heap->base();
}

void DeviceLayer::heapOpen(const cuda::DeviceApi& api, size_t q, const char* blob, std::string* why) {
  uint64_t bytes = 0;
  std::memcpy(&bytes, blob + cuda::kIpcHandleBytes, sizeof(bytes));
  if (bytes == 0) return;  // it has none: its data goes through its scratch
  void* p = nullptr;
  const int err = api.ipcOpenMemHandle(&p, blob);
  if (err != 0 && why->empty())
    *why = "cudaIpcOpenMemHandle (rank " + std::to_string(q) + "'s heap) failed: " + (api.errorString ? api.errorString(err) : "?");
  dev_.ipc.heaps[q] = static_cast<char*>(p);
}

// ---------------------------------------------------------------------------------------
// CUDA graphs: a captured op is one kernel whose arguments (buffers, the table, the pads) stay
// valid for the graph's life and whose signal counts come from device memory, so every replay
// meets the peers' replays at the right counts. The watchdog cannot see replays; a replay that
// gives up records its failure, which the watchdog reads all the same.

void DeviceLayer::runCaptured(const DeviceOp& dv, const DevicePlan& plan) {
  // Set-up allocates and meets the peers on the host: it must come before the capture.
  if (!dev_.shot.ready || dev_.ipc.device != dv.device || !plan.ipc)
    refuseCapture(dev_.ipc.device < 0 && !dev_.ipc.failed && opts_.config.cudaShots
                      ? "the group's first CUDA op sets it up, which must run outside the capture (a warm-up "
                        "call, as torch.cuda.graph asks)"
                      : "this group has no one-kernel ops (they need RAILCC_CUDA_SHOTS=1 and every rank of the "
                        "group on this host)");
  dev_.gpuWatched = true;  // the watchdog looks at the failure record every second from now on
  dev_.capturing = true;
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{dev_.capturing};
  plan.ipc(dv);
}

void DeviceLayer::refuseCapture(const std::string& why) const {
  const OpStamp* cur = ch_.current();
  std::ostringstream os;
  os << (cur ? opKindName(cur->kind) : "collective") << " (seq " << (cur ? cur->fp.seq : 0)
     << ") cannot be captured into a CUDA graph: " << why
     << ". railcc captures all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor and "
        "all_to_all_single of equal splits as one kernel each";
  Error err(ErrorCode::kInvalidUsage, os.str());
  if (cur) {
    err.seq = static_cast<long long>(cur->fp.seq);
    err.op = opKindName(cur->kind);
  }
  throw err;
}

}  // namespace railcc::engine
