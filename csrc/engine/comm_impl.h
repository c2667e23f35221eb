#pragma once
// The engine's inside, shared by its files: the wire format, the transfers and channels the
// progress thread drives, and CommImpl, the state behind one Communicator. Private to
// csrc/engine: the glue and the transports never include it.
//
// Who does what (one file each):
//   bootstrap.cpp    set-up: peer records, transports per peer, their connections
//   progress.cpp     the op queue, the progress thread, the engine token, abort and teardown
//   channels.cpp     transfers over connections: headers, sends, receives, exchange, waiting
//   failure.cpp      how a group fails, names the peer at fault, and tells its other groups
//   watchdog.cpp     progress records, hang attribution, stragglers, flight-recorder dumps
//   algorithms/      host algorithms written against exchange()/post()/complete()
//   device/          GPU buffers: pinned staging and CUDA IPC under the host algorithms
//   communicator.cpp the public Communicator: argument checks, then each op's body

#include <arpa/inet.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <thread>

#include "common/strings.h"
#include "common/error.h"
#include "common/log.h"
#include "engine/algorithms/choose.h"
#include "engine/communicator.h"
#include "engine/device.h"
#include "engine/rail_check.h"
#include "engine/telemetry.h"
#include "transport/local.h"
#include "transport/transport.h"
#include "transport/connection.h"

