#include "engine/algorithms/algorithms.h"
#include "engine/algorithms/schedule.h"

namespace railcc::engine {

// Chain broadcasts: each rank forwards what arrives to the next, pipelined; where hosts hold
// equal numbers of ranks, a chain along the root's rail and one through each host.

namespace {
// A chain's tail acknowledges to `to` once the header of its receive (xs.front(), from `from`)
// is in: every rank before it then agreed on the call. A tail whose predecessor is `to` itself
// vouches only for itself, which `to` checks in the acknowledgement's header: it sends it at
// once, so that rank waits a one-way trip, not a round trip (two ranks; a host of two).
void tailAcknowledges(const ChannelLayer& ch, std::vector<Transfer>& xs, int from, int to) {
  xs.push_back(ch.sendTo(to, nullptr, 0));
  if (from == to) return;
  xs.front().gates = true;
  xs.back().after = &xs.front();
}
}  // namespace

void Algorithms::broadcastChains(char* buf, size_t bytes, int root) {
  if (!rail_.empty()) return broadcastRailChain(buf, bytes, root);
  broadcastChain(buf, bytes, root);
}

// Hosts with equal numbers of ranks (two or more): a chain along the root's rail, and from each
// of its ranks one through that host (schedule::railChain), in ringOrder()'s host-by-host order.
void Algorithms::broadcastRailChain(char* buf, size_t bytes, int root) {
  const std::vector<int>& order = ringOrder();
  const int L = static_cast<int>(localRanks_.size()), H = size_ / L;
  const int me = positionIn(order, rank_), top = positionIn(order, root);
  const schedule::ChainLinks c = schedule::railChain(H, L, top / L, top % L, me / L, me % L);
  auto rankAt = [&](int i) { return order[static_cast<size_t>(i)]; };
  std::vector<Transfer> xs;
  xs.reserve(5);  // no reallocation: the forwarding sends point at the receive
  if (c.from >= 0) xs.push_back(ch_.recvFrom(rankAt(c.from), buf, bytes));
  for (int k = 0; k < c.nto; ++k) {
    xs.push_back(ch_.sendTo(rankAt(c.to[k]), buf, bytes));
    if (c.from >= 0) xs.back().limit = &xs.front().done;
  }
  for (int k = 0; k < c.nacks; ++k) xs.push_back(ch_.recvFrom(rankAt(c.acksFrom[k]), nullptr, 0));
  if (c.tailAck >= 0) tailAcknowledges(ch_, xs, rankAt(c.from), rankAt(c.tailAck));  // the header, not the payload
  ch_.zeroCopy(xs);
  ch_.exchange(xs);
  if (c.ackTo >= 0) {
    std::vector<Transfer> ack{ch_.sendTo(rankAt(c.ackTo), nullptr, 0)};
    ch_.exchange(ack);
  }
}

void Algorithms::broadcastChain(char* buf, size_t bytes, int root) {
  int n = size_, r = rank_;
  int pos = (r - root + n) % n;
  // A pipelined chain: each rank forwards bytes as soon as they arrive, and takes them only
  // after checking its predecessor's header, which carries the root. Once the tail has taken
  // that header (so every rank before it agreed on the root), it sends the root an empty
  // message: a root that the others do not agree on fails in this call, on both sides,
  // instead of returning as if its data had been taken (and the mismatch surfacing one op
  // later). The root waits for the tail's header, not for its whole payload; on two ranks
  // not even that (tailAcknowledges).
  std::vector<Transfer> xs;
  xs.reserve(3);
  if (pos > 0) xs.push_back(ch_.recvFrom((r - 1 + n) % n, buf, bytes));
  if (pos < n - 1) {
    xs.push_back(ch_.sendTo((r + 1) % n, buf, bytes));
    if (pos > 0) xs.back().limit = &xs.front().done;
  }
  if (pos == 0) {
    xs.push_back(ch_.recvFrom((root + n - 1) % n, nullptr, 0));
  } else if (pos == n - 1) {
    tailAcknowledges(ch_, xs, (r - 1 + n) % n, root);
  }
  ch_.zeroCopy(xs);  // the root's send (a forwarding send streams what has arrived)
  ch_.exchange(xs);
}

}  // namespace railcc::engine
