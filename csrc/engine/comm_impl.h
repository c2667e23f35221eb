#pragma once
// CommImpl, the state behind one Communicator, as an owner of parts, each declared in a header
// of its own with the lock that guards it: the channel layer (channels.h), the op queue and its
// ops (op_queue.h), how the group stands and its stragglers (health.h), the watchdog's shared
// state (watchdog_tasks.h), the connections made at first use (links.h), this rank's place in
// the topology (placement.h), the device layer's state (device/device_state.h) and how a device
// op is described (device/device_plan.h), the algorithms (algorithms/table.h) and the flight
// recorder (telemetry.h). Private to csrc/engine: glue and transports never include it.
//
// Who does what (one file each):
//   bootstrap.cpp    set-up: peer records, transports per peer, their connections
//   progress.cpp     the op queue, the progress thread, the engine token, abort and teardown
//   channels.cpp     the channel layer: transfers over connections, exchange, waiting
//   failure.cpp      how a group fails, names the peer at fault, and tells its other groups
//   watchdog.cpp     progress records, hang attribution, stragglers, flight-recorder dumps
//   algorithms/      host algorithms written against the channel layer's post()/complete()
//   device/          GPU buffers: pinned staging and CUDA IPC under the host algorithms, GPUDirect
//   communicator.cpp the public Communicator: argument checks, then each op's body

#include <arpa/inet.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <thread>

#include "common/pid.h"
#include "common/strings.h"
#include "common/error.h"
#include "common/log.h"
#include "engine/algorithms/choose.h"
#include "engine/algorithms/algorithms.h"
#include "engine/algorithms/table.h"
#include "engine/device/device_plan.h"
#include "engine/health.h"
#include "engine/channels.h"
#include "engine/communicator.h"
#include "engine/device.h"
#include "engine/device/device_state.h"
#include "engine/rail_check.h"
#include "engine/telemetry.h"
#include "engine/links.h"
#include "engine/op_queue.h"
#include "engine/placement.h"
#include "engine/watchdog_tasks.h"
#include "transport/copy.h"
#include "transport/local.h"
#include "transport/transport.h"
#include "transport/connection.h"

namespace railcc::engine {

// Said at init, with the number needed, rather than as an EMFILE from deep inside a
// transport (connections.cpp): raises the soft limit of open files where the hard limit
// allows (logged), else fails naming the group. `conns` must fit; `want` (connections that
// may come later, made at first use) is made room for as far as the hard limit allows. `when`
// says where the check runs ("init", "connecting to rank 7 at first use").
void checkFdLimit(size_t conns, const std::string& group, size_t want = 0, const std::string& when = "init");

class CommImpl : private ChannelHost {
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
  const pid_t ownerPid_ = thisPid();
  std::unique_ptr<Op> collective(OpKind kind, DataType dt, ReduceOp rop, int root, size_t count, Millis timeout);


  // Device buffers (progress thread; device/device_plan.h describes an op on them). Once per
  // device op: sets the device, makes its events (and own stream), orders its stream after the caller's event.
  DeviceOp beginDevice(const Placement& where);
  // `slots` is the most regions any rank of the group passes for this op, so every rank cuts the same
  // chunks; `agree` first agrees on the largest region across ranks (alltoall, whose splits differ).
  void runStaged(const DeviceOp& dv, DataType dt, size_t slots, std::vector<Region> regions, const StagedBody& body,
                 bool agree = false);
  // runDevice() picks how a DevicePlan (device/device_plan.h) runs: IPC where ipcReady() (every rank
  // on this host, peer access, RAILCC_CUDA_IPC), else staging.
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

  DeviceState dev_;  // device/device_state.h
  bool ipcReady(int device);
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
    checkDevice(api.eventRecord(dev_.stageEv[0], dv.stream), "cudaEventRecord", dv.device);
    deviceWait(api, dev_.stageEv[0], dv.device, what, dv.stream);
  }
  void watchGpu(const cuda::DeviceApi& api, const DeviceOp& dv, const char* what);
  // Drops the entries the GPU has finished. With `now`: returns the error of the oldest entry
  // past its timeout (nullptr if none) and sets `next` to when the oldest one runs out.
  std::exception_ptr retireGpuWork(const cuda::DeviceApi& api, const Clock::time_point* now, Clock::time_point* next);
  // The watchdog's side: checks the GPU work and fails the group when it is late.
  void checkGpuWork(Clock::time_point* next);
  void releaseGpuWork(const cuda::DeviceApi& api);
  // Records `e` on this rank's stream, tells every peer, and orders this rank's stream after
  // every peer's record of `e`.
  void ipcStep(const cuda::DeviceApi& api, void* stream, int d, IpcEvent e);  // device/cuda_ipc.cpp

