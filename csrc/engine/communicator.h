#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/callback_pool.h"
#include "common/config.h"
#include "engine/device.h"
#include "engine/store.h"
#include "common/types.h"

namespace railcc::engine {

/// Completion handle of one queued op. Thread-safe.
class Request {
 public:
  /// `spinUs`: how long wait() polls, yielding the CPU, before it blocks.
  explicit Request(int64_t spinUs, std::shared_ptr<CallbackPool> pool = nullptr)
      : spinUs_(spinUs), pool_(std::move(pool)) {}
  bool completed() const;
  /// Blocks until the op finishes or `timeout` passes (negative: no limit). Returns false
  /// on timeout; never throws the op's error (see error()).
  bool wait(std::chrono::milliseconds timeout);
  std::exception_ptr error() const;
  /// For a receive from any source: the rank the message came from.
  int sourceRank() const { return source_.load(); }
  /// Runs `cb` once when the op finishes: on the thread that finishes it (possibly the
  /// progress thread), or at once if it already has. `cb` must be quick and must never wait
  /// for another op: user code goes through runUserCode().
  void onComplete(std::function<void()> cb);
  /// Runs `fn` now, unless this is a thread the engine needs (its progress thread): then on the
  /// communicator's callback threads, where it may block and wait on other ops. For c10d
  /// Future callbacks and DDP comm hooks.
  void runUserCode(std::function<void()> fn);

  // Engine side.
  void finish(std::exception_ptr err);
  void setSourceRank(int r) { source_.store(r); }
  /// The op runs, but completes with this error (a straggler report) if it succeeds.
  void setStraggler(std::exception_ptr e) {
    std::lock_guard<std::mutex> g(mu_);
    straggler_ = std::move(e);
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  std::exception_ptr straggler_;
  std::vector<std::function<void()>> callbacks_;
  std::atomic<int> source_{-1};
  std::atomic<bool> doneFlag_{false};  // done_, readable without the lock
  const int64_t spinUs_;
  std::shared_ptr<CallbackPool> pool_;
};

using RequestPtr = std::shared_ptr<Request>;
using Millis = std::chrono::milliseconds;

struct CommOptions {
  int rank = 0;
  int size = 1;
  std::string name;          // group name, for logs
  /// Each group rank's rank in the default group: errors and logs name ranks by it, as users
  /// know them. Empty: the same numbers.
  std::vector<int> globalRanks;
  Millis timeout{Millis(30 * 60 * 1000)};  // per-op timeout (no progress for this long fails the op)
  Config config = Config::defaults();
  /// Optional owner of the store, so that a watchdog thread stuck in an unreachable store can
  /// outlive the communicator (it is then left behind at shutdown instead of joined).
  std::shared_ptr<Store> storeKeepAlive;
  /// Called once, on the thread that finds it, when the group fails (an op timed out, a peer
  /// died, abort() or shutdown() ended it), after the peers are told and before any teardown:
  /// torch's abort hooks run here. It must not call into this communicator.
  std::function<void(std::exception_ptr)> onFailure;
  /// Ranks per host as the launcher tells them (torchrun's LOCAL_WORLD_SIZE); 0: not told. A
  /// group larger than that spans hosts, so its topology is read while set-up still waits for
  /// the other ranks' records instead of after (CommImpl::discoverEarly).
  int ranksPerHostHint = 0;
};

/// What one peer told us about itself at bootstrap.
struct PeerInfo {
  int rank = -1;
  std::string hostId;     // decides shared memory
  std::string hostname;   // for people
  int pid = 0;
  std::string pidNs;      // its pid namespace: pids of another mean nothing here
  std::string addr;       // its inter-host endpoint during set-up (TCP: "ip:port[,ip:port]"), "-" if none
  std::string transport;  // "shm" or "socket ip:port": read it through Communicator::transportTo
};

class CommImpl;

/// While one is alive on a thread, the host collectives that thread queues do not wake the
/// progress thread: the caller promises to call Communicator::wait() on them at once (c10d's
/// asyncOp=false) and runs them there itself. Should that wait never come, the progress thread
/// still finds the op within RAILCC's idle recheck (100 ms).
class CallerWaits {
 public:
  explicit CallerWaits(bool on);
  ~CallerWaits();
  /// Whether one is on for this thread now.
  static bool active();
  CallerWaits(const CallerWaits&) = delete;
  CallerWaits& operator=(const CallerWaits&) = delete;

