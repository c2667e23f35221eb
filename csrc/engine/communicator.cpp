#include "engine/communicator.h"

#include <arpa/inet.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "engine/device.h"
#include "engine/error.h"
#include "engine/log.h"
#include "engine/telemetry.h"
#include "transport/shm/shm_transport.h"
#include "transport/socket/auth.h"
#include "transport/socket/rendezvous.h"
#include "transport/socket/socket_transport.h"

namespace railcc::engine {

using Clock = std::chrono::steady_clock;
using transport::Connection;

namespace {
// Polls `ready` for up to `us` microseconds before a waiter goes to sleep; true once it holds.
// Between polls it yields instead of spinning in place: that hands the core to any other
// runnable thread at once (the peer rank, or our own progress thread when ranks share cores),
// while a waiter that owns its core keeps it awake and reacts within a microsecond, where
// sleeping would cost a wake-up of tens of microseconds (far more in a VM, whose idle
// virtual CPUs halt).
template <typename F>
bool pollFor(int64_t us, F&& ready) {
  auto until = Clock::now() + std::chrono::microseconds(us);
  while (!ready()) {
    if (Clock::now() >= until) return false;
    sched_yield();
  }
  return true;
}
}  // namespace

namespace {
thread_local bool tCallerWaits = false;
}  // namespace

CallerWaits::CallerWaits(bool on) : prev_(tCallerWaits) { tCallerWaits = on; }
CallerWaits::~CallerWaits() { tCallerWaits = prev_; }
bool CallerWaits::active() { return tCallerWaits; }

// ---------------------------------------------------------------------------------------
// Request

bool Request::completed() const {
  std::lock_guard<std::mutex> g(mu_);
  return done_;
}

bool Request::wait(Millis timeout) {
  // Small ops finish within microseconds of being queued: poll briefly before blocking.
  pollFor(spinUs_, [&] { return doneFlag_.load(std::memory_order_acquire); });
  std::unique_lock<std::mutex> g(mu_);
  if (timeout.count() < 0) {
    cv_.wait(g, [&] { return done_; });
    return true;
  }
  return cv_.wait_for(g, timeout, [&] { return done_; });
}

std::exception_ptr Request::error() const {
  std::lock_guard<std::mutex> g(mu_);
  return error_;
}

void Request::onComplete(std::function<void()> cb) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!done_) {
      callbacks_.push_back(std::move(cb));
      return;
    }
  }
  cb();
}

void Request::runUserCode(std::function<void()> fn) {
  if (pool_ && CallbackPool::onEngineThread()) pool_->post(std::move(fn));
  else fn();
}

void Request::finish(std::exception_ptr err) {
  std::vector<std::function<void()>> cbs;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (done_) return;
    done_ = true;
    if (!err) err = straggler_;
    error_ = err;
    doneFlag_.store(true, std::memory_order_release);
    cbs.swap(callbacks_);
  }
  cv_.notify_all();
  for (auto& cb : cbs) {
    try {
      cb();
    } catch (const std::exception& e) {
      RAILCC_WARN(COLL, "completion callback threw: ", e.what());
    } catch (...) {
      RAILCC_WARN(COLL, "completion callback threw");
    }
  }
}

// ---------------------------------------------------------------------------------------
// Wire format. Every message is a header followed by its payload, padded to 8 bytes so
// that stream positions stay aligned for in-place reductions out of shared memory.

enum class OpKind : uint8_t {
  kAllreduce = 1, kBroadcast, kReduce, kAllgather, kReduceScatter, kAlltoall, kGather, kScatter,
  kBarrier, kP2P, kAllreduceCoalesced,
};

const char* opKindName(OpKind k) {
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

size_t pad8(size_t n) { return (n + 7) & ~size_t(7); }

std::string describeCall(const WireHeader& h) {
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
  bool bypassCache = false;       // a large receive from shared memory: non-temporal stores
  // progress
  size_t hdrDone = 0;
  size_t done = 0;
  size_t padDone = 0;
  bool matched = false;
  bool finished = false;
  Clock::time_point began{};  // first byte sent, or header received: for link throughput
};

// False when a forwarding send has sent all it may until more arrives.
bool hasBytesToSend(const Transfer& t) {
  if (t.hdrDone < sizeof(WireHeader) || t.done >= t.bytes) return true;
  return !t.limit || t.done < std::min(t.bytes, *t.limit);
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

std::string hostIdentity(const Config& cfg) {
  if (!cfg.hostId.empty()) return cfg.hostId;
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  struct stat st {};
  unsigned long long netns = 0;
  if (stat("/proc/self/ns/net", &st) == 0) netns = static_cast<unsigned long long>(st.st_ino);
  return boot + ":" + std::to_string(netns);
}

class CommImpl {
 public:
  CommImpl(Store& store, CommOptions opts);
  ~CommImpl();

  RequestPtr enqueue(std::unique_ptr<Op> op);
  std::unique_ptr<Op> collective(OpKind kind, DataType dt, ReduceOp rop, int root, size_t count, Millis timeout);

  // algorithms (progress thread)
  void runAllreduce(char* buf, size_t count, DataType dt, ReduceOp op, double scale);
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
  void runAllgatherRing(const char* mine, const std::vector<size_t>& sizes, const std::vector<char*>& outs,
                        bool headers);
  // Every same-host rank's broadcast ring, as an op that moves data through them sees them.
  struct Rings {
    transport::shm::BcastRing own;
    std::vector<transport::shm::BcastRing> of;  // by rank; ours is empty
    std::vector<int> consumers;                 // local indices of the peers reading ours
    std::vector<transport::shm::SegmentHeader*> wake;
    std::vector<std::pair<int, int>> on;  // the collective lane of every peer
    int myIdx = 0;
  };
  Rings rings();
  // Bytes of one rank's slice per chunk of the two-shot all-reduce: a multiple of 64, so that
  // a chunk's n-1 slices (block A) stay within BcastRing::blockMax(); 0 where rings are too
  // small for it.
  size_t ringSlice() const {
    const transport::shm::BcastRing own = shm_->bcastRing(-1);
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
  };
  using StagedBody = std::function<void(const std::vector<char*>& host, const std::vector<size_t>& counts)>;
  // `slots` is the most regions any rank of the group passes for this op, so every rank cuts
  // the same chunks; `agree` first agrees on the largest region across ranks (alltoall, whose
  // splits differ per rank).
  void runStaged(const DeviceOp& dv, DataType dt, size_t slots, std::vector<Region> regions, const StagedBody& body,
                 bool agree = false);
  void deviceWait(const cuda::DeviceApi& api, void* ev, int device, const char* what);
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
    if (dv.queued) return;
    checkDevice(api.eventRecord(stageEv_[0], dv.stream), "cudaEventRecord", dv.device);
    deviceWait(api, stageEv_[0], dv.device, what);
  }
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
  void ringSelf() {
    std::lock_guard<std::mutex> g(connMu_);
    if (shm_) shm_->ringSelf();
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
  std::unique_ptr<transport::shm::Domain> shm_;
  std::vector<std::vector<Channel>> chans_;  // [lane][peer]
  std::vector<char> bucket_;
  std::vector<char> scratch_;  // one-shot receive area, n blocks of at most RAILCC_ONESHOT_BYTES

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
  uint64_t collSeq_ = 0;
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
  using GetFrom = std::function<std::string(const std::string& key, int rank, const char* what)>;
  // Sets up the TCP connections to `remote` (ranks on other hosts) by a concurrent rendezvous.
  void connectRemote(Store& store, const std::vector<int>& remote, const std::string& secretHex,
                     Clock::time_point deadline, const GetFrom& getFrom);
  void progressLoop();
  bool tryAcquire();
  void release(bool wakeProgress);
  void failQueued(std::exception_ptr broken);
  std::exception_ptr runCollective(Op& op);
 public:
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
  void startP2P(std::unique_ptr<Op> op);
  size_t progressP2P();
  void finishP2P();
  size_t progressChannel(int lane, int peer);
  size_t progressChannelImpl(int lane, int peer);
  size_t progressSend(Channel& ch, Transfer& t);
  size_t progressRecv(Channel& ch, Transfer& t);
  bool readHeader(Channel& ch, size_t& moved);
  // Times transfers big enough to say something about the link's throughput.
  void sampleLink(const Transfer& t, bool send) {
    // Below a few hundred KiB a transfer's time is mostly wake-up latency, not the link.
    if (t.bytes < (256u << 10) || t.began == Clock::time_point{}) return;
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
  [[noreturn]] void peerFailed(int peer, const std::string& detail);
  // After a failure the streams are out of step: forget every queued transfer.
  void clearChannels() {
    for (auto& lane : chans_)
      for (auto& ch : lane) {
        ch.sendq.clear();
        ch.recvq.clear();
      }
  }
};

// ---------------------------------------------------------------------------------------
// Bootstrap

namespace {

// The pid namespace of this process ("pid:[4026531836]"): pids mean something only within one.
std::string pidNamespace() {
  char buf[64] = {0};
  ssize_t n = readlink("/proc/self/ns/pid", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "unknown";
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream is(s);
  while (std::getline(is, cur, sep)) out.push_back(cur);
  return out;
}

sockaddr_in parseAddr(const std::string& s) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  auto colon = s.rfind(':');
  inet_pton(AF_INET, s.substr(0, colon).c_str(), &a.sin_addr);
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(s.substr(colon + 1))));
  return a;
}

}  // namespace

CommImpl::CommImpl(Store& store, CommOptions opts)
    : opts_(std::move(opts)), store_(&store), rank_(opts_.rank), size_(opts_.size) {
  RAILCC_CHECK_ARG(size_ >= 1, "world size must be >= 1, got ", size_);
  RAILCC_CHECK_ARG(rank_ >= 0 && rank_ < size_, "rank ", rank_, " is out of range for world size ", size_);
  log::setThreadRank(rank_);
  wakeFd_.fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  RAILCC_SYSCHECK(wakeFd_.fd, "eventfd");
  userPool_ = std::make_shared<CallbackPool>(rank_);
  wd_ = std::make_shared<WatchdogShared>();
  wd_->keep = opts_.storeKeepAlive;
  wd_->store = store_;
  tele_ = std::make_unique<Telemetry>(rank_, size_, static_cast<size_t>(std::max<int64_t>(opts_.config.traceSize, 1)),
                                      static_cast<size_t>(std::max<int64_t>(opts_.config.stragglerWindow, 1)));
  arrivals_.assign(static_cast<size_t>(size_), 0);
  lagFlagged_.assign(static_cast<size_t>(size_), false);
  try {
    bootstrap(store);
  } catch (const Error&) {
    std::rethrow_exception(globalized(std::current_exception()));
  }
  hostname_ = peers_[static_cast<size_t>(rank_)].hostname;
  streamMin_ = std::max<size_t>(transport::lastLevelCacheBytes() / localRanks_.size(), size_t(1) << 20);
  for (const PeerInfo& p : peers_) shmPeer_.push_back(p.transport == "shm");
  // A first progress record now, so that a rank frozen before the watchdog's first beat is
  // still told apart from one that never published anything.
  if (size_ > 1 && opts_.config.progressIntervalMs > 0) store.set("progress/" + std::to_string(rank_), progressRecord());
  lastProgress_ = lastAliveCheck_ = Clock::now();
  thread_ = std::thread([this] { progressLoop(); });
  if (size_ > 1) watchdog_ = std::thread([this, w = wd_] { watchdogLoop(w); });
}

CommImpl::~CommImpl() { shutdown(); }

void CommImpl::connectRemote(Store& store, const std::vector<int>& remote, const std::string& secretHex,
                             Clock::time_point deadline, const GetFrom& getFrom) {
  const Config& cfg = opts_.config;
  std::vector<uint8_t> secret;
  for (size_t i = 0; i + 1 < secretHex.size(); i += 2)
    secret.push_back(static_cast<uint8_t>(std::stoi(secretHex.substr(i, 2), nullptr, 16)));
  PeerInfo& self = peers_[static_cast<size_t>(rank_)];
  self.addr = "-";  // until some peer dials us
  std::unique_ptr<transport::socket::Listener> listener;  // closed when set-up is done
  if (std::any_of(remote.begin(), remote.end(), [&](int r) { return r < rank_; })) {
    sockaddr_in bindAddr{};
    std::string ifname = transport::socket::pickInterface(cfg.socketIfname, bindAddr);
    listener = std::make_unique<transport::socket::Listener>(bindAddr);
    self.addr = transport::socket::formatAddr(listener->addr());
    RAILCC_INFO(INIT, "listening on ", ifname, " ", self.addr, " until the peers on other hosts have connected");
    store.set("addr/" + std::to_string(rank_), self.addr);
  }
  transport::socket::Rendezvous rv(secret, rank_, listener.get());
  for (int r : remote) {
    PeerInfo& p = peers_[static_cast<size_t>(r)];
    if (r > rank_) p.addr = getFrom("addr/" + std::to_string(r), r, "TCP address");
    for (int lane = 0; lane < kLanes; ++lane) {
      if (r > rank_) rv.dial(r, lane, parseAddr(p.addr));
      else rv.expect(r, lane);
    }
  }
  try {
    rv.run(deadline);
  } catch (const Error& e) {
    Error err(e.code(), "railcc init of group '" + opts_.name + "': " + e.what());
    err.ranks = e.ranks;
    for (int r : e.ranks) err.hosts.push_back(peers_[static_cast<size_t>(r)].hostname);
    throw err;
  }
  for (int r : remote) {
    std::string where = r > rank_ ? peers_[static_cast<size_t>(r)].addr : rv.remoteAddress(r, 0);
    for (int lane = 0; lane < kLanes; ++lane)
      chans_[lane][static_cast<size_t>(r)].conn =
          transport::socket::makeConnection(rv.take(r, lane), where, static_cast<size_t>(cfg.stagingSize));
    peers_[static_cast<size_t>(r)].transport = "socket " + where;
  }
}

void CommImpl::bootstrap(Store& store) {
  const Config& cfg = opts_.config;
  auto t0 = Clock::now();
  Millis initTimeout(cfg.initTimeoutSec * 1000);
  auto deadline = t0 + initTimeout;
  auto left = [&] { return std::max(Millis(1), std::chrono::duration_cast<Millis>(deadline - Clock::now())); };
  const std::string hostId = hostIdentity(cfg);
  // Waits in slices; between them, a same-host rank whose process has exited fails init at
  // once instead of after RAILCC_INIT_TIMEOUT.
  auto waitKey = [&](const std::string& key) {
    while (true) {
      try {
        return store.get(key, std::min(left(), Millis(1000)));
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kTimeout || Clock::now() >= deadline) throw;
      }
      for (const PeerInfo& p : peers_) {
        // Only peers we will share memory with, and only in our pid namespace: a pid of another
        // namespace names some other process here, or none.
        if (cfg.shmDisable || p.pid <= 0 || p.rank == rank_ || p.hostId != hostId || p.pidNs != pidNamespace() ||
            !transport::shm::processGone(p.pid))
          continue;
        Error err(ErrorCode::kPeerFailure, "railcc init of group '" + opts_.name + "': " + rankName(p.rank) +
                                               " (host " + p.hostname + ", pid " + std::to_string(p.pid) +
                                               ") exited during init");
        err.ranks = {p.rank};
        err.hosts = {p.hostname};
        throw err;
      }
    }
  };
  GetFrom getFrom = [&](const std::string& key, int r, const char* what) {
    try {
      return waitKey(key);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kPeerFailure) throw;
      Error err(e.code() == ErrorCode::kTimeout ? ErrorCode::kTimeout : e.code(),
                "railcc init of group '" + opts_.name + "': " + rankName(r) + " did not publish its " +
                    what + " within RAILCC_INIT_TIMEOUT=" + std::to_string(cfg.initTimeoutSec) +
                    " s; it never reached init_process_group or died during it (" + e.what() + ")");
      err.ranks = {r};
      throw err;
    }
  };

  // The group secret, shared through the store (which every member trusts, as in c10d): each
  // TCP connection proves it holds it by challenge-response before we read into a buffer.
  std::string secret;
  if (rank_ == 0) {
    secret = transport::socket::randomHex(32);
    store.set("secret", secret);
  } else {
    secret = getFrom("secret", 0, "group secret");
  }

  peers_.resize(static_cast<size_t>(size_));
  char hn[256] = {0};
  gethostname(hn, sizeof(hn) - 1);
  const std::string pidNs = pidNamespace();
  const std::string me = hostId + "|" + hn + "|" + std::to_string(getpid()) + "|" + pidNs;
  store.set("peer/" + std::to_string(rank_), me);
  for (int r = 0; r < size_; ++r) {
    std::string v = r == rank_ ? me : getFrom("peer/" + std::to_string(r), r, "host identity");
    auto f = split(v, '|');
    RAILCC_CHECK_EQ(f.size(), size_t(4));
    PeerInfo& p = peers_[static_cast<size_t>(r)];
    p.rank = r;
    p.hostId = f[0];
    p.hostname = f[1];
    p.pid = std::stoi(f[2]);
    p.pidNs = f[3];
    p.addr = "-";  // set for the peers that listen, in connectRemote
  }
  for (int r = 0; r < size_; ++r)
    if (peers_[static_cast<size_t>(r)].hostId == hostId && !cfg.shmDisable) localRanks_.push_back(r);
  if (localRanks_.empty()) localRanks_.push_back(rank_);
  if (localRanks_.size() > 1 && static_cast<int>(localRanks_.size()) < size_) {
    std::vector<std::string> order;  // hosts by their lowest rank
    std::map<std::string, std::vector<int>> byHost;
    for (int r = 0; r < size_; ++r) {
      const std::string& h = peers_[static_cast<size_t>(r)].hostId;
      if (byHost[h].empty()) order.push_back(h);
      byHost[h].push_back(r);
    }
    bool even = true;
    for (auto& [h, ranks] : byHost) even = even && ranks.size() == localRanks_.size();
    if (even)
      for (const std::string& h : order) rail_.push_back(byHost[h][static_cast<size_t>(localIndex(rank_))]);
  }
  if (opts_.config.spinUs < 0) RAILCC_THROW(kInvalidUsage, "RAILCC_SPIN_US must be 0 or more, got ", opts_.config.spinUs);

  chans_.resize(kLanes);
  for (auto& lane : chans_) lane = std::vector<Channel>(static_cast<size_t>(size_));

  // Same host: shared memory. Each rank creates one segment holding its incoming FIFOs and
  // maps its neighbours'; names are unlinked as soon as everyone has mapped them.
  if (localRanks_.size() > 1) {
    size_t slot = static_cast<size_t>(cfg.buffSize);
    shm_ = std::make_unique<transport::shm::Domain>(static_cast<int>(localRanks_.size()) * kLanes, slot);
    store.set("shm/" + std::to_string(rank_), shm_->segmentName());
    for (int r : localRanks_)
      if (r != rank_) shm_->attach(localIndex(r), getFrom("shm/" + std::to_string(r), r, "shared-memory segment"));
    store.set("shmok/" + std::to_string(rank_), "1");
    for (int r : localRanks_)
      if (r != rank_) getFrom("shmok/" + std::to_string(r), r, "shared-memory mapping");
    shm_->unlinkOwn();
    for (int r : localRanks_) {
      if (r == rank_) continue;
      for (int lane = 0; lane < kLanes; ++lane)
        chans_[lane][static_cast<size_t>(r)].conn = shm_->connect(localIndex(rank_), localIndex(r), lane, kLanes,
                                                                   peers_[static_cast<size_t>(r)].pidNs == pidNs);
      peers_[static_cast<size_t>(r)].transport = "shm";
    }
    RAILCC_INFO(SHM, "shared memory: ", localRanks_.size(), " ranks on this host, FIFO of ", slot,
                " bytes per peer, lane and direction");
  }

  // Other hosts: TCP. The lower rank dials, the higher accepts; only a rank that some peer
  // dials listens, and only until set-up is done.
  std::vector<int> remote;
  for (int r = 0; r < size_; ++r)
    if (r != rank_ && !chans_[0][static_cast<size_t>(r)].conn) remote.push_back(r);
  if (!remote.empty()) connectRemote(store, remote, secret, deadline, getFrom);
  if (!remote.empty())
    RAILCC_WARN(NET, "TCP sockets serve ", remote.size(), " peer(s)", cfg.shmDisable ? " (RAILCC_SHM_DISABLE=1)" : "",
                "; there is no RDMA transport in this build");

  for (int r = 0; r < size_; ++r)
    if (r != rank_)
      RAILCC_INFO(INIT, "rank ", rank_, " -> peer ", r, " (", peers_[static_cast<size_t>(r)].hostname, ") via ",
                  peers_[static_cast<size_t>(r)].transport);
  RAILCC_INFO(INIT, "group '", opts_.name, "' rank ", rank_, "/", size_, " ready in ",
              std::chrono::duration_cast<Millis>(Clock::now() - t0).count(), " ms");
}

