#pragma once
// What the device layer of one group keeps between ops: the CUDA IPC pools and events, the
// pinned staging chunks and their events and stream, and the GPU work the watchdog watches.
// Touched by the engine thread only (the token holder that set the device), except the GPU
// work list, which gpuMu guards against the watchdog thread.

#include <array>
#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "engine/device/heap.h"
#include "engine/device/segments.h"
#include "transport/host_shared.h"
#include "engine/wire.h"
#include "transport/memory_owners.h"

namespace railcc::engine {

// CUDA IPC (every rank on this host): each rank owns a device pool of two slots, each an
// input chunk and a reduced chunk, mapped by every peer, and three interprocess events. GPU
// work of different ranks is ordered only by those events and by zero-byte host messages
// (syncRound), never by a kernel waiting on another process's memory, so ranks that share
// one GPU cannot deadlock on it.
enum IpcEvent { kIpcIn, kIpcRed, kIpcDone, kIpcEvents };
struct IpcState {
  int device = -1;
  bool failed = false;
  size_t chunk = 0;                               // bytes of each of the four pool buffers
  std::vector<char*> pool;                        // [rank]: that rank's pool as mapped here
  std::vector<std::array<void*, kIpcEvents>> ev;  // [rank]: its events as opened here
  std::vector<char*> heaps;                       // [rank]: its heap as mapped here (null: none)
  // RAILCC_CUDA_IPC_SIGNALS (ipc_signals.cpp): steps ordered by the streams themselves. steps[e]
  // counts this rank's steps of kind e (every rank counts the same); `abortStream` is where
  // abortShots() releases this rank's stream from waits a failed peer will never satisfy.
  bool signals = false;
  std::array<std::atomic<uint64_t>, kIpcEvents> steps{};  // the watchdog reads them too
  void* abortStream = nullptr;
};

// This rank's heap (heap.h): made by the first allocate_tensor on CUDA or by the IPC set-up,
// whichever comes first, and shared with the peers at that set-up; guarded by `mu` (the
// glue's thread carves from it while the engine's runs ops). `share`: decided at set-up
// (kShared: every peer mapped it), kNotShared again at teardown.
enum class HeapShare { kUndecided, kShared, kNotShared };
struct HeapState {
  std::mutex mu;
  std::shared_ptr<DeviceHeap> heap;
  std::atomic<HeapShare> share{HeapShare::kUndecided};
};

// One-kernel collectives (RAILCC_CUDA_SHOTS, device/shots.cpp, cuda/shots.h): set up
// with the IPC pools, whose buffers are the scratch and whose tails hold every rank's signal
// pads. `table` (device memory) names every rank's scratch and pads as mapped here; `epochs`
// (device memory) are this rank's per-block chunk counts; `failure` and `abort` are pinned
// host memory the kernels see (the first failed wait; the host's "give up").
struct ShotState {
  bool ready = false;
  // Registered segments (segments.h): this rank's board, its peers' as mapped here ([rank]
  // empty), the pointers the kernels read (ShotPeers::segs, pinned host memory) and the
  // registry, listed with the allocator's directory while it lives.
  std::shared_ptr<transport::HostShared> board;
  std::vector<std::shared_ptr<transport::HostShared>> boards;
  char** segTable = nullptr;       // made at set-up, until the registry owns it
  char** segTableInUse = nullptr;  // the registry's, which the shot table names
  std::shared_ptr<SegmentRegistry> segs;
  void* table = nullptr;
  uint32_t* epochs = nullptr;
  void* failure = nullptr;  // cuda::SignalFailure
  uint32_t* abort = nullptr;
  std::atomic<bool> failureSeen{false};  // reported already (the engine's thread or the watchdog's)
  // The ops launched last, by seq (under gpuMu): a failure record names its op by seq only.
  std::array<std::pair<uint64_t, OpKind>, 64> launched{};
  size_t nextLaunched = 0;
};

// The GPU work of an op that completed once queued (engine/device/gpu_watch.cpp): the
// watchdog thread fails the group, naming the op and its stream, when the oldest entry is
// not done within the op's timeout.
struct GpuWork {
  uint64_t seq;
  OpKind kind;
  const char* what;  // "the CUDA IPC all-reduce"
  int device;
  void* stream;
  void* event;  // recorded on `stream` after the op's GPU work
  Clock::time_point queued;
  Millis timeout;
};

struct DeviceState {
  IpcState ipc;
  ShotState shot;
  HeapState heap;
  // Pinned staging (device/staging.cpp): two sets of chunks, their events, and a stream of
  // our own for ops that name none, all on device `devOf`.
  char* stage = nullptr;
  size_t stageCap = 0;
  // The staging's owner for transports that keep registrations of it (RDMA rendezvous): alive
  // until the staging is freed, so they register it once, not per message.
  std::shared_ptr<transport::FreedFlag> stageOwner;
  void* stageEv[2] = {nullptr, nullptr};
  void* ownStream = nullptr;
  int devOf = -1;
  // Sends of GPU memory copied to host memory (gpu_direct.cpp) run beside collectives (on the
  // p2p lane, while a collective step waits): a stream and an event of their own, on sendDev.
  void* sendStream = nullptr;
  void* sendEv = nullptr;
  int sendDev = -1;
  std::vector<std::shared_ptr<void>> sendKept;  // buffers of copies that failed while queued
  void* lastStream = nullptr;  // the stream of the last device op: drained before teardown
  bool capturing = false;      // the op running now is captured into a CUDA graph (shots.cpp)
  // GPU work in flight, oldest first, and the events of finished entries for reuse; gpuMu
  // guards both (the engine adds, the watchdog checks).
  std::mutex gpuMu;
  std::deque<GpuWork> gpuWork;
  std::vector<void*> gpuEvents;
  std::atomic<bool> gpuWatched{false};  // some GPU work was ever watched: the watchdog wakes every second
};

}  // namespace railcc::engine
