#include "common/log.h"
#include "common/waits.h"
#include "engine/comm_impl.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// Queue and progress thread

void CommImpl::checkOwner() const {
  if (thisPid() == ownerPid_) return;
  RAILCC_THROW(kInvalidUsage, "process group '", opts_.name, "' was created by process ", ownerPid_, "; this process (",
               getpid(), ") is a child forked from it and cannot use it: its peers talk to the parent. Create a new ",
               "process group in the child (or use the group only from the parent)");
}

uint64_t CommImpl::traceQueued(const Op& op, int64_t startedUs) {
  if (op.p2p)
    return tele_->opQueued(0, op.xfer.kind == Transfer::kSend ? "send" : "recv", "-", "-", op.xfer.peer, op.xfer.bytes);
  auto k = static_cast<OpKind>(op.fp.kind);
  bool reduces = k == OpKind::kAllreduce || k == OpKind::kReduce || k == OpKind::kReduceScatter ||
                 k == OpKind::kAllreduceCoalesced;
  bool rooted = k == OpKind::kBroadcast || k == OpKind::kReduce || k == OpKind::kGather || k == OpKind::kScatter;
  return tele_->opQueued(op.fp.seq, opKindName(k), dtypeName(static_cast<DataType>(op.fp.dtype)),
                         reduces ? reduceOpName(static_cast<ReduceOp>(op.fp.redop)) : "-", rooted ? op.fp.root : -1,
                         op.fp.count, startedUs);
}

RequestPtr CommImpl::enqueue(std::unique_ptr<Op> op) {
  checkOwner();
  if (estimate_.on.load(std::memory_order_relaxed)) return estimated(*op);
  op->req = std::make_shared<Request>(opts_.config.spinUs, userPool_);
  op->live.attach(&opsLive_);
  op->timeout = op->timeout.count() <= 0 ? opts_.timeout : boundedWait(op->timeout);
  RequestPtr req = op->req;
  // A straggler reported by the watchdog fails the next op when RAILCC_STRAGGLER_ACTION=raise.
  // Attached before the op is queued: a small op may be finished before enqueue() returns.
  std::string stragglers;
  std::vector<int> slow;
  if (watchdog_.takeStraggler(stragglers, slow)) {
    Error e(ErrorCode::kStraggler, stragglers);
    e.ranks = slow;
    for (int r : e.ranks) e.hosts.push_back(peers_[static_cast<size_t>(r)].hostname);
    req->setStraggler(globalized(std::make_exception_ptr(e)));
  }
  // A host collective whose caller would run it in wait() anyway runs now when it can.
  const bool callerRuns = CallerWaits::active() && !op->device && !op->p2p;
  if (callerRuns && runNow(*op)) return req;
  op->traceId = traceQueued(*op);
  std::exception_ptr err;
  // A caller that runs the op itself in wait() needs no wake-up, unless somebody holds the
  // engine: it is then that thread's to find the op (a progress thread asleep in a send/recv
  // wait has to be woken for it).
  bool wake = !callerRuns;
  {
    std::lock_guard<std::mutex> g(q_.mu);
    if (health_.brokenSet.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> ge(health_.errMu);
      err = health_.broken;
    }
    if (!err && q_.closing)
      err = std::make_exception_ptr(Error(ErrorCode::kAborted, "the process group was shut down"));
    if (!err) {
      q_.queue.push_back(std::move(op));
      q_.queued.fetch_add(1);
      wake = wake || q_.busy;
    }
  }
  if (err) {
    req->finish(err);
    return req;
  }
  if (!wake) return req;
  q_.cv.notify_one();
  ch_.wake(true);
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
  if (!estimate_.on.load(std::memory_order_relaxed)) op->fp.seq = q_.collSeq.fetch_add(1) + 1;
  return op;
}

void CommImpl::drainQueue() {
  if (q_.queued.load(std::memory_order_acquire) == 0) return;
  // q_.drained is only touched with the token held; swapping keeps both deques' memory, so a
  // warm queue allocates nothing.
  {
    std::lock_guard<std::mutex> g(q_.mu);
    takeQueued();
  }
  distributeDrained();
}

