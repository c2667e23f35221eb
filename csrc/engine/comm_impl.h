#pragma once
// CommImpl, the state behind one Communicator: a composition of parts, each with a header of
// its own that says which lock guards what and which thread may call it. Private to
// csrc/engine: glue and transports never include it.
//
//   part          header                      what it owns
//   channel layer channels.h                  connections (lane x peer x channel), transfers, waiting
//   algorithms    algorithms/algorithms.h     the host algorithms and their scratch (table.h: the rows)
//   device layer  device/device_layer.h       GPU buffers: CUDA IPC, pinned staging, GPU work watched
//   watchdog      watchdog.h                  its thread, progress records, stragglers, dumps
//   op queue      op_queue.h                  queued ops, the progress thread, the engine token
//   health        health.h                    whether the group failed, why, who died since
//   links         links.h                     connections made at first use, the link names
//   telemetry     telemetry.h                 the flight recorder, link and arrival statistics
//
// CommImpl itself wires them together and does what spans them, one file each:
//   bootstrap.cpp, connect_peers.cpp, connections.cpp, placement.cpp   set-up and links
//   progress.cpp   the op queue's threads, p2p ops, abort and teardown
//   failure.cpp    how a group fails, names the peer at fault, and tells its other groups
//   rank_names.cpp ranks and links as users know them
//   time_estimate.cpp  c10d's time estimator: ops costed by the algorithms' plans, not run
//   communicator.cpp  the public Communicator: argument checks, then each op's body

#include <poll.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/pid.h"
#include "engine/algorithms/algorithms.h"
#include "engine/channels.h"
#include "engine/communicator.h"
#include "engine/device/device_layer.h"
#include "engine/health.h"
#include "engine/links.h"
#include "engine/op_queue.h"
#include "engine/placement.h"
#include "engine/telemetry.h"
#include "engine/watchdog.h"

namespace railcc::engine {

// Said at init, with the number needed, rather than as an EMFILE from deep inside a transport
// (connections.cpp): raises the soft limit of open files where the hard limit allows (logged),
// else fails naming the group. `conns` must fit; `want` (connections that may come later) is
// made room for as far as the hard limit allows; `when` says where the check runs.
void checkFdLimit(size_t conns, const std::string& group, size_t want = 0, const std::string& when = "init");

class CommImpl : private ChannelHost, private WatchdogHost {
 public:
  CommImpl(Store& store, CommOptions opts);
  ~CommImpl();
  // The facade (communicator.cpp) builds each op from the parts and queues it; no other code
  // reaches in.
  friend class Communicator;

 private:
  // ---- the group, fixed by set-up and read by every part
  CommOptions opts_;
  Store* store_ = nullptr;  // outlives the communicator (owned by the glue or the test)
  int rank_, size_;
  const pid_t ownerPid_ = thisPid();
  std::vector<PeerInfo> peers_;
  std::vector<int> localRanks_;  // the ranks sharing this host's memory, ours included
  // Ranks with our index among the ranks of their host, one per host in the order of each
  // host's lowest rank; set only when there are two hosts or more and each has the same number
  // of ranks (two or more) sharing memory, else empty.
  std::vector<int> rail_;
  AlgoPlace place_;           // what the algorithm rule (algorithms/choose.h) reads of it
  std::vector<Algo> prefer_;  // RAILCC_ALGO / NCCL_ALGO
  std::string hostname_;
  bool hostSharesCores_ = false;  // this machine's ranks of the group outnumber its CPUs

  // ---- the parts, each declared after what it is given
  std::unique_ptr<Telemetry> tele_;
  ChannelLayer ch_;
  Algorithms algos_{ch_, opts_.config, *tele_, rank_, size_, {peers_, localRanks_, rail_, place_, prefer_}};
  DeviceLayer device_{ch_, algos_, opts_, rank_, size_, localRanks_, place_};
  std::atomic<int64_t> opsLive_{0};  // Op::live of every op; declared before q_, which holds them
  OpQueue q_;
  Health health_;
  Links links_;
  std::shared_ptr<CallbackPool> userPool_;  // c10d Future callbacks and comm hooks (Request::runUserCode)
  Watchdog watchdog_{*this, opts_, *tele_, rank_, size_, peers_, store_, opts_.storeKeepAlive};

  // ---- set-up (bootstrap.cpp, connect_peers.cpp, connections.cpp, placement.cpp)
  void bootstrap(Store& store);
  RailPlace placeRank();  // this rank's NIC and rail from the topology
  void discoverEarly();
  void checkRails(std::vector<std::string> lines, const std::vector<int>& heads, Clock::time_point deadline);
  using GetFrom = std::function<std::string(const std::string& key, int rank, const char* what)>;
  using GetAll = std::function<std::vector<std::string>(const std::string& prefix, const std::vector<int>& ranks,
                                                        const char* what)>;
  // Opens the registered transports, publishes their endpoints, picks one per peer and
  // connects every (peer, lane, channel) through it, now or at first use.
  void connectPeers(Store& store, const std::string& secretHex, Clock::time_point deadline, const GetAll& getAll,
                    const RailPlace& place);
  std::function<void()> pump_;  // run between store waits during connectPeers
  transport::PeerRecord recordOf(int peer, const LazyPeer& l) const;
  bool readEndpoint(int peer, LazyPeer& l);
  void readCollectiveEndpoints(const Op& op);  // before the group's first collective moves a byte
  [[noreturn]] void storeGoneAtFirstUse(const std::vector<int>& peers, const char* when);
  void connectAtInit(Clock::time_point deadline);  // RAILCC_RUNTIME_CONNECT=0