  // ChannelHost: what the channel layer asks of the engine while a step waits.
  size_t pumpBeside() override { return pumpP2P(); }
  bool connectPeer(int peer, int lane) override;
  int connectingFds(std::vector<pollfd>& out) override;
  void checkInterrupted() override {
    if (health_.aborted) RAILCC_THROW(kAborted, health_.abortWhy);
    if (health_.memberDown) std::rethrow_exception(brokenError());
  }
  bool shuttingDown() const override { return q_.stop; }
  bool opsQueued() const override { return q_.queued.load() > 0; }
  void checkPeersReported(const std::vector<std::pair<int, int>>& waitOn) override;  // failure.cpp
  [[noreturn]] void stalled(const std::vector<Transfer*>& pending, Millis timeout) override;  // failStalled
  const std::string& hostOf(int r) const override { return peers_[static_cast<size_t>(r)].hostname; }
  bool deviceReady(const DeviceSide& d) override;  // device/gpu_direct.cpp
  void stageDeviceSend(Transfer& t) override;
  void releaseSendStaging(const cuda::DeviceApi& api);

  // "rank G" with G the rank in the default group; "rank G (group rank r)" where they differ.
  std::string rankName(int r) const override {
    int g = globalRank(r);
    return g == r ? "rank " + std::to_string(r) : "rank " + std::to_string(g) + " (group rank " + std::to_string(r) + ")";
  }
  int globalRank(int r) const {
    return r >= 0 && static_cast<size_t>(r) < opts_.globalRanks.size() ? opts_.globalRanks[static_cast<size_t>(r)] : r;
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
  std::string peerName(int r) const override {
    const PeerInfo& p = peers_[static_cast<size_t>(r)];
    return rankName(r) + " (host " + p.hostname + ", " + linkOf(r) + ")";
  }
  // How this rank reaches `r` ("shm", "socket 10.0.0.2:5000 from eth1", "self"): fixed at
  // init, except for a connection made at first use, named once it is up; any thread.
  std::string linkOf(int r) const {
    std::lock_guard<std::mutex> g(links_.mu);
    const std::string& t = peers_[static_cast<size_t>(r)].transport;
    return t.empty() ? "self" : t;
  }

  void abort(const std::string& why);
  void shutdown();
  // What every op fails with once abort() was called on this rank.
  std::exception_ptr abortedError() {
    std::lock_guard<std::mutex> g(q_.mu);
    return std::make_exception_ptr(Error(ErrorCode::kAborted, health_.abortWhy));
  }

  CommOptions opts_;
  Store* store_ = nullptr;  // outlives the communicator (owned by the glue or the test)
  int rank_, size_;
  std::unique_ptr<Telemetry> tele_;  // the flight recorder, link and arrival statistics
  Channels ch_;                      // the connections and the transfers on them (channels.h)
  std::vector<PeerInfo> peers_;
  std::vector<int> localRanks_;
  // Ranks with our index among the ranks of their host, one per host in the order of each
  // host's lowest rank; set only when there are two hosts or more and each has the same
  // number of ranks (two or more) sharing memory, else empty.
  std::vector<int> rail_;

  // The algorithm rule (algorithms/choose.h) with this group's placement, set after set-up.
  AlgoPlace place_;
  std::vector<Algo> prefer_;  // RAILCC_ALGO / NCCL_ALGO
  // The host algorithms (algorithms/algorithms.h) on this group's channels and shape: declared
  // after everything they are given.
  Algorithms algos_{ch_, opts_.config, *tele_, rank_, size_, {peers_, localRanks_, rail_, place_, prefer_}};

  // The op queue, the engine token and the progress thread (progress.cpp). `mu` guards what
  // callers share with the engine (and Health::abortWhy); the rest is the token holder's.
  std::atomic<int64_t> opsLive_{0};  // Op::live of every op; declared before q_, which holds them
  OpQueue q_;  // op_queue.h

  // How the group stands (failure.cpp, progress.cpp). errMu guards `broken`; the flags are
  // read without it on the hot path.
  Health health_;  // health.h: how the group stands (errMu guards the error and the later dead)
  std::string hostname_;
  // Runs c10d Future callbacks and comm hooks off the progress thread (Request::runUserCode).
  std::shared_ptr<CallbackPool> userPool_;

  // watchdog thread: progress record, stragglers, what set-up left (tasks), every store write after
  // set-up (a frozen store blocks only it), sharing WatchdogShared so that it can be detached.
  std::shared_ptr<WatchdogShared> wd_;
  std::thread watchdog_;
  mutable std::mutex traceMu_;  // one trace file write at a time
  Stragglers strag_;  // health.h: what the watchdog found of slow ranks and links (watchdog.cpp)
  void watchdogLoop(std::shared_ptr<WatchdogShared> w);
  // Reads `key` within about `wait` even when the store itself hangs (its host frozen or the
  // network cut): the read then runs on a helper thread that is left behind if it overruns.
  bool storeTryGet(const std::string& key, Millis wait, std::string& out);
  void checkStragglers();
  std::string progressRecord() const;
  void checkHeartbeat(int peer);  // watchdog.cpp: a peer without a connection whose record stopped
  std::string traceJson(const std::string& reason) const;
  std::string writeTrace(const std::string& reason, const std::string& dir = "") const;
  bool ownDump(const std::string& path) const;  // absent, or written by this process
  std::string stragglerReport();
  std::string describePeerProgress(uint64_t seq, std::vector<int>& culprits);
  std::vector<int> stillSilent(const std::vector<int>& globals);  // Communicator::stillSilent
  // Links are compared with others of the same transport and direction: a send into a shm
  // FIFO with room is a memcpy, a receive waits for the sender's copy.
  std::string linkClass(const Telemetry::LinkStats& l) const {
    std::string t = linkOf(l.peer);
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

 private:
  void bootstrap(Store& store);
  bool hostSharesCores_ = false;  // this machine's ranks of the group outnumber the CPUs they may run on
  // placement.cpp: this rank's NIC and rail from the topology (logged at INFO once per process;
  // read early where the group spans hosts), and rank 0's check that the hosts agree on rails.
  RailPlace placeRank();
  void discoverEarly();
  void checkRails(std::vector<std::string> lines, const std::vector<int>& heads, Clock::time_point deadline);
  using GetFrom = std::function<std::string(const std::string& key, int rank, const char* what)>;
  using GetAll = std::function<std::vector<std::string>(const std::string& prefix, const std::vector<int>& ranks,
                                                        const char* what)>;
  // Opens the registered transports, publishes their endpoints, picks one per peer and
  // connects every (peer, lane, channel) through it, now or at first use.
  std::function<void()> pump_;  // run between store waits during connectPeers
  void connectPeers(Store& store, const std::string& secretHex, Clock::time_point deadline,
                    const GetAll& getAll, const RailPlace& place);
  // Connections made at first use (RAILCC_RUNTIME_CONNECT): the transports' set-ups that make them, kept for the
  // group's life, and per peer the one that reaches it (null: connected at init, or ourselves; or, with
  // `chooseLater`, one of `choices`, the first the peer's endpoint allows). Also what names each peer's link
  // (peers_[r].transport), which such a connection fills in later: `mu` guards it from then on (linkOf).
  Links links_;  // links.h
  transport::PeerRecord recordOf(int peer, const LazyPeer& l) const;  // connections.cpp
  bool readEndpoint(int peer, LazyPeer& l);       // connections.cpp, as connectAtInit (RAILCC_RUNTIME_CONNECT=0)
  void connectAtInit(Clock::time_point deadline);
  std::vector<int> collectivePeers();              // algorithms/peers.cpp: what it connects
  void progressLoop();
  // Takes the engine token; with `drain`, also moves the queued ops on (drainQueue) under the same lock.
  bool tryAcquire(bool drain = false);
  void release(bool wakeProgress);
  void failQueued(std::exception_ptr broken);
  std::exception_ptr runCollective(Op& op);
  void helpRun(const Request* req);
  void poke();  // wakes the progress thread to take the token (progress.cpp)

 private:
  void drainQueue();
  void takeQueued();         // q_.queue to q_.drained, with q_.mu held
  void distributeDrained();  // q_.drained to q_.coll and the started p2p ops
  void startP2P(std::unique_ptr<Op> op);
  size_t progressP2P();
  const std::vector<int>& p2pPeers();  // the peers of q_.p2p, sorted, once each
  void finishP2P();
  // Keeps sends and receives moving while a collective waits; returns bytes moved.
  size_t pumpP2P() {
    if (q_.p2p.empty() && q_.anySource.empty() && q_.queued.load(std::memory_order_relaxed) == 0) return 0;
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
  /// Whether another group of this rank knows global rank `g` as a process of this host that
  /// has exited (then that group learns it too): how, or "".
  std::string goneElsewhere(int g);
  /// Set-up failures this rank publishes for its peers ("initfail" in the group's store), the
  /// check for theirs while waiting, and the error a record "rank|host|why" of one makes (thrown;
  /// at op time too, for a peer never connected); health_.initFailSeen marks it as a peer's.
  void publishInitFailure(Store& store, const Error& e);
  void checkPeerInitFailure(Store& store);
  void throwInitFailure(const std::string& rec, const std::string& context, const std::string& after);
  void memberDied(const std::vector<int>& ranks, const std::string& group, const std::string& why);
  std::exception_ptr brokenError() const;
  [[noreturn]] void peerFailed(int peer, const std::string& detail) override;
};
}  // namespace railcc::engine