// ---------------------------------------------------------------------------------------
// Queue and progress thread

RequestPtr CommImpl::enqueue(std::unique_ptr<Op> op) {
  op->req = std::make_shared<Request>(opts_.config.spinUs, userPool_);
  if (op->timeout.count() <= 0) op->timeout = opts_.timeout;
  if (op->p2p) {
    op->traceId = tele_->opQueued(0, op->xfer.kind == Transfer::kSend ? "send" : "recv", "-", "-", op->xfer.peer,
                                  op->xfer.bytes);
  } else {
    auto k = static_cast<OpKind>(op->fp.kind);
    bool reduces = k == OpKind::kAllreduce || k == OpKind::kReduce || k == OpKind::kReduceScatter ||
                   k == OpKind::kAllreduceCoalesced;
    bool rooted = k == OpKind::kBroadcast || k == OpKind::kReduce || k == OpKind::kGather || k == OpKind::kScatter;
    op->traceId = tele_->opQueued(op->fp.seq, opKindName(k), dtypeName(static_cast<DataType>(op->fp.dtype)),
                                  reduces ? reduceOpName(static_cast<ReduceOp>(op->fp.redop)) : "-",
                                  rooted ? op->fp.root : -1, op->fp.count);
  }
  RequestPtr req = op->req;
  {
    // A straggler reported by the watchdog fails the next op when RAILCC_STRAGGLER_ACTION=raise.
    // Attached before the op is queued: a small op may be finished before enqueue() returns.
    std::lock_guard<std::mutex> g(wdMu_);
    if (!stragglerMsg_.empty()) {
      Error e(ErrorCode::kStraggler, stragglerMsg_);
      e.ranks = stragglerRanks_;
      for (int r : e.ranks) e.hosts.push_back(peers_[static_cast<size_t>(r)].hostname);
      stragglerMsg_.clear();
      req->setStraggler(globalized(std::make_exception_ptr(e)));
    }
  }
  std::exception_ptr err;
  // A caller that runs the op itself in wait() needs no wake-up, unless somebody holds the
  // engine: it is then that thread's to find the op (a progress thread asleep in a send/recv
  // wait has to be woken for it).
  bool wake = !(tCallerWaits && !op->device && !op->p2p);
  {
    std::lock_guard<std::mutex> g(mu_);
    {
      std::lock_guard<std::mutex> ge(errMu_);
      err = broken_;
    }
    if (!err && closing_)
      err = std::make_exception_ptr(Error(ErrorCode::kAborted, "the process group was shut down"));
    if (!err) {
      queue_.push_back(std::move(op));
      queued_.fetch_add(1);
      wake = wake || busy_;
    }
  }
  if (err) {
    req->finish(err);
    return req;
  }
  if (!wake) return req;
  cv_.notify_one();
  if (sleeping_.load()) {
    ringSelf();
    uint64_t one = 1;
    if (write(wakeFd_.fd, &one, sizeof(one)) < 0) { /* wake-up is best effort */ }
  }
  return req;
}

std::unique_ptr<Op> CommImpl::collective(OpKind kind, DataType dt, ReduceOp rop, int root, size_t count, Millis timeout) {
  auto op = std::make_unique<Op>();
  op->kind = kind;
  op->timeout = timeout;
  op->fp.magic = kWireMagic;
  op->fp.kind = static_cast<uint8_t>(kind);
  op->fp.dtype = static_cast<uint8_t>(dt);
  op->fp.redop = static_cast<uint8_t>(rop);
  op->fp.root = root;
  op->fp.count = count;
  {
    std::lock_guard<std::mutex> g(mu_);
    op->fp.seq = ++collSeq_;
  }
  return op;
}

void CommImpl::drainQueue() {
  if (queued_.load(std::memory_order_acquire) == 0) return;
  std::deque<std::unique_ptr<Op>> got;
  {
    std::lock_guard<std::mutex> g(mu_);
    got.swap(queue_);
    queued_.store(0);
  }
  for (auto& op : got) {
    if (op->p2p) startP2P(std::move(op));
    else collQueue_.push_back(std::move(op));
  }
}

void CommImpl::fail(std::exception_ptr err) {
  {
    std::lock_guard<std::mutex> g(errMu_);
    if (broken_) return;
    broken_ = err;
  }
  std::string msg, culprits;
  try {
    std::rethrow_exception(err);
  } catch (const Error& e) {
    msg = e.what();
    // A dead or silent rank is the root cause for every peer this failure reaches through the
    // report below: they name it, not us, the messenger.
    if (e.code() == ErrorCode::kPeerFailure || e.code() == ErrorCode::kTimeout)
      for (int r : e.ranks) culprits += (culprits.empty() ? "" : ",") + std::to_string(e.ranksGlobal ? r : globalRank(r));
  } catch (const std::exception& e) {
    msg = e.what();
  }
  RAILCC_WARN(WATCHDOG, "group '", opts_.name, "' failed: ", msg);
  // Tell the peers at once, and why: they would otherwise wait for their timeout. The reason
  // goes through the store (from the watchdog thread); peers that see the flags below wait
  // a moment for it.
  if (wd_ && size_ > 1) {
    {
      std::lock_guard<std::mutex> g(wd_->mu);
      wd_->publish.push_back({"failed/" + std::to_string(rank_), (culprits.empty() ? "" : "ranks=" + culprits + "\n") + msg});
      wd_->drained = false;
    }
    wd_->cv.notify_all();
  }
  {
    std::lock_guard<std::mutex> g(connMu_);
    if (shm_) shm_->markFailed();
    for (auto& lane : chans_)
      for (auto& ch : lane)
        if (ch.conn) ch.conn->markFailed();
  }
  try {
    std::string path = writeTrace("failure");
    if (!path.empty()) RAILCC_WARN(WATCHDOG, "flight recorder written to ", path);
  } catch (const std::exception& e) {
    RAILCC_WARN(WATCHDOG, "could not write the flight recorder: ", e.what());
  }
  bool userEnded = false;  // abort() or shutdown(): asked for, not a failure to tear down for
  try {
    std::rethrow_exception(err);
  } catch (const Error& e) {
    userEnded = e.code() == ErrorCode::kAborted;
  } catch (...) {
  }
  if (opts_.config.abortOnError && !userEnded) {
    RAILCC_WARN(WATCHDOG, "RAILCC_ABORT_ON_ERROR=1: tearing the process down");
    {
      // Give the watchdog a moment to put the reason in the store for the peers.
      std::unique_lock<std::mutex> g(wd_->mu);
      wd_->cv.wait_for(g, Millis(1000), [&] { return wd_->drained; });
    }
    std::abort();
  }
}

void CommImpl::peerFailed(int peer, const std::string& detail) {
  const PeerInfo& p = peers_[static_cast<size_t>(peer)];
  std::string reason;
  storeTryGet("failed/" + std::to_string(peer), Millis(200), reason);
  std::vector<int> rootCause;  // global ranks the peer blamed for its own failure
  if (reason.rfind("ranks=", 0) == 0) {
    size_t nl = reason.find('\n');
    for (const std::string& r : split(reason.substr(6, nl == std::string::npos ? std::string::npos : nl - 6), ','))
      if (!r.empty()) rootCause.push_back(std::stoi(r));
    reason = nl == std::string::npos ? "" : reason.substr(nl + 1);
  }
  ErrorCode code = ErrorCode::kPeerFailure;
  std::string msg;
  if (reason.rfind("collective mismatch", 0) == 0) {
    code = ErrorCode::kMismatch;  // the peer saw both calls; repeat them here
    msg = rankName(peer) + " (host " + p.hostname + ") detected a " + reason;
  } else if (!reason.empty()) {
    msg = rankName(peer) + " (host " + p.hostname + ", " + p.transport + ") failed: " + reason;
  } else if (detail.find("reported a failure") != std::string::npos) {
    msg = rankName(peer) + " (host " + p.hostname + ", pid " + std::to_string(p.pid) + ", " + p.transport +
          ") failed earlier; its reason is no longer readable from the store (see that rank's log or trace dump)";
  } else {
    msg = rankName(peer) + " (host " + p.hostname + ", pid " + std::to_string(p.pid) + ", " +
          p.transport + ") is gone: " + detail + "; it left no report, so it most likely died (killed, OOM or crash)";
  }
  Error err(code, msg);
  err.ranks = {globalRank(peer)};
  err.hosts = {p.hostname};
  err.ranksGlobal = true;
  bool blamesUs = std::find(rootCause.begin(), rootCause.end(), globalRank(rank_)) != rootCause.end();
  if (code == ErrorCode::kPeerFailure && !rootCause.empty() && !blamesUs) {
    err.ranks = rootCause;
    err.hosts.clear();
    for (int g : rootCause) {
      int r = g;
      for (size_t i = 0; i < opts_.globalRanks.size(); ++i)
        if (opts_.globalRanks[i] == g) r = static_cast<int>(i);
      err.hosts.push_back(r >= 0 && r < size_ ? peers_[static_cast<size_t>(r)].hostname : "?");
    }
  }
  if (current_) {
    err.seq = static_cast<long long>(current_->fp.seq);
    err.op = opKindName(current_->kind);
  }
  throw err;
}

bool CommImpl::tryAcquire() {
  std::lock_guard<std::mutex> g(mu_);
  if (busy_) return false;
  busy_ = true;
  return true;
}

void CommImpl::release(bool wakeProgress) {
  bool more = wakeProgress && (!collQueue_.empty() || !p2pActive_.empty() || !anyPending_.empty());
  {
    std::lock_guard<std::mutex> g(mu_);
    busy_ = false;
    if (more) kick_ = true;
    more = more || (wakeProgress && !queue_.empty());
  }
  if (more) cv_.notify_all();
}

void CommImpl::failQueued(std::exception_ptr broken) {
  for (auto& op : collQueue_) op->req->finish(broken);
  collQueue_.clear();
  for (auto& op : p2pActive_) op->req->finish(broken);
  p2pActive_.clear();
  for (auto& op : anyPending_) op->req->finish(broken);
  anyPending_.clear();
}

// Runs one collective with the token held; the caller finishes its request.
std::exception_ptr CommImpl::runCollective(Op& op) {
  current_ = &op;
  lastProgress_ = Clock::now();
  op.fp.startUs = wallMicros();
  std::fill(arrivals_.begin(), arrivals_.end(), 0);
  waitingOn_.clear();
  tele_->opStarted(op.traceId, op.fp.seq);
  std::exception_ptr err;
  std::string what;
  try {
    if (aborted_) RAILCC_THROW(kAborted, abortWhy_);
    // A peer that failed may have sent its part of this op before failing; taking it
    // would let this rank succeed where that rank raised.
    for (int r : localRanks_)
      if (r != rank_ && chans_[kCollLane][static_cast<size_t>(r)].conn->peerReportedFailure())
        peerFailed(r, "it reported a failure of its own");
    op.body();
  } catch (const Error& e) {
    err = std::current_exception();
    what = e.what();
  } catch (const std::exception& e) {
    err = std::make_exception_ptr(Error(ErrorCode::kInternal, e.what()));
    what = e.what();
  }
  // abort() shut our connections down: what the transports saw next is our own doing, not a
  // peer's failure.
  if (err && aborted_) err = abortedError();
  if (err) err = globalized(err);
  tele_->opFinished(op.traceId, op.fp.seq, what, waitingOn_);
  if (err) {
    fail(err);
    clearChannels();
  } else if (size_ > 1) {
    arrivals_[static_cast<size_t>(rank_)] = op.fp.startUs;
    tele_->arrivals(arrivals_);
  }
  current_ = nullptr;
  return err;
}

// A caller about to block on `req` runs it itself when the engine is idle: two thread hand-offs
// fewer (waking the progress thread, then waking the caller), which on cores shared by several
// ranks cost more than a small op. Host collectives only, and only those queued up to `req`;
// requests are finished after the token is released, so that what they run inline (user code
// included: this is not the progress thread) may queue and wait on new ops.
void CommImpl::helpRun(const Request* req) {
  if (!tryAcquire()) return;
  log::setThreadRank(rank_);
  std::vector<std::pair<std::unique_ptr<Op>, std::exception_ptr>> ran;
  drainQueue();
  std::exception_ptr broken;
  {
    std::lock_guard<std::mutex> g(errMu_);
    broken = broken_;
  }
  if (!broken && !stop_) {
    while (!collQueue_.empty() && !collQueue_.front()->device) {
      std::unique_ptr<Op> op = std::move(collQueue_.front());
      collQueue_.pop_front();
      std::exception_ptr err = runCollective(*op);
      bool mine = op->req.get() == req;
      ran.emplace_back(std::move(op), err);
      if (mine || err) break;
    }
  }
  release(true);
  for (auto& [op, err] : ran) op->req->finish(err);
}

void CommImpl::progressLoop() {
  log::setThreadRank(rank_);
  CallbackPool::markEngineThread();
  bool held = false;
  while (true) {
    if (!held) {
      if (!tryAcquire()) {
        // A caller runs its op; it hands over what it leaves behind (kick_).
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait_for(g, Millis(100), [&] { return !busy_ && (kick_ || !queue_.empty() || stop_.load()); });
        kick_ = false;
        continue;
      }
      held = true;
    }
    drainQueue();
    std::exception_ptr broken;
    {
      std::lock_guard<std::mutex> g(errMu_);
      broken = broken_;
    }
    if (broken) failQueued(broken);
    if (!collQueue_.empty()) {
      std::unique_ptr<Op> op = std::move(collQueue_.front());
      collQueue_.pop_front();
      std::exception_ptr err = runCollective(*op);
      op->req->finish(err);
      continue;
    }
    if (!p2pActive_.empty() || !anyPending_.empty()) {
      try {
        if (aborted_) RAILCC_THROW(kAborted, abortWhy_);
        size_t moved = progressP2P();
        finishP2P();
        if (moved == 0 && (!p2pActive_.empty() || !anyPending_.empty())) {
          std::vector<std::pair<int, int>> on;
          for (int r = 0; r < size_; ++r) {
            auto& ch = chans_[kP2PLane][static_cast<size_t>(r)];
            if (!ch.sendq.empty() || !ch.recvq.empty() || (!anyPending_.empty() && ch.conn)) on.push_back({kP2PLane, r});
          }
          Millis to = !p2pActive_.empty() ? p2pActive_.front()->timeout : anyPending_.front()->timeout;
          idle(on, to, "send/recv");
        }
      } catch (const Error& e) {
        for (auto& op : p2pActive_) tele_->opFinished(op->traceId, 0, e.what(), {op->xfer.peer});
        for (auto& op : anyPending_) tele_->opFinished(op->traceId, 0, e.what(), {});
        fail(aborted_ ? abortedError() : globalized(std::current_exception()));
        clearChannels();
      }
      continue;
    }
    if (stop_) break;  // with the token held: nobody runs anything after this
    // Idle: a caller may now run its own op (helpRun).
    release(false);
    held = false;
    // A caller that just got its result often posts the next op at once: poll a moment
    // before sleeping, which saves a wake-up on the latency path.
    pollFor(opts_.config.spinUs, [&] { return queued_.load(std::memory_order_acquire) != 0 || stop_; });
    if (queued_.load(std::memory_order_acquire) != 0 || stop_) continue;
    std::unique_lock<std::mutex> g(mu_);
    cv_.wait_for(g, Millis(100), [&] { return !queue_.empty() || stop_.load() || kick_; });
    kick_ = false;
  }
}

