#pragma once
// The device layer of one group: ops on GPU buffers. Each op is described once as a
// DevicePlan (device_plan.h) by its Communicator method; runDevice() runs it through CUDA IPC
// where every rank of the group is on this host and can map its peers' memory (cuda_ipc.cpp),
// else through pinned host staging under the host algorithms (staging.cpp). GPU memory sent
// or received point to point goes through gpu_direct.cpp; the GPU work of ops that complete
// once queued is watched by gpu_watch.cpp. What it keeps between ops is DeviceState
// (device_state.h). Private to csrc/engine.
//
// Threads: everything runs with the engine token held (the op's thread, which has set the
// device), except checkGpuWork(), which the watchdog thread calls (DeviceState::gpuMu guards
// the GPU work list against it), and gpuWatched().

#include <exception>
#include <functional>
#include <vector>

#include "common/config.h"
#include "engine/algorithms/algorithms.h"
#include "engine/algorithms/choose.h"
#include "engine/channels.h"
#include "engine/communicator.h"
#include "engine/device.h"
#include "engine/device/device_guards.h"
#include "engine/device/device_plan.h"
#include "engine/device/device_state.h"
#include "engine/op_queue.h"

namespace railcc::engine {

class DeviceLayer {
 public:
  // The layer's view of its group: fixed before the first op (set-up fills `localRanks` and
  // `place` in), read only here. The host algorithms run the staged ops and the rounds.
  DeviceLayer(ChannelLayer& ch, Algorithms& algos, const CommOptions& opts, int rank, int size,
              const std::vector<int>& localRanks, const AlgoPlace& place);

  // An op's body: its host algorithm on host buffers; on device buffers runDevice() on the
  // plan, which is built only for device ops (a template, so that a host op builds no
  // std::function around the plan's maker).
  template <typename MakePlan>
  void setBody(Op& o, const Placement& where, DataType dt, std::function<void()> host, MakePlan&& plan) {
    o.device = where.onDevice();
    if (!o.device) {
      o.body = std::move(host);
      return;
    }
    setDeviceBody(o, where, dt, plan());
  }
  // runDevice() picks how a DevicePlan runs: IPC where ipcReady() (every rank on this host,
  // peer access, RAILCC_CUDA_IPC), else staging.
  void runDevice(const Placement& where, DataType dt, const DevicePlan& plan);

  // The CUDA IPC form of each op (cuda_ipc.cpp), in place on the device buffers. All-reduce
  // takes the buffers `segs` (pointer, element count) as if they were one array: a single
  // tensor is one segment, a coalesced call packs many into each chunk.
  void runIpcAllreduce(const DeviceOp& dv, const std::vector<std::pair<char*, size_t>>& segs, DataType dt, ReduceOp op,
                       double scale);
  void runIpcReduce(const DeviceOp& dv, char* buf, size_t count, DataType dt, ReduceOp op, double scale, int root);
  void runIpcGather(const DeviceOp& dv, const char* in, size_t count, DataType dt, const std::vector<char*>& outs,
                    int root);
  void runIpcScatter(const DeviceOp& dv, const std::vector<char*>& ins, char* out, size_t count, DataType dt, int root);
  void runIpcAllgather(const DeviceOp& dv, const char* in, size_t count, DataType dt, const std::vector<char*>& outs);
  void runIpcReduceScatter(const DeviceOp& dv, const std::vector<char*>& ins, char* out, size_t count, DataType dt,
                           ReduceOp op, double scale);
  void runIpcBroadcast(const DeviceOp& dv, char* buf, size_t count, DataType dt, int root);
  void runIpcAlltoall(const DeviceOp& dv, const std::vector<char*>& ins, const std::vector<size_t>& inCounts,
                      const std::vector<char*>& outs, const std::vector<size_t>& outCounts, DataType dt);

  // What the channel layer asks of GPU memory sent or received (gpu_direct.cpp, ChannelHost).
  bool deviceReady(const DeviceSide& d);
  void stageDeviceSend(Transfer& t);

