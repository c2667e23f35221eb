#pragma once
// The channel layer: one group's connections to its peers (lane x peer x channel) and the
// transfers that move over them. An algorithm describes a step as Transfers (sendTo, recvFrom,
// recvReduce), hands them to post()/complete() (or exchange(), both at once), and the layer
// moves them: headers checked against the op's fingerprint, large messages split across a
// pair's channels, receive-reduce in pieces, waiting by spin, poll() or the local doorbell,
// with the op's timeout and the peers' liveness checked while it waits.
//
// Threads: everything here runs with the engine token held (the progress thread, or a caller
// running its own op), except wake(), markFailed() and close(), which any thread may call:
// connMu_ guards the connections and the local domain against them.

#include <poll.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/config.h"
#include "engine/telemetry.h"
#include "engine/wire.h"
#include "transport/connection.h"
#include "transport/local.h"

namespace railcc::engine {

// The transfers queued on a channel, first in first out. Allocates nothing until its first
// push: a group holds a channel per (lane, peer, channel) for every peer, most of them never
// used where connections are made at first use (a std::deque allocates about 600 bytes when
// constructed: 2.4 KiB per peer and channel, 0.6 MiB a rank at 128 ranks).
class TransferQueue {
 public:
  bool empty() const { return head_ == v_.size(); }
  size_t size() const { return v_.size() - head_; }
  Transfer* front() const { return v_[head_]; }
  void push_back(Transfer* t) { v_.push_back(t); }
  void pop_front() {
    if (++head_ == v_.size()) {
      clear();
    } else if (head_ >= 64 && 2 * head_ >= v_.size()) {  // never emptied: drop what was taken
      v_.erase(v_.begin(), v_.begin() + static_cast<std::ptrdiff_t>(head_));
      head_ = 0;
    }
  }
  void clear() {
    v_.clear();
    head_ = 0;
  }

 private:
  std::vector<Transfer*> v_;
  size_t head_ = 0;
};

// One connection to a peer on one lane, with the transfers queued on it (in posting order,
// which both sides share) and the header being read.
struct Channel {
  std::unique_ptr<transport::Connection> conn;
  TransferQueue sendq, recvq;
  WireHeader inHdr{};
  size_t inHdrGot = 0;
  char carry[8];  // a partial element split by a socket read
  size_t carryGot = 0;
  // Single copy: sends passed by address so far, and the address of the one being received.
  uint64_t addrSent = 0;
  AddressMsg inAddr{};
  size_t inAddrGot = 0;
};

// What the channel layer asks of the engine around it while a step waits.
class ChannelHost {
 public:
  /// Moves the work beside the step (send/recv on the p2p lane, newly queued ops); bytes moved.
  virtual size_t pumpBeside() = 0;
  /// Throws when the group was aborted, or failed by another group of this rank.
  virtual void checkInterrupted() = 0;
  /// The process group is shutting down: ops that stop moving fail instead of waiting.
  virtual bool shuttingDown() const = 0;
  /// Ops are queued that the progress thread has not taken yet: stop waiting, go take them.
  virtual bool opsQueued() const = 0;
  /// Starts, or moves on, the connections to `peer` on `lane` that are made at first use;
  /// true once they are up (the pair's channels then have them). Never blocks.
  virtual bool connectPeer(int peer, int lane) = 0;
  /// While connections made at first use come up: appends the fds that move them on and
  /// returns the ms a poll may sleep before connectPeer() must run anyway (Setup::pollFds).
  virtual int connectingFds(std::vector<pollfd>& out) = 0;
  /// Fails the group naming `peer`, which a connection found dead.
  [[noreturn]] virtual void peerFailed(int peer, const std::string& detail) = 0;
  /// A step has waited a while without progress: fails the group naming a peer it waits on
  /// that published a failure of its own (alive, so no connection of its closes), if any.
  virtual void checkPeersReported(const std::vector<std::pair<int, int>>& waitOn) = 0;
  /// Fails the op that moved nothing for `timeout`, naming the transfers it waits on.
  [[noreturn]] virtual void stalled(const std::vector<Transfer*>& pending, Millis timeout) = 0;
  /// "rank G (group rank r)", and with host and transport, for messages.
  virtual std::string rankName(int r) const = 0;
  virtual std::string peerName(int r) const = 0;
  virtual const std::string& hostOf(int r) const = 0;
  /// GPU memory of a send or receive (Transfer::device): true once the caller's stream is past
  /// the call, so that the GPU's bytes may be read or overwritten. Never blocks.
  virtual bool deviceReady(const DeviceSide& d) = 0;
  /// Copies a send's GPU bytes into its host `src` (the transport cannot reach the GPU).
  virtual void stageDeviceSend(Transfer& t) = 0;

