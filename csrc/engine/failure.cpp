#include "common/log.h"
#include "common/strings.h"
#include "engine/comm_impl.h"
#include "engine/records.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// How a group fails: fail() records the error, tells the peers through the store, marks the
// connections and spreads a death to this rank's other groups; peerFailed() turns a peer's
// closed connection or exit (and the reason it published) into the error that names it;
// failStalled() is the timeout's error, naming who never called the op, froze or is stuck.

void CommImpl::fail(std::exception_ptr err) {
  {
    std::lock_guard<std::mutex> g(health_.errMu);
    if (health_.broken) return;
    health_.broken = err;
    health_.brokenSet.store(true, std::memory_order_release);
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
  watchdog_.publish("failed/" + std::to_string(rank_), (culprits.empty() ? "" : "ranks=" + culprits + "\n") + msg);
  ch_.markFailed();
  device_.abortShots();  // a one-kernel op waiting on the GPU for a peer gives up too
  // A peer dialing us for a connection made at first use is refused from now on, instead of
  // waiting for a handshake nobody will answer.
  for (auto& s : links_.setups) s->markFailed();
  try {
    std::rethrow_exception(err);
  } catch (const Error& e) {
    spreadDeath(e);
  } catch (...) {
  }
  try {
    std::string path = watchdog_.writeTrace("failure");
    if (!path.empty()) RAILCC_WARN(WATCHDOG, "flight recorder written to ", path);
  } catch (const std::exception& e) {
    RAILCC_WARN(WATCHDOG, "could not write the flight recorder: ", e.what());
  }
  // torch's abort hooks: after the peers are told (a hook may take a while, a flight-recorder
  // dump, and a late peer must not finish the op meanwhile), before any teardown.
  if (opts_.onFailure) {
    try {
      opts_.onFailure(err);
    } catch (const std::exception& e) {
      RAILCC_WARN(WATCHDOG, "group '", opts_.name, "': a failure hook threw: ", e.what());
    }
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
    watchdog_.waitPublished(Millis(1000));  // a moment to put the reason in the store for the peers
    std::abort();
  }
}

// The watchdog's look at the GPU work (device/gpu_watch.cpp): work past its op's timeout fails
// the group, and the progress thread is woken wherever it waits so that what is queued fails too.
void CommImpl::checkGpu(Clock::time_point* next) {
  std::exception_ptr late = device_.checkGpuWork(next);
  if (!late || brokenError()) return;
  fail(late);
  ch_.wake();
  q_.cv.notify_all();
}

// The group was aborted, or failed by another group of this rank (memberDied).
void CommImpl::checkInterrupted() {
  if (health_.aborted) RAILCC_THROW(kAborted, health_.abortWhy);
  if (health_.memberDown) std::rethrow_exception(brokenError());
}

void CommImpl::stalled(const std::vector<Transfer*>& pending, Millis timeout) { failStalled(pending, timeout); }

void CommImpl::checkPeersReported(const std::vector<std::pair<int, int>>& waitOn) {
  if (opts_.config.progressIntervalMs <= 0) return;  // no background store traffic asked for
  // A few peers a second (an all-to-all waits on many), in turn across checks.
  constexpr size_t kPerCheck = 8;
  std::vector<std::pair<int, bool>> peers;  // and whether every lane waited on has a connection to it
  for (auto& [lane, p] : waitOn) {
    if (p == rank_) continue;
    const bool up = static_cast<bool>(ch_.chan(lane, p).conn);
    auto it = std::find_if(peers.begin(), peers.end(), [p = p](const auto& e) { return e.first == p; });
    if (it == peers.end()) peers.emplace_back(p, up);
    else it->second = it->second && up;
  }
  // A peer not connected yet may never come: it failed its own init after this rank's ended
  // (a setting of its own refused), and said why in the group's store (publishInitFailure).
  if (std::any_of(peers.begin(), peers.end(), [](const auto& e) { return !e.second; })) {
    std::string rec;
    if (watchdog_.storeTryGet("initfail/why", Millis(2), rec))
      throwInitFailure(rec, "railcc group '" + opts_.name + "': ", ", so it never joins the group");
  }
  const size_t n = std::min(peers.size(), kPerCheck);
  for (size_t i = 0; i < n; ++i) {
    const auto [p, up] = peers[(health_.reportTurn + i) % peers.size()];
    std::string reason;
    if (watchdog_.storeTryGet("failed/" + std::to_string(p), Millis(2), reason) && !reason.empty())
      peerFailed(p, "it reported a failure of its own");
    std::string why;
    if (!up && watchdog_.heartbeatStopped(p, why)) peerFailed(p, why);
  }
  health_.reportTurn += n;
}

void CommImpl::peerFailed(int peer, const std::string& detail) {
  const PeerInfo& p = peers_[static_cast<size_t>(peer)];
  std::string reason;
  watchdog_.storeTryGet("failed/" + std::to_string(peer), Millis(200), reason);
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
  int pid = p.pid;
  std::string rec;  // a rank of another host: set-up never read its record; read now, at best effort
  if (pid <= 0 && watchdog_.storeTryGet("peer/" + std::to_string(peer), Millis(200), rec)) {
    try {
      pid = std::atoi(parsePeerRecord(rec, rankName(peer))[2].c_str());
    } catch (const Error&) {  // malformed: the message goes without the pid
    }
  }
  const std::string pidText = pid > 0 ? ", pid " + std::to_string(pid) : "";
  ErrorCode code = ErrorCode::kPeerFailure;
  std::string msg;
  if (reason.rfind("collective mismatch", 0) == 0) {
    code = ErrorCode::kMismatch;  // the peer saw both calls; repeat them here
    msg = rankName(peer) + " (host " + p.hostname + ") detected a " + reason;
  } else if (!reason.empty()) {
    msg = rankName(peer) + " (host " + p.hostname + ", " + linkOf(peer) + ") failed: " + innermostReason(reason);
  } else if (detail.find("reported a failure") != std::string::npos) {
    msg = rankName(peer) + " (host " + p.hostname + pidText + ", " + linkOf(peer) +
          ") failed earlier; its reason is no longer readable from the store (see that rank's log or trace dump)";
  } else {
    msg = rankName(peer) + " (host " + p.hostname + pidText + ", " +
          linkOf(peer) + ") is gone: " + detail + "; it left no report, so it most likely died (killed, OOM or crash)";
  }
  Error err(code, msg);
  err.ranks = {globalRank(peer)};
  err.hosts = {p.hostname};
  err.ranksGlobal = true;
  // Gone with no word of its own: every group holding it is doomed (see spreadDeath below).
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
  if (ch_.current()) {
    err.seq = static_cast<long long>(ch_.current()->fp.seq);
    err.op = opKindName(ch_.current()->kind);
  }
  throw err;
}

void CommImpl::failStalled(const std::vector<Transfer*>& pending, Millis timeout) {
  std::ostringstream os;
  std::vector<int> ranks;
  std::vector<std::string> hosts;
  for (Transfer* t : pending) {
    os << "\n  " << (t->kind == Transfer::kSend ? "sending to " : "receiving from ") << peerName(t->peer) << ", "
       << t->done << " of " << t->bytes << " bytes moved";
    const bool up = t->lane >= 0 && t->lane < kLanes && ch_.chan(t->lane, t->peer).conn;
    if (!up)
      os << " (the connection, made at first use, is not up yet: that rank has not reached this op, or "
            "cannot be reached)";
    // A send or receive of GPU memory that waits for the caller's stream (gpu_direct.cpp): this
    // rank's GPU is what is late, not the peer.
    if (t->device && ((t->kind == Transfer::kSend && up && t->hdrDone == 0) || t->dst == t->device->gpu)) {
      os << " (waiting for this rank's GPU: the caller's CUDA stream on cuda:" << t->device->device
         << " has not reached the call; the work queued on it before is still running)";
      ranks.push_back(rank_);
      hosts.push_back(peers_[static_cast<size_t>(rank_)].hostname);
      continue;
    }
    ranks.push_back(t->peer);
    hosts.push_back(peers_[static_cast<size_t>(t->peer)].hostname);
  }
  failTimedOut(os.str(), std::move(ranks), std::move(hosts), timeout);
}

void CommImpl::failTimedOut(const std::string& waitingOn, std::vector<int> ranks, std::vector<std::string> hosts,
                            Millis timeout) {
  std::ostringstream os;
  os << (ch_.current() ? opKindName(ch_.current()->kind) : "send/recv");
  if (ch_.current()) os << " (seq " << ch_.current()->fp.seq << ")";
  // "timed out" on the first line: scripts and torch's own tests match on it.
  os << " timed out: no progress for " << timeout.count() << " ms; waiting on:" << waitingOn;
  if (ch_.current()) {
    // Which ranks never called this op, which froze, which joined and are stuck: from the
    // progress records every rank publishes.
    std::vector<int> culprits;
    os << watchdog_.describePeerProgress(ch_.current()->fp.seq, culprits);
    if (!culprits.empty()) {
      ranks = culprits;
      hosts.clear();
      for (int r : ranks) hosts.push_back(peers_[static_cast<size_t>(r)].hostname);
    }
  }
  Error err(ErrorCode::kTimeout, os.str());
  err.ranks = std::move(ranks);
  err.hosts = std::move(hosts);
  if (ch_.current()) {
    err.seq = static_cast<long long>(ch_.current()->fp.seq);
    err.op = opKindName(ch_.current()->kind);
  }
  throw err;
}



// ---------------------------------------------------------------------------------------
// A dead rank dooms every group it belongs to, not only the one that saw it die.
//
// Rank 2 finds rank 1 dead in a subgroup and raises there; its world group is idle and
// healthy, so rank 0, waiting in a world collective for rank 2's part, would wait for its
// timeout: it never talks to rank 1 in that step and cannot tell it is gone. Here the
// failing group tells the process's other groups that hold the dead rank; each fails as
// if it had seen the death itself: it publishes "failed/<rank>" naming the dead rank and
// shuts its connections, so its own peers raise at once and name the dead rank too.
//
// "This process" is decided by the global rank: communicators of one rank share it, and
// ranks simulated as threads of one test process do not. The dead rank must be the same
// process in both groups (same host identity and pid).

namespace {

struct Registry {
  std::recursive_mutex mu;  // a notified group fails and notifies in turn, on this thread
  std::vector<CommImpl*> comms;
};

Registry& registry() {
  static Registry* r = new Registry;  // outlives communicators torn down at exit
  return *r;
}

}  // namespace

void CommImpl::enlist() {
  std::lock_guard<std::recursive_mutex> g(registry().mu);
  registry().comms.push_back(this);
}

void CommImpl::unlist() {
  std::lock_guard<std::recursive_mutex> g(registry().mu);
  auto& v = registry().comms;
  v.erase(std::remove(v.begin(), v.end(), this), v.end());
}

void CommImpl::spreadDeath(const Error& e) {
  if (e.code() != ErrorCode::kPeerFailure || !e.ranksDead || e.ranks.empty()) return;
  struct Dead {
    int global;
    std::string hostId;
    int pid;
  };
  std::vector<Dead> dead;
  for (int r : e.ranks) {
    int g = e.ranksGlobal ? r : globalRank(r);
    for (int q = 0; q < size_; ++q)
      if (globalRank(q) == g && q != rank_)
        dead.push_back({g, peers_[static_cast<size_t>(q)].hostId, peers_[static_cast<size_t>(q)].pid});
  }
  if (dead.empty()) return;
  std::lock_guard<std::recursive_mutex> g(registry().mu);
  for (CommImpl* other : registry().comms) {
    if (other == this || other->globalRank(other->rank_) != globalRank(rank_)) continue;
    std::vector<int> theirs;
    for (const Dead& d : dead)
      for (int q = 0; q < other->size_; ++q) {
        const PeerInfo& p = other->peers_[static_cast<size_t>(q)];
        if (q != other->rank_ && other->globalRank(q) == d.global && p.hostId == d.hostId && p.pid == d.pid)
          theirs.push_back(q);
      }
    if (!theirs.empty()) other->memberDied(theirs, opts_.name, e.what());
  }
}

void CommImpl::memberDied(const std::vector<int>& ranks, const std::string& group, const std::string& why) {
  {
    std::lock_guard<std::mutex> g(health_.errMu);
    if (health_.broken) {  // failed already: remembered, for railcc.failed_ranks() and a shrink's retry
      for (int r : ranks)
        if (std::find(health_.laterDead.begin(), health_.laterDead.end(), globalRank(r)) == health_.laterDead.end())
          health_.laterDead.push_back(globalRank(r));
      return;
    }
  }
  std::ostringstream os;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const PeerInfo& p = peers_[static_cast<size_t>(ranks[i])];
    os << (i ? ", " : "") << rankName(ranks[i]) << " (host " << p.hostname
       << (p.pid > 0 ? ", pid " + std::to_string(p.pid) : std::string()) << ", " << linkOf(ranks[i]) << ")";
  }
  os << " failed, as group '" << group << "' on this rank found: " << why;
  Error err(ErrorCode::kPeerFailure, os.str());
  for (int r : ranks) {
    err.ranks.push_back(globalRank(r));
    err.hosts.push_back(peers_[static_cast<size_t>(r)].hostname);
  }
  err.ranksGlobal = true;
  err.ranksDead = true;
  health_.memberDown = true;
  fail(std::make_exception_ptr(err));
  // Wake our progress thread wherever it waits: the op it runs fails with this error.
  ch_.wake();
  q_.cv.notify_all();
}