void CommImpl::takeQueued() {
  q_.drained.swap(q_.queue);
  q_.queued.store(0);
}

void CommImpl::distributeDrained() {
  for (auto& op : q_.drained) {
    if (op->p2p) startP2P(std::move(op));
    else q_.coll.push_back(std::move(op));
  }
  q_.drained.clear();
}

bool CommImpl::tryAcquire(bool drain) {
  {
    std::lock_guard<std::mutex> g(q_.mu);
    if (q_.busy) return false;
    q_.busy = true;
    if (!drain || q_.queue.empty()) return true;
    takeQueued();
  }
  distributeDrained();
  return true;
}

void CommImpl::poke() {
  {
    std::lock_guard<std::mutex> g(q_.mu);
    q_.kick = true;
  }
  q_.cv.notify_one();
}

void CommImpl::release(bool wakeProgress) {
  bool more = wakeProgress && (!q_.coll.empty() || !q_.p2p.empty() || !q_.anySource.empty());
  {
    std::lock_guard<std::mutex> g(q_.mu);
    q_.busy = false;
    if (more) q_.kick = true;
    more = more || (wakeProgress && !q_.queue.empty());
  }
  if (more) q_.cv.notify_all();
}

void CommImpl::failQueued(std::exception_ptr broken) {
  for (auto& op : q_.coll) op->req->finish(broken);
  q_.coll.clear();
  for (auto& op : q_.p2p) op->req->finish(broken);
  q_.p2p.clear();
  for (auto& op : q_.anySource) op->req->finish(broken);
  q_.anySource.clear();
}

// The lean path for small synchronous calls (issue 70): when nobody holds the engine and
// nothing is queued, the caller runs its collective here, before its Work exists, instead of
// queueing it for its own wait(): one lock for the token instead of three for the queue, the
// token and its release, one flight-recorder update for queued and started, and a request
// finished before anybody waits on it (its Work completes at once, with no callback kept).
// The watchdog, the mismatch checks and the flight recorder see the op as any other. False
// (nothing done) when the engine is busy, or ops taken before this one have not run yet.
bool CommImpl::runNow(Op& op) {
  {
    std::lock_guard<std::mutex> g(q_.mu);
    if (q_.busy || !q_.queue.empty() || q_.closing || q_.stop.load()) return false;
    q_.busy = true;
  }
  // The token is ours, and q_.coll with it.
  if (!q_.coll.empty() || health_.brokenSet.load(std::memory_order_acquire)) {
    release(true);
    return false;
  }
  log::setThreadRank(rank_);
  int64_t now = wallMicros();
  op.traceId = traceQueued(op, now);
  std::exception_ptr err = runCollective(op, now);
  release(true);
  op.req->finish(err);
  return true;
}

