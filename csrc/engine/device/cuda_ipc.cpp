#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "common/error.h"
#include "common/log.h"
#include "engine/device/device_layer.h"
#include "transport/stats.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// Device buffers: CUDA IPC between the processes of one host

void DeviceLayer::ipcStep(const cuda::DeviceApi& api, void* stream, int d, IpcEvent e) {
  if (dev_.capturing) refuseCapture("it meets the peers on the host for each chunk, which a replay of the graph would skip");
  if (dev_.ipc.signals) return signalStep(api, stream, d, e);
  checkDevice(api.eventRecord(dev_.ipc.ev[static_cast<size_t>(rank_)][e], stream), "cudaEventRecord", d);
  algos_.syncRound();
  transport::addStat(transport::StatKind::kDevice, transport::Stat::kHostRounds, 1);
  for (int q = 0; q < size_; ++q)
    if (q != rank_)
      checkDevice(api.streamWaitEvent(stream, dev_.ipc.ev[static_cast<size_t>(q)][e]), "cudaStreamWaitEvent (peer's IPC event)", d);
}

void DeviceLayer::releaseIpc(const cuda::DeviceApi& api, bool peersDone) {
  shotRelease(api);
  {
    std::lock_guard<std::mutex> g(dev_.gpuMu);  // abortSteps() reads these under it
    dev_.ipc.signals = false;
    if (dev_.ipc.abortStream) api.streamDestroy(dev_.ipc.abortStream);
    dev_.ipc.abortStream = nullptr;
  }
  for (auto& k : dev_.ipc.steps) k.store(0);
  const size_t me = static_cast<size_t>(rank_);
  for (size_t r = 0; r < dev_.ipc.pool.size(); ++r) {
    if (r == me) continue;
    if (dev_.ipc.pool[r]) api.ipcCloseMemHandle(dev_.ipc.pool[r]);
    for (void* e : dev_.ipc.ev[r])  // opened event handles are destroyed like local events
      if (e) api.eventDestroy(e);
    if (r < dev_.ipc.heaps.size() && dev_.ipc.heaps[r]) api.ipcCloseMemHandle(dev_.ipc.heaps[r]);
  }
  {
    // The heap: freed when its last buffer goes, unless peers may still map it.
    std::lock_guard<std::mutex> g(dev_.heap.mu);
    if (dev_.heap.heap && !peersDone) dev_.heap.heap->keep();
    dev_.heap.heap.reset();
    dev_.heap.share = HeapShare::kNotShared;
  }
  if (me < dev_.ipc.pool.size()) {
    // Freeing memory or events that a peer still has open is undefined in CUDA, and a peer's
    // stream may still hold a wait on our events. Only when every peer is known to have
    // closed them are they freed; otherwise they stay until the process exits.
    if (peersDone) {
      if (dev_.ipc.pool[me]) api.deviceFree(dev_.ipc.pool[me]);
      for (void* e : dev_.ipc.ev[me])
        if (e) api.eventDestroy(e);
    } else if (dev_.ipc.pool[me]) {
      RAILCC_INFO(COLL, "group '", opts_.name, "': keeping its ", (4 * dev_.ipc.chunk) >> 10,
                  " KiB CUDA IPC pool until the process exits (peers may still map it)");
    }
  }
  dev_.ipc.pool.clear();
  dev_.ipc.ev.clear();
  dev_.ipc.heaps.clear();
}

void DeviceLayer::ipcFinish(const cuda::DeviceApi& api, const DeviceOp& dv, const char* what) {
  if (dv.queued) return watchGpu(api, dv, what);
  checkDevice(api.eventRecord(dev_.stageEv[0], dv.stream), "cudaEventRecord", dv.device);
  deviceWait(api, dev_.stageEv[0], dv.device, what, dv.stream);
}

