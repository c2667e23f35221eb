#include "engine/comm_impl.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// Queue and progress thread

void CommImpl::checkOwner() const {
  if (getpid() == ownerPid_) return;
  RAILCC_THROW(kInvalidUsage, "process group '", opts_.name, "' was created by process ", ownerPid_, "; this process (",
               getpid(), ") is a child forked from it and cannot use it: its peers talk to the parent. Create a new ",
               "process group in the child (or use the group only from the parent)");
}

RequestPtr CommImpl::enqueue(std::unique_ptr<Op> op) {
  checkOwner();
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
  if (stragglerPending_.load(std::memory_order_acquire)) {
    // A straggler reported by the watchdog fails the next op when RAILCC_STRAGGLER_ACTION=raise.
    // Attached before the op is queued: a small op may be finished before enqueue() returns.
    std::lock_guard<std::mutex> g(wdMu_);
    stragglerPending_.store(false);
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
  bool wake = !(CallerWaits::active() && !op->device && !op->p2p);
  {
    std::lock_guard<std::mutex> g(mu_);
    if (brokenSet_.load(std::memory_order_acquire)) {
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
    wakeSelf();
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
  op->fp.seq = collSeq_.fetch_add(1) + 1;
  return op;
}

void CommImpl::drainQueue() {
  if (queued_.load(std::memory_order_acquire) == 0) return;
  // drained_ is only touched with the token held; swapping keeps both deques' memory, so a
  // warm queue allocates nothing.
  {
    std::lock_guard<std::mutex> g(mu_);
    takeQueued();
  }
  distributeDrained();
}

void CommImpl::takeQueued() {
  drained_.swap(queue_);
  queued_.store(0);
}

void CommImpl::distributeDrained() {
  for (auto& op : drained_) {
    if (op->p2p) startP2P(std::move(op));
    else collQueue_.push_back(std::move(op));
  }
  drained_.clear();
}

void CommImpl::fail(std::exception_ptr err) {
  {
    std::lock_guard<std::mutex> g(errMu_);
    if (broken_) return;
    broken_ = err;
    brokenSet_.store(true, std::memory_order_release);
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
    if (local_) local_->markFailed();
    for (auto& lane : chans_)
      for (auto& peer : lane)
        for (auto& ch : peer)
          if (ch.conn) ch.conn->markFailed();
  }
  try {
    std::rethrow_exception(err);
  } catch (const Error& e) {
    spreadDeath(e);
  } catch (...) {
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
    // The record comes from another process: a field that is not a rank of the job is
    // passed over (and said), never allowed to end this one.
    for (const std::string& r : split(reason.substr(6, nl == std::string::npos ? std::string::npos : nl - 6), ',')) {
      long long g = -1;
      if (parseInt(r, 0, 1 << 30, g)) rootCause.push_back(static_cast<int>(g));
      else if (!r.empty()) RAILCC_WARN(WATCHDOG, "failed/", peer, " in the store names '", r, "' as a rank; ignored");
    }
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
  // Gone with no word of its own: every group holding it is doomed (see failure_spread.cpp).
  // A peer that reported a failure is alive, or blamed others who may only be slow.
  err.ranksDead = code == ErrorCode::kPeerFailure && reason.empty() && detail.find("reported a failure") == std::string::npos;
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

bool CommImpl::tryAcquire(bool drain) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (busy_) return false;
    busy_ = true;
    if (!drain || queue_.empty()) return true;
    takeQueued();
  }
  distributeDrained();
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
  tele_->opStarted(op.traceId, op.fp.seq, op.fp.startUs);
  std::exception_ptr err;
  std::string what;
  try {
    if (aborted_) RAILCC_THROW(kAborted, abortWhy_);
    // A peer that failed may have sent its part of this op before failing; taking it
    // would let this rank succeed where that rank raised.
    for (int r : localRanks_)
      if (r != rank_ && chan(kCollLane, r).conn->peerReportedFailure())
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
  // Another group of this rank found a member dead and failed us: that is the cause, not
  // the closed connections it left behind.
  if (err && memberDown_) err = brokenError();
  // One lock for the trace and the arrival lags (stragglers) of a successful op.
  if (!err && size_ > 1) arrivals_[static_cast<size_t>(rank_)] = op.fp.startUs;
  tele_->opFinished(op.traceId, op.fp.seq, what, waitingOn_, !err && size_ > 1 ? &arrivals_ : nullptr);
  if (err) {
    fail(err);
    clearChannels();
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
  if (!tryAcquire(true)) return;
  log::setThreadRank(rank_);
  // Usually just `req`'s op: the first one needs no vector.
  std::pair<std::unique_ptr<Op>, std::exception_ptr> first;
  std::vector<std::pair<std::unique_ptr<Op>, std::exception_ptr>> ran;
  std::exception_ptr broken;
  if (brokenSet_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> g(errMu_);
    broken = broken_;
  }
  if (!broken && !stop_) {
    while (!collQueue_.empty() && !collQueue_.front()->device) {
      std::unique_ptr<Op> op = std::move(collQueue_.front());
      collQueue_.pop_front();
      std::exception_ptr err = runCollective(*op);
      bool mine = op->req.get() == req;
      if (!first.first) first = {std::move(op), err};
      else ran.emplace_back(std::move(op), err);
      if (mine || err) break;
    }
  }
  release(true);
  if (first.first) first.first->req->finish(first.second);
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
            auto& ch = chan(kP2PLane, r);
            if (!ch.sendq.empty() || !ch.recvq.empty() || (!anyPending_.empty() && ch.conn)) on.push_back({kP2PLane, r});
          }
          Millis to = !p2pActive_.empty() ? p2pActive_.front()->timeout : anyPending_.front()->timeout;
          idle(on, to, "send/recv");
        }
      } catch (const std::exception& e) {
        // Not only railcc's own errors: anything thrown here would otherwise end the process.
        for (auto& op : p2pActive_) tele_->opFinished(op->traceId, 0, e.what(), {op->xfer.peer});
        for (auto& op : anyPending_) tele_->opFinished(op->traceId, 0, e.what(), {});
        std::exception_ptr err = std::current_exception();
        if (!dynamic_cast<const Error*>(&e)) err = std::make_exception_ptr(Error(ErrorCode::kInternal, e.what()));
        fail(aborted_ ? abortedError() : globalized(err));
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
  Channel& ch = chan(kP2PLane, op->xfer.peer);
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
      Channel& ch = chan(kP2PLane, r);
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
    chan(kP2PLane, got).recvq.push_back(&op.xfer);
    p2pActive_.push_back(std::move(*it));
    it = anyPending_.erase(it);
  }
  for (int r = 0; r < size_; ++r) {
    Channel& ch = chan(kP2PLane, r);
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

// A small message read in one go once all of it is there: header, payload, padding, one
// consume (one publication back to the sender). False, having read nothing, while it is not.
bool CommImpl::recvWhole(Channel& ch, Transfer& t, int lane, int peer, size_t& moved) {
  const size_t pad = pad8(t.bytes) - t.bytes, total = sizeof(WireHeader) + t.bytes + pad;
  auto [p, avail] = ch.conn->peek();
  if (avail < total) return false;
  std::memcpy(&ch.inHdr, p, sizeof(WireHeader));
  acceptHeader(ch, t, lane, peer);
  const char* payload = static_cast<const char*>(p) + sizeof(WireHeader);
  if (t.kind == Transfer::kRecv) {
    if (t.bytes) std::memcpy(t.dst, payload, t.bytes);
  } else if (t.bytes) {
    reduceInto(t.dst, payload, t.bytes / dtypeSize(t.dtype), t.dtype, t.op, t.scale);
  }
  ch.conn->consume(total);
  t.done = t.bytes;
  t.padDone = pad;
  t.finished = true;
  moved += total;
  return true;
}

// The peer's header (in ch.inHdr) for receive `t`: checked against our own call, and its start
// time noted for the arrival lags.
void CommImpl::acceptHeader(Channel& ch, Transfer& t, int lane, int peer) {
  checkHeader(t, ch.inHdr, peer);
  t.matched = true;
  if (lane == kCollLane && arrivals_[static_cast<size_t>(peer)] == 0)
    arrivals_[static_cast<size_t>(peer)] = ch.inHdr.startUs;
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
  if (t.hdrDone == 0 && t.bytes <= kInlineBytes && sendLimit(t) == t.bytes) {
    // Header, payload and padding in one write: the receiver sees the whole message at once
    // (one publication and one wake-up check instead of three).
    char frame[sizeof(WireHeader) + kInlineBytes + 8];
    const size_t pad = pad8(t.bytes) - t.bytes, total = sizeof(WireHeader) + t.bytes + pad;
    std::memcpy(frame, &t.hdr, sizeof(WireHeader));
    if (t.bytes) std::memcpy(frame + sizeof(WireHeader), t.src, t.bytes);
    std::memset(frame + sizeof(WireHeader) + t.bytes, 0, pad);
    size_t k = ch.conn->send(frame, total);
    t.hdrDone = std::min(k, sizeof(WireHeader));
    t.done = std::min(k - t.hdrDone, t.bytes);
    t.padDone = k - t.hdrDone - t.done;
    moved = k;
    if (k == total) {
      t.finished = true;
      return moved;
    }
  }
  while (t.hdrDone < sizeof(WireHeader)) {
    size_t k = ch.conn->send(reinterpret_cast<const char*>(&t.hdr) + t.hdrDone, sizeof(WireHeader) - t.hdrDone);
    if (k == 0) return moved;
    t.hdrDone += k;
    moved += k;
  }
  while (t.done < t.bytes) {
    size_t upto = sendLimit(t);
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
    size_t moved = 0;
    for (Channel& ch : chans_[lane][static_cast<size_t>(peer)])
      if (!ch.sendq.empty() || !ch.recvq.empty()) moved += progressChannelImpl(ch, lane, peer);
    return moved;
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kPeerFailure) peerFailed(peer, e.what());
    throw;
  }
}

size_t CommImpl::progressChannelImpl(Channel& ch, int lane, int peer) {
  size_t moved = 0;
  while (!ch.sendq.empty()) {
    Transfer& t = *ch.sendq.front();
    bool fresh = t.hdrDone == 0;
    size_t k = progressSend(ch, t);
    if (fresh && k > 0 && sampled(t)) t.began = Clock::now();
    moved += k;
    if (!t.finished) break;
    sampleLink(t, true);
    ch.sendq.pop_front();
  }
  while (!ch.recvq.empty()) {
    Transfer& t = *ch.recvq.front();
    if (!t.matched && ch.inHdrGot == 0 && t.bytes <= kInlineBytes && recvWhole(ch, t, lane, peer, moved)) {
      ch.recvq.pop_front();
      continue;
    }
    if (!t.matched) {
      if (!readHeader(ch, moved)) break;
      acceptHeader(ch, t, lane, peer);
      if (sampled(t)) t.began = Clock::now();
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
    auto& chs = chans_[kCollLane][static_cast<size_t>(t.peer)];
    // Large messages are split across the pair's channels, the same way on both sides: the
    // shares depend only on the size, the pair's channel count and RAILCC_CHANNEL_MIN_BYTES.
    size_t minShare = static_cast<size_t>(opts_.config.channelMinBytes);
    size_t k = std::min(chs.size(), t.bytes / std::max<size_t>(minShare, 1));
    if (k < 2) {
      (t.kind == Transfer::kSend ? chs[0].sendq : chs[0].recvq).push_back(&t);
      continue;
    }
    size_t share = (t.bytes + k - 1) / k;
    share = (share + 63) / 64 * 64;  // element-aligned for every dtype
    t.parts = std::make_shared<std::vector<Transfer>>();
    t.parts->reserve(k);
    for (size_t i = 0, off = 0; i < k && off < t.bytes; ++i, off += share) {
      Transfer p = t;
      p.parts.reset();
      p.channel = static_cast<int>(i);
      p.bytes = std::min(share, t.bytes - off);
      p.hdr.bytes = p.bytes;
      if (p.src) p.src += off;
      if (p.dst) p.dst += off;
      p.limitBase = t.limitBase + off;
      t.parts->push_back(p);
    }
    for (Transfer& p : *t.parts) {
      Channel& ch = chs[static_cast<size_t>(p.channel)];
      (p.kind == Transfer::kSend ? ch.sendq : ch.recvq).push_back(&p);
    }
  }
}

// A split message is done when every share is; its `done` counts the bytes moved without a
// gap from its start, which is what a forwarding send limited by it may rely on.
void CommImpl::refreshSplit(Transfer& t) {
  if (!t.parts) return;
  size_t prefix = 0;
  bool all = true, gap = false;
  for (const Transfer& p : *t.parts) {
    all = all && p.finished;
    if (!gap) prefix += p.done;
    gap = gap || !p.finished;
    if (t.began == Clock::time_point{} && p.began != Clock::time_point{}) t.began = p.began;
  }
  t.done = prefix;
  t.finished = all;
}

void CommImpl::complete(std::vector<Transfer>& xs) {
  std::vector<std::pair<int, int>>& chans = completeChans_;  // kept: no allocation per step
  chans.clear();
  for (auto& t : xs)
    if (std::find(chans.begin(), chans.end(), std::make_pair(kCollLane, t.peer)) == chans.end())
      chans.push_back({kCollLane, t.peer});
  // Bytes per peer go to the flight recorder, and on failure the peers still owed bytes.
  struct Account {
    CommImpl* c;
    std::vector<Transfer>& xs;
    ~Account() {
      if (!c->current_) return;
      try {
        auto& rows = c->byteRows_;
        rows.clear();
        for (auto& t : xs) rows.push_back({static_cast<uint64_t>(t.peer), t.kind == Transfer::kSend ? t.done : 0,
                                           t.kind == Transfer::kSend ? 0 : t.done});
        c->tele_->opBytes(c->current_->traceId, rows);
      } catch (const std::bad_alloc&) {  // the trace goes without these bytes
      }
      for (auto& t : xs) {
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
    for (auto& t : xs) {
      refreshSplit(t);
      all = all && t.finished;
    }
    moved += pumpP2P();
    if (all) return;
    if (moved) {
      lastProgress_ = Clock::now();
      continue;
    }
    if (aborted_) RAILCC_THROW(kAborted, abortWhy_);
    if (memberDown_) std::rethrow_exception(brokenError());
    std::vector<std::pair<int, int>>& on = completeWaitOn_;  // kept: no allocation per wait
    on.clear();
    for (auto& t : xs)
      if (!t.finished) on.push_back({kCollLane, t.peer});
    idle(on, current_->timeout, opKindName(current_->kind));
  }
}

int64_t CommImpl::busyFor(const std::vector<std::pair<int, int>>& waitOn) {
  if (busyUs_ == 0 || !local_) return busyUs_;
  int cpu = sched_getcpu();
  if (cpu < 0) return busyUs_;
  local_->publishCpu(cpu);
  for (const auto& [lane, peer] : waitOn)
    if (shmPeer_[static_cast<size_t>(peer)] &&
        local_->lastCpu(localIndex(peer)) == cpu)
      return 0;
  return busyUs_;
}

void CommImpl::idle(const std::vector<std::pair<int, int>>& waitOn, Millis timeout, const char* what,
                    const std::function<bool()>& alsoReady) {
  if (memberDown_) std::rethrow_exception(brokenError());
  auto now = Clock::now();
  if (stop_ && now - lastProgress_ > Millis(1000))
    RAILCC_THROW(kAborted, what, " was still pending when the process group was shut down");
  if (now - lastProgress_ > timeout) {
    std::vector<Transfer*> pending;
    for (auto& [lane, peer] : waitOn)
      for (Channel& ch : chans_[lane][static_cast<size_t>(peer)]) {
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
        for (Channel& ch : chans_[lane][static_cast<size_t>(peer)]) ch.conn->checkAlive();
      } catch (const Error& e) {
        peerFailed(peer, e.what());
      }
    }
  }
  // Spin briefly (a peer is usually microseconds away), then sleep so that ranks sharing a
  // core do not starve the one that has work.
  auto anyReady = [&] {
    if (alsoReady && alsoReady()) return true;
    for (auto& [lane, peer] : waitOn)
      for (Channel& ch : chans_[lane][static_cast<size_t>(peer)]) {
        if (ch.conn->pollFd() >= 0) continue;
        if (!ch.recvq.empty() && ch.conn->peek().second > 0) return true;
        if (!ch.sendq.empty() && hasBytesToSend(*ch.sendq.front()) && ch.conn->canSend()) return true;
      }
    return queued_.load() > 0;
  };
  if (pollFor(opts_.config.spinUs, anyReady, busyFor(waitOn))) return;
  std::vector<pollfd> fds;
  bool hasDoorbell = false;
  for (auto& [lane, peer] : waitOn)
    for (Channel& ch : chans_[lane][static_cast<size_t>(peer)]) {
      int fd = ch.conn->pollFd();
      if (fd < 0) {
        hasDoorbell = true;
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
    if (queued_.load() == 0) poll(fds.data(), fds.size(), hasDoorbell ? 1 : 100);
    uint64_t v;
    if (read(wakeFd_.fd, &v, sizeof(v)) < 0) { /* nothing pending */ }
  } else if (local_) {
    // The timeout only bounds how late abort, liveness and timeout checks can run.
    local_->sleep(100000, [&] { return anyReady(); });
  }
  sleeping_.store(false);
}

void CommImpl::failStalled(const std::vector<Transfer*>& pending, Millis timeout) {
  std::ostringstream os;
  os << (current_ ? opKindName(current_->kind) : "send/recv");
  if (current_) os << " (seq " << current_->fp.seq << ")";
  // "timed out" on the first line: scripts and torch's own tests match on it.
  os << " timed out: no progress for " << timeout.count() << " ms; waiting on:";
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
  wakeSelf();
  uint64_t one = 1;
  if (write(wakeFd_.fd, &one, sizeof(one)) < 0) { /* best effort */ }
}

void CommImpl::shutdown() {
  unlist();
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
    wd_->cv.wait(g, [&] { return !wd_->inComm; });  // a GPU check in progress uses this communicator
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
    local_.reset();
  }
  releaseDevice();
}

}  // namespace railcc::engine