namespace railcc::engine {

using Clock = std::chrono::steady_clock;
using transport::Connection;

// Polls `ready` for up to `us` microseconds before a waiter goes to sleep; true once it holds.
// For the first `busyUs` of them it spins in place (a CPU pause between polls): a peer a few
// hundred nanoseconds away is seen at once, where a yield is a system call that costs about as
// much as the whole exchange of a small message, and a yield gives any other busy process on
// the core a whole time slice. Only a rank that has a core to itself may do that, and only
// while the peer it waits for is not on the same core (see CommImpl::busyFor). After that,
// between polls it yields: that hands the core to any other runnable thread at once (the peer
// rank, or our own progress thread when ranks share cores), while a waiter that owns its core
// keeps it awake and reacts within a microsecond, where sleeping would cost a wake-up of tens
// of microseconds (far more in a VM, whose idle virtual CPUs halt).
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

template <typename F>
inline bool pollFor(int64_t us, F&& ready, int64_t busyUs = 0) {
  if (ready()) return true;
  auto start = Clock::now();
  auto until = start + std::chrono::microseconds(us);
  auto busyUntil = start + std::chrono::microseconds(std::min(busyUs, us));
  while (true) {
    auto now = Clock::now();
    if (now >= until) return false;
    if (now < busyUntil) {
      for (int i = 0; i < 8; ++i) cpuRelax();
    } else {
      sched_yield();
    }
    if (ready()) return true;
  }
}

// ---------------------------------------------------------------------------------------
// Wire format. Every message is a header followed by its payload, padded to 8 bytes so
// that stream positions stay aligned for in-place reductions out of shared memory.

enum class OpKind : uint8_t {
  kAllreduce = 1, kBroadcast, kReduce, kAllgather, kReduceScatter, kAlltoall, kGather, kScatter,
  kBarrier, kP2P, kAllreduceCoalesced,
};

inline const char* opKindName(OpKind k) {
  switch (k) {
    case OpKind::kAllreduce: return "allreduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kReduce: return "reduce";
    case OpKind::kAllgather: return "allgather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAlltoall: return "alltoall";
    case OpKind::kGather: return "gather";
    case OpKind::kScatter: return "scatter";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kP2P: return "send/recv";
    case OpKind::kAllreduceCoalesced: return "allreduce_coalesced";
  }
  return "?";
}

struct WireHeader {
  uint32_t magic;
  uint8_t kind;
  uint8_t dtype;
  uint8_t redop;
  uint8_t flags;
  int32_t root;
  int32_t tag;
  uint64_t seq;
  uint64_t count;
  uint64_t bytes;
  int64_t startUs;  // when the sender started this collective (wall clock): arrival lag
};
static_assert(sizeof(WireHeader) == 48, "wire header layout");
constexpr uint32_t kWireMagic = 0x52434331;  // "RCC1"
constexpr int kCollLane = 0;
constexpr int kP2PLane = 1;
constexpr int kLanes = 2;

inline size_t pad8(size_t n) { return (n + 7) & ~size_t(7); }

inline std::string describeCall(const WireHeader& h) {
  std::ostringstream os;
  auto kind = static_cast<OpKind>(h.kind);
  os << opKindName(kind);
  if (kind == OpKind::kP2P) {
    os << "(tag=" << h.tag << ", " << h.bytes << " bytes)";
    return os.str();
  }
  os << "(seq=" << h.seq << ", count=" << h.count << ", dtype=" << dtypeName(static_cast<DataType>(h.dtype));
  if (kind == OpKind::kAllreduce || kind == OpKind::kReduce || kind == OpKind::kReduceScatter ||
      kind == OpKind::kAllreduceCoalesced)
    os << ", op=" << reduceOpName(static_cast<ReduceOp>(h.redop));
  if (kind == OpKind::kBroadcast || kind == OpKind::kReduce || kind == OpKind::kGather || kind == OpKind::kScatter)
    os << ", root=" << h.root;
  os << ")";
  return os.str();
}

// One message to move: a send, a receive, or a receive that reduces into its destination.
struct Transfer {
  enum Kind : uint8_t { kSend, kRecv, kRecvReduce } kind = kSend;
  int peer = -1;
  int lane = kCollLane;
  const char* src = nullptr;
  char* dst = nullptr;
  size_t bytes = 0;
  WireHeader hdr{};  // sent as is, or what the received header must say
  DataType dtype = DataType::kUInt8;
  ReduceOp op = ReduceOp::kSum;
  double scale = 1.0;
  const size_t* limit = nullptr;  // forwarding: send no further than another transfer has received
  const Transfer* after = nullptr;  // send nothing, header included, until this receive has taken its header
  bool gates = false;               // a receive some send waits on (`after`): yield once its header is in
  size_t limitBase = 0;           // a share of a split send: where it starts in what `limit` counts
  int channel = 0;                // which of the pair's channels carries it
  std::shared_ptr<std::vector<Transfer>> parts;  // a message split across channels (post())
  bool bypassCache = false;       // a large receive from shared memory: non-temporal stores
  // progress
  size_t hdrDone = 0;
  size_t done = 0;
  size_t padDone = 0;
  bool matched = false;
  bool finished = false;
  Clock::time_point began{};  // first byte sent, or header received: for link throughput
};

// How far a send may go now: a forwarding send no further than its source has received.
inline size_t sendLimit(const Transfer& t) {
  if (!t.limit) return t.bytes;
  size_t got = *t.limit > t.limitBase ? *t.limit - t.limitBase : 0;
  return std::min(t.bytes, got);
}

// A send waiting for a receive to take its header first (a broadcast tail's acknowledgement).
inline bool gated(const Transfer& t) { return t.after && !(t.after->matched || t.after->done > 0 || t.after->finished); }

// False when a forwarding send has sent all it may until more arrives.
inline bool hasBytesToSend(const Transfer& t) {
  if (gated(t)) return false;
  if (t.hdrDone < sizeof(WireHeader) || t.done >= t.bytes) return true;
  return t.done < sendLimit(t);
}

struct Channel {
  std::unique_ptr<Connection> conn;
  std::deque<Transfer*> sendq, recvq;
  WireHeader inHdr{};
  size_t inHdrGot = 0;
  char carry[8];  // a partial element split by a socket read
  size_t carryGot = 0;
};

struct Op {
  OpKind kind = OpKind::kBarrier;
  bool p2p = false;
  WireHeader fp{};  // fingerprint carried by every message of the op
  std::function<void()> body;
  Transfer xfer;    // for sends and receives
  bool anySource = false;
  bool device = false;  // runs through a GPU: only the progress thread, which set the device, runs it
  RequestPtr req;
  Millis timeout{0};
  uint64_t traceId = 0;
};

// ---------------------------------------------------------------------------------------

// Element blocks of a buffer split n ways as evenly as may be (the first `rem` one larger).
struct Blocks {
  size_t base, rem, es;
  Blocks(size_t count, int n, size_t esize) : base(count / static_cast<size_t>(n)), rem(count % static_cast<size_t>(n)), es(esize) {}
  size_t count(int i) const { return base + (static_cast<size_t>(i) < rem ? 1 : 0); }
  size_t offset(int i) const { return (base * static_cast<size_t>(i) + std::min(static_cast<size_t>(i), rem)) * es; }
};

inline int positionIn(const std::vector<int>& g, int r) {
  return static_cast<int>(std::find(g.begin(), g.end(), r) - g.begin());
}

class CommImpl {
 public:
  CommImpl(Store& store, CommOptions opts);
  ~CommImpl();

  // Everything else is private. The facade (Communicator, communicator.cpp) defines each op
  // from the primitives and algorithms below and queues it; no other code reaches in.
  friend class Communicator;

 private:
  RequestPtr enqueue(std::unique_ptr<Op> op);
  /// Throws Error(kInvalidUsage) on a process other than the one that made the group (a child
  /// forked after init, which would otherwise run the parent's protocol with the parent's peers).
  void checkOwner() const;
  const pid_t ownerPid_ = getpid();
  std::unique_ptr<Op> collective(OpKind kind, DataType dt, ReduceOp rop, int root, size_t count, Millis timeout);