bool DeviceLayer::ipcReady(int d, void* stream) {
  const cuda::DeviceApi& api = deviceApi();
  if (!opts_.config.cudaIpc || size_ < 2 || static_cast<int>(localRanks_.size()) != size_ || !api.ipcGetMemHandle)
    return false;
  if (dev_.ipc.failed) return false;
  if (dev_.ipc.device == d) return true;
  RAILCC_CHECK_ARG(dev_.ipc.device < 0, "a group serves one CUDA device; it used cuda:", dev_.ipc.device, ", now cuda:", d);
  // First CUDA op of the group: map every peer's pool and events. Every rank gets here at the
  // same op, so the handle exchange and the vote below line up.
  dev_.ipc.device = d;
  const size_t n = static_cast<size_t>(size_), me = static_cast<size_t>(rank_);
  dev_.ipc.chunk = std::max<size_t>(static_cast<size_t>(std::max<int64_t>(opts_.config.cudaIpcBytes, 0)) / 4 / 256 * 256,
                                64 << 10);
  dev_.ipc.pool.assign(n, nullptr);
  dev_.ipc.ev.assign(n, {nullptr, nullptr, nullptr});
  bool ok = true;
  std::string why;
  auto attempt = [&](int err, const std::string& call) {
    if (err != 0 && ok) {
      ok = false;
      why = call + " failed: " + (api.errorString ? api.errorString(err) : "?");
    }
  };
  // The blob: ok flag, the settings every rank must agree on (they fix the chunking, the
  // number of host rounds, which zero-byte rounds cannot check, and the one-kernel ops'
  // shape), then the handles.
  const bool shots = opts_.config.cudaShots && api.shotAsync != nullptr;
  constexpr size_t kCfg = 5;
  const size_t hb = cuda::kIpcHandleBytes, cfgAt = 1, handlesAt = cfgAt + kCfg * sizeof(int64_t);
  const size_t heapAt = handlesAt + hb * (1 + kIpcEvents), boardAt = heapAt + kHeapBlob, blob = boardAt + kBoardBlob;
  std::vector<char> mine(blob, 0), all(blob * n, 0);
  const int64_t cfg[kCfg] = {static_cast<int64_t>(dev_.ipc.chunk), opts_.config.oneshotBytes, shots ? 1 : 0,
                             opts_.config.cudaShotBlocks, opts_.config.cudaIpcSignals ? 1 : 0};
  std::memcpy(mine.data() + cfgAt, cfg, sizeof(cfg));
  void* p = nullptr;
  // Four chunk buffers, then the one-kernel ops' signal pads and the steps' pads, zeroed before
  // any peer maps them.
  const size_t tail = shotPadBytes() + stepPadBytes();
  attempt(api.deviceMalloc(&p, 4 * dev_.ipc.chunk + tail), "cudaMalloc (CUDA IPC pool)");
  dev_.ipc.pool[me] = static_cast<char*>(p);
  if (ok) {
    std::vector<char> zeros(tail, 0);
    attempt(api.memcpyAsync(dev_.ipc.pool[me] + 4 * dev_.ipc.chunk, zeros.data(), zeros.size(), stream),
            "cudaMemcpyAsync (signal pads)");
    if (ok) attempt(api.streamSynchronize(stream), "cudaStreamSynchronize (signal pads)");
  }
  for (auto& e : dev_.ipc.ev[me]) attempt(api.ipcEventCreate(&e), "cudaEventCreate (interprocess)");
  if (ok) attempt(api.ipcGetMemHandle(mine.data() + handlesAt, dev_.ipc.pool[me]), "cudaIpcGetMemHandle");
  for (int i = 0; i < kIpcEvents && ok; ++i)
    attempt(api.ipcGetEventHandle(mine.data() + handlesAt + hb * (1 + static_cast<size_t>(i)),
                                  dev_.ipc.ev[me][static_cast<size_t>(i)]),
            "cudaIpcGetEventHandle");
  if (ok && shots) heapExport(api, d, mine.data() + heapAt);  // the heap's handle, if it has one
  if (ok && shots) {
    segsExport(mine.data() + boardAt, &why);  // the registered segments' board
    ok = why.empty();
  }
  mine[0] = ok ? 1 : 0;
  {
    std::vector<Transfer> xs;
    for (int q = 0; q < size_; ++q)
      if (q != rank_) {
        xs.push_back(ch_.sendTo(q, mine.data(), blob));
        xs.push_back(ch_.recvFrom(q, all.data() + blob * static_cast<size_t>(q), blob));
      }
    ch_.exchange(xs);
  }
  // Our own pool and events, once no peer maps them.
  auto freeOwn = [&api](char* pool, const std::array<void*, kIpcEvents>& evs) {
    if (pool) api.deviceFree(pool);
    for (void* e : evs)
      if (e) api.eventDestroy(e);
  };
  // Every rank sees every blob, so all of them reach the same verdict here.
  for (size_t q = 0; q < n; ++q) {
    if (q == me) continue;
    int64_t theirs[kCfg];
    std::memcpy(theirs, all.data() + blob * q + cfgAt, sizeof(theirs));
    if (std::equal(theirs, theirs + kCfg, cfg)) continue;
    freeOwn(dev_.ipc.pool[me], dev_.ipc.ev[me]);  // nobody has opened them yet
    dev_.ipc.pool.clear();
    dev_.ipc.ev.clear();
    dev_.ipc.device = -1;
    Error err(ErrorCode::kMismatch,
              "CUDA IPC settings differ between ranks (they must be equal on all ranks): rank " + std::to_string(rank_) +
                  " has RAILCC_CUDA_IPC_BYTES=" + std::to_string(opts_.config.cudaIpcBytes) + " (chunk " +
                  std::to_string(cfg[0]) + " B), RAILCC_ONESHOT_BYTES=" + std::to_string(cfg[1]) +
                  ", RAILCC_CUDA_SHOTS=" + std::to_string(cfg[2]) + ", RAILCC_CUDA_SHOT_BLOCKS=" +
                  std::to_string(cfg[3]) + " and RAILCC_CUDA_IPC_SIGNALS=" + std::to_string(cfg[4]) + ", rank " +
                  std::to_string(q) + " a chunk of " + std::to_string(theirs[0]) + " B, RAILCC_ONESHOT_BYTES=" +
                  std::to_string(theirs[1]) + ", RAILCC_CUDA_SHOTS=" + std::to_string(theirs[2]) +
                  ", RAILCC_CUDA_SHOT_BLOCKS=" + std::to_string(theirs[3]) + " and RAILCC_CUDA_IPC_SIGNALS=" +
                  std::to_string(theirs[4]) +
                  " (RAILCC_CUDA_SHOTS reads 0 where the CUDA plugin has no one-kernel ops)");
    err.ranks = {rank_, static_cast<int>(q)};
    throw err;
  }
  int sharing = 0;  // peers whose pool is on this rank's GPU
  for (size_t q = 0; q < n && ok; ++q) {
    if (q == me) continue;
    const char* b = all.data() + blob * q;
    if (b[0] != 1) {
      ok = false;
      why = ch_.rankName(q) + " could not set up its side";
      break;
    }
    void* mp = nullptr;
    attempt(api.ipcOpenMemHandle(&mp, b + handlesAt), "cudaIpcOpenMemHandle (rank " + std::to_string(q) + ")");
    dev_.ipc.pool[q] = static_cast<char*>(mp);
    for (size_t i = 0; i < kIpcEvents && ok; ++i)
      attempt(api.ipcOpenEventHandle(&dev_.ipc.ev[q][i], b + handlesAt + hb * (1 + i)),
              "cudaIpcOpenEventHandle (rank " + std::to_string(q) + ")");
    if (ok && shots) {
      heapOpen(api, q, b + heapAt, &why);
      if (why.empty()) segsOpen(q, b + boardAt, &why);
      ok = why.empty();
    }
    int pd = -1, can = 0;
    if (ok) attempt(api.pointerDevice(dev_.ipc.pool[q], &pd), "cudaPointerGetAttributes");
    if (ok && pd == d) ++sharing;
    if (ok && pd != d) {
      attempt(api.canAccessPeer(d, pd, &can), "cudaDeviceCanAccessPeer");
      if (ok && !can) {
        ok = false;
        why = "cuda:" + std::to_string(d) + " cannot access the memory of rank " + std::to_string(q) + "'s GPU directly";
      }
    }
  }
  // The one-kernel ops' table, once every peer's pool is mapped.
  if (ok && shots && !(segsStart(api, d, &why) && shotSetup(api, stream, &why))) ok = false;
  // Steps through the streams' signals where asked for and every rank's stream can.
  std::string noSignals;
  const bool signals = ok && opts_.config.cudaIpcSignals && signalsProbe(api, stream, &noSignals);
  // Every rank must take the same path, so one vote decides (2: with signals, 1: without).
  int64_t vote = ok ? (signals ? 2 : 1) : 0;
  algos_.allreduce(reinterpret_cast<char*>(&vote), 1, DataType::kInt64, ReduceOp::kMin, 1.0);
  if (opts_.config.cudaIpcSignals && vote == 1)
    RAILCC_WARN(COLL, "group '", opts_.name, "': RAILCC_CUDA_IPC_SIGNALS=1, but ",
                noSignals.empty() ? std::string("another rank's stream cannot use stream memory operations") : noSignals,
                "; the CUDA IPC steps meet on the host");
  if (vote == 0) {
    RAILCC_WARN(COLL, "group '", opts_.name, "': CUDA IPC is not usable (",
                why.empty() ? std::string("another rank could not set it up") : why,
                "); collectives on CUDA tensors are staged through pinned host memory");
    // Peers close their mappings of our pool, then one more round before anyone frees.
    const size_t mine = static_cast<size_t>(rank_);
    char* own = dev_.ipc.pool[mine];
    auto ownEv = dev_.ipc.ev[mine];
    dev_.ipc.pool[mine] = nullptr;
    dev_.ipc.ev[mine] = {nullptr, nullptr, nullptr};
    releaseIpc(api, false);
    algos_.syncRound();
    freeOwn(own, ownEv);
    dev_.ipc.failed = true;
    return false;
  }
  dev_.shot.ready = shots;
  {
    std::lock_guard<std::mutex> g(dev_.gpuMu);  // abortSteps() reads it under the lock
    dev_.ipc.signals = vote == 2;
  }
  segsGo();
  // Every peer mapped this rank's heap (if it has one): its buffers are now reached in place.
  dev_.heap.share = shots ? HeapShare::kShared : HeapShare::kNotShared;
  RAILCC_INFO(COLL, "group '", opts_.name, "': CUDA IPC on cuda:", d, ", ", (4 * dev_.ipc.chunk) >> 10,
              " KiB of device memory per rank (RAILCC_CUDA_IPC_BYTES)",
              shots ? "; collectives in one kernel per tensor (RAILCC_CUDA_SHOTS=1)" : "",
              dev_.ipc.signals ? "; steps ordered by the streams' signals (RAILCC_CUDA_IPC_SIGNALS=1)" : "");
  if (sharing > 0) {
    // Without MPS the GPU runs one process's kernels at a time: ranks meeting inside a kernel
    // (RAILCC_CUDA_SHOTS) then wait for each other's turn.
    const char* pipe = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
    const std::string control = std::string(pipe && *pipe ? pipe : "/tmp/nvidia-mps") + "/control";
    const bool mps = access(control.c_str(), F_OK) == 0;
    RAILCC_INFO(COLL, "group '", opts_.name, "': ", sharing + 1, " of its ranks share cuda:", d, "; ",
                mps ? "an MPS control daemon is there (" + control + "), so their kernels can run side by side"
                    : "no MPS control daemon (" + control + " is absent): their kernels take turns" +
                          std::string(shots ? "; nvidia-cuda-mps-control -d starts one" : ""));
  }
  return true;
}