 protected:
  ~ChannelHost() = default;
};

class ChannelLayer {
 public:
  ChannelLayer(ChannelHost& host, const Config& config, Telemetry& tele, int rank, int size);
  ~ChannelLayer();
  ChannelLayer(const ChannelLayer&) = delete;
  ChannelLayer& operator=(const ChannelLayer&) = delete;

  // ---- set-up (bootstrap)
  /// The channels of (lane, peer), made the first time the pair is asked for (idle until a
  /// connection joins them): a rank keeps channels only for the peers it meets, not one per
  /// rank of the group. Engine thread.
  std::vector<Channel>& pair(int lane, int peer) {
    auto& v = chans_[static_cast<size_t>(lane)][static_cast<size_t>(peer)];
    if (v.empty()) makePair(v, peer);
    return v;
  }
  Channel& chan(int lane, int peer, int c = 0) { return pair(lane, peer)[static_cast<size_t>(c)]; }
  /// The pair's channels if it was ever asked for, else null (a scan over every rank).
  std::vector<Channel>* findPair(int lane, int peer) {
    auto& v = chans_[static_cast<size_t>(lane)][static_cast<size_t>(peer)];
    return v.empty() ? nullptr : &v;
  }
  /// How many channels a pair with `peer` has, on each lane (1 unless set before it is made).
  void setChannels(int peer, int n) { nchan_[static_cast<size_t>(peer)] = static_cast<uint8_t>(n); }
  /// A connection made after set-up (at first use) joins its channel.
  void adopt(int lane, int peer, int c, std::unique_ptr<transport::Connection> conn) {
    Channel& ch = chan(lane, peer, c);  // made first: makePair takes connMu_ itself
    std::lock_guard<std::mutex> g(connMu_);
    ch.conn = std::move(conn);
  }
  void setLocal(std::shared_ptr<transport::LocalDomain> d) {
    std::lock_guard<std::mutex> g(connMu_);
    local_ = std::move(d);
  }
  /// Per peer: reached through shared memory (cache-bypassing receives, doorbell waits);
  /// `cmaBytes`: single copy from this size (RAILCC_CMA_BYTES as cmaBytesFor resolved it).
  void setShmPeers(std::vector<bool> shm, std::vector<int> localRanks, size_t streamMin, int64_t busyUs,
                   int64_t cmaBytes);

  // ---- the op being run
  void begin(const OpStamp* op);
  void end() { op_ = nullptr; }
  const OpStamp* current() const { return op_; }
  /// (peer, start time stamped in its first message) of the current op, one per peer heard
  /// from; the owner may add its own.
  std::vector<std::pair<int, int64_t>>& arrivals() { return arrived_; }
  /// The peers of the transfers that were unfinished when a step failed.
  const std::vector<int>& waitingOn() const { return waitingOn_; }