// Sends and receives: each is one transfer on the p2p lane, matched in posting order per peer.
void CommImpl::startP2P(std::unique_ptr<Op> op) {
  if (p2pActive_.empty() && anyPending_.empty()) lastProgress_ = Clock::now();
  tele_->opStarted(op->traceId, op->p2p ? 0 : op->fp.seq);
  if (op->anySource) {
    anyPending_.push_back(std::move(op));
    return;
  }
  Channel& ch = chans_[kP2PLane][static_cast<size_t>(op->xfer.peer)];
  (op->xfer.kind == Transfer::kSend ? ch.sendq : ch.recvq).push_back(&op->xfer);
  p2pActive_.push_back(std::move(op));
}

size_t CommImpl::progressP2P() {
  size_t moved = 0;
  // A receive from any source takes the first peer whose next message is a matching send.
  for (auto it = anyPending_.begin(); it != anyPending_.end();) {
    Op& op = **it;
    int got = -1;
    for (int r = 0; r < size_ && got < 0; ++r) {
      if (r == rank_) continue;
      Channel& ch = chans_[kP2PLane][static_cast<size_t>(r)];
      if (!ch.recvq.empty()) continue;
      try {
        if (readHeader(ch, moved) && ch.inHdr.tag == op.xfer.hdr.tag) got = r;
      } catch (const Error& e) {
        if (e.code() == ErrorCode::kPeerFailure) peerFailed(r, e.what());
        throw;
      }
    }
    if (got < 0) {
      ++it;
      continue;
    }
    op.xfer.peer = got;
    op.req->setSourceRank(got);
    chans_[kP2PLane][static_cast<size_t>(got)].recvq.push_back(&op.xfer);
    p2pActive_.push_back(std::move(*it));
    it = anyPending_.erase(it);
  }
  for (int r = 0; r < size_; ++r) {
    Channel& ch = chans_[kP2PLane][static_cast<size_t>(r)];
    if (!ch.sendq.empty() || !ch.recvq.empty()) moved += progressChannel(kP2PLane, r);
  }
  if (moved) lastProgress_ = Clock::now();
  return moved;
}

void CommImpl::finishP2P() {
  for (auto it = p2pActive_.begin(); it != p2pActive_.end();) {
    if ((*it)->xfer.finished) {
      const Transfer& t = (*it)->xfer;
      tele_->opBytes((*it)->traceId, t.peer, t.kind == Transfer::kSend ? t.done : 0, t.kind == Transfer::kSend ? 0 : t.done);
      tele_->opFinished((*it)->traceId, 0, "", {});
      (*it)->req->finish(nullptr);
      it = p2pActive_.erase(it);
    } else {
      ++it;
    }
  }
}

bool CommImpl::readHeader(Channel& ch, size_t& moved) {
  while (ch.inHdrGot < sizeof(WireHeader)) {
    size_t k = ch.conn->recv(reinterpret_cast<char*>(&ch.inHdr) + ch.inHdrGot, sizeof(WireHeader) - ch.inHdrGot);
    if (k == 0) return false;
    ch.inHdrGot += k;
    moved += k;
  }
  return true;
}

void CommImpl::checkHeader(const Transfer& t, const WireHeader& h, int peer) {
  if (h.magic != kWireMagic)
    RAILCC_THROW(kInternal, "corrupt message from ", peerName(peer), " (bad magic ", h.magic, ")");
  const WireHeader& e = t.hdr;
  bool same = h.kind == e.kind;
  if (same && e.kind == static_cast<uint8_t>(OpKind::kP2P)) {
    if (h.tag != e.tag || h.bytes != e.bytes) same = false;
  } else if (same) {
    same = h.seq == e.seq && h.dtype == e.dtype && h.redop == e.redop && h.root == e.root && h.count == e.count &&
           h.bytes == e.bytes;
  }
  if (same) return;
  Error err(ErrorCode::kMismatch,
            "collective mismatch between " + rankName(rank_) + " and " + peerName(peer) +
                ":\n  " + rankName(rank_) + " called " + describeCall(e) + (e.kind == h.kind &&
                e.kind != static_cast<uint8_t>(OpKind::kP2P) && h.seq == e.seq && h.bytes != e.bytes
                ? " expecting " + std::to_string(e.bytes) + " bytes from it" : "") +
                "\n  " + rankName(peer) + " called " + describeCall(h) +
                (h.bytes != e.bytes ? " sending " + std::to_string(h.bytes) + " bytes" : ""));
  err.ranks = {rank_, peer};
  err.hosts = {peers_[static_cast<size_t>(rank_)].hostname, peers_[static_cast<size_t>(peer)].hostname};
  err.seq = static_cast<long long>(e.seq);
  err.op = opKindName(static_cast<OpKind>(e.kind));
  throw err;
}

size_t CommImpl::progressSend(Channel& ch, Transfer& t) {
  size_t moved = 0;
  while (t.hdrDone < sizeof(WireHeader)) {
    size_t k = ch.conn->send(reinterpret_cast<const char*>(&t.hdr) + t.hdrDone, sizeof(WireHeader) - t.hdrDone);
    if (k == 0) return moved;
    t.hdrDone += k;
    moved += k;
  }
  while (t.done < t.bytes) {
    size_t upto = t.limit ? std::min(t.bytes, *t.limit) : t.bytes;
    if (t.done >= upto) return moved;
    size_t k = ch.conn->send(t.src + t.done, upto - t.done);
    if (k == 0) return moved;
    t.done += k;
    moved += k;
  }
  static const char zeros[8] = {0};
  size_t pad = pad8(t.bytes) - t.bytes;
  while (t.padDone < pad) {
    size_t k = ch.conn->send(zeros, pad - t.padDone);
    if (k == 0) return moved;
    t.padDone += k;
    moved += k;
  }
  t.finished = true;
  return moved;
}

size_t CommImpl::progressRecv(Channel& ch, Transfer& t) {
  size_t moved = 0;
  if (t.kind == Transfer::kRecv) {
    while (t.done < t.bytes) {
      size_t k;
      if (t.bypassCache) {
        // In pieces, each consumed at once, so the producer refills behind this copy.
        auto [src, avail] = ch.conn->peek();
        k = std::min({avail, t.bytes - t.done, size_t(256) << 10});
        if (k) {
          transport::streamCopy(t.dst + t.done, src, k);
          ch.conn->consume(k);
        }
      } else {
        k = ch.conn->recv(t.dst + t.done, t.bytes - t.done);
      }
      if (k == 0) return moved;
      t.done += k;
      moved += k;
    }
  } else {
    size_t es = dtypeSize(t.dtype);
    while (t.done < t.bytes) {
      if (ch.carryGot > 0) {  // finish an element split across socket reads
        size_t k = ch.conn->recv(ch.carry + ch.carryGot, es - ch.carryGot);
        if (k == 0) return moved;
        ch.carryGot += k;
        moved += k;
        if (ch.carryGot < es) return moved;
        reduceInto(t.dst + t.done, ch.carry, 1, t.dtype, t.op, t.scale);
        t.done += es;
        ch.carryGot = 0;
        continue;
      }
      auto [p, avail] = ch.conn->peek();
      // In pieces, so that the sender can refill the FIFO while this reduces.
      size_t want = std::min({avail, t.bytes - t.done, size_t(256u << 10)});
      size_t whole = want / es * es;
      if (whole == 0) {
        if (want == 0) return moved;
        std::memcpy(ch.carry, p, want);
        ch.carryGot = want;
        ch.conn->consume(want);
        moved += want;
        continue;
      }
      reduceInto(t.dst + t.done, p, whole / es, t.dtype, t.op, t.scale);
      ch.conn->consume(whole);
      t.done += whole;
      moved += whole;
    }
  }
  size_t pad = pad8(t.bytes) - t.bytes;
  char sink[8];
  while (t.padDone < pad) {
    size_t k = ch.conn->recv(sink, pad - t.padDone);
    if (k == 0) return moved;
    t.padDone += k;
    moved += k;
  }
  t.finished = true;
  return moved;
}

size_t CommImpl::progressChannel(int lane, int peer) {
  try {
    return progressChannelImpl(lane, peer);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kPeerFailure) peerFailed(peer, e.what());
    throw;
  }
}

size_t CommImpl::progressChannelImpl(int lane, int peer) {
  Channel& ch = chans_[lane][static_cast<size_t>(peer)];
  size_t moved = 0;
  while (!ch.sendq.empty()) {
    Transfer& t = *ch.sendq.front();
    bool fresh = t.hdrDone == 0;
    size_t k = progressSend(ch, t);
    if (fresh && k > 0) t.began = Clock::now();
    moved += k;
    if (!t.finished) break;
    sampleLink(t, true);
    ch.sendq.pop_front();
  }
  while (!ch.recvq.empty()) {
    Transfer& t = *ch.recvq.front();
    if (!t.matched) {
      if (!readHeader(ch, moved)) break;
      checkHeader(t, ch.inHdr, peer);
      t.matched = true;
      t.began = Clock::now();
      if (lane == kCollLane && arrivals_[static_cast<size_t>(peer)] == 0)
        arrivals_[static_cast<size_t>(peer)] = ch.inHdr.startUs;
    }
    moved += progressRecv(ch, t);
    if (!t.finished) break;
    sampleLink(t, false);
    ch.recvq.pop_front();
    ch.inHdrGot = 0;
  }
  return moved;
}

// Runs the transfers of one collective step to completion, keeping the p2p lane moving.
void CommImpl::exchange(std::vector<Transfer>& xs) {
  post(xs);
  complete(xs);
}

void CommImpl::post(std::vector<Transfer>& xs) {
  for (auto& t : xs) {
    t.lane = kCollLane;
    if (t.peer == rank_) RAILCC_THROW(kInternal, "transfer to self");
    Channel& ch = chans_[kCollLane][static_cast<size_t>(t.peer)];
    (t.kind == Transfer::kSend ? ch.sendq : ch.recvq).push_back(&t);
  }
}

void CommImpl::complete(std::vector<Transfer>& xs) {
  std::vector<std::pair<int, int>> chans;
  for (auto& t : xs)
    if (std::find(chans.begin(), chans.end(), std::make_pair(kCollLane, t.peer)) == chans.end())
      chans.push_back({kCollLane, t.peer});
  // Bytes per peer go to the flight recorder, and on failure the peers still owed bytes.
  struct Account {
    CommImpl* c;
    std::vector<Transfer>& xs;
    ~Account() {
      if (!c->current_) return;
      for (auto& t : xs) {
        c->tele_->opBytes(c->current_->traceId, t.peer, t.kind == Transfer::kSend ? t.done : 0,
                          t.kind == Transfer::kSend ? 0 : t.done);
        if (!t.finished && std::uncaught_exceptions() > 0 &&
            std::find(c->waitingOn_.begin(), c->waitingOn_.end(), t.peer) == c->waitingOn_.end())
          c->waitingOn_.push_back(t.peer);
      }
    }
  } account{this, xs};
  while (true) {
    size_t moved = 0;
    bool all = true;
    for (auto& [lane, peer] : chans) moved += progressChannel(lane, peer);
    for (auto& t : xs) all = all && t.finished;
    moved += pumpP2P();
    if (all) return;
    if (moved) {
      lastProgress_ = Clock::now();
      continue;
    }
    if (aborted_) RAILCC_THROW(kAborted, abortWhy_);
    std::vector<std::pair<int, int>> on;
    for (auto& t : xs)
      if (!t.finished) on.push_back({kCollLane, t.peer});
    idle(on, current_->timeout, opKindName(current_->kind));
  }
}

void CommImpl::idle(const std::vector<std::pair<int, int>>& waitOn, Millis timeout, const char* what,
                    const std::function<bool()>& alsoReady) {
  auto now = Clock::now();
  if (stop_ && now - lastProgress_ > Millis(1000))
    RAILCC_THROW(kAborted, what, " was still pending when the process group was shut down");
  if (now - lastProgress_ > timeout) {
    std::vector<Transfer*> pending;
    for (auto& [lane, peer] : waitOn) {
      Channel& ch = chans_[lane][static_cast<size_t>(peer)];
      if (!ch.sendq.empty()) pending.push_back(ch.sendq.front());
      if (!ch.recvq.empty()) pending.push_back(ch.recvq.front());
    }
    failStalled(pending, timeout);
  }
  // Dead peers on shared memory cannot close anything: look for them a few times a second.
  if (now - lastAliveCheck_ > Millis(200)) {
    lastAliveCheck_ = now;
    for (auto& [lane, peer] : waitOn) {
      try {
        chans_[lane][static_cast<size_t>(peer)].conn->checkAlive();
      } catch (const Error& e) {
        peerFailed(peer, e.what());
      }
    }
  }
  // Spin briefly (a peer is usually microseconds away), then sleep so that ranks sharing a
  // core do not starve the one that has work.
  auto anyReady = [&] {
    if (alsoReady && alsoReady()) return true;
    for (auto& [lane, peer] : waitOn) {
      Channel& ch = chans_[lane][static_cast<size_t>(peer)];
      if (ch.conn->pollFd() >= 0) continue;
      if (!ch.recvq.empty() && ch.conn->peek().second > 0) return true;
      if (!ch.sendq.empty() && hasBytesToSend(*ch.sendq.front()) && ch.conn->canSend()) return true;
    }
    return queued_.load() > 0;
  };
  if (pollFor(opts_.config.spinUs, anyReady)) return;
  std::vector<pollfd> fds;
  bool hasShm = false;
  for (auto& [lane, peer] : waitOn) {
    Channel& ch = chans_[lane][static_cast<size_t>(peer)];
    int fd = ch.conn->pollFd();
    if (fd < 0) {
      hasShm = true;
      continue;
    }
    short ev = 0;
    if (!ch.sendq.empty()) ev |= POLLOUT;
    if (!ch.recvq.empty() || lane == kP2PLane) ev |= POLLIN;
    fds.push_back({fd, ev, 0});
  }
  sleeping_.store(true);
  if (!fds.empty()) {
    fds.push_back({wakeFd_.fd, POLLIN, 0});
    if (queued_.load() == 0) poll(fds.data(), fds.size(), hasShm ? 1 : 100);
    uint64_t v;
    if (read(wakeFd_.fd, &v, sizeof(v)) < 0) { /* nothing pending */ }
  } else if (shm_) {
    // The timeout only bounds how late abort, liveness and timeout checks can run.
    shm_->sleep(100000, [&] { return anyReady(); });
  }
  sleeping_.store(false);
}

void CommImpl::failStalled(const std::vector<Transfer*>& pending, Millis timeout) {
  std::ostringstream os;
  os << (current_ ? opKindName(current_->kind) : "send/recv");
  if (current_) os << " (seq " << current_->fp.seq << ")";
  os << " made no progress for " << timeout.count() << " ms; waiting on:";
  std::vector<int> ranks;
  std::vector<std::string> hosts;
  for (Transfer* t : pending) {
    os << "\n  " << (t->kind == Transfer::kSend ? "sending to " : "receiving from ") << peerName(t->peer) << ", "
       << t->done << " of " << t->bytes << " bytes moved";
    ranks.push_back(t->peer);
    hosts.push_back(peers_[static_cast<size_t>(t->peer)].hostname);
  }
  if (current_) {
    // Which ranks never called this op, which froze, which joined and are stuck: from the
    // progress records every rank publishes.
    std::vector<int> culprits;
    os << describePeerProgress(current_->fp.seq, culprits);
    if (!culprits.empty()) {
      ranks = culprits;
      hosts.clear();
      for (int r : ranks) hosts.push_back(peers_[static_cast<size_t>(r)].hostname);
    }
  }
  Error err(ErrorCode::kTimeout, os.str());
  err.ranks = ranks;
  err.hosts = hosts;
  if (current_) {
    err.seq = static_cast<long long>(current_->fp.seq);
    err.op = opKindName(current_->kind);
  }
  throw err;
}

void CommImpl::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!aborted_) abortWhy_ = why;
    aborted_ = true;
  }
  fail(abortedError());
  cv_.notify_all();
  ringSelf();
  uint64_t one = 1;
  if (write(wakeFd_.fd, &one, sizeof(one)) < 0) { /* best effort */ }
}

void CommImpl::shutdown() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closing_ && !thread_.joinable()) return;
    closing_ = true;
  }
  if (thread_.joinable()) {
    // The progress thread finishes what is queued and then exits; ops that stop moving for a
    // second after this point are failed with kAborted, so shutdown never hangs.
    stop_ = true;
    cv_.notify_all();
    thread_.join();
  }
  // Every request is finished now; the callbacks they handed over run to their end (new ops
  // they queue fail at once: closing_ is set).
  userPool_->shutdown(Millis(5000));
  if (watchdog_.joinable()) {
    std::unique_lock<std::mutex> g(wd_->mu);
    wd_->stop = true;
    wd_->cv.notify_all();
    // A watchdog blocked in an unreachable store must not hold up destroy_process_group: it
    // never touches the communicator once `stop` is set, so it can be left to finish alone.
    // Without a keep-alive the store is the caller's, and may go right after us: always join.
    if (!wd_->keep || wd_->cv.wait_for(g, Millis(2000), [&] { return wd_->exited; })) {
      wd_->cv.wait(g, [&] { return wd_->exited; });
      g.unlock();
      watchdog_.join();
    } else {
      g.unlock();
      RAILCC_WARN(WATCHDOG, "the watchdog thread is blocked in the c10d store; leaving it behind");
      watchdog_.detach();
    }
  }
  {
    // abort() may run now on another thread (a watchdog, work.wait(timeout)): it touches the
    // channels and the shared memory only under connMu_.
    std::lock_guard<std::mutex> g(connMu_);
    chans_.clear();
    shm_.reset();
  }
  releaseDevice();
}