void DeviceLayer::runIpcAllreduce(const DeviceOp& dv, const std::vector<std::pair<char*, size_t>>& segs, DataType dt,
                               ReduceOp op, double scale) {
  if (shotUsable(dt, op)) return runShotAllreduce(dv, segs, dt, op, scale);
  const cuda::DeviceApi& api = deviceApi();
  const int d = dv.device;
  void* stream = dv.stream;
  const size_t n = static_cast<size_t>(size_), me = static_cast<size_t>(rank_), es = dtypeSize(dt);
  size_t count = 0;
  for (auto& sg : segs) count += sg.second;
  const size_t per = dev_.ipc.chunk / es;
  const size_t chunks = std::max<size_t>(1, (count + per - 1) / per);
  auto check = [d](int err, const char* call) { checkDevice(err, call, d); };
  // Calls f(pointer, first element relative to the chunk, length) for each piece of a segment
  // that falls in elements [lo, hi) of the whole array.
  auto overlap = [&segs, es](size_t lo, size_t hi, const std::function<void(char*, size_t, size_t)>& f) {
    size_t at = 0;
    for (auto& [p, c] : segs) {
      size_t a = std::max(at, lo), b = std::min(at + c, hi);
      if (a < b) f(p + (a - at) * es, a - lo, b - a);
      at += c;
      if (at >= hi) break;
    }
  };
  // Elements [lo, hi) of the array into this rank's input buffer `dst`, where peers read them.
  auto stageIn = [&](char* dst, size_t lo, size_t hi) {
    overlap(lo, hi, [&](char* p, size_t at, size_t len) {
      check(api.memcpyAsync(dst + at * es, p, len * es, stream), "cudaMemcpyAsync (into the IPC pool)");
    });
  };
  // One shot for small messages (RAILCC_ONESHOT_BYTES, one chunk): every rank reduces the whole
  // chunk itself, in rank order, into its own reduced buffer, which only it reads: two host
  // rounds instead of three, and no all-gather.
  if (algos_.oneshot(count * es) && count <= per) {
    auto in = [&](size_t q) { return dev_.ipc.pool[q]; };
    char* out = dev_.ipc.pool[me] + dev_.ipc.chunk;
    stageIn(in(me), 0, count);
    ipcStep(api, stream, d, kIpcIn);
    ipcReduceRanks(api, dv, out, in, count, dt, op, scale);
    overlap(0, count, [&](char* p, size_t at, size_t len) {
      check(api.memcpyAsync(p, out + at * es, len * es, stream), "cudaMemcpyAsync (result out of the pool)");
    });
    // Peers read our input buffer until they pass this step.
    ipcStep(api, stream, d, kIpcDone);
    ch_.touch();
    return ipcFinish(api, dv, "the CUDA IPC all-reduce");
  }
  for (size_t k = 0; k < chunks; ++k) {
    const size_t off = k * per, m = count > off ? std::min(per, count - off) : 0;
    auto in = [&](size_t q) { return dev_.ipc.pool[q] + (k & 1) * 2 * dev_.ipc.chunk; };
    auto red = [&](size_t q) { return in(q) + dev_.ipc.chunk; };
    auto lo = [&](size_t j) { return m * j / n; };  // rank j reduces elements [lo(j), lo(j+1)) of the chunk
    // 1. this rank's chunk into its pool, where the peers can read it
    stageIn(in(me), off, off + m);
    ipcStep(api, stream, d, kIpcIn);
    // 2. reduce this rank's slice over every rank's chunk, in rank order (same bits everywhere)
    const size_t a = lo(me), len = lo(me + 1) - a;
    ipcReduceRanks(api, dv, red(me) + a * es, [&](size_t q) { return in(q) + a * es; }, len, dt, op, scale);
    ipcStep(api, stream, d, kIpcRed);
    // 3. every rank's reduced slice into the result: a piece of a segment may span slices
    overlap(off, off + m, [&](char* p, size_t at, size_t len) {
      for (size_t j = 0; len > 0; ++j) {
        if (lo(j + 1) <= at) continue;
        size_t l = std::min(len, lo(j + 1) - at);
        check(api.memcpyAsync(p, red(j) + at * es, l * es, stream), "cudaMemcpyAsync (peer's slice)");
        p += l * es, at += l, len -= l;
      }
    });
    // The slot is reused two chunks on: no rank writes it again before every peer read it.
    ipcStep(api, stream, d, kIpcDone);
    ch_.touch();
  }
  ipcFinish(api, dv, "the CUDA IPC all-reduce");
}