  // algorithms (progress thread)
  void runAllreduce(char* buf, size_t count, DataType dt, ReduceOp op, double scale);
  void runAllreduceCoalesced(const std::vector<char*>& bufs, const std::vector<size_t>& counts, DataType dt, ReduceOp op,
                             double scale);
  void runAllreduceRings(char* buf, size_t count, DataType dt, ReduceOp op, double scale);
  void runReduceScatterRings(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op,
                             double scale);
  struct RingReduce;
  void runRingsReduce(const RingReduce& job, DataType dt, ReduceOp op, double scale, bool bypass);
  void runAllreduceHosts(char* buf, size_t count, DataType dt, ReduceOp op, double scale);
  // Pairwise schedules among the ranks `g` (which include us), on `count` elements of `buf`
  // split into |g| blocks: block j ends reduced at g[j]; then every block everywhere.
  void pairwiseReduceScatter(const std::vector<int>& g, char* buf, size_t count, DataType dt, ReduceOp op,
                             double scale);
  void pairwiseAllgather(const std::vector<int>& g, char* buf, size_t count, size_t es);
  void runBroadcastRing(char* buf, size_t bytes, int root);
  // algorithms/direct.cpp: the other ops' host algorithms (the rule where there is a choice)
  void runBroadcast(char* buf, size_t bytes, int root);
  void runBroadcastChain(char* buf, size_t bytes, int root);
  void runReduce(char* buf, size_t count, DataType dt, ReduceOp op, double scale, int root);
  void runAllgather(const char* in, size_t bytes, const std::vector<char*>& outs);
  void runReduceScatter(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op, double scale);
  void runAlltoall(const std::vector<char*>& ins, const std::vector<size_t>& inCounts, const std::vector<char*>& outs,
                   const std::vector<size_t>& outCounts, DataType dt);
  void runGather(const char* in, size_t bytes, const std::vector<char*>& outs, int root);
  void runScatter(const std::vector<char*>& ins, char* out, size_t bytes, int root);
  void runBarrier();
  void runAllgatherRing(const char* mine, const std::vector<size_t>& sizes, const std::vector<char*>& outs,
                        bool headers);
  // Every same-host rank's broadcast ring, as an op that moves data through them sees them.
  struct Rings {
    transport::BroadcastRing own;
    std::vector<transport::BroadcastRing> of;  // by rank; ours is empty
    std::vector<int> consumers;                 // local indices of the peers reading ours
    std::vector<transport::Doorbell*> wake;
    std::vector<std::pair<int, int>> on;  // the collective lane of every peer
    int myIdx = 0;
  };
  Rings rings();
  // Bytes of one rank's slice per chunk of the two-shot all-reduce: a multiple of 64, so that
  // a chunk's n-1 slices (block A) stay within BroadcastRing::blockMax(); 0 where rings are too
  // small for it.
  size_t ringSlice() const {
    const transport::BroadcastRing own = local_->broadcastRing(-1);
    size_t cap = own.capacity(), slice = cap / 2 / static_cast<size_t>(size_) / 64 * 64;
    return cap % 64 == 0 && slice >= 64 && (static_cast<size_t>(size_) - 1) * slice <= own.blockMax() ? slice : 0;
  }
  // The end of one pass of a ring op's loop: reads the messages posted on the collective lane
  // before the op (its header receives), so that a rank that took another path fails here and
  // not at its timeout; then, if nothing moved, sleeps until `ready` may hold.
  void ringTurn(const Rings& r, size_t moved, const std::function<bool()>& ready);
  // Whether every rank shares this host's memory and there are enough of them for the
  // broadcast rings to save copies (with two ranks a ring and a FIFO copy the same).
  bool ringsCover() const { return size_ > 2 && static_cast<int>(localRanks_.size()) == size_; }
  int localIndex(int r) const {
    return static_cast<int>(std::find(localRanks_.begin(), localRanks_.end(), r) - localRanks_.begin());
  }
  void exchange(std::vector<Transfer>& xs);
  // exchange() in two halves: queue the transfers on the collective lane, then drive them to
  // the end. In between, anything that progresses those channels moves them too.
  void post(std::vector<Transfer>& xs);
  void complete(std::vector<Transfer>& xs);

