#pragma once
// c10d glue: the only layer that sees torch. Tensors become engine buffers here, engine
// Requests become c10d Work objects, engine errors become typed DistBackendErrors.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "engine/communicator.h"
#include "common/error.h"
#include "common/log.h"

namespace railcc {

/// What a call on CUDA tensors carries besides its buffers: the device, the group's stream
/// for it, an event recorded on the caller's current stream when the call was made (the
/// engine's copies wait for it) and one the glue records on the group's stream when the op
/// is done (wait() makes the caller's current stream wait for it).
struct DeviceCall {
  c10::Device device{c10::kCPU};
  c10::Stream comm{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
  std::shared_ptr<c10::Event> start, end;
  // The engine may complete an op once its GPU work is queued on `comm`: every wait, future
  // and isCompleted() here goes through the end event recorded after it.
  engine::Placement where() const {
    return {device.index(), comm.native_handle(), start->eventId(), /*queued=*/true};
  }
  // A send's or receive's CUDA tensor for the engine, which moves it straight where a transport
  // reaches the GPU's memory (GPUDirect RDMA), after the caller's stream reached the call; else
  // through `host`. Both tensors and the event stay alive while the NIC or a copy may touch them,
  // even past a failure of the op.
  std::shared_ptr<engine::DeviceSide> side(const at::Tensor& t, const at::Tensor& host) const {
    struct Kept {
      std::shared_ptr<c10::Event> ready;
      at::Tensor gpu, host;
    };
    auto s = std::make_shared<engine::DeviceSide>();
    s->gpu = static_cast<char*>(t.data_ptr());
    s->device = device.index();
    s->ready = start->eventId();
    s->keep = std::make_shared<Kept>(Kept{start, t, host});
    return s;
  }
};
using DeviceCallPtr = std::shared_ptr<DeviceCall>;

/// A DistBackendError that remembers what the engine knew (code, ranks, hosts, seq, op), so
/// the Python translator can raise the matching railcc exception with those attributes.
class RailccError : public c10::DistBackendError {
 public:
  RailccError(const ::railcc::Error& e, const std::string& context);
  ::railcc::ErrorCode code;
  std::vector<int> ranks;
  std::vector<std::string> hosts;
  long long seq;
  std::string op;
  bool ranksDead;  // `ranks` were seen gone (process exited, connections dropped), not merely slow
};

/// torch 2.14's abort hooks (Backend::registerAbortHook), by id: abort() runs them first, and a
/// failure (a timeout, a dead peer) on the thread that finds it, once the peers are told and
/// before anything is torn down; shutdown() runs none. Shared with the communicators, whose
/// threads may outlive the group.
struct AbortHooks {
  std::mutex mu;
  std::map<int64_t, std::function<void()>> hooks;
  void run() {
    std::vector<std::function<void()>> now;
    {
      std::lock_guard<std::mutex> g(mu);
      for (auto& [id, h] : hooks) now.push_back(h);
    }
    for (auto& h : now) {
      try {
        h();
      } catch (const std::exception& e) {  // one hook's failure keeps none of the others from running
        RAILCC_WARN(WATCHDOG, "an abort hook threw: ", e.what());
      }
    }
  }
  // A failure of the group's: abort() has run the hooks already and shutdown() needs none.
  void runFor(std::exception_ptr err) {
    try {
      std::rethrow_exception(err);
    } catch (const ::railcc::Error& e) {
      if (e.code() == ::railcc::ErrorCode::kAborted) return;
    } catch (...) {
    }
    run();
  }
};

/// Converts an engine exception_ptr into a RailccError exception_ptr (others pass through).
std::exception_ptr toTorchError(std::exception_ptr err, const std::string& context);

/// Runs an engine call for the glue: bad arguments (kInvalidUsage) become ValueError, every
/// other engine error a RailccError naming `what`.
template <typename F>
auto guard(const char* what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const ::railcc::Error& e) {
    // A message the engine already opens with the call ("railcc init of group 'G': ...") is
    // not prefixed with it a second time.
    const bool worded = std::string_view(e.what()).rfind(std::string("railcc ") + what, 0) == 0;
    if (e.code() == ::railcc::ErrorCode::kInvalidUsage)
      C10_THROW_ERROR(ValueError, (worded ? std::string() : std::string("railcc: ") + what + ": ") + e.what());
    throw RailccError(e, worded ? std::string() : std::string("railcc ") + what + ": ");
  }
}

/// The group's timeout as the engine keeps it (at most 50 years); a count of zero or less
/// (torch's conversion of timedelta.max overflows into one) throws ValueError naming it.
std::chrono::milliseconds groupTimeout(std::chrono::milliseconds t);

class ProcessGroupRailcc : public c10d::Backend {
 public:
  ProcessGroupRailcc(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     std::chrono::milliseconds timeout, std::string groupName, std::vector<int> globalRanks = {});
  ~ProcessGroupRailcc() override;