void DeviceLayer::ipcReduceRanks(const cuda::DeviceApi& api, const DeviceOp& dv, char* out,
                              const std::function<const char*(size_t)>& src, size_t len, DataType dt, ReduceOp op,
                              double scale) {
  if (!len) return;
  const int d = dv.device;
  const size_t n = static_cast<size_t>(size_);
  if (op == ReduceOp::kPremulSum) checkDevice(api.scaleCopyAsync(out, src(0), len, dt, scale, dv.stream), "scale kernel", d);
  else checkDevice(api.memcpyAsync(out, src(0), len * dtypeSize(dt), dv.stream), "cudaMemcpyAsync (peer's buffer)", d);
  for (size_t q = 1; q < n; ++q) checkDevice(api.reduceAsync(out, src(q), len, dt, op, scale, dv.stream), "reduce kernel", d);
  if (op == ReduceOp::kAvg) checkDevice(api.divideAsync(out, len, dt, static_cast<double>(n), dv.stream), "divide kernel", d);
}

void DeviceLayer::ipcSlotChunks(const cuda::DeviceApi& api, const DeviceOp& dv, const char* in, size_t count, size_t es,
                             bool stage,
                             const std::function<void(const std::function<char*(size_t)>&, size_t, size_t)>& use) {
  const size_t me = static_cast<size_t>(rank_), per = 2 * dev_.ipc.chunk / es;
  const size_t chunks = std::max<size_t>(1, (count + per - 1) / per);
  for (size_t k = 0; k < chunks; ++k) {
    const size_t off = k * per, m = count > off ? std::min(per, count - off) : 0;
    auto slot = [&](size_t q) { return dev_.ipc.pool[q] + (k & 1) * 2 * dev_.ipc.chunk; };
    if (stage && m)
      checkDevice(api.memcpyAsync(slot(me), in + off * es, m * es, dv.stream), "cudaMemcpyAsync (into the IPC pool)", dv.device);
    ipcStep(api, dv.stream, dv.device, kIpcIn);
    if (m) use(slot, off, m);
    ipcStep(api, dv.stream, dv.device, kIpcDone);
    ch_.touch();
  }
}