 private:
  bool prev_;
};

/// A group of ranks that run collectives together. Construction bootstraps through the
/// store and connects every pair (blocking, bounded by RAILCC_INIT_TIMEOUT). Each op is
/// validated on the calling thread (bad arguments throw Error(kInvalidUsage) and leave the
/// communicator usable), then queued to the progress thread and returned as a Request
/// (a caller that blocks in wait() on a host collective may run it itself, see wait()).
/// Collectives run one at a time in call order; sends and receives run beside them on their
/// own lane, so a posted receive never blocks a later collective.
///
/// Pointers are host memory, or device memory of one GPU when the op's Placement names it
/// (collectives only: the op then runs through pinned staging, see runStaged in the .cpp).
/// Counts are elements of `dtype`. The caller keeps buffers alive until the Request
/// completes; a device op completes once its results are on the device.
class Communicator {
 public:
  Communicator(Store& store, CommOptions opts);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int size() const;
  const std::vector<PeerInfo>& peers() const;
  /// How this rank reaches rank `r` (PeerInfo::transport, which a connection made at first
  /// use fills in later): safe on any thread, unlike reading peers()[r].transport.
  std::string transportTo(int r) const;
  const Config& config() const;

  // `scale` is PREMUL_SUM's factor; `timeout` of 0 means the communicator's.
  RequestPtr allreduce(void* buf, size_t count, DataType dt, ReduceOp op, double scale = 1.0, Millis timeout = Millis(0),
                       Placement where = {});
  /// Fuses the buffers into buckets of RAILCC_BUCKET_SIZE and runs one all-reduce per bucket.
  RequestPtr allreduceCoalesced(std::vector<void*> bufs, std::vector<size_t> counts, DataType dt, ReduceOp op,
                                double scale = 1.0, Millis timeout = Millis(0), Placement where = {});
  RequestPtr broadcast(void* buf, size_t count, DataType dt, int root, Millis timeout = Millis(0),
                       Placement where = {});
  /// Result lands in root's `buf`; other ranks' buffers are left as they were.
  RequestPtr reduce(void* buf, size_t count, DataType dt, ReduceOp op, int root, double scale = 1.0,
                    Millis timeout = Millis(0), Placement where = {});
  /// outs[r] (count elements each) receives rank r's `in`. outs[rank()] may equal `in`.
  RequestPtr allgather(const void* in, size_t count, DataType dt, std::vector<void*> outs, Millis timeout = Millis(0),
                       Placement where = {});
  /// ins[r] (count elements each) is this rank's contribution to rank r's `out`.
  RequestPtr reduceScatter(std::vector<const void*> ins, void* out, size_t count, DataType dt, ReduceOp op,
                           double scale = 1.0, Millis timeout = Millis(0), Placement where = {});
  /// ins[r] (inCounts[r] elements) goes to rank r; outs[r] (outCounts[r]) comes from rank r.
  RequestPtr alltoall(std::vector<const void*> ins, std::vector<size_t> inCounts, std::vector<void*> outs,
                      std::vector<size_t> outCounts, DataType dt, Millis timeout = Millis(0), Placement where = {});
  /// On root, outs[r] receives rank r's `in`; elsewhere `outs` is ignored.
  RequestPtr gather(const void* in, size_t count, DataType dt, std::vector<void*> outs, int root,
                    Millis timeout = Millis(0), Placement where = {});
  /// On root, ins[r] goes to rank r's `out`; elsewhere `ins` is ignored.
  RequestPtr scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt, int root,
                     Millis timeout = Millis(0), Placement where = {});
  RequestPtr barrier(Millis timeout = Millis(0));
  /// `gpu`: `buf` is host memory standing in for GPU memory (DeviceSide), which a transport
  /// that reaches the GPU moves instead.
  RequestPtr send(const void* buf, size_t bytes, int peer, int tag, Millis timeout = Millis(0),
                  std::shared_ptr<DeviceSide> gpu = nullptr);
  /// peer == -1 receives from any source; Request::sourceRank() then tells which.
  RequestPtr recv(void* buf, size_t bytes, int peer, int tag, Millis timeout = Millis(0),
                  std::shared_ptr<DeviceSide> gpu = nullptr);