// ---------------------------------------------------------------------------------------
// Watchdog: progress records, stragglers, flight-recorder dumps

namespace {

// Reads a number that follows "key": in a flat JSON record we wrote ourselves.
bool jsonNumber(const std::string& doc, const char* key, long long& out) {
  std::string k = std::string("\"") + key + "\": ";
  auto pos = doc.find(k);
  if (pos == std::string::npos) return false;
  out = std::strtoll(doc.c_str() + pos + k.size(), nullptr, 10);
  return true;
}

std::string jsonText(const std::string& doc, const char* key) {
  std::string k = std::string("\"") + key + "\": \"";
  auto pos = doc.find(k);
  if (pos == std::string::npos) return "";
  auto end = doc.find('"', pos + k.size());
  return doc.substr(pos + k.size(), end - pos - k.size());
}

std::string transportKind(const std::string& t) { return t.substr(0, t.find(' ')); }

char processState(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(f, line);
  auto rp = line.rfind(')');
  return rp != std::string::npos && rp + 2 < line.size() ? line[rp + 2] : '?';
}

std::string fmt(const char* f, double v) {
  char buf[64];
  snprintf(buf, sizeof(buf), f, v);
  return buf;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

}  // namespace

std::string CommImpl::progressRecord() const {
  Telemetry::Progress p = tele_->progress();
  std::ostringstream os;
  os << "{\"rank\": " << rank_ << ", \"pid\": " << getpid() << ", \"wall_us\": " << wallMicros()
     << ", \"enqueued\": " << p.enqueued << ", \"started\": " << p.started << ", \"completed\": " << p.completed
     << ", \"last_op\": " << jsonString(p.lastOp) << ", \"slow_links\": [";
  std::lock_guard<std::mutex> g(wdMu_);
  bool first = true;
  for (const auto& [peer, send] : linkFlagged_) {
    os << (first ? "" : ", ") << "{\"src\": " << (send ? rank_ : peer) << ", \"dst\": " << (send ? peer : rank_) << "}";
    first = false;
  }
  os << "]}";
  return os.str();
}

bool CommImpl::storeTryGet(const std::string& key, Millis wait, std::string& out) {
  if (store_->lost()) return false;  // its host has exited: nothing to read, and no noise
  if (!wd_->keep) {  // a store the caller owns (tests): read in place, it cannot be left behind
    try {
      out = store_->get(key, wait);
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }
  struct Slot {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false, ok = false;
    std::string value;
  };
  auto slot = std::make_shared<Slot>();
  try {
    std::thread([slot, store = wd_->keep, key, wait] {
    std::string v;
    bool ok = false;
    try {
      v = store->get(key, wait);
      ok = true;
    } catch (const std::exception&) {
    }
    std::lock_guard<std::mutex> g(slot->mu);
    slot->done = true;
    slot->ok = ok;
    slot->value = std::move(v);
    slot->cv.notify_all();
    }).detach();
  } catch (const std::system_error&) {
    return false;  // no thread to spare (helpers stuck in a dead store): go without the value
  }
  std::unique_lock<std::mutex> g(slot->mu);
  if (!slot->cv.wait_for(g, wait + Millis(100), [&] { return slot->done; })) return false;
  out = slot->value;
  return slot->ok;
}

void CommImpl::watchdogLoop(std::shared_ptr<WatchdogShared> w) {
  log::setThreadRank(rank_);
  const int rank = rank_;
  const bool stragglers = opts_.config.stragglerAction != "off";
  const bool records = opts_.config.progressIntervalMs > 0;
  const Millis every(records ? opts_.config.progressIntervalMs : 1000);
  bool storeGone = false;
  auto nextBeat = Clock::now() + every;
  while (true) {
    std::vector<std::pair<std::string, std::string>> todo;
    {
      std::unique_lock<std::mutex> g(w->mu);
      w->cv.wait_until(g, nextBeat, [&] { return w->stop || !w->publish.empty(); });
      todo.swap(w->publish);
      if (w->stop) {  // from here on the communicator may be gone: only the queued reports go out
        g.unlock();
        for (auto& [key, value] : todo) {
          if (storeGone || w->store->lost()) break;
          try {
            w->store->set(key, value);
          } catch (const std::exception&) {
          }
        }
        break;
      }
      if (Clock::now() >= nextBeat) {
        nextBeat = Clock::now() + every;
        if (stragglers) checkStragglers();
        if (records) todo.push_back({"progress/" + std::to_string(rank), progressRecord()});
      }
    }
    if (!storeGone && w->store->lost()) {
      storeGone = true;
      RAILCC_WARN(WATCHDOG, "the c10d store is gone (its host, usually rank 0 or the launcher, has exited): no more "
                  "progress records or failure reports through it; peer failures are still found by the transports");
    }
    for (auto& [key, value] : todo) {
      if (storeGone) break;
      try {
        w->store->set(key, value);
      } catch (const std::exception& e) {
        // The store's host is gone (it usually dies with rank 0 or the launcher): stop all
        // background traffic through it, which would only fail again, each time noisily.
        std::string what = e.what();
        RAILCC_WARN(WATCHDOG, "could not write '", key, "' to the c10d store, so railcc stops its background store "
                    "traffic (progress records, failure reports): ", what.substr(0, what.find('\n')));
        storeGone = true;
        break;
      }
    }
    {
      std::lock_guard<std::mutex> g(w->mu);
      w->drained = w->publish.empty();
    }
    w->cv.notify_all();
  }
  std::lock_guard<std::mutex> g(w->mu);
  w->exited = true;
  w->cv.notify_all();
}

void CommImpl::checkStragglers() {
  std::lock_guard<std::mutex> serial(stragglerMu_);  // the watchdog and straggler_report() both call this
  const Config& cfg = opts_.config;
  bool raise = cfg.stragglerAction == "raise";
  std::vector<std::string> news;
  std::vector<int> newRanks;
  // Compute stragglers: ranks that arrive last, by far, collective after collective.
  auto lags = tele_->lags();
  double limit = static_cast<double>(cfg.stragglerLagMs) * 1000.0;
  int minOps = static_cast<int>(std::min<int64_t>(8, cfg.stragglerWindow));
  for (size_t r = 0; r < lags.size(); ++r) {
    const auto& l = lags[r];
    std::vector<double> others;  // the typical rank, this one left out (with 2 ranks: the other)
    for (size_t q = 0; q < lags.size(); ++q)
      if (q != r && lags[q].ops > 0) others.push_back(lags[q].meanUs);
    double med = median(others);
    bool bad = l.ops >= minOps && l.meanUs > limit && l.meanUs > 4 * med;
    if (bad && !lagFlagged_[r]) {
      news.push_back(rankName(r) + " (host " + peers_[r].hostname + ") is a straggler: it entered the last " +
                     std::to_string(l.ops) + " collectives " + fmt("%.1f", l.meanUs / 1000) + " ms after the first rank on average (max " +
                     fmt("%.1f", l.maxUs / 1000) + " ms; median rank " + fmt("%.1f", med / 1000) + " ms)");
      newRanks.push_back(static_cast<int>(r));
    }
    if (bad) lagFlagged_[r] = true;
    else if (l.meanUs < limit / 2) lagFlagged_[r] = false;
  }
  // Slow links: far below the median link of the same transport.
  auto links = tele_->links();
  auto byKind = ratesByClass(links);
  std::set<std::pair<int, bool>> flagged;
  for (auto& l : links) {
    auto& all = byKind[linkClass(l)];
    double m = median(all);
    if (l.samples < kMinLinkSamples || all.size() < 2 || l.gbps() >= m * static_cast<double>(cfg.stragglerLinkPct) / 100.0) continue;
    flagged.insert({l.peer, l.send});
    std::lock_guard<std::mutex> g(wdMu_);
    if (linkFlagged_.count({l.peer, l.send})) continue;
    int src = l.send ? rank_ : l.peer, dst = l.send ? l.peer : rank_;
    news.push_back("slow link: rank " + std::to_string(src) + " -> rank " + std::to_string(dst) + " (" +
                   peers_[src].hostname + " -> " + peers_[dst].hostname + ", " + peers_[l.peer].transport + ") moves " +
                   fmt("%.3f", l.gbps()) + " GB/s against a median of " + fmt("%.3f", m) + " GB/s over the " +
                   std::to_string(all.size()) + " " + linkClass(l) + " links of rank " + std::to_string(rank_));
    newRanks.push_back(l.peer);
  }
  std::lock_guard<std::mutex> g(wdMu_);
  linkFlagged_ = flagged;
  for (auto& m : news) RAILCC_WARN(WATCHDOG, m);
  if (raise && !news.empty()) {
    stragglerMsg_.clear();
    for (auto& m : news) stragglerMsg_ += (stragglerMsg_.empty() ? "" : "\n") + m;
    stragglerRanks_ = newRanks;
  }
}

std::string CommImpl::stragglerReport() {
  checkStragglers();
  std::ostringstream os;
  auto lags = tele_->lags();
  os << "{\"rank\": " << rank_ << ", \"window\": " << opts_.config.stragglerWindow << ", \"ranks\": [";
  {
    std::lock_guard<std::mutex> g(wdMu_);
    for (size_t r = 0; r < lags.size(); ++r)
      os << (r ? ", " : "") << "{\"rank\": " << r << ", \"host\": " << jsonString(peers_[r].hostname)
         << ", \"lag_us_mean\": " << fmt("%.1f", lags[r].meanUs) << ", \"lag_us_max\": " << fmt("%.1f", lags[r].maxUs)
         << ", \"ops\": " << lags[r].ops << ", \"straggler\": " << (lagFlagged_[r] ? "true" : "false") << "}";
  }
  os << "], \"links\": [";
  auto links = tele_->links();
  auto byKind = ratesByClass(links);
  std::set<std::pair<int, int>> slow;
  bool first = true;
  for (auto& l : links) {
    std::string kind = transportKind(peers_[l.peer].transport);
    double m = median(byKind[linkClass(l)]);
    int src = l.send ? rank_ : l.peer, dst = l.send ? l.peer : rank_;
    bool isSlow;
    {
      std::lock_guard<std::mutex> g(wdMu_);
      isSlow = linkFlagged_.count({l.peer, l.send}) > 0;
    }
    if (isSlow) slow.insert({src, dst});
    os << (first ? "" : ", ") << "{\"src\": " << src << ", \"dst\": " << dst << ", \"src_host\": "
       << jsonString(peers_[src].hostname) << ", \"dst_host\": " << jsonString(peers_[dst].hostname)
       << ", \"transport\": " << jsonString(kind) << ", \"bytes\": " << l.bytes << ", \"samples\": " << l.samples << ", \"gbps\": " << fmt("%.4f", l.gbps())
       << ", \"median_gbps\": " << fmt("%.4f", m) << ", \"slow\": " << (isSlow ? "true" : "false") << "}";
    first = false;
  }
  // Slow links other ranks found (published with their progress records).
  if (opts_.config.progressIntervalMs > 0) {
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      std::string rec;
      if (!storeTryGet("progress/" + std::to_string(r), Millis(20), rec)) continue;
      size_t pos = 0;
      while ((pos = rec.find("{\"src\": ", pos)) != std::string::npos) {
        long long a = std::strtoll(rec.c_str() + pos + 8, nullptr, 10), b = -1;
        jsonNumber(rec.substr(pos, rec.find('}', pos) - pos + 1), "dst", b);
        if (a >= 0 && a < size_ && b >= 0 && b < size_) slow.insert({static_cast<int>(a), static_cast<int>(b)});
        ++pos;
      }
    }
  }
  os << "], \"stragglers\": [";
  first = true;
  {
    std::lock_guard<std::mutex> g(wdMu_);
    for (size_t r = 0; r < lagFlagged_.size(); ++r)
      if (lagFlagged_[r]) {
        os << (first ? "" : ", ") << r;
        first = false;
      }
  }
  os << "], \"slow_links\": [";
  first = true;
  for (auto& [a, b] : slow) {
    os << (first ? "" : ", ") << "{\"src\": " << a << ", \"dst\": " << b << ", \"src_host\": " << jsonString(peers_[a].hostname)
       << ", \"dst_host\": " << jsonString(peers_[b].hostname) << "}";
    first = false;
  }
  os << "]}";
  return os.str();
}

std::string CommImpl::describePeerProgress(uint64_t seq, std::vector<int>& culprits) {
  if (opts_.config.progressIntervalMs <= 0) return "";
  std::ostringstream os;
  std::vector<int> never, frozen, joined;
  int64_t now = wallMicros();
  int64_t staleUs = 3 * opts_.config.progressIntervalMs * 1000 + 1000000;
  auto deadline = Clock::now() + Millis(2000);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const PeerInfo& p = peers_[static_cast<size_t>(r)];
    std::string rec;
    auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    if (left.count() <= 0) {
      os << "\n  (no time left to read the progress of ranks " << r << " and up: the store is slow)";
      break;
    }
    if (!storeTryGet("progress/" + std::to_string(r), std::max(Millis(1), std::min(Millis(100), left)), rec)) {
      os << "\n  " << rankName(r) << " (host " << p.hostname << ") has no progress record in the store";
      frozen.push_back(r);
      continue;
    }
    long long enq = 0, comp = 0, wall = 0;
    jsonNumber(rec, "enqueued", enq);
    jsonNumber(rec, "completed", comp);
    jsonNumber(rec, "wall_us", wall);
    if (comp >= static_cast<long long>(seq)) continue;
    double age = static_cast<double>(now - wall) / 1e6;
    bool stale = now - wall > staleUs;
    bool stopped = p.hostId == peers_[static_cast<size_t>(rank_)].hostId && processState(p.pid) == 'T';
    std::string last = jsonText(rec, "last_op");
    std::string lastCall = "seq " + std::to_string(enq) + (enq > 0 && !last.empty() ? " (" + last + ")" : "");
    os << "\n  " << rankName(r) << " (host " << p.hostname << ") ";
    if (stopped || stale) {
      // Its record is old: whether it reached this op is unknown, but it is not running.
      os << (stopped ? "is frozen: its process " + std::to_string(p.pid) + " is stopped (SIGSTOP or a debugger)"
                     : "is frozen or unreachable: it stopped reporting (SIGSTOP, debugger, swap storm, or hung "
                       "outside railcc)")
         << "; its last report, " << fmt("%.1f", age) << " s ago, said its last call was " << lastCall;
      frozen.push_back(r);
    } else if (enq < static_cast<long long>(seq)) {
      os << "never called seq " << seq << ": its last call was " << lastCall
         << "; it is alive and reporting, so it is still in code before this call";
      never.push_back(r);
    } else {
      os << "joined seq " << seq << " but has not finished it";
      joined.push_back(r);
    }
  }
  culprits = !never.empty() ? never : frozen;
  {
    std::ostringstream js;
    js << "{";
    bool first = true;
    for (auto* group : {&never, &frozen, &joined})
      for (int r : *group) {
        js << (first ? "" : ", ") << "\"" << r << "\": \""
           << (group == &never ? "never_called" : group == &frozen ? "frozen" : "joined") << "\"";
        first = false;
      }
    js << "}";
    std::lock_guard<std::mutex> g(wdMu_);
    peerProgressJson_ = js.str();
  }
  std::string body = os.str();
  return body.empty() ? "" : "\nprogress of the other ranks:" + body;
}

std::string CommImpl::traceJson(const std::string& reason) const {
  std::ostringstream os;
  Telemetry::Progress p = tele_->progress();
  os << "{\n  \"version\": 1, \"group\": " << jsonString(opts_.name) << ", \"rank\": " << rank_ << ", \"size\": " << size_
     << ", \"host\": " << jsonString(hostname_) << ", \"pid\": " << getpid() << ",\n  \"dumped_at_us\": " << wallMicros()
     << ", \"reason\": " << jsonString(reason) << ",\n  \"error\": ";
  std::exception_ptr broken;
  {
    std::lock_guard<std::mutex> g(errMu_);
    broken = broken_;
  }
  if (!broken) {
    os << "null";
  } else {
    try {
      std::rethrow_exception(broken);
    } catch (const Error& e) {
      std::string code = errorCodeName(e.code());
      std::transform(code.begin(), code.end(), code.begin(), ::tolower);
      if (code == "peerfailure") code = "peer_failure";
      os << "{\"code\": " << jsonString(code) << ", \"message\": " << jsonString(e.what()) << ", \"ranks\": [";
      for (size_t i = 0; i < e.ranks.size(); ++i) os << (i ? ", " : "") << e.ranks[i];
      os << "], \"hosts\": [";
      for (size_t i = 0; i < e.hosts.size(); ++i) os << (i ? ", " : "") << jsonString(e.hosts[i]);
      os << "], \"seq\": " << (e.seq < 0 ? std::string("null") : std::to_string(e.seq))
         << ", \"op\": " << (e.op.empty() ? std::string("null") : jsonString(e.op)) << "}";
    } catch (const std::exception& e) {
      os << "{\"code\": \"internal\", \"message\": " << jsonString(e.what()) << "}";
    }
  }
  os << ",\n  \"progress\": {\"enqueued\": " << p.enqueued << ", \"started\": " << p.started
     << ", \"completed\": " << p.completed << "},\n  \"peers\": [";
  for (size_t r = 0; r < peers_.size(); ++r)
    os << (r ? ", " : "") << "{\"rank\": " << r << ", \"host\": " << jsonString(peers_[r].hostname)
       << ", \"transport\": " << jsonString(static_cast<int>(r) == rank_ ? "self" : peers_[r].transport) << "}";
  auto lags = tele_->lags();
  const auto& mine = lags[static_cast<size_t>(rank_)];
  os << "],\n  \"ops\": " << tele_->opsJson() << ",\n  \"links\": " << tele_->linksJson()
     << ",\n  \"arrival\": {\"lag_us_mean\": " << fmt("%.1f", mine.meanUs) << ", \"lag_us_max\": " << fmt("%.1f", mine.maxUs)
     << ", \"last_count\": " << mine.ops << "},\n  \"lags\": " << tele_->lagsJson();
  {
    std::lock_guard<std::mutex> g(wdMu_);
    os << ",\n  \"peer_progress\": " << peerProgressJson_ << "\n}\n";
  }
  return os.str();
}