// The root alone reduces the ranks' slots, straight into its buffer (its own contribution is
// already in its slot); the other ranks' buffers are left as they were.
void DeviceLayer::runIpcReduce(const DeviceOp& dv, char* buf, size_t count, DataType dt, ReduceOp op, double scale,
                            int root) {
  const cuda::DeviceApi& api = deviceApi();
  const size_t es = dtypeSize(dt);
  ipcSlotChunks(api, dv, buf, count, es, true, [&](const std::function<char*(size_t)>& slot, size_t off, size_t m) {
    if (rank_ == root) ipcReduceRanks(api, dv, buf + off * es, slot, m, dt, op, scale);
  });
  ipcFinish(api, dv, "the CUDA IPC reduce");
}

void DeviceLayer::runIpcGather(const DeviceOp& dv, const char* in, size_t count, DataType dt, const std::vector<char*>& outs,
                            int root) {
  const cuda::DeviceApi& api = deviceApi();
  const size_t es = dtypeSize(dt);
  ipcSlotChunks(api, dv, in, count, es, true, [&](const std::function<char*(size_t)>& slot, size_t off, size_t m) {
    if (rank_ != root) return;
    for (size_t q = 0; q < outs.size(); ++q)
      checkDevice(api.memcpyAsync(outs[q] + off * es, slot(q), m * es, dv.stream), "cudaMemcpyAsync (peer's piece)", dv.device);
  });
  ipcFinish(api, dv, "the CUDA IPC gather");
}