  // Device buffers (progress thread). An op on device memory runs its host algorithm chunk by
  // chunk on pinned staging: the copy to host of chunk k+1 and the copy back of chunk k-1
  // overlap the network part of chunk k. Each region is one buffer of the op; regions with the
  // same address are staged once (in-place ops).
  // Once per device op: sets the device, makes the events (and own stream) for it, and
  // orders the op's stream after the caller's event.
  struct DeviceOp {
    int device;
    void* stream;
    bool queued = false;  // Placement::queued, with a caller's stream
  };
  DeviceOp beginDevice(const Placement& where);
  struct Region {
    char* dev;
    size_t count;  // elements
    bool in, out;  // copied to host before / back to the device after
    static Region input(char* p, size_t n) { return {p, n, true, false}; }
    static Region output(char* p, size_t n) { return {p, n, false, true}; }
    static Region inOut(char* p, size_t n) { return {p, n, true, true}; }
  };
  using StagedBody = std::function<void(const std::vector<char*>& host, const std::vector<size_t>& counts)>;
  // `slots` is the most regions any rank of the group passes for this op, so every rank cuts
  // the same chunks; `agree` first agrees on the largest region across ranks (alltoall, whose
  // splits differ per rank).
  void runStaged(const DeviceOp& dv, DataType dt, size_t slots, std::vector<Region> regions, const StagedBody& body,
                 bool agree = false);
  // An op on device buffers, described once for the device layer: its buffers (as staging
  // copies them), the host algorithm that runs on staged copies, and its CUDA IPC form, which
  // works on the device buffers in place. runDevice() is the one place that picks between
  // them: IPC where ipcReady() (every rank on this host, peer access, RAILCC_CUDA_IPC), else
  // staging.
  struct DevicePlan {
    std::vector<Region> regions;
    size_t slots = 0;    // the most regions any rank passes, so every rank cuts the same chunks
    bool agree = false;  // agree on the largest region first (alltoall: splits differ per rank)
    StagedBody host;
    std::function<void(const DeviceOp&)> ipc;
    /// The plan of an op on one buffer.
    static DevicePlan of(Region r, StagedBody host, std::function<void(const DeviceOp&)> ipc) {
      DevicePlan p;
      p.regions = {r};
      p.slots = 1;
      p.host = std::move(host);
      p.ipc = std::move(ipc);
      return p;
    }
  };
  void runDevice(const Placement& where, DataType dt, const DevicePlan& plan);
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
  void setDeviceBody(Op& o, const Placement& where, DataType dt, DevicePlan plan);
  // Waits for `ev` without holding a CPU: polls, then naps for a tenth of the time waited so
  // far (20 us to 1 ms). Throws kTimeout after the op's timeout, naming `what` and `stream`.
  void deviceWait(const cuda::DeviceApi& api, void* ev, int device, const char* what, void* stream);
  void releaseDevice();

  // CUDA IPC (every rank on this host): each rank owns a device pool of two slots, each an
  // input chunk and a reduced chunk, mapped by every peer, and three interprocess events. GPU
  // work of different ranks is ordered only by those events and by zero-byte host messages
  // (syncRound), never by a kernel waiting on another process's memory, so ranks that share
  // one GPU cannot deadlock on it.
  enum IpcEvent { kIpcIn, kIpcRed, kIpcDone, kIpcEvents };
  struct IpcState {
    int device = -1;
    bool failed = false;
    size_t chunk = 0;                             // bytes of each of the four pool buffers
    std::vector<char*> pool;                      // [rank]: that rank's pool as mapped here
    std::vector<std::array<void*, kIpcEvents>> ev;  // [rank]: its events as opened here
  } ipc_;
  bool ipcReady(int device);
  // A zero-byte message to and from every peer: each rank knows every peer has reached this
  // point of the op (and the headers check that all called the same op).
  void syncRound();
  // The transfers of one such round, for callers that wait on the two halves separately.
  void headerRound(std::vector<Transfer>& sends, std::vector<Transfer>& recvs);
  // Closes the peers' pools and events; frees this rank's own only when `peersDone` (every
  // peer has closed them: an syncRound after their close).
  void releaseIpc(const cuda::DeviceApi& api, bool peersDone);
  // All-reduce of the buffers `segs` (pointer, element count) as if they were one array: a
  // single tensor is one segment, a coalesced call packs many into each chunk.
  void runIpcAllreduce(const DeviceOp& dv, const std::vector<std::pair<char*, size_t>>& segs, DataType dt, ReduceOp op,
                       double scale);
  void runIpcReduce(const DeviceOp& dv, char* buf, size_t count, DataType dt, ReduceOp op, double scale, int root);
  // out = src(0) op src(1) ... op src(n-1) over `len` elements on the GPU, in rank order (the
  // same bits wherever it runs), PREMUL_SUM's scale and AVG's division included.
  void ipcReduceRanks(const cuda::DeviceApi& api, const DeviceOp& dv, char* out,
                      const std::function<const char*(size_t)>& src, size_t len, DataType dt, ReduceOp op, double scale);
  // The pattern of the rooted and gathering IPC ops, a slot (two chunk buffers) at a time:
  // ranks that `stage` copy elements [off, off + m) of `in` into their slot, and after the In
  // step `use(slot, off, m)` may read any rank's slot; the Done step then frees the slots.
  void ipcSlotChunks(const cuda::DeviceApi& api, const DeviceOp& dv, const char* in, size_t count, size_t es, bool stage,
                     const std::function<void(const std::function<char*(size_t)>& slot, size_t off, size_t m)>& use);
  void runIpcGather(const DeviceOp& dv, const char* in, size_t count, DataType dt, const std::vector<char*>& outs,
                    int root);
  void runIpcScatter(const DeviceOp& dv, const std::vector<char*>& ins, char* out, size_t count, DataType dt, int root);
  void runIpcAllgather(const DeviceOp& dv, const char* in, size_t count, DataType dt, const std::vector<char*>& outs);
  void runIpcReduceScatter(const DeviceOp& dv, const std::vector<char*>& ins, char* out, size_t count, DataType dt,
                           ReduceOp op, double scale);
  void runIpcBroadcast(const DeviceOp& dv, char* buf, size_t count, DataType dt, int root);
  void runIpcAlltoall(const DeviceOp& dv, const std::vector<char*>& ins, const std::vector<size_t>& inCounts,
                      const std::vector<char*>& outs, const std::vector<size_t>& outCounts, DataType dt);
  // The end of a device op: this rank's stream has done the op's GPU work.
  // The end of an IPC op. Its GPU work is ordered by events alone (every slot is rewritten
  // only after each peer's stream has passed its reads of it, whatever op comes next), so the
  // host need not wait for it unless the caller has no stream to order on.
  void ipcFinish(const cuda::DeviceApi& api, const DeviceOp& dv, const char* what) {
    if (dv.queued) return watchGpu(api, dv, what);
    checkDevice(api.eventRecord(stageEv_[0], dv.stream), "cudaEventRecord", dv.device);
    deviceWait(api, stageEv_[0], dv.device, what, dv.stream);
  }
  // The GPU work of ops that completed once queued, oldest first, until the GPU has done it
  // (engine/device/gpu_watch.cpp): the watchdog thread fails the group, naming the op and its
  // stream, when the oldest is not done within the op's timeout.
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
  std::mutex gpuMu_;              // the two below; taken by the engine and the watchdog thread
  std::deque<GpuWork> gpuWork_;
  std::vector<void*> gpuEvents_;  // events of finished entries, for reuse (device devOf_)
  std::atomic<bool> gpuWatched_{false};  // some GPU work was ever watched: the watchdog wakes every second
  void watchGpu(const cuda::DeviceApi& api, const DeviceOp& dv, const char* what);
  // Drops the entries the GPU has finished. With `now`: returns the error of the oldest entry
  // past its timeout (nullptr if none) and sets `next` to when the oldest one runs out.
  std::exception_ptr retireGpuWork(const cuda::DeviceApi& api, const Clock::time_point* now, Clock::time_point* next);
  // The watchdog's side: checks the GPU work and fails the group when it is late.
  void checkGpuWork(Clock::time_point* next);
  void releaseGpuWork(const cuda::DeviceApi& api);
  void* lastStream_ = nullptr;  // the stream of the last device op: drained before teardown
  // Records `e` on this rank's stream, tells every peer, and orders this rank's stream after
  // every peer's record of `e`.
  void ipcStep(const cuda::DeviceApi& api, void* stream, int d, IpcEvent e) {
    checkDevice(api.eventRecord(ipc_.ev[static_cast<size_t>(rank_)][e], stream), "cudaEventRecord", d);
    syncRound();
    for (int q = 0; q < size_; ++q)
      if (q != rank_)
        checkDevice(api.streamWaitEvent(stream, ipc_.ev[static_cast<size_t>(q)][e]), "cudaStreamWaitEvent (peer's IPC event)", d);
  }
  char* stage_ = nullptr;     // pinned: two sets of staging chunks
  size_t stageCap_ = 0;
  void* stageEv_[2] = {nullptr, nullptr};
  void* ownStream_ = nullptr;  // for ops that name no stream
  int devOf_ = -1;             // device the events and stream above belong to