std::string CommImpl::seenDeadElsewhere(int g) const {
  std::lock_guard<std::recursive_mutex> lk(registry().mu);
  for (CommImpl* other : registry().comms) {
    if (other == this || other->globalRank(other->rank_) != globalRank(rank_)) continue;
    std::exception_ptr err = other->brokenError();
    if (!err) continue;
    try {
      std::rethrow_exception(err);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kPeerFailure || !e.ranksDead) continue;
      for (int r : e.ranks)
        if ((e.ranksGlobal ? r : other->globalRank(r)) == g) return "group '" + other->opts_.name + "' found: " + e.what();
    } catch (...) {
    }
  }
  return "";
}

std::string CommImpl::goneElsewhere(int g) {
  std::lock_guard<std::recursive_mutex> lk(registry().mu);
  for (CommImpl* other : registry().comms) {
    if (other == this || other->globalRank(other->rank_) != globalRank(rank_)) continue;
    for (int q : other->localRanks_) {  // a pid means something only on this host, in this pid namespace
      const PeerInfo& p = other->peers_[static_cast<size_t>(q)];
      if (q == other->rank_ || other->globalRank(q) != g || p.pid <= 0 || p.pidNs != pidNamespace() ||
          !transport::processGone(p.pid))
        continue;
      const std::string how = "group '" + other->opts_.name + "' knew it as pid " + std::to_string(p.pid) + " on host " +
                              p.hostname + ", and that process has exited";
      other->memberDied({q}, opts_.name, "it exited while group '" + opts_.name + "' was being set up");
      return how;
    }
  }
  return "";
}