  /// req->wait(timeout), except that with no timeout (negative) a host collective that has not
  /// started yet runs on the calling thread when the progress thread is idle, which saves two
  /// thread hand-offs. Safe on a request of a communicator that has been shut down.
  bool wait(const RequestPtr& req, Millis timeout = Millis(-1));
  /// Has the progress thread look at the queue now: for an op queued under CallerWaits whose
  /// caller polls or waits on a future instead of calling wait().
  void poke();

  /// Waits until every op queued so far has finished (done or failed) and been let go, at
  /// most `timeout`; true if none is left. For a shrink without SHRINK_ABORT.
  bool drain(Millis timeout);

  /// Device memory that this group's peers reach in place (RAILCC_CUDA_SHOTS, its heap of
  /// RAILCC_CUDA_HEAP_BYTES): `bytes` on `device`, given back when the holder goes; nullptr
  /// where there is none to give, and the caller allocates as usual. Any thread.
  std::shared_ptr<void> allocateShared(int device, size_t bytes);
  /// Whether allocateShared() may give anything at all (allocate_tensor's supports_tensor_alloc).
  bool offersShared() const;

  /// Number of collectives queued so far.
  uint64_t collectiveCount() const;
  /// c10d's time estimator: from startTimeEstimate() to endTimeEstimate(), ops on this
  /// communicator (on the calling process only: no peer needs to take part) move nothing and
  /// finish at once; endTimeEstimate() returns the microseconds they would have taken by the
  /// model of algorithms/estimate.cpp. Throws kInvalidUsage when not started, or started twice.
  void startTimeEstimate();
  double endTimeEstimate();

  /// Fails every pending and future op with kAborted and wakes all waiters. Thread-safe,
  /// never blocks for long.
  void abort(const std::string& why = "abort() was called");
  /// Waits for queued ops (unless the communicator has failed), then stops the progress
  /// thread and frees every connection and segment. Idempotent.
  void shutdown();
  /// The error that broke the communicator, if any.
  std::exception_ptr brokenError() const;
  /// Global ranks learned dead after it broke (another group of this rank saw them die).
  std::vector<int> laterDead() const;
  /// Of `globals`, the ranks that are silent now: their process is gone or stopped (this host),
  /// or their progress record has not been refreshed (a live rank's is, even in a broken
  /// group). Reads the store: for recovery, not for the hot path.
  std::vector<int> stillSilent(const std::vector<int>& globals);

  /// The flight recorder as a JSON document (read by `python -m railcc trace`): recent ops with their
  /// state, times and bytes per peer, this rank's progress and link throughput.
  std::string traceJson(const std::string& reason) const;
  /// Writes traceJson() to RAILCC_TRACE_DIR (or `dir` when given); returns the file's path,
  /// or "" when there is no directory to write to. Throws kSystem if writing fails.
  std::string dumpTrace(const std::string& reason, const std::string& dir = "") const;
  /// Straggler report as JSON: lag of every rank, throughput of every link of this rank
  /// against the median link of its transport, and the slow links other ranks published.
  std::string stragglerReport();

 private:
  /// True in a child forked after construction: the group belongs to the process that made
  /// it. Its ops raise there, and abort, shutdown and the destructor leave the parent's
  /// threads, connections and shared memory alone.
  bool forked() const;
  std::unique_ptr<CommImpl> impl_;
  int ownerPid_;
};

/// "bootid:netns" unless RAILCC_HOST_ID overrides it: equal on ranks that can share memory.
std::string hostIdentity(const Config& cfg);

}  // namespace railcc::engine