// Runs one collective with the token held; the caller finishes its request. `startedUs` > 0:
// the flight recorder already has it started (runNow).
std::exception_ptr CommImpl::runCollective(Op& op, int64_t startedUs) {
  op.fp.startUs = startedUs > 0 ? startedUs : wallMicros();
  ch_.begin(&op);
  if (startedUs <= 0) tele_->opStarted(op.traceId, op.fp.seq, op.fp.startUs);
  std::exception_ptr err;
  std::string what;
  try {
    if (health_.aborted) RAILCC_THROW(kAborted, health_.abortWhy);
    // A peer that failed may have sent its part of this op before failing; taking it
    // would let this rank succeed where that rank raised.
    for (int r : localRanks_)
      if (r != rank_ && ch_.chan(kCollLane, r).conn->peerReportedFailure())
        peerFailed(r, "it reported a failure of its own");
    if (!links_.collectiveRead) readCollectiveEndpoints(op);
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
  if (err && health_.aborted) err = abortedError();
  if (err) err = globalized(err);
  // Another group of this rank found a member dead and failed us: that is the cause, not
  // the closed connections it left behind.
  if (err && health_.memberDown) err = brokenError();
  // One lock for the trace and the arrival lags (stragglers) of a successful op.
  if (!err && size_ > 1 && op.fp.startUs > 0) ch_.arrivals().push_back({rank_, op.fp.startUs});
  tele_->opFinished(op.traceId, op.fp.seq, what, ch_.waitingOn(), !err && size_ > 1 ? &ch_.arrivals() : nullptr);
  if (err) {
    fail(err);
    ch_.clear();
  }
  ch_.end();
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
  if (health_.brokenSet.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> g(health_.errMu);
    broken = health_.broken;
  }
  if (!broken && !q_.stop) {
    while (!q_.coll.empty() && !q_.coll.front()->device) {
      std::unique_ptr<Op> op = std::move(q_.coll.front());
      q_.coll.pop_front();
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
  bool held = false, spinNext = false;
  while (true) {
    if (!held) {
      if (!tryAcquire()) {
        // A caller runs its op; it hands over what it leaves behind (q_.kick).
        std::unique_lock<std::mutex> g(q_.mu);
        q_.cv.wait_for(g, Millis(100), [&] { return !q_.busy && (q_.kick || !q_.queue.empty() || q_.stop.load()); });
        q_.kick = false;
        continue;
      }
      held = true;
    }
    drainQueue();
    std::exception_ptr broken;
    {
      std::lock_guard<std::mutex> g(health_.errMu);
      broken = health_.broken;
    }
    if (broken) failQueued(broken);
    if (!q_.coll.empty()) {
      std::unique_ptr<Op> op = std::move(q_.coll.front());
      q_.coll.pop_front();
      std::exception_ptr err = runCollective(*op);
      op->req->finish(err);
      spinNext = true;
      continue;
    }
    if (!q_.p2p.empty() || !q_.anySource.empty()) {
      spinNext = true;
      try {
        if (health_.aborted) RAILCC_THROW(kAborted, health_.abortWhy);
        size_t moved = progressP2P();
        finishP2P();
        if (moved == 0 && (!q_.p2p.empty() || !q_.anySource.empty())) {
          std::vector<std::pair<int, int>> on;
          for (int r : p2pPeers()) on.push_back({kP2PLane, r});
          if (!q_.anySource.empty())  // any peer may send it
            for (int r = 0; r < size_; ++r)
              if (r != rank_ && !std::binary_search(q_.p2pPeers.begin(), q_.p2pPeers.end(), r)) on.push_back({kP2PLane, r});
          Millis to = !q_.p2p.empty() ? q_.p2p.front()->timeout : q_.anySource.front()->timeout;
          ch_.idle(on, to, "send/recv");
        }
      } catch (const std::exception& e) {
        // Not only railcc's own errors: anything thrown here would otherwise end the process.
        for (auto& op : q_.p2p) tele_->opFinished(op->traceId, 0, e.what(), {op->xfer.peer});
        for (auto& op : q_.anySource) tele_->opFinished(op->traceId, 0, e.what(), {});
        std::exception_ptr err = std::current_exception();
        if (!dynamic_cast<const Error*>(&e)) err = std::make_exception_ptr(Error(ErrorCode::kInternal, e.what()));
        fail(health_.aborted ? abortedError() : globalized(err));
        ch_.clear();
      }
      continue;
    }
    if (q_.stop) break;  // with the token held: nobody runs anything after this
    // Idle: a caller may now run its own op (helpRun).
    release(false);
    held = false;
    // A caller that just got its result often posts the next op at once: poll a moment
    // before sleeping, which saves a wake-up on the latency path.
    // Only after work: a wake-up that found nothing (the 100 ms recheck) sleeps again at once,
    // so that an idle rank costs no CPU (every rank of an idle job spun 10 times a second).
    if (std::exchange(spinNext, false))
      pollFor(opts_.config.spinUs, [&] { return q_.queued.load(std::memory_order_acquire) != 0 || q_.stop; });
    if (q_.queued.load(std::memory_order_acquire) != 0 || q_.stop) continue;
    std::unique_lock<std::mutex> g(q_.mu);
    q_.cv.wait_for(g, Millis(100), [&] { return !q_.queue.empty() || q_.stop.load() || q_.kick; });
    q_.kick = false;
  }
}

// Sends and receives: each is one transfer on the p2p lane, matched in posting order per peer.
void CommImpl::startP2P(std::unique_ptr<Op> op) {
  if (q_.p2p.empty() && q_.anySource.empty()) ch_.touch();
  tele_->opStarted(op->traceId, op->p2p ? 0 : op->fp.seq);
  if (op->anySource) {
    q_.anySource.push_back(std::move(op));
    return;
  }
  Channel& ch = ch_.chan(kP2PLane, op->xfer.peer);
  (op->xfer.kind == Transfer::kSend ? ch.sendq : ch.recvq).push_back(&op->xfer);
  q_.p2p.push_back(std::move(op));
}

size_t CommImpl::progressP2P() {
  size_t moved = 0;
  // A receive from any source takes the first peer whose next message is a matching send.
  for (auto it = q_.anySource.begin(); it != q_.anySource.end();) {
    Op& op = **it;
    int got = -1;
    for (int r = 0; r < size_ && got < 0; ++r) {
      if (r == rank_) continue;
      Channel& ch = ch_.chan(kP2PLane, r);
      if (!ch.recvq.empty()) continue;
      // Any peer may be the sender: one not connected yet is connected now.
      if (!ch.conn && !connectPeer(r, kP2PLane)) continue;
      try {
        if (ch_.readHeader(ch, moved) && ch.inHdr.tag == op.xfer.hdr.tag) got = r;
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
    ch_.chan(kP2PLane, got).recvq.push_back(&op.xfer);
    q_.p2p.push_back(std::move(*it));
    it = q_.anySource.erase(it);
  }
  for (int r : p2pPeers()) moved += ch_.progress(kP2PLane, r);
  if (moved) ch_.touch();
  return moved;
}

const std::vector<int>& CommImpl::p2pPeers() {
  // The peers of the sends and receives under way, not a pass over every rank of the group.
  std::vector<int>& v = q_.p2pPeers;
  v.clear();
  for (auto& op : q_.p2p) v.push_back(op->xfer.peer);
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

void CommImpl::finishP2P() {
  for (auto it = q_.p2p.begin(); it != q_.p2p.end();) {
    if ((*it)->xfer.finished) {
      const Transfer& t = (*it)->xfer;
      tele_->opBytes((*it)->traceId, t.peer, t.kind == Transfer::kSend ? t.done : 0, t.kind == Transfer::kSend ? 0 : t.done);
      tele_->opFinished((*it)->traceId, 0, "", {});
      (*it)->req->finish(nullptr);
      it = q_.p2p.erase(it);
    } else {
      ++it;
    }
  }
}

void CommImpl::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> g(q_.mu);
    if (!health_.aborted) health_.abortWhy = why;
    health_.aborted = true;
  }
  fail(abortedError());
  q_.cv.notify_all();
  ch_.wake();
}

void CommImpl::shutdown() {
  unlist();
  {
    std::lock_guard<std::mutex> g(q_.mu);
    if (q_.closing && !q_.thread.joinable()) return;
    q_.closing = true;
  }
  if (q_.thread.joinable()) {
    // The progress thread finishes what is queued and then exits; ops that stop moving for a
    // second after this point are failed with kAborted, so shutdown never hangs.
    q_.stop = true;
    q_.cv.notify_all();
    q_.thread.join();
  }
  // Every request is finished now; the callbacks they handed over run to their end (new ops
  // they queue fail at once: q_.closing is set).
  userPool_->shutdown(Millis(5000));
  watchdog_.stop();
  // abort() may run now on another thread (a watchdog, work.wait(timeout)): close() and
  // markFailed() exclude each other.
  ch_.close();
  device_.releaseDevice();
}

// Keeps sends and receives moving while a collective waits; returns bytes moved.
size_t CommImpl::pumpP2P() {
  if (q_.p2p.empty() && q_.anySource.empty() && q_.queued.load(std::memory_order_relaxed) == 0) return 0;
  drainQueue();
  size_t moved = progressP2P();
  finishP2P();
  return moved;
}

std::exception_ptr CommImpl::abortedError() {
  std::lock_guard<std::mutex> g(q_.mu);
  return std::make_exception_ptr(Error(ErrorCode::kAborted, health_.abortWhy));
}

}  // namespace railcc::engine