void DeviceLayer::runIpcScatter(const DeviceOp& dv, const std::vector<char*>& ins, char* out, size_t count, DataType dt,
                             int root) {
  const cuda::DeviceApi& api = deviceApi();
  const int d = dv.device;
  void* stream = dv.stream;
  const size_t n = static_cast<size_t>(size_), me = static_cast<size_t>(rank_), es = dtypeSize(dt);
  const size_t per = std::max<size_t>(2 * dev_.ipc.chunk / n / es, 1);  // n pieces of a chunk fill the root's slot
  const size_t chunks = std::max<size_t>(1, (count + per - 1) / per);
  for (size_t k = 0; k < chunks; ++k) {
    const size_t off = k * per, m = count > off ? std::min(per, count - off) : 0;
    // piece j of the root's slot: what rank j receives
    auto piece = [&](size_t j) { return dev_.ipc.pool[static_cast<size_t>(root)] + (k & 1) * 2 * dev_.ipc.chunk + j * per * es; };
    if (rank_ == root && m)
      for (size_t j = 0; j < n; ++j)
        checkDevice(api.memcpyAsync(piece(j), ins[j] + off * es, m * es, stream), "cudaMemcpyAsync (into the IPC pool)", d);
    ipcStep(api, stream, d, kIpcIn);
    if (m) checkDevice(api.memcpyAsync(out + off * es, piece(me), m * es, stream), "cudaMemcpyAsync (root's piece)", d);
    ipcStep(api, stream, d, kIpcDone);
    ch_.touch();
  }
  ipcFinish(api, dv, "the CUDA IPC scatter");
}