  // The watchdog's side (any thread): the error of the oldest GPU work past its op's timeout
  // (nullptr if none), with `next` set to when the oldest runs out; the group fails with it.
  std::exception_ptr checkGpuWork(Clock::time_point* next);
  bool gpuWatched() const { return dev_.gpuWatched.load(std::memory_order_relaxed); }
  // Teardown (the caller's thread): lets the GPU finish, unmaps and frees everything.
  void releaseDevice();
  // Any thread, when the group fails or is aborted: every one-kernel op's device wait gives up.
  void abortShots();
  // Any thread (allocate_tensor): `bytes` of this rank's heap on `device`, which peers reach in
  // place; given back when the holder goes. Null where there is none to give (shots off, a group
  // not all on this host, another device, full, or not shared with the peers at set-up).
  std::shared_ptr<void> allocateShared(int device, size_t bytes);
  // Whether allocateShared() may give anything: shots and a heap configured, every rank on this
  // host, and not refused at set-up.
  bool offersShared() const;

 private:
  void setDeviceBody(Op& o, const Placement& where, DataType dt, DevicePlan plan);
  // Once per device op: sets the device, makes its events (and own stream), orders its
  // stream after the caller's event.
  DeviceOp beginDevice(const Placement& where);
  // `slots` is the most regions any rank of the group passes for this op, so every rank cuts
  // the same chunks; `agree` first agrees on the largest region across ranks (alltoall, whose
  // splits differ).
  void runStaged(const DeviceOp& dv, DataType dt, size_t slots, std::vector<Region> regions, const StagedBody& body,
                 bool agree = false);
  // Waits for `ev` without holding a CPU: polls, then naps for a tenth of the time waited so
  // far (20 us to 1 ms). Throws kTimeout after the op's timeout, naming `what` and `stream`.
  void deviceWait(const cuda::DeviceApi& api, void* ev, int device, const char* what, void* stream);

  bool ipcReady(int device, void* stream);
  // Closes the peers' pools and events; frees this rank's own only when `peersDone` (every
  // peer has closed them: a syncRound after their close).
  void releaseIpc(const cuda::DeviceApi& api, bool peersDone);
  // out = src(0) op src(1) ... op src(n-1) over `len` elements on the GPU, in rank order (the
  // same bits wherever it runs), PREMUL_SUM's scale and AVG's division included.
  void ipcReduceRanks(const cuda::DeviceApi& api, const DeviceOp& dv, char* out,
                      const std::function<const char*(size_t)>& src, size_t len, DataType dt, ReduceOp op, double scale);
  // The pattern of the rooted and gathering IPC ops, a slot (two chunk buffers) at a time:
  // ranks that `stage` copy elements [off, off + m) of `in` into their slot, and after the In
  // step `use(slot, off, m)` may read any rank's slot; the Done step then frees the slots.
  void ipcSlotChunks(const cuda::DeviceApi& api, const DeviceOp& dv, const char* in, size_t count, size_t es, bool stage,
                     const std::function<void(const std::function<char*(size_t)>& slot, size_t off, size_t m)>& use);
  // Records `e` on this rank's stream, tells every peer, and orders this rank's stream after
  // every peer's record of `e`.
  void ipcStep(const cuda::DeviceApi& api, void* stream, int d, IpcEvent e);
  // ipc_signals.cpp (RAILCC_CUDA_IPC_SIGNALS): the step with no host round: this rank's stream
  // writes the step's count into every peer's step pad and waits until every peer's count in
  // its own has reached it. The pads follow the shot pads at each pool's tail (stepPadBytes()).
  static size_t stepPadBytes();
  uint64_t* stepPad(size_t owner, IpcEvent e, size_t from);
  void signalStep(const cuda::DeviceApi& api, void* stream, int d, IpcEvent e);
  // At set-up: whether this rank's stream can write and wait on its pads (false, `why`).
  bool signalsProbe(const cuda::DeviceApi& api, void* stream, std::string* why);
  void abortSteps();  // under gpuMu: every wait of this rank's stream on its pads passes
  // The peers whose counts in this rank's pads are behind its own steps (they did not come),
  // and the words an error adds for them ("" for none).
  std::vector<int> stepLaggards(const cuda::DeviceApi& api);
  std::string lateText(const std::vector<int>& late) const;
  // The end of an IPC op. Its GPU work is ordered by events alone (every slot is rewritten
  // only after each peer's stream has passed its reads of it, whatever op comes next), so the
  // host need not wait for it unless the caller has no stream to order on.
  void ipcFinish(const cuda::DeviceApi& api, const DeviceOp& dv, const char* what);