  Transfer sendTo(int peer, const void* p, size_t bytes) {
    Transfer t;
    t.kind = Transfer::kSend;
    t.peer = peer;
    t.src = static_cast<const char*>(p);
    t.bytes = bytes;
    t.hdr = current_->fp;
    t.hdr.bytes = bytes;
    return t;
  }
  Transfer recvFrom(int peer, void* p, size_t bytes) {
    Transfer t = sendTo(peer, nullptr, bytes);
    t.kind = Transfer::kRecv;
    t.dst = static_cast<char*>(p);
    t.bypassCache = bytes >= streamMin_ && shmPeer_[static_cast<size_t>(peer)];
    return t;
  }
  // Receives of at least this many bytes from shared memory write around the cache: the
  // local ranks' results together no longer fit in the last-level cache.
  size_t streamMin_ = ~size_t(0);
  // An op that writes `total` bytes on this rank in pieces (all-gather, all-to-all): the same
  // holds for the whole of it, so its pieces of at least kStreamPiece also write around the
  // cache once `total` reaches streamMin_ (several pieces together fill the cache just as one
  // large one does).
  static constexpr size_t kStreamPiece = 1u << 20;
  bool streamPiece(size_t total, size_t piece) const {
    return piece >= streamMin_ || (total >= streamMin_ && piece >= kStreamPiece);
  }
  void streamPieces(std::vector<Transfer>& xs, size_t total) {
    for (Transfer& t : xs)
      if (t.kind == Transfer::kRecv && shmPeer_[static_cast<size_t>(t.peer)]) t.bypassCache = streamPiece(total, t.bytes);
  }
  // How long a wait on a peer spins in place before it yields (pollFor): all of
  // RAILCC_SPIN_US when this host has a CPU for each of its ranks, none when they share cores.
  int64_t busyUs_ = 0;
  // busyUs_, or 0 where a peer waited on last reported waiting on this thread's CPU: the
  // scheduler has put both on one CPU, and spinning would only keep that peer from running.
  int64_t busyFor(const std::vector<std::pair<int, int>>& waitOn);
  // This host's ranks of the group outnumber the CPUs they may run on (bootstrap).
  bool hostSharesCores_ = false;
  std::vector<bool> shmPeer_;  // peers reached through shared memory
  Transfer recvReduce(int peer, void* p, size_t count, DataType dt, ReduceOp op, double scale) {
    Transfer t = recvFrom(peer, p, count * dtypeSize(dt));
    t.kind = Transfer::kRecvReduce;
    t.dtype = dt;
    t.op = op;
    t.scale = scale;
    return t;
  }

