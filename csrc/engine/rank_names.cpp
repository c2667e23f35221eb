#include "common/error.h"
#include "common/log.h"
#include "engine/comm_impl.h"

namespace railcc::engine {

// Ranks and links as users know them: a group made by new_group or split_group numbers its
// ranks from 0, but a user reads ranks of the default group (opts_.globalRanks).

int CommImpl::globalRank(int r) const {
  return r >= 0 && static_cast<size_t>(r) < opts_.globalRanks.size() ? opts_.globalRanks[static_cast<size_t>(r)] : r;
}

// "rank G" with G the rank in the default group; "rank G (group rank r)" where they differ.
std::string CommImpl::rankName(int r) const {
  int g = globalRank(r);
  return g == r ? "rank " + std::to_string(r) : "rank " + std::to_string(g) + " (group rank " + std::to_string(r) + ")";
}

std::string CommImpl::peerName(int r) const {
  const PeerInfo& p = peers_[static_cast<size_t>(r)];
  return rankName(r) + " (host " + p.hostname + ", " + linkOf(r) + ")";
}

// How this rank reaches `r`: fixed at init, except for a connection made at first use, named
// once it is up (links_.mu guards it from then on); any thread.
std::string CommImpl::linkOf(int r) const {
  std::lock_guard<std::mutex> g(links_.mu);
  const std::string& t = peers_[static_cast<size_t>(r)].transport;
  return t.empty() ? "self" : t;
}

// The error with its ranks as users know them (see rankName).
std::exception_ptr CommImpl::globalized(std::exception_ptr err) const {
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

}  // namespace railcc::engine