  // ---- building a step
  Transfer sendTo(int peer, const void* p, size_t bytes) const {
    Transfer t;
    t.kind = Transfer::kSend;
    t.peer = peer;
    t.src = static_cast<const char*>(p);
    t.bytes = bytes;
    t.hdr = op_->fp;
    t.hdr.bytes = bytes;
    return t;
  }
  Transfer recvFrom(int peer, void* p, size_t bytes) const {
    Transfer t = sendTo(peer, nullptr, bytes);
    t.kind = Transfer::kRecv;
    t.dst = static_cast<char*>(p);
    t.bypassCache = bytes >= streamMin_ && shmPeer(peer);
    return t;
  }
  Transfer recvReduce(int peer, void* p, size_t count, DataType dt, ReduceOp op, double scale) const {
    Transfer t = recvFrom(peer, p, count * dtypeSize(dt));
    t.kind = Transfer::kRecvReduce;
    t.dtype = dt;
    t.op = op;
    t.scale = scale;
    return t;
  }
  bool shmPeer(int peer) const { return shmPeer_[static_cast<size_t>(peer)]; }
  // Receives of at least streamMin bytes from shared memory write around the cache: the
  // local ranks' results together no longer fit in the last-level cache. An op that writes
  // `total` bytes in pieces (all-gather, all-to-all) does the same for its pieces of at least
  // kStreamPiece once `total` reaches it (several pieces together fill the cache as one does).
  static constexpr size_t kStreamPiece = 1u << 20;
  size_t streamMin() const { return streamMin_; }
  bool streamPiece(size_t total, size_t piece) const {
    return piece >= streamMin_ || (total >= streamMin_ && piece >= kStreamPiece);
  }
  void streamPieces(std::vector<Transfer>& xs, size_t total) const {
    for (Transfer& t : xs)
      if (t.kind == Transfer::kRecv && shmPeer(t.peer)) t.bypassCache = streamPiece(total, t.bytes);
  }

  /// Lets the step's sends pass their buffers by address (single copy, RAILCC_CMA_BYTES).
  /// Only for steps in which every rank sends and receives at once (all-gather, all-to-all):
  /// process_vm_readv copies at 0.4-0.7x memcpy's speed here, so where the sender would sit
  /// idle (broadcast, gather, p2p) the FIFO's two copies, one per core and pipelined, finish
  /// sooner; and a reduction out of a piece read that way was slower than out of the FIFO.
  static void singleCopy(std::vector<Transfer>& xs) {
    for (Transfer& t : xs) t.mayPassAddress = t.landsInPlace = t.kind == Transfer::kSend;
  }
  /// Lets the step's sends to peers on other hosts pass their buffers by address where the
  /// transport reads them itself (RDMA rendezvous): only for steps whose receives copy.
  static void zeroCopy(std::vector<Transfer>& xs) {
    for (Transfer& t : xs) t.landsInPlace = t.kind == Transfer::kSend;
  }

  /// What the engine around the layer does beside a step (ChannelHost), for algorithms that
  /// wait in their own loops: move the work beside it; throw if the group was interrupted.
  size_t pumpBeside() { return host_.pumpBeside(); }
  void checkInterrupted() { host_.checkInterrupted(); }
  std::string rankName(int r) const { return host_.rankName(r); }

  // ---- running a step (collective lane)
  /// Queues the transfers on the collective lane; anything that progresses those channels
  /// moves them from then on.
  void post(std::vector<Transfer>& xs);
  /// Drives posted transfers to their end, keeping the work beside them moving.
  void complete(std::vector<Transfer>& xs);
  void exchange(std::vector<Transfer>& xs) {
    post(xs);
    complete(xs);
  }
  /// Moves what is queued on the pair's channels as far as they allow; bytes moved.
  size_t progress(int lane, int peer);
  /// Reads the next header on `ch` (any-source receives look at it before matching).
  bool readHeader(Channel& ch, size_t& moved);
  /// Waits until one of the (lane, peer) channels in `waitOn` may move, `alsoReady` holds,
  /// or an op is queued; fails the op after `timeout` without progress, and a peer found dead.
  void idle(const std::vector<std::pair<int, int>>& waitOn, Millis timeout, const char* what,
            const std::function<bool()>& alsoReady = {});
  /// Something moved: the op's timeout counts from now.
  void touch() { lastProgress_ = Clock::now(); }
  Clock::time_point lastProgress() const { return lastProgress_; }

  // ---- any thread
  /// Wakes the engine thread wherever it waits (doorbell or poll()); with `ifSleeping`, only
  /// when it said it was going to sleep.
  void wake(bool ifSleeping = false);
  /// Every connection and the local domain told that this rank failed (its peers see it).
  void markFailed();
  /// Frees every connection and the local domain (teardown).
  void close();
  /// After a failure the streams are out of step: forget every queued transfer.
  void clear();

  // ---- engine thread
  transport::LocalDomain* local() const { return local_.get(); }
  int localIndex(int r) const {
    return static_cast<int>(std::find(localRanks_.begin(), localRanks_.end(), r) - localRanks_.begin());
  }
  /// How long a wait on these peers spins in place before it yields: the spin budget when
  /// this host has a CPU per rank, none where a peer waited on last ran on this thread's CPU
  /// (the scheduler put both on one CPU; spinning would only keep that peer from running).
  int64_t busyFor(const std::vector<std::pair<int, int>>& waitOn);

