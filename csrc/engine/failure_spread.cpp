#include "engine/comm_impl.h"

namespace railcc::engine {

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
    std::lock_guard<std::mutex> g(errMu_);
    if (broken_) return;
  }
  std::ostringstream os;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const PeerInfo& p = peers_[static_cast<size_t>(ranks[i])];
    os << (i ? ", " : "") << rankName(ranks[i]) << " (host " << p.hostname << ", pid " << p.pid << ", " << p.transport << ")";
  }
  os << " failed, as group '" << group << "' on this rank found: " << why;
  Error err(ErrorCode::kPeerFailure, os.str());
  for (int r : ranks) {
    err.ranks.push_back(globalRank(r));
    err.hosts.push_back(peers_[static_cast<size_t>(r)].hostname);
  }
  err.ranksGlobal = true;
  err.ranksDead = true;
  memberDown_ = true;
  fail(std::make_exception_ptr(err));
  // Wake our progress thread wherever it waits: the op it runs fails with this error.
  wakeSelf();
  uint64_t one = 1;
  if (write(wakeFd_.fd, &one, sizeof(one)) < 0) { /* best effort */ }
  cv_.notify_all();
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

std::exception_ptr CommImpl::brokenError() const {
  std::lock_guard<std::mutex> g(errMu_);
  return broken_;
}

}  // namespace railcc::engine