  // "rank G" with G the rank in the default group; "rank G (group rank r)" where they differ.
  std::string rankName(int r) const {
    int g = globalRank(r);
    return g == r ? "rank " + std::to_string(r) : "rank " + std::to_string(g) + " (group rank " + std::to_string(r) + ")";
  }
  int globalRank(int r) const {
    const auto& gr = opts_.globalRanks;
    return r >= 0 && static_cast<size_t>(r) < gr.size() ? gr[static_cast<size_t>(r)] : r;
  }
  // The error with its ranks as users know them (see rankName).
  std::exception_ptr globalized(std::exception_ptr err) const {
    if (opts_.globalRanks.empty()) return err;
    try {
      std::rethrow_exception(err);
    } catch (const Error& e) {
      if (e.ranksGlobal) return err;
      Error copy = e;
      for (int& r : copy.ranks) r = globalRank(r);
      copy.ranksGlobal = true;
      return std::make_exception_ptr(copy);
    } catch (...) {
      return err;
    }
  }
  std::string peerName(int r) const {
    const PeerInfo& p = peers_[static_cast<size_t>(r)];
    return rankName(r) + " (host " + p.hostname + ", " + (p.transport.empty() ? "self" : p.transport) + ")";
  }

  void abort(const std::string& why);
  void shutdown();
  // What every op fails with once abort() was called on this rank.
  std::exception_ptr abortedError() {
    std::lock_guard<std::mutex> g(mu_);
    return std::make_exception_ptr(Error(ErrorCode::kAborted, abortWhy_));
  }
  // Wakes our progress thread wherever it sleeps; safe against a concurrent shutdown().
  void wakeSelf() {
    std::lock_guard<std::mutex> g(connMu_);
    if (local_) local_->wakeSelf();
  }

  CommOptions opts_;
  Store* store_ = nullptr;  // outlives the communicator (owned by the glue or the test)
  int rank_, size_;
  std::vector<PeerInfo> peers_;
  std::vector<int> localRanks_;
  // Ranks with our index among the ranks of their host, one per host in the order of each
  // host's lowest rank; set only when there are two hosts or more and each has the same
  // number of ranks (two or more) sharing memory, else empty.
  std::vector<int> rail_;
  std::shared_ptr<transport::LocalDomain> local_;  // same-host rings and doorbells, when a transport shares memory
  std::vector<std::vector<std::vector<Channel>>> chans_;  // [lane][peer][channel]
  Channel& chan(int lane, int peer, int c = 0) { return chans_[lane][static_cast<size_t>(peer)][static_cast<size_t>(c)]; }
  std::vector<char> bucket_;
  std::vector<char> scratch_;  // one-shot receive area, n blocks of at most RAILCC_ONESHOT_BYTES

  // The algorithm rule (algorithms/choose.h) with this group's placement, set after set-up.
  AlgoPlace place_;
  std::vector<Algo> prefer_;  // RAILCC_ALGO / NCCL_ALGO
  Algo algoFor(AlgoOp op, size_t bytes) const { return chooseAlgo(op, bytes, place_, prefer_, nullptr); }

  bool oneshot(size_t bytes) const {
    return size_ > 1 && static_cast<int64_t>(bytes) <= opts_.config.oneshotBytes;
  }
  // One step: `blockOf(p)` goes to every peer p, and every peer's block for us lands in the
  // scratch area; then out = own (op) peer 0 (op) peer 1 ... in rank order, so every rank
  // computes bit-identical results whatever order the messages arrived in.
  void oneshotReduce(const std::function<const char*(int)>& blockOf, char* out, size_t count, DataType dt,
                     ReduceOp op, double scale);