 private:
  size_t progressPair(Channel& ch, int lane, int peer);
  size_t progressSend(Channel& ch, Transfer& t);
  size_t progressRecv(Channel& ch, Transfer& t);
  // By address: the send passes its buffer's address, the receive moves it straight out of the
  // sender's memory, in pieces, then acknowledges. Same-host peers (RAILCC_CMA_BYTES) only where
  // the algorithm says single copy wins; others where the transport reads for itself (RDMA,
  // RAILCC_IB_RNDV_BYTES) and the receive copies.
  bool sendsByAddress(Channel& ch, const Transfer& t) const {
    if (t.limit || !t.landsInPlace) return false;
    if (shmPeer(t.peer))
      return t.mayPassAddress && t.bytes >= byAddressMin_ && t.lane == kCollLane && ch.conn->peerReadsUs();
    return t.bytes >= ch.conn->byAddressMinBytes(t.lane == kP2PLane) && ch.conn->peerReadsUs();
  }
  size_t sendByAddress(Channel& ch, Transfer& t);
  size_t recvByAddress(Channel& ch, Transfer& t);
  // GPU memory (device/gpu_direct.cpp): how a send or receive of it moves, decided once, where
  // its first byte would move; false while the caller's stream is not there yet.
  bool startDeviceSend(Channel& ch, Transfer& t);
  bool startDeviceRecv(Channel& ch, Transfer& t);
  // A transfer waits for the caller's GPU stream, which wakes nobody: idle() naps briefly
  // instead of sleeping until a peer or fd does.
  bool deviceWaiting() {
    deviceWait_ = true;
    return false;
  }
  bool deviceWait_ = false;
  bool recvWhole(Channel& ch, Transfer& t, int lane, int peer, size_t& moved);
  void acceptHeader(Channel& ch, Transfer& t, int lane, int peer);
  void checkHeader(const Transfer& t, const WireHeader& h, int peer);
  static void refreshSplit(Transfer& t);
  // Messages up to this size travel as one write of header, payload and padding.
  static constexpr size_t kInlineBytes = 512;
  // Times transfers big enough to say something about the link's throughput: below a few
  // hundred KiB a transfer's time is mostly wake-up latency, not the link.
  static bool sampled(const Transfer& t) { return t.bytes >= (256u << 10); }
  void sampleLink(const Transfer& t, bool send);

  ChannelHost& host_;
  const Config& config_;
  Telemetry& tele_;
  const int rank_, size_;
  std::mutex connMu_;  // guards chans_' connections and local_ against wake/markFailed/close
  std::vector<std::vector<std::vector<Channel>>> chans_;  // [lane][peer][channel], empty until asked for
  std::vector<uint8_t> nchan_;                            // per peer: its pairs' channel count
  void makePair(std::vector<Channel>& v, int peer);
  std::shared_ptr<transport::LocalDomain> local_;         // same-host rings and doorbells
  std::vector<bool> shmPeer_;
  std::vector<int> localRanks_;
  size_t streamMin_ = ~size_t(0);
  size_t byAddressMin_ = ~size_t(0);  // RAILCC_CMA_BYTES (at least 4096), or never
  int64_t busyUs_ = 0;
  // Wakes an engine thread asleep in poll(); `sleeping_` says it is about to.
  int wakeFd_ = -1;
  std::atomic<bool> sleeping_{false};
  // The op being run (engine thread only, like everything below).
  const OpStamp* op_ = nullptr;
  // Per peer: its start time in the current op (0: not heard from yet), and the peers heard
  // from (begin() clears only those: no pass over every rank per op).
  std::vector<int64_t> arrivals_;
  std::vector<std::pair<int, int64_t>> arrived_;
  std::vector<int> waitingOn_;
  Clock::time_point lastProgress_{}, lastAliveCheck_{}, lastReportCheck_{};
  // Kept between steps, so that a warm step allocates nothing.
  std::vector<std::pair<int, int>> completeChans_, completeWaitOn_;
  std::vector<std::array<uint64_t, 3>> byteRows_;
};

}  // namespace railcc::engine
