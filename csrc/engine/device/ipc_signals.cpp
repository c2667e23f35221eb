// The CUDA IPC path's steps ordered by the ranks' streams (RAILCC_CUDA_IPC_SIGNALS): instead of
// an interprocess event and a host round per step (cuda_ipc.cpp, ipcStep), each rank's stream
// writes its step count into every peer's pad once its copies before the step are done, and
// waits until every peer's count in its own pad has reached the same number. The copies stay on
// the copy engines and the reductions in their kernels; nothing on the host waits between a
// call and the GPU's end, and no kernel spins (a stream's wait is the GPU's own, as a wait on
// another process's event is), so ranks that share a GPU still take turns safely.
//
// Counts only grow (64 bits: they never wrap), so a step's wait is "at least k": a peer that is
// already a step ahead satisfies it too. Every rank makes the same steps in the same order, so
// the counts agree without being exchanged.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/log.h"
#include "engine/device/device_layer.h"
#include "transport/stats.h"

namespace railcc::engine {


size_t DeviceLayer::stepPadBytes() {
  return (kIpcEvents * cuda::kMaxSignalPeers * sizeof(uint64_t) + 255) / 256 * 256;
}

uint64_t* DeviceLayer::stepPad(size_t owner, IpcEvent e, size_t from) {
  char* tail = dev_.ipc.pool[owner] + 4 * dev_.ipc.chunk + shotPadBytes();
  return reinterpret_cast<uint64_t*>(tail) + static_cast<size_t>(e) * cuda::kMaxSignalPeers + from;
}

void DeviceLayer::signalStep(const cuda::DeviceApi& api, void* stream, int d, IpcEvent e) {
  const size_t me = static_cast<size_t>(rank_), n = static_cast<size_t>(size_);
  const uint64_t k = ++dev_.ipc.steps[static_cast<size_t>(e)];
  for (size_t q = 0; q < n; ++q)
    if (q != me) checkDevice(api.streamWriteValue64(stream, stepPad(q, e, me), k), "cuStreamWriteValue64 (a peer's step pad)", d);
  for (size_t q = 0; q < n; ++q)
    if (q != me) checkDevice(api.streamWaitValue64(stream, stepPad(me, e, q), k), "cuStreamWaitValue64 (this rank's step pad)", d);
  transport::addStat(transport::StatKind::kDevice, transport::Stat::kDeviceSignalSteps, 1);
}

bool DeviceLayer::signalsProbe(const cuda::DeviceApi& api, void* stream, std::string* why) {
  if (!api.streamWriteValue64 || !api.streamWaitValue64) {
    *why = "this CUDA plugin has no stream memory operations";
    return false;
  }
  const size_t me = static_cast<size_t>(rank_);
  // A write of zero (the counts' start) into this rank's pad and every peer's, and a wait: the
  // driver refuses here, not in the middle of an op, where stream memory operations are not
  // supported or cannot reach a peer's memory.
  int err = api.streamWriteValue64(stream, stepPad(me, kIpcIn, me), 0);
  for (size_t q = 0; q < static_cast<size_t>(size_) && err == 0; ++q)  // and into every peer's, as mapped here
    if (q != me) err = api.streamWriteValue64(stream, stepPad(q, kIpcIn, me), 0);
  if (err == 0) err = api.streamWaitValue64(stream, stepPad(me, kIpcIn, me), 0);
  if (err == 0) err = api.streamSynchronize(stream);
  if (err != 0) *why = std::string("stream memory operations failed: ") + (api.errorString ? api.errorString(err) : "?");
  if (err == 0 && (err = api.streamCreate(&dev_.ipc.abortStream)) != 0)
    *why = std::string("cudaStreamCreate (for aborts) failed: ") + (api.errorString ? api.errorString(err) : "?");
  return err == 0;
}

void DeviceLayer::abortSteps() {
  if (!dev_.ipc.signals || !dev_.ipc.abortStream || dev_.ipc.pool.empty()) return;
  // The largest count in every pad of this rank: its stream's waits, now and later, all pass.
  static const std::vector<unsigned char> ones(kIpcEvents * cuda::kMaxSignalPeers * sizeof(uint64_t), 0xFF);
  const cuda::DeviceApi& api = deviceApi();
  DeviceScope on(api, dev_.ipc.device);
  const int err =
      api.memcpyAsync(stepPad(static_cast<size_t>(rank_), kIpcIn, 0), ones.data(), ones.size(), dev_.ipc.abortStream);
  if (err != 0)
    RAILCC_WARN(COLL, "group '", opts_.name, "': could not release this rank's stream from its step waits (",
                api.errorString ? api.errorString(err) : "?", "): work queued behind them may never run");
}

std::vector<int> DeviceLayer::stepLaggards(const cuda::DeviceApi& api) {
  std::vector<int> late;
  if (!dev_.ipc.signals || !dev_.ipc.abortStream || dev_.ipc.pool.empty()) return late;
  // This rank's pads, as the peers' streams last wrote them, through the abort stream, which no
  // step ever holds.
  std::vector<uint64_t> pads(kIpcEvents * cuda::kMaxSignalPeers, 0);
  DeviceScope on(api, dev_.ipc.device);
  if (api.memcpyAsync(pads.data(), stepPad(static_cast<size_t>(rank_), kIpcIn, 0), pads.size() * sizeof(uint64_t),
                      dev_.ipc.abortStream) != 0 ||
      api.streamSynchronize(dev_.ipc.abortStream) != 0)
    return late;
  // Steps each peer is behind: a peer that stopped is behind on every step since; one held up
  // only by it (its stream waits too) is behind on fewer. The furthest behind are named.
  std::vector<uint64_t> behind(static_cast<size_t>(size_), 0);
  uint64_t most = 0;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    for (size_t e = 0; e < kIpcEvents; ++e) {
      const uint64_t mine = dev_.ipc.steps[e].load(), theirs = pads[e * cuda::kMaxSignalPeers + static_cast<size_t>(q)];
      if (theirs < mine) behind[static_cast<size_t>(q)] += mine - theirs;
    }
    most = std::max(most, behind[static_cast<size_t>(q)]);
  }
  for (int q = 0; q < size_; ++q)
    if (most > 0 && behind[static_cast<size_t>(q)] == most) late.push_back(q);
  return late;
}

std::string DeviceLayer::lateText(const std::vector<int>& late) const {
  if (late.empty()) return "";
  std::string who;
  for (int q : late) who += (who.empty() ? "" : ", ") + ch_.rankName(q);
  return "; " + who + (late.size() == 1 ? " has" : " have") +
         " not signalled this op's steps to this rank's stream (stopped calling, died, or runs a different op)";
}

}  // namespace railcc::engine