std::string CommImpl::writeTrace(const std::string& reason, const std::string& dirArg) const {
  std::lock_guard<std::mutex> serial(traceMu_);
  std::string dir = dirArg.empty() ? opts_.config.traceDir : dirArg;
  if (dir.empty()) return "";
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
    RAILCC_THROW(kSystem, "cannot create RAILCC_TRACE_DIR ", dir, ": ", detail::errnoString());
  std::string group = opts_.name.empty() ? "default" : opts_.name;
  for (char& c : group)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') c = '_';
  std::string path = dir + "/railcc-trace-" + group + "-rank" + std::to_string(rank_) + ".json";
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << traceJson(reason);
    if (!f) RAILCC_THROW(kSystem, "writing ", tmp, " failed");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) RAILCC_THROW(kSystem, "renaming ", tmp, ": ", detail::errnoString());
  return path;
}

// ---------------------------------------------------------------------------------------
// Algorithms. Direct, pairwise schedules: at step s rank r sends to r+s and receives from
// r-s, so every step pairs distinct peers and the order of every reduction is fixed.

namespace {
struct Blocks {
  size_t base, rem, es;
  Blocks(size_t count, int n, size_t esize) : base(count / static_cast<size_t>(n)), rem(count % static_cast<size_t>(n)), es(esize) {}
  size_t count(int i) const { return base + (static_cast<size_t>(i) < rem ? 1 : 0); }
  size_t offset(int i) const { return (base * static_cast<size_t>(i) + std::min(static_cast<size_t>(i), rem)) * es; }
};
}  // namespace

void CommImpl::oneshotReduce(const std::function<const char*(int)>& blockOf, char* out, size_t count, DataType dt,
                             ReduceOp op, double scale) {
  int n = size_, r = rank_;
  size_t bytes = count * dtypeSize(dt), stride = pad8(bytes);
  if (scratch_.size() < stride * static_cast<size_t>(n)) scratch_.resize(stride * static_cast<size_t>(n));
  char* sc = scratch_.data();
  auto slot = [&](int p) { return sc + stride * static_cast<size_t>(p); };
  std::vector<Transfer> xs;
  xs.reserve(2 * static_cast<size_t>(n));
  for (int p = 0; p < n; ++p)
    if (p != r) {
      xs.push_back(sendTo(p, blockOf(p), bytes));
      xs.push_back(recvFrom(p, slot(p), bytes));
    }
  std::memcpy(slot(r), blockOf(r), bytes);  // `out` may alias our own block
  exchange(xs);
  if (op == ReduceOp::kPremulSum) scaleCopy(out, slot(0), count, dt, scale);
  else std::memcpy(out, slot(0), bytes);
  for (int p = 1; p < n; ++p) reduceInto(out, slot(p), count, dt, op, scale);
  if (op == ReduceOp::kAvg) divideBy(out, count, dt, n);
}

// Broadcast when every rank shares this host: an all-gather through the rings in which only
// the root's piece is not empty. The root writes each byte once and every other rank copies it
// out (n copies of the data in all; a chain of FIFOs makes 2(n-1)).
//
// Every rank sends its call's header to every other rank and checks theirs after the data has
// moved: each waits for one event (the root's data, or for the root the ring's space) instead
// of two (every header, then the data), which on shared cores is one wake-up fewer per rank on
// the critical path. A rank that disagrees (count, dtype, root, another op) makes every rank
// that checks its header fail, the root included, and the root's failure reaches a rank that
// waits on the wrong ring. The header receives are posted before the ring and read while it
// runs, so a rank that took the FIFO chain instead (a root whose count is at most
// RAILCC_ONESHOT_BYTES when ours is larger) fails the rank it sends to at once. Only a
// broadcast larger than the ring has the root wait for the headers first: its writes wait for
// every reader to make room, and a rank reading another ring never would.
void CommImpl::runBroadcastRing(char* buf, size_t bytes, int root) {
  std::vector<size_t> sizes(static_cast<size_t>(size_), 0);
  std::vector<char*> outs(static_cast<size_t>(size_), nullptr);
  sizes[static_cast<size_t>(root)] = bytes;
  outs[static_cast<size_t>(root)] = buf;
  if (rank_ == root && bytes > shm_->bcastRing(-1).capacity()) {
    syncRound();
    return runAllgatherRing(buf, sizes, outs, false);
  }
  std::vector<Transfer> sends, recvs;
  headerRound(sends, recvs);
  exchange(sends);
  post(recvs);
  runAllgatherRing(buf, sizes, outs, false);
  complete(recvs);
}

namespace {
int positionIn(const std::vector<int>& g, int r) {
  return static_cast<int>(std::find(g.begin(), g.end(), r) - g.begin());
}
}  // namespace

void CommImpl::pairwiseReduceScatter(const std::vector<int>& g, char* buf, size_t count, DataType dt, ReduceOp op,
                                     double scale) {
  const int m = static_cast<int>(g.size()), i = positionIn(g, rank_);
  const size_t es = dtypeSize(dt);
  Blocks b(count, m, es);
  char* mine = buf + b.offset(i);
  if (op == ReduceOp::kPremulSum) scaleCopy(mine, mine, b.count(i), dt, scale);
  for (int s = 1; s < m; ++s) {
    int to = (i + s) % m, from = (i - s + m) % m;
    std::vector<Transfer> xs{sendTo(g[static_cast<size_t>(to)], buf + b.offset(to), b.count(to) * es),
                             recvReduce(g[static_cast<size_t>(from)], mine, b.count(i), dt, op, scale)};
    exchange(xs);
  }
}

void CommImpl::pairwiseAllgather(const std::vector<int>& g, char* buf, size_t count, size_t es) {
  const int m = static_cast<int>(g.size()), i = positionIn(g, rank_);
  Blocks b(count, m, es);
  for (int s = 1; s < m; ++s) {
    int to = (i + s) % m, from = (i - s + m) % m;
    std::vector<Transfer> xs{sendTo(g[static_cast<size_t>(to)], buf + b.offset(i), b.count(i) * es),
                             recvFrom(g[static_cast<size_t>(from)], buf + b.offset(from), b.count(from) * es)};
    exchange(xs);
  }
}

void CommImpl::runAllreduce(char* buf, size_t count, DataType dt, ReduceOp op, double scale) {
  int n = size_, r = rank_;
  size_t es = dtypeSize(dt);
  if (oneshot(count * es)) return oneshotReduce([buf](int) { return buf; }, buf, count, dt, op, scale);
  if (ringsCover() && ringSlice() > 0) return runAllreduceRings(buf, count, dt, op, scale);
  if (!rail_.empty()) return runAllreduceHosts(buf, count, dt, op, scale);
  std::vector<int> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  pairwiseReduceScatter(all, buf, count, dt, op, scale);
  Blocks b(count, n, es);
  char* mine = buf + b.offset(r);
  if (op == ReduceOp::kAvg) divideBy(mine, b.count(r), dt, n);
  if (ringsCover()) {
    // The reduce-scatter above already checked every peer's fingerprint.
    std::vector<size_t> sizes(static_cast<size_t>(n));
    std::vector<char*> outs(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p) {
      sizes[static_cast<size_t>(p)] = b.count(p) * es;
      outs[static_cast<size_t>(p)] = buf + b.offset(p);
    }
    return runAllgatherRing(mine, sizes, outs, false);
  }
  pairwiseAllgather(all, buf, count, es);
}

// All-reduce across hosts that each run the same number of ranks: reduce-scatter among the
// ranks of each host (shared memory), all-reduce each host's piece among the ranks that hold
// it on every host (one rail: the network), then all-gather on each host again. Every rank
// sends S/L bytes over the network where the flat pairwise schedule sends about S (L ranks
// per host, S the buffer's size), and each element is reduced once, by one rank, so every
// rank ends with the same bits. Each rank checks the headers of its host's ranks and of its
// rail; a rank that disagrees fails those, and their failure reaches the rest.
void CommImpl::runAllreduceHosts(char* buf, size_t count, DataType dt, ReduceOp op, double scale) {
  const size_t es = dtypeSize(dt);
  const int L = static_cast<int>(localRanks_.size()), H = static_cast<int>(rail_.size());
  Blocks b(count, L, es);
  const int li = localIndex(rank_);
  char* piece = buf + b.offset(li);
  const size_t pc = b.count(li);
  pairwiseReduceScatter(localRanks_, buf, count, dt, op, scale);
  // The host's partial results are already scaled; an average divides once, at the end.
  ReduceOp across = op == ReduceOp::kPremulSum || op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  pairwiseReduceScatter(rail_, piece, pc, dt, across, 1.0);
  if (op == ReduceOp::kAvg) {
    Blocks c(pc, H, es);
    const int hi = positionIn(rail_, rank_);
    divideBy(piece + c.offset(hi), c.count(hi), dt, size_);
  }
  pairwiseAllgather(rail_, piece, pc, es);
  pairwiseAllgather(localRanks_, buf, count, es);
}

CommImpl::Rings CommImpl::rings() {
  Rings r;
  r.own = shm_->bcastRing(-1);
  r.of.resize(static_cast<size_t>(size_));
  r.myIdx = localIndex(rank_);
  for (int p = 0; p < size_; ++p)
    if (p != rank_) {
      r.of[static_cast<size_t>(p)] = shm_->bcastRing(localIndex(p));
      r.consumers.push_back(localIndex(p));
      r.wake.push_back(shm_->headerOf(localIndex(p)));
      r.on.push_back({kCollLane, p});
    }
  return r;
}

void CommImpl::ringTurn(const Rings& r, size_t moved, const std::function<bool()>& ready) {
  for (auto& [lane, peer] : r.on)
    if (!chans_[lane][static_cast<size_t>(peer)].recvq.empty()) moved += progressChannel(lane, peer);
  if (moved + pumpP2P() > 0) {
    lastProgress_ = Clock::now();
    return;
  }
  if (aborted_) RAILCC_THROW(kAborted, abortWhy_);
  idle(r.on, current_->timeout, opKindName(current_->kind), ready);
}

// Reductions when every rank shares this host, through the broadcast rings, in chunks. Per
// chunk k each rank q owns a piece of `count(k, q)` elements; `in(k, q)` is our input for it
// and `out(k, q)` where it ends. Each rank writes into its ring the pieces its peers reduce
// (block A: every piece but its own, in rank order), then reduces its own piece in one pass,
// in rank order, straight out of the peers' rings. With `gather` (all-reduce) it then writes
// that result into its ring (block B) and copies every peer's result out of theirs. Each ring
// carries A0 B0 A1 B1 ... (A0 A1 ... without gather); a peer may write A(k+1) while we still
// copy its B(k). For a 4-rank all-reduce of 16 MiB each rank reads and writes about 76 MiB
// where the pairwise reduce-scatter and ring all-gather moved 92 (n-1 reduction passes, each
// reading and writing the accumulator), with two waits per chunk instead of n. Headers are
// checked while the data moves, as in the ring broadcast.
struct CommImpl::RingReduce {
  size_t nchunks;  // every chunk but the last has the same counts
  std::function<size_t(size_t, int)> count;
  std::function<const char*(size_t, int)> in;
  std::function<char*(size_t, int)> out;
  bool gather;
};

void CommImpl::runRingsReduce(const RingReduce& job, DataType dt, ReduceOp op, double scale, bool bypass) {
  const int n = size_, me = rank_;
  const size_t es = dtypeSize(dt), nchunks = job.nchunks, blocks = job.gather ? 2 : 1;
  Rings rs = rings();
  transport::shm::BcastRing& own = rs.own;
  const int myIdx = rs.myIdx;
  std::vector<transport::shm::BcastRing>& peerRing = rs.of;
  std::vector<Transfer> sends, recvs;
  headerRound(sends, recvs);
  exchange(sends);
  post(recvs);

  // Piece sizes of a chunk, worked out once for the full chunks and once for the last.
  struct Layout {
    std::vector<size_t> bytes, before;  // piece q's bytes, and those of pieces 0..q-1
    size_t total = 0;
  };
  auto layoutOf = [&](size_t k) {
    Layout l;
    for (int q = 0; q < n; ++q) {
      l.before.push_back(l.total);
      l.bytes.push_back(job.count(k, q) * es);
      l.total += l.bytes.back();
    }
    return l;
  };
  const Layout full = layoutOf(0), last = layoutOf(nchunks ? nchunks - 1 : 0);
  auto layout = [&](size_t k) -> const Layout& { return k + 1 == nchunks ? last : full; };
  auto bytes = [&](size_t k, int q) { return layout(k).bytes[static_cast<size_t>(q)]; };
  // Block A of producer p: every piece but p's, in rank order.
  auto offsetInA = [&](size_t k, int p, int q) {
    const Layout& l = layout(k);
    return l.before[static_cast<size_t>(q)] - (p < q ? l.bytes[static_cast<size_t>(p)] : 0);
  };
  auto bytesA = [&](size_t k, int p) { return layout(k).total - bytes(k, p); };

  size_t written = 0, reduced = 0;  // own blocks written (A0 B0 A1 ... or A0 A1 ...), chunks reduced
  std::vector<size_t> read(static_cast<size_t>(n), 0);  // blocks of each peer consumed
  read[static_cast<size_t>(me)] = blocks * nchunks;
  auto done = [&] {
    if (written < blocks * nchunks || reduced < nchunks) return false;
    for (size_t x : read)
      if (x < blocks * nchunks) return false;
    return true;
  };
  // The peers' A blocks of chunk `reduced`, once every one is there (and our own is written).
  auto inputsReady = [&] {
    if (reduced >= nchunks || written <= blocks * reduced) return false;
    for (int p = 0; p < n; ++p)
      if (p != me && (read[static_cast<size_t>(p)] != blocks * reduced ||
                      !peerRing[static_cast<size_t>(p)].block(myIdx, bytesA(reduced, p))))
        return false;
    return true;
  };
  // Our next block, once there is room for it (B only after its chunk is reduced).
  auto nextWrite = [&](bool commit) {
    if (written >= blocks * nchunks) return false;
    size_t k = written / blocks;
    bool isA = written % blocks == 0;
    if (!isA && reduced <= k) return false;
    size_t len = isA ? bytesA(k, me) : bytes(k, me);
    char* dst = own.reserve(len, rs.consumers);
    if (!dst || !commit) return dst != nullptr;
    if (isA) {
      for (int q = 0; q < n; ++q)
        if (q != me) std::memcpy(dst + offsetInA(k, me, q), job.in(k, q), bytes(k, q));
    } else {
      std::memcpy(dst, job.out(k, me), len);
    }
    own.publish(len, rs.wake);
    ++written;
    return true;
  };
  // A peer's result B(k), once it is there.
  auto resultOf = [&](int p) -> const char* {
    size_t x = read[static_cast<size_t>(p)];
    if (!job.gather || p == me || x % 2 == 0 || x >= 2 * nchunks) return nullptr;
    return peerRing[static_cast<size_t>(p)].block(myIdx, bytes(x / 2, p));
  };
  while (!done()) {
    size_t moved = 0;
    if (nextWrite(true)) moved += 1;
    if (inputsReady()) {
      size_t k = reduced, cnt = bytes(k, me) / es;
      char* out = job.out(k, me);
      const char* mine = job.in(k, me);
      if (op == ReduceOp::kPremulSum) scaleCopy(out, mine, cnt, dt, scale);
      else if (out != mine) std::memmove(out, mine, cnt * es);
      for (int p = 0; p < n; ++p) {
        if (p == me) continue;
        auto& from = peerRing[static_cast<size_t>(p)];
        reduceInto(out, from.block(myIdx, bytesA(k, p)) + offsetInA(k, p, me), cnt, dt, op, scale);
        from.release(myIdx, bytesA(k, p));
        ++read[static_cast<size_t>(p)];
      }
      if (op == ReduceOp::kAvg) divideBy(out, cnt, dt, n);
      ++reduced;
      moved += cnt * es + 1;
    }
    for (int p = 0; p < n; ++p) {
      const char* src = resultOf(p);
      if (!src) continue;
      size_t k = read[static_cast<size_t>(p)] / 2, len = bytes(k, p);
      if (bypass) transport::streamCopy(job.out(k, p), src, len);
      else std::memcpy(job.out(k, p), src, len);
      peerRing[static_cast<size_t>(p)].release(myIdx, len);
      ++read[static_cast<size_t>(p)];
      moved += len + 1;
    }
    ringTurn(rs, moved, [&] {
      if (nextWrite(false) || inputsReady()) return true;
      for (int p = 0; p < n; ++p)
        if (resultOf(p)) return true;
      return false;
    });
  }
  complete(recvs);
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    size_t sent = 0, got = 0;  // p reads its piece of our A (and our B); we read ours of its
    for (size_t k = 0; k < nchunks; ++k) {
      sent += bytes(k, p) + (job.gather ? bytes(k, me) : 0);
      got += bytes(k, me) + (job.gather ? bytes(k, p) : 0);
    }
    tele_->opBytes(current_->traceId, p, sent, got);
  }
}

