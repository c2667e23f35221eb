#include "engine/algorithms/schedule.h"
#include "engine/comm_impl.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// The small broadcast across hosts: a binary tree along the root's rail, then a binary tree
// within each host (schedule::bcastTree). The chain takes n - 1 hops before the last rank has
// the payload (4,095 at 4,096 ranks); this takes the tree's depth, about log2 of the hosts plus
// log2 of a host's ranks, and then as many hops of empty acknowledgements back up, so that the
// root, like the chain's, returns only once every rank has taken a message naming the same
// root (a root the others disagree on fails on both sides in this call). A rank talks to at
// most its parent and four children, one of them across the network per rail child. Ranks
// are placed as ringOrder() lists them (host by host); where hosts hold unequal numbers of
// ranks, or one rank each, the whole group is one binary tree in that order.

void CommImpl::runBroadcastTree(char* buf, size_t bytes, int root) {
  const std::vector<int>& order = ringOrder();
  const int L = rail_.empty() ? 1 : static_cast<int>(localRanks_.size()), H = size_ / L;
  const int me = positionIn(order, rank_), top = positionIn(order, root);
  const schedule::BcastLinks b = schedule::bcastTree(H, L, top / L, top % L, me / L, me % L);
  auto rankAt = [&](int i) { return order[static_cast<size_t>(i)]; };
  if (b.parent >= 0) {
    std::vector<Transfer> xs{ch_.recvFrom(rankAt(b.parent), buf, bytes)};
    ch_.exchange(xs);
  }
  if (b.nkids > 0) {
    std::vector<Transfer> xs;
    xs.reserve(2 * static_cast<size_t>(b.nkids));
    for (int k = 0; k < b.nkids; ++k) xs.push_back(ch_.sendTo(rankAt(b.kids[k]), buf, bytes));
    for (int k = 0; k < b.nkids; ++k) xs.push_back(ch_.recvFrom(rankAt(b.kids[k]), nullptr, 0));
    ch_.exchange(xs);
  }
  if (b.parent >= 0) {
    std::vector<Transfer> xs{ch_.sendTo(rankAt(b.parent), nullptr, 0)};
    ch_.exchange(xs);
  }
}

}  // namespace railcc::engine