  // queue
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Op>> queue_;
  std::deque<std::unique_ptr<Op>> drained_;  // drainQueue()'s, with the token held
  std::vector<std::pair<int, int>> completeChans_;  // complete()'s, with the token held
  std::vector<std::pair<int, int>> completeWaitOn_;
  std::vector<Transfer> oneshotXs_;                 // oneshotReduce()'s, with the token held
  std::vector<std::array<uint64_t, 3>> byteRows_;   // complete()'s bytes per peer, for the trace
  std::atomic<size_t> queued_{0};
  std::atomic<bool> sleeping_{false};
  // Wakes a progress thread asleep in poll(). A member that closes itself, so a constructor
  // that throws (a failed init) leaks nothing.
  struct OwnedFd {
    int fd = -1;
    OwnedFd() = default;
    OwnedFd(const OwnedFd&) = delete;
    OwnedFd& operator=(const OwnedFd&) = delete;
    ~OwnedFd() {
      if (fd >= 0) close(fd);
    }
  } wakeFd_;
  bool closing_ = false;
  std::atomic<uint64_t> collSeq_{0};
  // The engine token (under mu_): whoever holds it (the progress thread, or a caller running
  // its own op in wait()) is the only thread touching channels, queues and transports.
  bool busy_ = false;
  bool kick_ = false;  // a caller left work behind: the progress thread should take the token

  // progress thread state
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> aborted_{false};
  std::string abortWhy_;
  mutable std::mutex errMu_;
  std::mutex connMu_;  // guards chans_ against an aborting thread while shutdown frees them
  std::exception_ptr broken_;
  std::atomic<bool> brokenSet_{false};  // broken_ is set: the hot path checks this, not errMu_
  std::deque<std::unique_ptr<Op>> collQueue_;
  std::vector<std::unique_ptr<Op>> p2pActive_;
  std::vector<std::unique_ptr<Op>> anyPending_;
  Op* current_ = nullptr;
  std::vector<int64_t> arrivals_;  // per peer: start time stamped in its first message of the current op
  std::vector<int> waitingOn_;     // peers of the transfers that were unfinished when an op failed
  std::unique_ptr<Telemetry> tele_;
  std::string hostname_;
  // Runs c10d Future callbacks and comm hooks off the progress thread (Request::runUserCode).
  std::shared_ptr<CallbackPool> userPool_;

  // watchdog thread: progress record, straggler checks. It also does every store write after
  // set-up, so a store whose host froze or became unreachable can block only it, never the
  // progress thread. What it shares lives in WatchdogShared, so that a watchdog stuck in the
  // store can be detached at shutdown.
  struct WatchdogShared {
    std::mutex mu;
    std::condition_variable cv;
    bool stop = false, exited = false, drained = true;
    bool inComm = false;  // the watchdog uses the communicator outside `mu` (GPU checks): teardown waits
    std::vector<std::pair<std::string, std::string>> publish;  // keys to set now (failure reports)
    std::shared_ptr<Store> keep;  // keeps the store alive for a detached watchdog
    Store* store = nullptr;
  };
  std::shared_ptr<WatchdogShared> wd_;
  std::thread watchdog_;
  mutable std::mutex wdMu_;  // straggler state below
  std::mutex stragglerMu_;   // one checkStragglers() at a time
  mutable std::mutex traceMu_;      // one trace file write at a time
  std::vector<bool> lagFlagged_;
  std::set<std::pair<int, bool>> linkFlagged_;
  std::string stragglerMsg_;  // pending StragglerError for the next op (RAILCC_STRAGGLER_ACTION=raise)
  std::atomic<bool> stragglerPending_{false};  // stragglerMsg_ is not empty
  std::vector<int> stragglerRanks_;
  std::string peerProgressJson_ = "{}";  // what describePeerProgress concluded, for the dump
  void watchdogLoop(std::shared_ptr<WatchdogShared> w);
  // Reads `key` within about `wait` even when the store itself hangs (its host frozen or the
  // network cut): the read then runs on a helper thread that is left behind if it overruns.
  bool storeTryGet(const std::string& key, Millis wait, std::string& out);
  void checkStragglers();
  std::string progressRecord() const;
  std::string traceJson(const std::string& reason) const;
  std::string writeTrace(const std::string& reason, const std::string& dir = "") const;
  bool ownDump(const std::string& path) const;  // absent, or written by this process
  std::string stragglerReport();
  std::string describePeerProgress(uint64_t seq, std::vector<int>& culprits);
  // Links are compared with others of the same transport and direction: a send into a shm
  // FIFO with room is a memcpy, a receive waits for the sender's copy.
  std::string linkClass(const Telemetry::LinkStats& l) const {
    std::string t = peers_[static_cast<size_t>(l.peer)].transport;
    return t.substr(0, t.find(' ')) + (l.send ? " send" : " receive");
  }
  static constexpr int kMinLinkSamples = 3;  // fewer timed transfers say nothing about a link
  // Throughputs of the links with enough samples, by class.
  std::map<std::string, std::vector<double>> ratesByClass(const std::vector<Telemetry::LinkStats>& links) const {
    std::map<std::string, std::vector<double>> out;
    for (auto& l : links)
      if (l.samples >= kMinLinkSamples) out[linkClass(l)].push_back(l.gbps());
    return out;
  }
  Clock::time_point lastProgress_;
  Clock::time_point lastAliveCheck_;