void CommImpl::runAllreduceRings(char* buf, size_t count, DataType dt, ReduceOp op, double scale) {
  const size_t es = dtypeSize(dt), chunkElems = ringSlice() / es * static_cast<size_t>(size_);
  auto chunkOf = [=](size_t k) { return Blocks(std::min(chunkElems, count - k * chunkElems), size_, es); };
  auto piece = [=](size_t k, int q) { return buf + k * chunkElems * es + chunkOf(k).offset(q); };
  RingReduce job{(count + chunkElems - 1) / chunkElems, [=](size_t k, int q) { return chunkOf(k).count(q); },
                 piece, piece, true};
  runRingsReduce(job, dt, op, scale, count * es >= streamMin_);
}

void CommImpl::runReduceScatterRings(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op,
                                     double scale) {
  const size_t es = dtypeSize(dt), chunkElems = ringSlice() / es;
  const int me = rank_;
  auto cnt = [=](size_t k) { return std::min(chunkElems, count - k * chunkElems); };
  RingReduce job{(count + chunkElems - 1) / chunkElems, [=](size_t k, int) { return cnt(k); },
                 [=, &ins](size_t k, int q) -> const char* { return ins[static_cast<size_t>(q)] + k * chunkElems * es; },
                 [=](size_t k, int q) -> char* { return q == me ? out + k * chunkElems * es : nullptr; }, false};
  runRingsReduce(job, dt, op, scale, false);
}

// All-gather through the broadcast rings: each rank writes its piece once into its own ring
// and copies every peer's piece out of theirs, n copies of each piece in all where per-peer
// FIFOs make 2(n-1). With `headers`, header-only messages check every peer's call first.
void CommImpl::runAllgatherRing(const char* mine, const std::vector<size_t>& sizes, const std::vector<char*>& outs,
                                bool headers) {
  int n = size_, me = rank_;
  if (headers) syncRound();
  const size_t chunk = 256u << 10;
  Rings rs = rings();
  transport::shm::BcastRing& own = rs.own;
  const int myIdx = rs.myIdx;
  const size_t myBytes = sizes[static_cast<size_t>(me)];
  size_t wrote = 0;
  std::vector<size_t> got(static_cast<size_t>(n), 0);
  got[static_cast<size_t>(me)] = myBytes;
  auto complete = [&] {
    if (wrote < myBytes) return false;
    for (int p = 0; p < n; ++p)
      if (got[static_cast<size_t>(p)] < sizes[static_cast<size_t>(p)]) return false;
    return true;
  };
  while (!complete()) {
    size_t moved = 0;
    if (wrote < myBytes) {
      size_t k = own.write(mine + wrote, std::min(chunk, myBytes - wrote), rs.consumers, rs.wake);
      wrote += k;
      moved += k;
    }
    for (int p = 0; p < n; ++p) {
      size_t want = sizes[static_cast<size_t>(p)] - got[static_cast<size_t>(p)];
      if (p == me || want == 0) continue;
      auto& ring = rs.of[static_cast<size_t>(p)];
      auto [src, avail] = ring.peek(myIdx);
      size_t k = std::min(avail, want);
      if (k == 0) continue;
      if (sizes[static_cast<size_t>(p)] >= streamMin_)
        transport::streamCopy(outs[static_cast<size_t>(p)] + got[static_cast<size_t>(p)], src, k);
      else
        std::memcpy(outs[static_cast<size_t>(p)] + got[static_cast<size_t>(p)], src, k);
      ring.consume(myIdx, k);
      got[static_cast<size_t>(p)] += k;
      moved += k;
    }
    ringTurn(rs, moved, [&] {
      if (wrote < myBytes && own.canWrite(rs.consumers)) return true;
      for (int p = 0; p < n; ++p)
        if (p != me && got[static_cast<size_t>(p)] < sizes[static_cast<size_t>(p)] &&
            rs.of[static_cast<size_t>(p)].readable(myIdx))
          return true;
      return false;
    });
  }
  for (int p = 0; p < n; ++p)
    if (p != me) tele_->opBytes(current_->traceId, p, myBytes, sizes[static_cast<size_t>(p)]);
}

// ---------------------------------------------------------------------------------------
// Communicator: validation on the caller's thread, then the op's body for the progress thread.

Communicator::Communicator(Store& store, CommOptions opts) : impl_(std::make_unique<CommImpl>(store, std::move(opts))) {}
Communicator::~Communicator() = default;
int Communicator::rank() const { return impl_->rank_; }
int Communicator::size() const { return impl_->size_; }
const std::vector<PeerInfo>& Communicator::peers() const { return impl_->peers_; }
const Config& Communicator::config() const { return impl_->opts_.config; }
void Communicator::abort(const std::string& why) { impl_->abort(why); }
void Communicator::poke() { impl_->poke(); }
bool Communicator::wait(const RequestPtr& req, Millis timeout) {
  if (req->completed()) return true;
  if (timeout.count() < 0) impl_->helpRun(req.get());
  else impl_->poke();  // it may have been queued under CallerWaits, with nobody woken for it
  return req->wait(timeout);
}
void Communicator::shutdown() { impl_->shutdown(); }
std::exception_ptr Communicator::brokenError() const {
  std::lock_guard<std::mutex> g(impl_->errMu_);
  return impl_->broken_;
}
std::string Communicator::traceJson(const std::string& reason) const { return impl_->traceJson(reason); }
std::string Communicator::dumpTrace(const std::string& reason, const std::string& dir) const {
  return impl_->writeTrace(reason, dir);
}
std::string Communicator::stragglerReport() { return impl_->stragglerReport(); }
uint64_t Communicator::collectiveCount() const {
  std::lock_guard<std::mutex> g(impl_->mu_);
  return impl_->collSeq_;
}

// ---------------------------------------------------------------------------------------
// Device buffers: pinned staging