void DeviceLayer::runIpcAllgather(const DeviceOp& dv, const char* in, size_t count, DataType dt,
                               const std::vector<char*>& outs) {
  if (shotMoves(outs, count, dt)) return runShotAllgather(dv, in, count, dt, outs[0]);
  const cuda::DeviceApi& api = deviceApi();
  const size_t es = dtypeSize(dt);
  ipcSlotChunks(api, dv, in, count, es, true, [&](const std::function<char*(size_t)>& slot, size_t off, size_t m) {
    for (size_t q = 0; q < outs.size(); ++q)
      checkDevice(api.memcpyAsync(outs[q] + off * es, slot(q), m * es, dv.stream), "cudaMemcpyAsync (peer's piece)", dv.device);
  });
  ipcFinish(api, dv, "the CUDA IPC all-gather");
}

void DeviceLayer::runIpcReduceScatter(const DeviceOp& dv, const std::vector<char*>& ins, char* out, size_t count,
                                   DataType dt, ReduceOp op, double scale) {
  if (shotUsable(dt, op) && shotMoves(ins, count, dt)) return runShotReduceScatter(dv, ins[0], out, count, dt, op, scale);
  const cuda::DeviceApi& api = deviceApi();
  const int d = dv.device;
  void* stream = dv.stream;
  const size_t n = static_cast<size_t>(size_), me = static_cast<size_t>(rank_), es = dtypeSize(dt);
  const size_t per = std::max<size_t>(2 * dev_.ipc.chunk / n / es, 1);  // n pieces of a chunk fill a slot
  const size_t chunks = std::max<size_t>(1, (count + per - 1) / per);
  for (size_t k = 0; k < chunks; ++k) {
    const size_t off = k * per, m = count > off ? std::min(per, count - off) : 0;
    // piece j of rank q's slot: rank q's contribution to rank j's result
    auto piece = [&](size_t q, size_t j) { return dev_.ipc.pool[q] + (k & 1) * 2 * dev_.ipc.chunk + j * m * es; };
    for (size_t j = 0; j < n; ++j)
      if (m) checkDevice(api.memcpyAsync(piece(me, j), ins[j] + off * es, m * es, stream), "cudaMemcpyAsync (into the IPC pool)", d);
    ipcStep(api, stream, d, kIpcIn);
    ipcReduceRanks(api, dv, out + off * es, [&](size_t q) { return piece(q, me); }, m, dt, op, scale);
    ipcStep(api, stream, d, kIpcDone);
    ch_.touch();
  }
  ipcFinish(api, dv, "the CUDA IPC reduce-scatter");
}