  // shots.cpp: the one-kernel collectives (RAILCC_CUDA_SHOTS). The pads sit at the
  // tail of each rank's IPC pool (shotPadBytes() of it, zeroed before peers map it);
  // shotSetup() fills the table once the pools are mapped (false and `why` when it cannot);
  // shotFailure() is the error of the first failed device wait, once.
  static size_t shotPadBytes();
  bool shotSetup(const cuda::DeviceApi& api, void* stream, std::string* why);
  void shotRelease(const cuda::DeviceApi& api);
  // shotUsable: a reduction shots run; shotMoves: n blocks of `count` that are one tensor's.
  bool shotUsable(DataType dt, ReduceOp op) const;
  bool shotMoves(const std::vector<char*>& blocks, size_t count, DataType dt) const;
  void launchShot(const DeviceOp& dv, cuda::ShotKind k, const char* in, char* out, size_t count, int root, DataType dt,
                  ReduceOp op, double scale);
  void finishShot(const DeviceOp& dv, const char* what);  // as ipcFinish, then the device's failure record
  void runShotAllreduce(const DeviceOp& dv, const std::vector<std::pair<char*, size_t>>& segs, DataType dt, ReduceOp op,
                        double scale);
  void runShotAllgather(const DeviceOp& dv, const char* in, size_t count, DataType dt, char* out);
  void runShotReduceScatter(const DeviceOp& dv, const char* in, char* out, size_t count, DataType dt, ReduceOp op,
                            double scale);
  void runShotBroadcast(const DeviceOp& dv, char* buf, size_t count, DataType dt, int root);
  void runShotAlltoall(const DeviceOp& dv, const char* in, char* out, size_t count, DataType dt);
  std::exception_ptr shotFailure();
  // CUDA graphs (shots.cpp): an op whose stream is being captured runs only as one kernel,
  // recorded into the graph with nothing on the host to replay; anything else is refused.
  void runCaptured(const DeviceOp& dv, const DevicePlan& plan);
  [[noreturn]] void refuseCapture(const std::string& why) const;
  // The heap at the IPC set-up (shots.cpp): heapExport() makes it if need be and writes its
  // handle and size (0: none) into kHeapBlob bytes; heapOpen() maps rank q's from its blob.
  static constexpr size_t kHeapBlob = cuda::kIpcHandleBytes + sizeof(uint64_t);
  void heapExport(const cuda::DeviceApi& api, int device, char* blob);
  void heapOpen(const cuda::DeviceApi& api, size_t q, const char* blob, std::string* why);
  // Registered segments at the IPC set-up (segment_layer.cpp, segments.h): segsExport() makes
  // this rank's board and writes its name into kBoardBlob bytes; segsOpen() maps rank q's;
  // segsStart() makes the table and the registry once every peer's board is mapped;
  // segsRelease() revokes, closes and frees them. segPlace(): where peers find [p, p + bytes)
  // of this rank's memory outside the heap (cuda::kInScratch until it is registered).
  static constexpr size_t kBoardBlob = 96;
  void segsExport(char* blob, std::string* why);
  void segsOpen(size_t q, const char* blob, std::string* why);
  bool segsStart(const cuda::DeviceApi& api, int device, std::string* why);
  void segsGo();  // after the vote: the board's name goes, the watcher starts
  void segsRelease(const cuda::DeviceApi& api);
  uint64_t segPlace(const void* p, size_t bytes);
  // The heap, made on `device` if there is none yet and set-up has not decided (heap.mu held).
  std::shared_ptr<DeviceHeap> heapLocked(const cuda::DeviceApi& api, int device);
  std::shared_ptr<DeviceHeap> makeHeap(const cuda::DeviceApi& api, int device);

  // gpu_watch.cpp: an op's GPU work left for the watchdog; with `now`, retireGpuWork() also
  // returns the error of the oldest entry past its timeout and sets `next`.
  void watchGpu(const cuda::DeviceApi& api, const DeviceOp& dv, const char* what);
  std::exception_ptr retireGpuWork(const cuda::DeviceApi& api, const Clock::time_point* now, Clock::time_point* next);
  void releaseGpuWork(const cuda::DeviceApi& api);
  void releaseSendStaging(const cuda::DeviceApi& api);  // gpu_direct.cpp

  ChannelLayer& ch_;
  Algorithms& algos_;
  const CommOptions& opts_;
  const int rank_, size_;
  const std::vector<int>& localRanks_;
  const AlgoPlace& place_;
  DeviceState dev_;
};

}  // namespace railcc::engine