void CommImpl::deviceWait(const cuda::DeviceApi& api, void* ev, int device, const char* what) {
  auto t0 = Clock::now();
  Millis limit = current_ ? current_->timeout : opts_.timeout;
  for (int spins = 0;; ++spins) {
    int e = api.eventQuery(ev);
    if (e == 0) return;
    if (e != api.notReady) checkDevice(e, "cudaEventQuery", device);
    if (aborted_) RAILCC_THROW(kAborted, abortWhy_);
    if (Clock::now() - t0 > limit)
      RAILCC_THROW(kTimeout, what, " on cuda:", device, " did not finish within ", limit.count(),
                   " ms: the GPU is hung, or busy with work queued before this op on the caller's stream");
    // The copies take tens of microseconds to milliseconds: poll briefly, then nap.
    if (spins < 64) __builtin_ia32_pause();
    else std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void CommImpl::releaseDevice() {
  if (devOf_ < 0 && !stage_ && ipc_.pool.empty()) return;
  const cuda::DeviceApi* api = nullptr;
  try {
    api = &deviceApi();
  } catch (const Error&) {
    return;
  }
  // Errors are ignored here: at process exit the CUDA runtime may already be gone. This runs
  // on the caller's thread (shutdown), whose current device is put back afterwards.
  int callerDevice = -1;
  api->getDevice(&callerDevice);
  if (devOf_ >= 0) api->setDevice(devOf_);
  // IPC ops may still run on the GPU (they complete once queued): let them finish before the
  // peers' pools are unmapped, but never hang teardown on a GPU that does not.
  if (lastStream_ && stageEv_[0] && api->eventRecord(stageEv_[0], lastStream_) == 0) {
    auto until = Clock::now() + std::chrono::seconds(10);
    while (api->eventQuery(stageEv_[0]) == api->notReady && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  lastStream_ = nullptr;
  releaseIpc(*api, false);
  for (auto& ev : stageEv_)
    if (ev) api->eventDestroy(ev), ev = nullptr;
  if (ownStream_) api->streamDestroy(ownStream_), ownStream_ = nullptr;
  if (stage_) api->hostFree(stage_), stage_ = nullptr;
  stageCap_ = 0;
  devOf_ = -1;
  if (callerDevice >= 0) api->setDevice(callerDevice);
}

CommImpl::DeviceOp CommImpl::beginDevice(const Placement& where) {
  const cuda::DeviceApi& api = deviceApi();
  const int d = where.device;
  checkDevice(api.setDevice(d), "cudaSetDevice", d);
  if (devOf_ != d) {
    // Events and streams belong to one device; a group that moves to another starts afresh.
    for (auto& ev : stageEv_)
      if (ev) api.eventDestroy(ev), ev = nullptr;
    if (ownStream_) api.streamDestroy(ownStream_), ownStream_ = nullptr;
    devOf_ = d;
    lastStream_ = nullptr;
    for (auto& ev : stageEv_) checkDevice(api.eventCreate(&ev), "cudaEventCreate", d);
  }
  void* stream = where.stream;
  if (!stream) {
    if (!ownStream_) checkDevice(api.streamCreate(&ownStream_), "cudaStreamCreate", d);
    stream = ownStream_;
  }
  if (where.waitEvent) checkDevice(api.streamWaitEvent(stream, where.waitEvent), "cudaStreamWaitEvent", d);
  // Ops complete once queued, and what orders one op's writes to the IPC pool after the peers'
  // reads of the op before is that op's stream: a new stream first waits for the last one.
  if (lastStream_ && lastStream_ != stream) {
    checkDevice(api.eventRecord(stageEv_[1], lastStream_), "cudaEventRecord", d);
    checkDevice(api.streamWaitEvent(stream, stageEv_[1]), "cudaStreamWaitEvent (previous op's stream)", d);
  }
  lastStream_ = stream;
  return {d, stream, where.queued && where.stream != nullptr};
}

void CommImpl::runStaged(const DeviceOp& dv, DataType dt, size_t slots, std::vector<Region> regions,
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
    runAllreduce(reinterpret_cast<char*>(&m), 1, DataType::kInt64, ReduceOp::kMax, 1.0);
    maxCount = static_cast<size_t>(m);
  }
  const size_t chunks = std::max<size_t>(1, (maxCount + per - 1) / per);
  const size_t need = 2 * std::max<size_t>(uniq.size(), 1) * stride;
  if (stageCap_ < need) {
    if (stage_) checkDevice(api.hostFree(stage_), "cudaFreeHost", d), stage_ = nullptr, stageCap_ = 0;
    void* p = nullptr;
    checkDevice(api.hostAlloc(&p, need), "cudaHostAlloc (pinned staging)", d);
    stage_ = static_cast<char*>(p);
    stageCap_ = need;
    RAILCC_INFO(COLL, "group '", opts_.name, "': ", need >> 10, " KiB of pinned staging for cuda:", d,
                " (RAILCC_CUDA_STAGING_BYTES=", opts_.config.cudaStagingBytes, ")");
  }
  auto hostOf = [&](size_t set, size_t j) { return stage_ + (set * uniq.size() + j) * stride; };
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
    checkDevice(api.eventRecord(stageEv_[set], stream), "cudaEventRecord", d);
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
    deviceWait(api, stageEv_[set], d, "the copy of a chunk to pinned host memory");
    for (size_t i = 0; i < regions.size(); ++i) {
      host[i] = hostOf(set, slot[i]);
      counts[i] = piece(regions[i].count, k);
    }
    body(host, counts);
    lastProgress_ = Clock::now();
    toDevice(k, set);
  }
  // The op completes once its results are on the device: the staging is then free for the
  // next op, and the caller's buffers are no longer touched.
  checkDevice(api.eventRecord(stageEv_[0], stream), "cudaEventRecord", d);
  deviceWait(api, stageEv_[0], d, "the copy of the result back to the device");
}


// ---------------------------------------------------------------------------------------
// Device buffers: CUDA IPC between the processes of one host

void CommImpl::releaseIpc(const cuda::DeviceApi& api, bool peersDone) {
  const size_t me = static_cast<size_t>(rank_);
  for (size_t r = 0; r < ipc_.pool.size(); ++r) {
    if (r == me) continue;
    if (ipc_.pool[r]) api.ipcCloseMemHandle(ipc_.pool[r]);
    for (void* e : ipc_.ev[r])  // opened event handles are destroyed like local events
      if (e) api.eventDestroy(e);
  }
  if (me < ipc_.pool.size()) {
    // Freeing memory or events that a peer still has open is undefined in CUDA, and a peer's
    // stream may still hold a wait on our events. Only when every peer is known to have
    // closed them are they freed; otherwise they stay until the process exits.
    if (peersDone) {
      if (ipc_.pool[me]) api.deviceFree(ipc_.pool[me]);
      for (void* e : ipc_.ev[me])
        if (e) api.eventDestroy(e);
    } else if (ipc_.pool[me]) {
      RAILCC_INFO(COLL, "group '", opts_.name, "': keeping its ", (4 * ipc_.chunk) >> 10,
                  " KiB CUDA IPC pool until the process exits (peers may still map it)");
    }
  }
  ipc_.pool.clear();
  ipc_.ev.clear();
}

void CommImpl::headerRound(std::vector<Transfer>& sends, std::vector<Transfer>& recvs) {
  sends.reserve(2 * static_cast<size_t>(size_));
  recvs.reserve(static_cast<size_t>(size_));
  for (int p = 0; p < size_; ++p)
    if (p != rank_) {
      sends.push_back(sendTo(p, nullptr, 0));
      recvs.push_back(recvFrom(p, nullptr, 0));
    }
}

void CommImpl::syncRound() {
  std::vector<Transfer> sends, recvs;
  headerRound(sends, recvs);
  sends.insert(sends.end(), recvs.begin(), recvs.end());
  exchange(sends);
}

bool CommImpl::ipcReady(int d) {
  const cuda::DeviceApi& api = deviceApi();
  if (!opts_.config.cudaIpc || size_ < 2 || static_cast<int>(localRanks_.size()) != size_ || !api.ipcGetMemHandle)
    return false;
  if (ipc_.failed) return false;
  if (ipc_.device == d) return true;
  RAILCC_CHECK_ARG(ipc_.device < 0, "a group serves one CUDA device; it used cuda:", ipc_.device, ", now cuda:", d);
  // First CUDA op of the group: map every peer's pool and events. Every rank gets here at the
  // same op, so the handle exchange and the vote below line up.
  ipc_.device = d;
  const size_t n = static_cast<size_t>(size_), me = static_cast<size_t>(rank_);
  ipc_.chunk = std::max<size_t>(static_cast<size_t>(std::max<int64_t>(opts_.config.cudaIpcBytes, 0)) / 4 / 256 * 256,
                                64 << 10);
  ipc_.pool.assign(n, nullptr);
  ipc_.ev.assign(n, {nullptr, nullptr, nullptr});
  bool ok = true;
  std::string why;
  auto attempt = [&](int err, const std::string& call) {
    if (err != 0 && ok) {
      ok = false;
      why = call + " failed: " + (api.errorString ? api.errorString(err) : "?");
    }
  };
  // The blob: ok flag, the two sizes every rank must agree on (they fix the chunking and the
  // number of host rounds, which zero-byte rounds cannot check), then the handles.
  const size_t hb = cuda::kIpcHandleBytes, cfgAt = 1, handlesAt = cfgAt + 2 * sizeof(int64_t);
  const size_t blob = handlesAt + hb * (1 + kIpcEvents);
  std::vector<char> mine(blob, 0), all(blob * n, 0);
  const int64_t cfg[2] = {static_cast<int64_t>(ipc_.chunk), opts_.config.oneshotBytes};
  std::memcpy(mine.data() + cfgAt, cfg, sizeof(cfg));
  void* p = nullptr;
  attempt(api.deviceMalloc(&p, 4 * ipc_.chunk), "cudaMalloc (CUDA IPC pool)");
  ipc_.pool[me] = static_cast<char*>(p);
  for (auto& e : ipc_.ev[me]) attempt(api.ipcEventCreate(&e), "cudaEventCreate (interprocess)");
  if (ok) attempt(api.ipcGetMemHandle(mine.data() + handlesAt, ipc_.pool[me]), "cudaIpcGetMemHandle");
  for (int i = 0; i < kIpcEvents && ok; ++i)
    attempt(api.ipcGetEventHandle(mine.data() + handlesAt + hb * (1 + static_cast<size_t>(i)),
                                  ipc_.ev[me][static_cast<size_t>(i)]),
            "cudaIpcGetEventHandle");
  mine[0] = ok ? 1 : 0;
  {
    std::vector<Transfer> xs;
    for (int q = 0; q < size_; ++q)
      if (q != rank_) {
        xs.push_back(sendTo(q, mine.data(), blob));
        xs.push_back(recvFrom(q, all.data() + blob * static_cast<size_t>(q), blob));
      }
    exchange(xs);
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
    int64_t theirs[2];
    std::memcpy(theirs, all.data() + blob * q + cfgAt, sizeof(theirs));
    if (theirs[0] == cfg[0] && theirs[1] == cfg[1]) continue;
    freeOwn(ipc_.pool[me], ipc_.ev[me]);  // nobody has opened them yet
    ipc_.pool.clear();
    ipc_.ev.clear();
    ipc_.device = -1;
    Error err(ErrorCode::kMismatch,
              "CUDA IPC settings differ between ranks (they must be equal on all ranks): rank " + std::to_string(rank_) +
                  " has RAILCC_CUDA_IPC_BYTES=" + std::to_string(opts_.config.cudaIpcBytes) + " (chunk " +
                  std::to_string(cfg[0]) + " B) and RAILCC_ONESHOT_BYTES=" + std::to_string(cfg[1]) + ", rank " +
                  std::to_string(q) + " a chunk of " + std::to_string(theirs[0]) + " B and RAILCC_ONESHOT_BYTES=" +
                  std::to_string(theirs[1]));
    err.ranks = {rank_, static_cast<int>(q)};
    throw err;
  }
  for (size_t q = 0; q < n && ok; ++q) {
    if (q == me) continue;
    const char* b = all.data() + blob * q;
    if (b[0] != 1) {
      ok = false;
      why = rankName(q) + " could not set up its side";
      break;
    }
    void* mp = nullptr;
    attempt(api.ipcOpenMemHandle(&mp, b + handlesAt), "cudaIpcOpenMemHandle (rank " + std::to_string(q) + ")");
    ipc_.pool[q] = static_cast<char*>(mp);
    for (size_t i = 0; i < kIpcEvents && ok; ++i)
      attempt(api.ipcOpenEventHandle(&ipc_.ev[q][i], b + handlesAt + hb * (1 + i)),
              "cudaIpcOpenEventHandle (rank " + std::to_string(q) + ")");
    int pd = -1, can = 0;
    if (ok) attempt(api.pointerDevice(ipc_.pool[q], &pd), "cudaPointerGetAttributes");
    if (ok && pd != d) {
      attempt(api.canAccessPeer(d, pd, &can), "cudaDeviceCanAccessPeer");
      if (ok && !can) {
        ok = false;
        why = "cuda:" + std::to_string(d) + " cannot access the memory of rank " + std::to_string(q) + "'s GPU directly";
      }
    }
  }
  // Every rank must take the same path, so one vote decides.
  int64_t vote = ok ? 1 : 0;
  runAllreduce(reinterpret_cast<char*>(&vote), 1, DataType::kInt64, ReduceOp::kMin, 1.0);
  if (vote == 0) {
    RAILCC_WARN(COLL, "group '", opts_.name, "': CUDA IPC is not usable (",
                why.empty() ? std::string("another rank could not set it up") : why,
                "); collectives on CUDA tensors are staged through pinned host memory");
    // Peers close their mappings of our pool, then one more round before anyone frees.
    const size_t mine = static_cast<size_t>(rank_);
    char* own = ipc_.pool[mine];
    auto ownEv = ipc_.ev[mine];
    ipc_.pool[mine] = nullptr;
    ipc_.ev[mine] = {nullptr, nullptr, nullptr};
    releaseIpc(api, false);
    syncRound();
    freeOwn(own, ownEv);
    ipc_.failed = true;
    return false;
  }
  RAILCC_INFO(COLL, "group '", opts_.name, "': CUDA IPC on cuda:", d, ", ", (4 * ipc_.chunk) >> 10,
              " KiB of device memory per rank (RAILCC_CUDA_IPC_BYTES)");
  return true;
}

void CommImpl::runIpcAllreduce(const DeviceOp& dv, const std::vector<std::pair<char*, size_t>>& segs, DataType dt,
                               ReduceOp op, double scale) {
  const cuda::DeviceApi& api = deviceApi();
  const int d = dv.device;
  void* stream = dv.stream;
  const size_t n = static_cast<size_t>(size_), me = static_cast<size_t>(rank_), es = dtypeSize(dt);
  size_t count = 0;
  for (auto& sg : segs) count += sg.second;
  const size_t per = ipc_.chunk / es;
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
  if (oneshot(count * es) && count <= per) {
    auto in = [&](size_t q) { return ipc_.pool[q]; };
    char* out = ipc_.pool[me] + ipc_.chunk;
    stageIn(in(me), 0, count);
    ipcStep(api, stream, d, kIpcIn);
    ipcReduceRanks(api, dv, out, in, count, dt, op, scale);
    overlap(0, count, [&](char* p, size_t at, size_t len) {
      check(api.memcpyAsync(p, out + at * es, len * es, stream), "cudaMemcpyAsync (result out of the pool)");
    });
    // Peers read our input buffer until they pass this step.
    ipcStep(api, stream, d, kIpcDone);
    lastProgress_ = Clock::now();
    return ipcFinish(api, dv, "the CUDA IPC all-reduce");
  }
  for (size_t k = 0; k < chunks; ++k) {
    const size_t off = k * per, m = count > off ? std::min(per, count - off) : 0;
    auto in = [&](size_t q) { return ipc_.pool[q] + (k & 1) * 2 * ipc_.chunk; };
    auto red = [&](size_t q) { return in(q) + ipc_.chunk; };
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
    lastProgress_ = Clock::now();
  }
  ipcFinish(api, dv, "the CUDA IPC all-reduce");
}

void CommImpl::ipcReduceRanks(const cuda::DeviceApi& api, const DeviceOp& dv, char* out,
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

void CommImpl::ipcSlotChunks(const cuda::DeviceApi& api, const DeviceOp& dv, const char* in, size_t count, size_t es,
                             bool stage,
                             const std::function<void(const std::function<char*(size_t)>&, size_t, size_t)>& use) {
  const size_t me = static_cast<size_t>(rank_), per = 2 * ipc_.chunk / es;
  const size_t chunks = std::max<size_t>(1, (count + per - 1) / per);
  for (size_t k = 0; k < chunks; ++k) {
    const size_t off = k * per, m = count > off ? std::min(per, count - off) : 0;
    auto slot = [&](size_t q) { return ipc_.pool[q] + (k & 1) * 2 * ipc_.chunk; };
    if (stage && m)
      checkDevice(api.memcpyAsync(slot(me), in + off * es, m * es, dv.stream), "cudaMemcpyAsync (into the IPC pool)", dv.device);
    ipcStep(api, dv.stream, dv.device, kIpcIn);
    if (m) use(slot, off, m);
    ipcStep(api, dv.stream, dv.device, kIpcDone);
    lastProgress_ = Clock::now();
  }
}

// The root alone reduces the ranks' slots, straight into its buffer (its own contribution is
// already in its slot); the other ranks' buffers are left as they were.
void CommImpl::runIpcReduce(const DeviceOp& dv, char* buf, size_t count, DataType dt, ReduceOp op, double scale,
                            int root) {
  const cuda::DeviceApi& api = deviceApi();
  const size_t es = dtypeSize(dt);
  ipcSlotChunks(api, dv, buf, count, es, true, [&](const std::function<char*(size_t)>& slot, size_t off, size_t m) {
    if (rank_ == root) ipcReduceRanks(api, dv, buf + off * es, slot, m, dt, op, scale);
  });
  ipcFinish(api, dv, "the CUDA IPC reduce");
}

void CommImpl::runIpcGather(const DeviceOp& dv, const char* in, size_t count, DataType dt, const std::vector<char*>& outs,
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

void CommImpl::runIpcScatter(const DeviceOp& dv, const std::vector<char*>& ins, char* out, size_t count, DataType dt,
                             int root) {
  const cuda::DeviceApi& api = deviceApi();
  const int d = dv.device;
  void* stream = dv.stream;
  const size_t n = static_cast<size_t>(size_), me = static_cast<size_t>(rank_), es = dtypeSize(dt);
  const size_t per = std::max<size_t>(2 * ipc_.chunk / n / es, 1);  // n pieces of a chunk fill the root's slot
  const size_t chunks = std::max<size_t>(1, (count + per - 1) / per);
  for (size_t k = 0; k < chunks; ++k) {
    const size_t off = k * per, m = count > off ? std::min(per, count - off) : 0;
    // piece j of the root's slot: what rank j receives
    auto piece = [&](size_t j) { return ipc_.pool[static_cast<size_t>(root)] + (k & 1) * 2 * ipc_.chunk + j * per * es; };
    if (rank_ == root && m)
      for (size_t j = 0; j < n; ++j)
        checkDevice(api.memcpyAsync(piece(j), ins[j] + off * es, m * es, stream), "cudaMemcpyAsync (into the IPC pool)", d);
    ipcStep(api, stream, d, kIpcIn);
    if (m) checkDevice(api.memcpyAsync(out + off * es, piece(me), m * es, stream), "cudaMemcpyAsync (root's piece)", d);
    ipcStep(api, stream, d, kIpcDone);
    lastProgress_ = Clock::now();
  }
  ipcFinish(api, dv, "the CUDA IPC scatter");
}

void CommImpl::runIpcAllgather(const DeviceOp& dv, const char* in, size_t count, DataType dt,
                               const std::vector<char*>& outs) {
  const cuda::DeviceApi& api = deviceApi();
  const size_t es = dtypeSize(dt);
  ipcSlotChunks(api, dv, in, count, es, true, [&](const std::function<char*(size_t)>& slot, size_t off, size_t m) {
    for (size_t q = 0; q < outs.size(); ++q)
      checkDevice(api.memcpyAsync(outs[q] + off * es, slot(q), m * es, dv.stream), "cudaMemcpyAsync (peer's piece)", dv.device);
  });
  ipcFinish(api, dv, "the CUDA IPC all-gather");
}

void CommImpl::runIpcReduceScatter(const DeviceOp& dv, const std::vector<char*>& ins, char* out, size_t count,
                                   DataType dt, ReduceOp op, double scale) {
  const cuda::DeviceApi& api = deviceApi();
  const int d = dv.device;
  void* stream = dv.stream;
  const size_t n = static_cast<size_t>(size_), me = static_cast<size_t>(rank_), es = dtypeSize(dt);
  const size_t per = std::max<size_t>(2 * ipc_.chunk / n / es, 1);  // n pieces of a chunk fill a slot
  const size_t chunks = std::max<size_t>(1, (count + per - 1) / per);
  for (size_t k = 0; k < chunks; ++k) {
    const size_t off = k * per, m = count > off ? std::min(per, count - off) : 0;
    // piece j of rank q's slot: rank q's contribution to rank j's result
    auto piece = [&](size_t q, size_t j) { return ipc_.pool[q] + (k & 1) * 2 * ipc_.chunk + j * m * es; };
    for (size_t j = 0; j < n; ++j)
      if (m) checkDevice(api.memcpyAsync(piece(me, j), ins[j] + off * es, m * es, stream), "cudaMemcpyAsync (into the IPC pool)", d);
    ipcStep(api, stream, d, kIpcIn);
    ipcReduceRanks(api, dv, out + off * es, [&](size_t q) { return piece(q, me); }, m, dt, op, scale);
    ipcStep(api, stream, d, kIpcDone);
    lastProgress_ = Clock::now();
  }
  ipcFinish(api, dv, "the CUDA IPC reduce-scatter");
}

void CommImpl::runIpcBroadcast(const DeviceOp& dv, char* buf, size_t count, DataType dt, int root) {
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

void CommImpl::runIpcAlltoall(const DeviceOp& dv, const std::vector<char*>& ins, const std::vector<size_t>& inCounts,
                              const std::vector<char*>& outs, const std::vector<size_t>& outCounts, DataType dt) {
  const cuda::DeviceApi& api = deviceApi();
  const int d = dv.device;
  void* stream = dv.stream;
  const size_t n = static_cast<size_t>(size_), me = static_cast<size_t>(rank_), es = dtypeSize(dt);
  const size_t per = std::max<size_t>(2 * ipc_.chunk / n / es, 1);  // n pieces of a chunk fill a slot
  // Splits differ per rank: agree on the number of chunks first.
  int64_t most = 0;
  for (size_t j = 0; j < n; ++j) most = std::max<int64_t>(most, static_cast<int64_t>(std::max(inCounts[j], outCounts[j])));
  runAllreduce(reinterpret_cast<char*>(&most), 1, DataType::kInt64, ReduceOp::kMax, 1.0);
  const size_t chunks = std::max<size_t>(1, (static_cast<size_t>(most) + per - 1) / per);
  auto part = [&](size_t count, size_t k) {
    size_t lo = k * per;
    return lo >= count ? size_t(0) : std::min(per, count - lo);
  };
  for (size_t k = 0; k < chunks; ++k) {
    // piece j of rank q's slot: what rank q sends rank j, elements [k*per, k*per + per)
    auto piece = [&](size_t q, size_t j) { return ipc_.pool[q] + (k & 1) * 2 * ipc_.chunk + j * per * es; };
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
    lastProgress_ = Clock::now();
  }
  ipcFinish(api, dv, "the CUDA IPC all-to-all");
}

namespace {
void checkRoot(int root, int size, const char* what) {
  RAILCC_CHECK_ARG(root >= 0 && root < size, what, ": root rank ", root, " is out of range for a group of size ", size);
}
}  // namespace

RequestPtr Communicator::allreduce(void* buf, size_t count, DataType dt, ReduceOp op, double scale, Millis timeout,
                                   Placement where) {
  checkReduceSupported(op, dt);
  CommImpl* c = impl_.get();
  auto o = c->collective(OpKind::kAllreduce, dt, op, 0, count, timeout);
  auto run = [c, dt, op, scale](char* b, size_t n) { c->runAllreduce(b, n, dt, op, scale); };
  o->device = where.onDevice();
  if (o->device)
    o->body = [c, where, buf, count, dt, op, scale, run] {
      auto dv = c->beginDevice(where);
      if (c->ipcReady(dv.device))
        return c->runIpcAllreduce(dv, {{static_cast<char*>(buf), count}}, dt, op, scale);
      c->runStaged(dv, dt, 1, {{static_cast<char*>(buf), count, true, true}},
                   [&](const std::vector<char*>& h, const std::vector<size_t>& n) { run(h[0], n[0]); });
    };
  else
    o->body = [buf, count, run] { run(static_cast<char*>(buf), count); };
  return c->enqueue(std::move(o));
}

namespace {
// Fuses small buffers into buckets of RAILCC_BUCKET_SIZE; one all-reduce per bucket.
void coalescedAllreduce(CommImpl* c, const std::vector<char*>& bufs, const std::vector<size_t>& counts, DataType dt,
                        ReduceOp op, double scale) {
  size_t es = dtypeSize(dt);
  size_t cap = static_cast<size_t>(std::max<int64_t>(c->opts_.config.bucketSize, 1)) / es * es;
  size_t i = 0;
  while (i < bufs.size()) {
    // A tensor that fills a bucket alone is reduced in place; smaller ones are packed.
    if (counts[i] * es >= cap || cap == 0) {
      c->runAllreduce(bufs[i], counts[i], dt, op, scale);
      ++i;
      continue;
    }
    if (c->bucket_.size() < cap) c->bucket_.resize(cap);
    size_t j = i, used = 0;
    while (j < bufs.size() && used + counts[j] * es <= cap) {
      if (counts[j]) std::memcpy(c->bucket_.data() + used, bufs[j], counts[j] * es);
      used += counts[j] * es;
      ++j;
    }
    c->runAllreduce(c->bucket_.data(), used / es, dt, op, scale);
    used = 0;
    for (size_t k = i; k < j; ++k) {
      if (counts[k]) std::memcpy(bufs[k], c->bucket_.data() + used, counts[k] * es);
      used += counts[k] * es;
    }
    i = j;
  }
}
}  // namespace

RequestPtr Communicator::allreduceCoalesced(std::vector<void*> bufs, std::vector<size_t> counts, DataType dt,
                                            ReduceOp op, double scale, Millis timeout, Placement where) {
  checkReduceSupported(op, dt);
  RAILCC_CHECK_ARG(bufs.size() == counts.size(), "allreduce_coalesced: ", bufs.size(), " buffers but ", counts.size(), " counts");
  CommImpl* c = impl_.get();
  size_t total = 0;
  for (size_t n : counts) total += n;
  auto o = c->collective(OpKind::kAllreduceCoalesced, dt, op, 0, total, timeout);
  std::vector<char*> ptrs;
  for (void* b : bufs) ptrs.push_back(static_cast<char*>(b));
  o->device = where.onDevice();
  if (o->device)
    o->body = [c, where, ptrs, counts, dt, op, scale] {
      auto dv = c->beginDevice(where);
      if (c->ipcReady(dv.device)) {
        std::vector<std::pair<char*, size_t>> segs;
        for (size_t i = 0; i < ptrs.size(); ++i) segs.push_back({ptrs[i], counts[i]});
        return c->runIpcAllreduce(dv, segs, dt, op, scale);
      }
      std::vector<CommImpl::Region> regs;
      for (size_t i = 0; i < ptrs.size(); ++i) regs.push_back({ptrs[i], counts[i], true, true});
      c->runStaged(dv, dt, regs.size(), regs, [&](const std::vector<char*>& h, const std::vector<size_t>& n) {
        coalescedAllreduce(c, h, n, dt, op, scale);
      });
    };
  else
    o->body = [c, ptrs, counts, dt, op, scale] { coalescedAllreduce(c, ptrs, counts, dt, op, scale); };
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::broadcast(void* buf, size_t count, DataType dt, int root, Millis timeout, Placement where) {
  CommImpl* c = impl_.get();
  checkRoot(root, c->size_, "broadcast");
  auto o = c->collective(OpKind::kBroadcast, dt, ReduceOp::kSum, root, count, timeout);
  auto run = [c, dt, root](char* buf, size_t count) {
    int n = c->size_, r = c->rank_;
    if (n == 1) return;
    size_t bytes = count * dtypeSize(dt);
    if (c->ringsCover() && static_cast<int64_t>(bytes) > c->opts_.config.oneshotBytes)
      return c->runBroadcastRing(buf, bytes, root);
    int pos = (r - root + n) % n;
    // A pipelined chain: each rank forwards bytes as soon as they arrive.
    std::vector<Transfer> xs;
    xs.reserve(2);
    if (pos > 0) xs.push_back(c->recvFrom((r - 1 + n) % n, buf, bytes));
    if (pos < n - 1) {
      xs.push_back(c->sendTo((r + 1) % n, buf, bytes));
      if (pos > 0) xs.back().limit = &xs.front().done;
    }
    c->exchange(xs);
  };
  o->device = where.onDevice();
  if (o->device)
    o->body = [c, where, buf, count, dt, root, run] {
      auto dv = c->beginDevice(where);
      if (c->ipcReady(dv.device)) return c->runIpcBroadcast(dv, static_cast<char*>(buf), count, dt, root);
      bool isRoot = c->rank_ == root;
      c->runStaged(dv, dt, 1, {{static_cast<char*>(buf), count, isRoot, !isRoot}},
                   [&](const std::vector<char*>& h, const std::vector<size_t>& n) { run(h[0], n[0]); });
    };
  else
    o->body = [buf, count, run] { run(static_cast<char*>(buf), count); };
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::reduce(void* buf, size_t count, DataType dt, ReduceOp op, int root, double scale, Millis timeout,
                                Placement where) {
  checkReduceSupported(op, dt);
  CommImpl* c = impl_.get();
  checkRoot(root, c->size_, "reduce");
  auto o = c->collective(OpKind::kReduce, dt, op, root, count, timeout);
  auto run = [c, dt, op, root, scale](char* buf, size_t count) {
    int n = c->size_, r = c->rank_;
    size_t bytes = count * dtypeSize(dt);
    if (r != root) {
      std::vector<Transfer> xs{c->sendTo(root, buf, bytes)};
      c->exchange(xs);
      return;
    }
    if (op == ReduceOp::kPremulSum) scaleCopy(buf, buf, count, dt, scale);
    for (int s = 1; s < n; ++s) {
      std::vector<Transfer> xs{c->recvReduce((root + s) % n, buf, count, dt, op, scale)};
      c->exchange(xs);
    }
    if (op == ReduceOp::kAvg) divideBy(buf, count, dt, n);
  };
  o->device = where.onDevice();
  if (o->device)
    o->body = [c, where, buf, count, dt, op, root, scale, run] {
      auto dv = c->beginDevice(where);
      if (c->ipcReady(dv.device)) return c->runIpcReduce(dv, static_cast<char*>(buf), count, dt, op, scale, root);
      c->runStaged(dv, dt, 1, {{static_cast<char*>(buf), count, true, c->rank_ == root}},
                   [&](const std::vector<char*>& h, const std::vector<size_t>& n) { run(h[0], n[0]); });
    };
  else
    o->body = [buf, count, run] { run(static_cast<char*>(buf), count); };
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::allgather(const void* in, size_t count, DataType dt, std::vector<void*> outs, Millis timeout,
                                   Placement where) {
  CommImpl* c = impl_.get();
  RAILCC_CHECK_ARG(static_cast<int>(outs.size()) == c->size_, "allgather: ", outs.size(),
                   " output buffers for a group of size ", c->size_);
  auto o = c->collective(OpKind::kAllgather, dt, ReduceOp::kSum, 0, count, timeout);
  auto run = [c, dt](const char* in, size_t count, const std::vector<char*>& outs) {
    int n = c->size_, r = c->rank_;
    size_t bytes = count * dtypeSize(dt);
    if (outs[static_cast<size_t>(r)] != in && bytes) std::memmove(outs[static_cast<size_t>(r)], in, bytes);
    if (c->ringsCover() && static_cast<int64_t>(bytes) > c->opts_.config.oneshotBytes)
      return c->runAllgatherRing(in, std::vector<size_t>(outs.size(), bytes), outs, true);
    // Every peer at once: one synchronization instead of n-1, and nothing is reduced, so the
    // order in which the pieces land does not matter.
    std::vector<Transfer> xs;
    xs.reserve(2 * static_cast<size_t>(n));
    for (int s = 1; s < n; ++s) {
      int to = (r + s) % n, from = (r - s + n) % n;
      xs.push_back(c->sendTo(to, in, bytes));
      xs.push_back(c->recvFrom(from, outs[static_cast<size_t>(from)], bytes));
    }
    c->exchange(xs);
  };
  std::vector<char*> o8;
  for (void* p : outs) o8.push_back(static_cast<char*>(p));
  char* in8 = const_cast<char*>(static_cast<const char*>(in));
  o->device = where.onDevice();
  if (o->device)
    o->body = [c, where, in8, count, dt, o8, run] {
      auto dv = c->beginDevice(where);
      if (c->ipcReady(dv.device)) return c->runIpcAllgather(dv, in8, count, dt, o8);
      std::vector<CommImpl::Region> regs{{in8, count, true, false}};
      for (char* p : o8) regs.push_back({p, count, false, true});
      c->runStaged(dv, dt, o8.size() + 1, regs, [&](const std::vector<char*>& h, const std::vector<size_t>& n) {
        run(h[0], n[0], std::vector<char*>(h.begin() + 1, h.end()));
      });
    };
  else
    o->body = [in8, count, o8, run] { run(in8, count, o8); };
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::reduceScatter(std::vector<const void*> ins, void* out, size_t count, DataType dt, ReduceOp op,
                                       double scale, Millis timeout, Placement where) {
  checkReduceSupported(op, dt);
  CommImpl* c = impl_.get();
  RAILCC_CHECK_ARG(static_cast<int>(ins.size()) == c->size_, "reduce_scatter: ", ins.size(),
                   " input buffers for a group of size ", c->size_);
  auto o = c->collective(OpKind::kReduceScatter, dt, op, 0, count, timeout);
  auto run = [c, dt, op, scale](const std::vector<char*>& ins, char* out, size_t count) {
    int n = c->size_, r = c->rank_;
    size_t bytes = count * dtypeSize(dt);
    const char* mine = ins[static_cast<size_t>(r)];
    if (c->oneshot(bytes)) {
      auto blockOf = [&ins](int p) { return static_cast<const char*>(ins[static_cast<size_t>(p)]); };
      return c->oneshotReduce(blockOf, out, count, dt, op, scale);
    }
    if (c->ringsCover() && c->ringSlice() > 0) return c->runReduceScatterRings(ins, out, count, dt, op, scale);
    if (op == ReduceOp::kPremulSum) scaleCopy(out, mine, count, dt, scale);
    else if (out != mine && bytes) std::memmove(out, mine, bytes);
    for (int s = 1; s < n; ++s) {
      int to = (r + s) % n, from = (r - s + n) % n;
      std::vector<Transfer> xs{c->sendTo(to, ins[static_cast<size_t>(to)], bytes),
                               c->recvReduce(from, out, count, dt, op, scale)};
      c->exchange(xs);
    }
    if (op == ReduceOp::kAvg) divideBy(out, count, dt, n);
  };
  std::vector<char*> i8;
  for (const void* p : ins) i8.push_back(const_cast<char*>(static_cast<const char*>(p)));
  char* out8 = static_cast<char*>(out);
  o->device = where.onDevice();
  if (o->device)
    o->body = [c, where, i8, out8, count, dt, op, scale, run] {
      auto dv = c->beginDevice(where);
      if (c->ipcReady(dv.device)) return c->runIpcReduceScatter(dv, i8, out8, count, dt, op, scale);
      std::vector<CommImpl::Region> regs;
      for (char* p : i8) regs.push_back({p, count, true, false});
      regs.push_back({out8, count, false, true});
      c->runStaged(dv, dt, i8.size() + 1, regs, [&](const std::vector<char*>& h, const std::vector<size_t>& n) {
        run(std::vector<char*>(h.begin(), h.end() - 1), h.back(), n.back());
      });
    };
  else
    o->body = [i8, out8, count, run] { run(i8, out8, count); };
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::alltoall(std::vector<const void*> ins, std::vector<size_t> inCounts, std::vector<void*> outs,
                                  std::vector<size_t> outCounts, DataType dt, Millis timeout, Placement where) {
  CommImpl* c = impl_.get();
  size_t n = static_cast<size_t>(c->size_);
  RAILCC_CHECK_ARG(ins.size() == n && inCounts.size() == n, "alltoall: need ", n, " input splits, got ", inCounts.size());
  RAILCC_CHECK_ARG(outs.size() == n && outCounts.size() == n, "alltoall: need ", n, " output splits, got ", outCounts.size());
  size_t r = static_cast<size_t>(c->rank_);
  RAILCC_CHECK_ARG(inCounts[r] == outCounts[r], "alltoall: this rank sends itself ", inCounts[r],
                   " elements (input split) but expects ", outCounts[r], " (output split)");
  // Splits may differ per rank, so the fingerprint leaves count out; sizes are checked per message.
  auto o = c->collective(OpKind::kAlltoall, dt, ReduceOp::kSum, 0, 0, timeout);
  auto run = [c, dt](const std::vector<char*>& ins, const std::vector<size_t>& inCounts, const std::vector<char*>& outs,
                     const std::vector<size_t>& outCounts) {
    int n = c->size_, r = c->rank_;
    size_t es = dtypeSize(dt);
    size_t me = static_cast<size_t>(r);
    if (outs[me] != ins[me] && inCounts[me]) std::memmove(outs[me], ins[me], inCounts[me] * es);
    std::vector<Transfer> xs;
    xs.reserve(2 * static_cast<size_t>(n));
    for (int s = 1; s < n; ++s) {
      size_t to = static_cast<size_t>((r + s) % n), from = static_cast<size_t>((r - s + n) % n);
      xs.push_back(c->sendTo(static_cast<int>(to), ins[to], inCounts[to] * es));
      xs.push_back(c->recvFrom(static_cast<int>(from), outs[from], outCounts[from] * es));
    }
    c->exchange(xs);
  };
  std::vector<char*> i8, o8;
  for (const void* p : ins) i8.push_back(const_cast<char*>(static_cast<const char*>(p)));
  for (void* p : outs) o8.push_back(static_cast<char*>(p));
  o->device = where.onDevice();
  if (o->device)
    o->body = [c, where, i8, o8, inCounts, outCounts, dt, run, n] {
      auto dv = c->beginDevice(where);
      if (c->ipcReady(dv.device)) return c->runIpcAlltoall(dv, i8, inCounts, o8, outCounts, dt);
      std::vector<CommImpl::Region> regs;
      for (size_t i = 0; i < n; ++i) regs.push_back({i8[i], inCounts[i], true, false});
      for (size_t i = 0; i < n; ++i) regs.push_back({o8[i], outCounts[i], false, true});
      c->runStaged(
          dv, dt, 2 * n, regs,
          [&](const std::vector<char*>& h, const std::vector<size_t>& k) {
            run(std::vector<char*>(h.begin(), h.begin() + static_cast<long>(n)),
                std::vector<size_t>(k.begin(), k.begin() + static_cast<long>(n)),
                std::vector<char*>(h.begin() + static_cast<long>(n), h.end()),
                std::vector<size_t>(k.begin() + static_cast<long>(n), k.end()));
          },
          /*agree=*/true);
    };
  else
    o->body = [i8, o8, inCounts, outCounts, run] { run(i8, inCounts, o8, outCounts); };
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::gather(const void* in, size_t count, DataType dt, std::vector<void*> outs, int root, Millis timeout,
                                Placement where) {
  CommImpl* c = impl_.get();
  checkRoot(root, c->size_, "gather");
  if (c->rank_ == root)
    RAILCC_CHECK_ARG(static_cast<int>(outs.size()) == c->size_, "gather: root needs ", c->size_, " output buffers, got ", outs.size());
  auto o = c->collective(OpKind::kGather, dt, ReduceOp::kSum, root, count, timeout);
  auto run = [c, dt, root](const char* in, size_t count, const std::vector<char*>& outs) {
    int n = c->size_, r = c->rank_;
    size_t bytes = count * dtypeSize(dt);
    std::vector<Transfer> xs;
    if (r != root) {
      xs.push_back(c->sendTo(root, in, bytes));
    } else {
      if (outs[static_cast<size_t>(r)] != in && bytes) std::memmove(outs[static_cast<size_t>(r)], in, bytes);
      xs.reserve(static_cast<size_t>(n));
      for (int p = 0; p < n; ++p)
        if (p != r) xs.push_back(c->recvFrom(p, outs[static_cast<size_t>(p)], bytes));
    }
    c->exchange(xs);
  };
  std::vector<char*> o8;
  if (c->rank_ == root)
    for (void* p : outs) o8.push_back(static_cast<char*>(p));
  char* in8 = const_cast<char*>(static_cast<const char*>(in));
  o->device = where.onDevice();
  if (o->device)
    o->body = [c, where, in8, count, dt, o8, root, run] {
      auto dv = c->beginDevice(where);
      if (c->ipcReady(dv.device)) return c->runIpcGather(dv, in8, count, dt, o8, root);
      std::vector<CommImpl::Region> regs{{in8, count, true, false}};
      for (char* p : o8) regs.push_back({p, count, false, true});
      c->runStaged(dv, dt, static_cast<size_t>(c->size_) + 1, regs,
                   [&](const std::vector<char*>& h, const std::vector<size_t>& n) {
                     run(h[0], n[0], std::vector<char*>(h.begin() + 1, h.end()));
                   });
    };
  else
    o->body = [in8, count, o8, run] { run(in8, count, o8); };
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt, int root, Millis timeout,
                                 Placement where) {
  CommImpl* c = impl_.get();
  checkRoot(root, c->size_, "scatter");
  if (c->rank_ == root)
    RAILCC_CHECK_ARG(static_cast<int>(ins.size()) == c->size_, "scatter: root needs ", c->size_, " input buffers, got ", ins.size());
  auto o = c->collective(OpKind::kScatter, dt, ReduceOp::kSum, root, count, timeout);
  auto run = [c, dt, root](const std::vector<char*>& ins, char* out, size_t count) {
    int n = c->size_, r = c->rank_;
    size_t bytes = count * dtypeSize(dt);
    std::vector<Transfer> xs;
    if (r != root) {
      xs.push_back(c->recvFrom(root, out, bytes));
    } else {
      if (ins[static_cast<size_t>(r)] != out && bytes) std::memmove(out, ins[static_cast<size_t>(r)], bytes);
      xs.reserve(static_cast<size_t>(n));
      for (int p = 0; p < n; ++p)
        if (p != r) xs.push_back(c->sendTo(p, ins[static_cast<size_t>(p)], bytes));
    }
    c->exchange(xs);
  };
  std::vector<char*> i8;
  if (c->rank_ == root)
    for (const void* p : ins) i8.push_back(const_cast<char*>(static_cast<const char*>(p)));
  char* out8 = static_cast<char*>(out);
  o->device = where.onDevice();
  if (o->device)
    o->body = [c, where, i8, out8, count, dt, root, run] {
      auto dv = c->beginDevice(where);
      if (c->ipcReady(dv.device)) return c->runIpcScatter(dv, i8, out8, count, dt, root);
      std::vector<CommImpl::Region> regs;
      for (char* p : i8) regs.push_back({p, count, true, false});
      regs.push_back({out8, count, false, true});
      c->runStaged(dv, dt, static_cast<size_t>(c->size_) + 1, regs,
                   [&](const std::vector<char*>& h, const std::vector<size_t>& n) {
                     run(std::vector<char*>(h.begin(), h.end() - 1), h.back(), n.back());
                   });
    };
  else
    o->body = [i8, out8, count, run] { run(i8, out8, count); };
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::barrier(Millis timeout) {
  CommImpl* c = impl_.get();
  auto o = c->collective(OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, 0, 0, timeout);
  o->body = [c] {
    int n = c->size_, r = c->rank_;
    // Dissemination: after round k every rank has heard, transitively, from 2^(k+1) ranks.
    for (int k = 1; k < n; k *= 2) {
      std::vector<Transfer> xs{c->sendTo((r + k) % n, nullptr, 0), c->recvFrom((r - k + n) % n, nullptr, 0)};
      c->exchange(xs);
    }
  };
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::send(const void* buf, size_t bytes, int peer, int tag, Millis timeout) {
  CommImpl* c = impl_.get();
  RAILCC_CHECK_ARG(peer >= 0 && peer < c->size_, "send: destination rank ", peer, " is out of range for a group of size ", c->size_);
  RAILCC_CHECK_ARG(peer != c->rank_, "send: destination rank ", peer, " is this rank; sending to oneself is not supported");
  auto o = std::make_unique<Op>();
  o->kind = OpKind::kP2P;
  o->p2p = true;
  o->timeout = timeout;
  o->xfer.kind = Transfer::kSend;
  o->xfer.lane = kP2PLane;
  o->xfer.peer = peer;
  o->xfer.src = static_cast<const char*>(buf);
  o->xfer.bytes = bytes;
  o->xfer.hdr.magic = kWireMagic;
  o->xfer.hdr.kind = static_cast<uint8_t>(OpKind::kP2P);
  o->xfer.hdr.tag = tag;
  o->xfer.hdr.bytes = bytes;
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::recv(void* buf, size_t bytes, int peer, int tag, Millis timeout) {
  CommImpl* c = impl_.get();
  RAILCC_CHECK_ARG(peer == -1 || (peer >= 0 && peer < c->size_), "recv: source rank ", peer,
                   " is out of range for a group of size ", c->size_);
  RAILCC_CHECK_ARG(peer != c->rank_, "recv: source rank ", peer, " is this rank; receiving from oneself is not supported");
  auto o = std::make_unique<Op>();
  o->kind = OpKind::kP2P;
  o->p2p = true;
  o->anySource = peer == -1;
  o->timeout = timeout;
  o->xfer.kind = Transfer::kRecv;
  o->xfer.lane = kP2PLane;
  o->xfer.peer = peer;
  o->xfer.dst = static_cast<char*>(buf);
  o->xfer.bytes = bytes;
  o->xfer.hdr.magic = kWireMagic;
  o->xfer.hdr.kind = static_cast<uint8_t>(OpKind::kP2P);
  o->xfer.hdr.tag = tag;
  o->xfer.hdr.bytes = bytes;
  auto req = c->enqueue(std::move(o));
  if (peer >= 0) req->setSourceRank(peer);
  return req;
}

}  // namespace railcc::engine