void DeviceLayer::runIpcBroadcast(const DeviceOp& dv, char* buf, size_t count, DataType dt, int root) {
  if (dev_.shot.ready) return runShotBroadcast(dv, buf, count, dt, root);
  const cuda::DeviceApi& api = deviceApi();
  const size_t es = dtypeSize(dt);
  ipcSlotChunks(api, dv, buf, count, es, rank_ == root,
                [&](const std::function<char*(size_t)>& slot, size_t off, size_t m) {
                  if (rank_ != root)
                    checkDevice(api.memcpyAsync(buf + off * es, slot(static_cast<size_t>(root)), m * es, dv.stream),
                                "cudaMemcpyAsync (root's chunk)", dv.device);
                });
  ipcFinish(api, dv, "the CUDA IPC broadcast");
}

void DeviceLayer::runIpcAlltoall(const DeviceOp& dv, const std::vector<char*>& ins, const std::vector<size_t>& inCounts,
                              const std::vector<char*>& outs, const std::vector<size_t>& outCounts, DataType dt) {
  if (dev_.shot.ready && std::all_of(inCounts.begin(), inCounts.end(), [&](size_t c) { return c == inCounts[0]; }) &&
      outCounts == inCounts && shotMoves(ins, inCounts[0], dt) && shotMoves(outs, inCounts[0], dt))
    return runShotAlltoall(dv, ins[0], outs[0], inCounts[0], dt);
  const cuda::DeviceApi& api = deviceApi();
  const int d = dv.device;
  void* stream = dv.stream;
  const size_t n = static_cast<size_t>(size_), me = static_cast<size_t>(rank_), es = dtypeSize(dt);
  const size_t per = std::max<size_t>(2 * dev_.ipc.chunk / n / es, 1);  // n pieces of a chunk fill a slot
  // Splits differ per rank: agree on the number of chunks first.
  int64_t most = 0;
  for (size_t j = 0; j < n; ++j) most = std::max<int64_t>(most, static_cast<int64_t>(std::max(inCounts[j], outCounts[j])));
  algos_.allreduce(reinterpret_cast<char*>(&most), 1, DataType::kInt64, ReduceOp::kMax, 1.0);
  const size_t chunks = std::max<size_t>(1, (static_cast<size_t>(most) + per - 1) / per);
  auto part = [&](size_t count, size_t k) {
    size_t lo = k * per;
    return lo >= count ? size_t(0) : std::min(per, count - lo);
  };
  for (size_t k = 0; k < chunks; ++k) {
    // piece j of rank q's slot: what rank q sends rank j, elements [k*per, k*per + per)
    auto piece = [&](size_t q, size_t j) { return dev_.ipc.pool[q] + (k & 1) * 2 * dev_.ipc.chunk + j * per * es; };
    for (size_t j = 0; j < n; ++j) {
      size_t m = part(inCounts[j], k);
      if (m)
        checkDevice(api.memcpyAsync(piece(me, j), ins[j] + k * per * es, m * es, stream),
                    "cudaMemcpyAsync (into the IPC pool)", d);
    }
    ipcStep(api, stream, d, kIpcIn);
    for (size_t q = 0; q < n; ++q) {
      size_t m = part(outCounts[q], k);
      if (m)
        checkDevice(api.memcpyAsync(outs[q] + k * per * es, piece(q, me), m * es, stream), "cudaMemcpyAsync (peer's piece)",
                    d);
    }
    ipcStep(api, stream, d, kIpcDone);
    ch_.touch();
  }
  ipcFinish(api, dv, "the CUDA IPC all-to-all");
}

}  // namespace railcc::engine