  // ---- ops (progress.cpp)
  void checkOwner() const;  // throws kInvalidUsage in a child forked after init
  std::unique_ptr<Op> collective(OpKind kind, DataType dt, ReduceOp rop, int root, size_t count, Millis timeout);
  RequestPtr enqueue(std::unique_ptr<Op> op);
  uint64_t traceQueued(const Op& op, int64_t startedUs = 0);  // its flight-recorder slot
  bool runNow(Op& op);  // the lean path: a caller's collective run at once (progress.cpp)
  void progressLoop();
  bool tryAcquire(bool drain = false);  // the engine token; with `drain`, moves queued ops on too
  void release(bool wakeProgress);
  void failQueued(std::exception_ptr broken);
  std::exception_ptr runCollective(Op& op, int64_t startedUs = 0);
  void helpRun(const Request* req);
  void poke();  // wakes the progress thread to take the token
  void drainQueue();
  void takeQueued();         // q_.queue to q_.drained, with q_.mu held
  void distributeDrained();  // q_.drained to q_.coll and the started p2p ops
  void startP2P(std::unique_ptr<Op> op);
  size_t progressP2P();
  const std::vector<int>& p2pPeers();  // the peers of q_.p2p, sorted, once each
  void finishP2P();
  size_t pumpP2P();  // keeps sends and receives moving while a collective waits; bytes moved
  void abort(const std::string& why);
  void shutdown();
  std::exception_ptr abortedError();  // what every op fails with once abort() was called

  // ---- c10d's time estimator (time_estimate.cpp): while it is on, ops are costed, not run,
  // and take no sequence number (so a rank that estimates stays in step with one that does not)
  struct Estimating {
    std::atomic<bool> on{false};
    std::mutex mu;  // guards the rest: callers
    double us = 0;
    std::vector<Algorithms::LinkCost> byPeer;
  } estimate_;
  void startEstimate();
  double endEstimate();
  RequestPtr estimated(const Op& op);  // its cost counted; a Request finished already

  // ---- failure (failure.cpp)
  void fail(std::exception_ptr err);
  [[noreturn]] void failStalled(const std::vector<Transfer*>& pending, Millis timeout);
  // "<op> (seq N) timed out ...; waiting on:" `waitingOn` (a line per peer), what the peers'
  // progress records say of this op, and the ranks to blame (those records', else `ranks`).
  [[noreturn]] void failTimedOut(const std::string& waitingOn, std::vector<int> ranks, std::vector<std::string> hosts,
                                 Millis timeout);
  void memberDied(const std::vector<int>& ranks, const std::string& group, const std::string& why);
  // The communicators of this process, so that a rank found dead in one group fails the
  // others that hold it; what another group saw of global rank `g` ("" when nothing).
  void enlist();
  void unlist();
  void spreadDeath(const Error& e);
  std::string seenDeadElsewhere(int g) const;
  std::string goneElsewhere(int g);  // a process of this host that has exited
  // Set-up failures published for the peers ("initfail" in the group's store), the check for
  // theirs, and the error a record "rank|host|why" makes.
  void publishInitFailure(Store& store, const Error& e);
  void checkPeerInitFailure(Store& store);
  void throwInitFailure(const std::string& rec, const std::string& context, const std::string& after);
  std::exception_ptr globalized(std::exception_ptr err) const;  // ranks as users know them

  // ---- ChannelHost: what the channel layer asks while a step waits
  size_t pumpBeside() override { return pumpP2P(); }
  void checkInterrupted() override;
  bool shuttingDown() const override { return q_.stop; }
  bool opsQueued() const override { return q_.queued.load() > 0; }
  bool connectPeer(int peer, int lane) override;                  // connections.cpp
  int connectingFds(std::vector<pollfd>& out) override;           // connections.cpp
  [[noreturn]] void peerFailed(int peer, const std::string& detail) override;
  void checkPeersReported(const std::vector<std::pair<int, int>>& waitOn) override;
  [[noreturn]] void stalled(const std::vector<Transfer*>& pending, Millis timeout) override;
  std::string rankName(int r) const override;  // "rank G (group rank r)" where they differ
  std::string peerName(int r) const override;  // with its host and link
  const std::string& hostOf(int r) const override { return peers_[static_cast<size_t>(r)].hostname; }
  bool deviceReady(const DeviceSide& d) override { return device_.deviceReady(d); }
  void stageDeviceSend(Transfer& t) override { device_.stageDeviceSend(t); }

  // ---- WatchdogHost: what the watchdog asks, from its thread
  int globalRank(int r) const override;
  std::string linkOf(int r) const override;  // "shm", "socket 10.0.0.2:5000 from eth1", "self"
  std::exception_ptr brokenError() const override;
  void checkGpu(Clock::time_point* next) override;
  bool gpuWatched() const override { return device_.gpuWatched(); }
};

}  // namespace railcc::engine