 private:
  void bootstrap(Store& store);
  // placement.cpp: this rank's NIC and rail from the topology (logged at INFO once per
  // process), and rank 0's check that the hosts agree on their rails.
  struct RailPlace {
    int rail = -1;                     // -1: unknown (one host, no topology, no NIC)
    std::string nic;                   // "mlx5_1"
    std::vector<std::string> railIfs;  // per rail of this host, its NIC's IPv4 interface ("" none)
    std::string why;
    std::string line;                  // published to the peers for checkRails
    std::vector<transport::GpuNicPath> gpuNics;  // for the GPUDirect RDMA decisions
  };
  RailPlace placeRank();
  void checkRails(const std::vector<std::string>& lines);
  using GetFrom = std::function<std::string(const std::string& key, int rank, const char* what)>;
  // Sets up the TCP connections to `remote` (ranks on other hosts) by a concurrent rendezvous.
  // Opens the registered transports, publishes their endpoints, picks one per peer and
  // connects every (peer, lane, channel) through it.
  std::function<void()> pump_;  // run between store waits during connectPeers
  void connectPeers(Store& store, const std::string& secretHex, Clock::time_point deadline, const GetFrom& getFrom,
                    const RailPlace& place);
  void progressLoop();
  // Takes the engine token; with `drain`, also moves the queued ops on (drainQueue) under the same lock.
  bool tryAcquire(bool drain = false);
  void release(bool wakeProgress);
  void failQueued(std::exception_ptr broken);
  std::exception_ptr runCollective(Op& op);
  void helpRun(const Request* req);
  void poke() {
    {
      std::lock_guard<std::mutex> g(mu_);
      kick_ = true;
    }
    cv_.notify_one();
  }

 private:
  void drainQueue();
  void takeQueued();         // queue_ to drained_, with mu_ held
  void distributeDrained();  // drained_ to collQueue_ and the started p2p ops
  void startP2P(std::unique_ptr<Op> op);
  size_t progressP2P();
  void finishP2P();
  size_t progressChannel(int lane, int peer);
  size_t progressChannelImpl(Channel& ch, int lane, int peer);
  void refreshSplit(Transfer& t);
  size_t progressSend(Channel& ch, Transfer& t);
  size_t progressRecv(Channel& ch, Transfer& t);
  bool readHeader(Channel& ch, size_t& moved);
  bool recvWhole(Channel& ch, Transfer& t, int lane, int peer, size_t& moved);
  void acceptHeader(Channel& ch, Transfer& t, int lane, int peer);
  // Messages up to this size travel as one write of header, payload and padding.
  static constexpr size_t kInlineBytes = 512;
  // Times transfers big enough to say something about the link's throughput: below a few
  // hundred KiB a transfer's time is mostly wake-up latency, not the link.
  static bool sampled(const Transfer& t) { return t.bytes >= (256u << 10); }
  void sampleLink(const Transfer& t, bool send) {
    if (!sampled(t) || t.began == Clock::time_point{}) return;
    tele_->linkSample(t.peer, send, t.bytes,
                      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t.began).count());
  }
  void checkHeader(const Transfer& t, const WireHeader& h, int peer);
  void idle(const std::vector<std::pair<int, int>>& waitOn, Millis timeout, const char* what,
            const std::function<bool()>& alsoReady = {});
  // Keeps sends and receives moving while a collective waits; returns bytes moved.
  size_t pumpP2P() {
    if (p2pActive_.empty() && anyPending_.empty() && queued_.load(std::memory_order_relaxed) == 0) return 0;
    drainQueue();
    size_t moved = progressP2P();
    finishP2P();
    return moved;
  }
  [[noreturn]] void failStalled(const std::vector<Transfer*>& pending, Millis timeout);
  void fail(std::exception_ptr err);
  // failure.cpp: the communicators of this process, so that a rank found dead in one
  // group fails the others that hold it (their peers may never talk to it in the op they wait in).
  void enlist();
  void unlist();
  void spreadDeath(const Error& e);
  /// How another live group of this rank saw global rank `g` die ("" when none did): set-up
  /// of a new group waiting for that rank fails with it at once.
  std::string seenDeadElsewhere(int g) const;
  /// Set-up failures this rank publishes for its peers ("initfail" in the group's store), and
  /// the check for theirs while waiting; initFailSeen_ marks an error that came from a peer's.
  void publishInitFailure(Store& store, const Error& e);
  void checkPeerInitFailure(Store& store);
  bool initFailSeen_ = false;
  Clock::time_point lastInitFailCheck_{};
  void memberDied(const std::vector<int>& ranks, const std::string& group, const std::string& why);
  std::exception_ptr brokenError() const;
  std::atomic<bool> memberDown_{false};  // another group of this rank failed us: raise broken_
  [[noreturn]] void peerFailed(int peer, const std::string& detail);
  // After a failure the streams are out of step: forget every queued transfer.
  void clearChannels() {
    for (auto& lane : chans_)
      for (auto& peer : lane)
        for (auto& ch : peer) {
          ch.sendq.clear();
          ch.recvq.clear();
        }
  }
};

}  // namespace railcc::engine