  const std::string getBackendName() const override { return "railcc"; }
  bool supportsCoalescing() const override { return true; }
  // torch.distributed's _time_estimator: ops costed by railcc's own schedule model, not run
  // (engine/algorithms/estimate.cpp; _start_time_estimate / _end_time_estimate, module.cpp).
  bool supportsTimeEstimation() const override { return true; }
  // split_group: a child group of some of this group's ranks, formed by those ranks alone
  // through the store torch hands over (traffic proportional to the child, nothing asked of
  // the other ranks); nullptr on a rank left out.
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;
  c10::intrusive_ptr<Options> getBackendOptions() override;
  // Communication tensors (backend.allocate_tensor, mem_allocator). In host memory: page-aligned
  // and known to the RDMA registration cache from birth (tensor_memory.h). On CUDA, with
  // RAILCC_CUDA_SHOTS and every rank on this host: carved from the group's heap, which every peer
  // mapped once, so the one-kernel ops read them in place (a tensor that does not fit comes from
  // torch's allocator).
  bool supportsTensorAlloc(c10::DeviceIndex deviceIdx) override;
  at::Tensor allocateTensor(long size, at::TensorOptions options = {}) override;
  std::shared_ptr<c10::Allocator> getMemAllocator() override;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_; }
  c10d::ErrorType getError() override;
  void abort() override;
  void shutdown() override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits, const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks = false) override;
  c10::intrusive_ptr<c10d::Work> sparseAllreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts);

  engine::Communicator& comm() { return *comm_; }
  // What a shrink needs to form the survivors' group (railcc/_shrink.py): the c10d store the
  // group was made with (under this torchrun attempt's prefix, as the group's own keys), its
  // timeout and name, and each group rank's rank in the default group.
  const c10::intrusive_ptr<c10d::Store>& c10dStore() const { return c10dStore_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const std::string& groupName() const { return groupName_; }
  const std::vector<int>& globalRanks() const { return globalRanks_; }
  /// Per-peer transport, e.g. {"shm", "socket 10.0.0.2:4000"}, for diagnostics.
  std::vector<std::string> peerTransports() const;

#ifdef C10D_BACKEND_HAS_RECONFIGURE
  // torch 2.14's reconfigure (reconfigure.cpp): the group takes a new membership in place.
  bool supportsReconfigure() const override { return true; }
  c10d::ReconfigureHandle get_reconfigure_handle() const override;
  c10::intrusive_ptr<c10d::Work> reconfigure(const c10d::ReconfigureOptions& opts) override;
#endif
#ifdef C10D_BACKEND_HAS_WINDOW
  // torch 2.14's one-sided windows over host memory (window.cpp).
  bool supportsWindow() const override { return true; }
  c10::intrusive_ptr<c10d::Window> new_window(const std::optional<at::Tensor>& tensor) override;
#endif
#ifdef C10D_BACKEND_HAS_HOOKS
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 15)  // asked from 2.15 on
  bool supportsAbortHooks() const override { return true; }
#endif
  void registerAbortHook(int64_t id, c10d::AbortHook hook) override {
    std::lock_guard<std::mutex> g(abortHooks_->mu);
    abortHooks_->hooks[id] = std::move(hook);
  }
  void unregisterAbortHook(int64_t id) override {
    std::lock_guard<std::mutex> g(abortHooks_->mu);
    abortHooks_->hooks.erase(id);
  }
#endif

 private:
  c10::intrusive_ptr<c10d::Work> makeWork(c10d::OpType type, const char* name, std::vector<engine::RequestPtr> reqs,
                                          std::vector<at::Tensor> outputs, std::vector<at::Tensor> keep = {},
                                          DeviceCallPtr dev = nullptr, std::function<void()> after = {});
  /// Checks that every tensor of a call is on one device. nullptr for CPU tensors; for CUDA
  /// tensors the group's stream and the caller's start event.
  DeviceCallPtr deviceCall(const char* what, const std::vector<at::Tensor>& tensors);
  std::chrono::milliseconds opTimeout(std::chrono::milliseconds requested) const;

  /// The communicator of this group's `rank` and `size` over store_ (init, reconfigure).
  std::unique_ptr<engine::Communicator> connect(const char* what, int rank, int size, std::string name,
                                                std::vector<int> globalRanks);

  std::shared_ptr<engine::Store> store_;  // shared with a watchdog thread that may outlive us
  std::unique_ptr<engine::Communicator> comm_;
  // Reconfigure: this process's part of every handle (random, made once), the uuids used, and
  // the communicators and stores replaced (shut down, but a Work of theirs may still ask them).
  mutable std::once_flag handleOnce_;
  mutable std::string handleId_;
  std::vector<int64_t> uuids_;
  std::vector<std::unique_ptr<engine::Communicator>> retired_;
  std::vector<std::shared_ptr<engine::Store>> retiredStores_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::Store> c10dStore_;
  std::string groupName_;
  std::vector<int> globalRanks_;
  // Children made by split(), by group name: torch 2.13's ProcessGroup::splitGroup calls
  // split() once per device type the parent serves (cpu and cuda here), and two children
  // rendezvousing under one store prefix would race; the second call gets the first child.
  std::mutex splitMu_;
  std::map<std::string, c10::weak_intrusive_ptr<c10d::Backend>> splits_;
  uint64_t seq_ = 0;
  uint64_t windows_ = 0;  // new_window calls: every rank makes its windows in one order
  std::shared_ptr<AbortHooks> abortHooks_ = std::make_shared<AbortHooks>();
  bool coalescing_ = false;
  std::vector<engine::RequestPtr> coalescedReqs_;
  std::vector<at::Tensor> coalescedOutputs_;
  DeviceCallPtr coalescedDev_;
  std::mutex streamsMu_;
  std::vector<std::pair<c10::DeviceIndex, c10::Stream>> commStreams_;  // one per device used
  c10::DeviceIndex boundDevice_ = -1;  // a group serves one CUDA device, as in NCCL
  std::atomic<bool> watchSegments_{false};  // one-kernel ops on: attach torch's allocator hook (allocator_trace.h)
};

}  // namespace railcc