std::exception_ptr CommImpl::brokenError() const {
  std::lock_guard<std::mutex> g(health_.errMu);
  return health_.broken;
}

// ---------------------------------------------------------------------------------------
// Set-up failures: a rank that fails its own init says why in the group's store, and the
// peers waiting for it end their wait with that reason.

void CommImpl::publishInitFailure(Store& store, const Error& e) {
  // Only this rank's own failures (bad settings, a system call, a device, a handshake that
  // failed authentication): a timeout or a peer's failure names its culprit already, and
  // re-publishing it would blame us.
  if (health_.initFailSeen || size_ < 2 || e.code() == ErrorCode::kTimeout ||
      (e.code() == ErrorCode::kPeerFailure && !e.tellPeers))
    return;
  char hn[256] = {0};
  gethostname(hn, sizeof(hn) - 1);
  try {
    store.set("initfail/why", std::to_string(rank_) + "|" + hn + "|" + std::string(e.what()).substr(0, 4000));
    store.add("initfail", 1);
  } catch (const std::exception&) {  // best effort: the store may be what failed
  }
}

void CommImpl::checkPeerInitFailure(Store& store) {
  auto now = Clock::now();
  if (now - health_.lastInitFailCheck < Millis(250)) return;  // one store call per quarter second at most
  health_.lastInitFailCheck = now;
  std::string rec;
  try {
    if (store.add("initfail", 0) <= 0) return;
    rec = store.get("initfail/why", Millis(2000));
  } catch (const std::exception&) {  // unreadable (or not a counter): the wait goes on as before
    return;
  }
  throwInitFailure(rec, "railcc init of group '" + opts_.name + "': ", "");
}

void CommImpl::throwInitFailure(const std::string& rec, const std::string& context, const std::string& after) {
  auto a = rec.find('|'), b = rec.find('|', a == std::string::npos ? a : a + 1);
  long long r = -1;
  if (a == std::string::npos || b == std::string::npos || !parseInt(rec.substr(0, a), 0, size_ - 1, r) || r == rank_) return;
  const std::string host = quoteBytes(rec.substr(a + 1, b - a - 1), 64);
  Error err(ErrorCode::kPeerFailure,
            context + rankName(static_cast<int>(r)) + " (host " + host + ") failed its own init" + after + ": " + rec.substr(b + 1));
  err.ranks = {static_cast<int>(r)};
  err.hosts = {host};
  health_.initFailSeen = true;
  throw err;
}

}  // namespace railcc::engine
