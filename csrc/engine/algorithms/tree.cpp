#include "engine/algorithms/algorithms.h"
#include "engine/algorithms/schedule.h"

namespace railcc::engine {

namespace {
constexpr size_t kTreeScratchKeep = 1u << 20;
}  // namespace


// Recursive doubling: for small all-reduces, ceil(log2 n) + 2 steps at most instead of the
// ring's 2(n-1), each exchanging the whole buffer with one partner. With p the largest power
// of two up to n, the first 2(n-p) ranks pair up: each even one hands its buffer to the odd
// one after it and waits for the result. The p ranks left exchange with the rank whose
// virtual index differs in one bit, one bit per step. A rank talks to at most log2(p) + 1
// peers. Both sides of an exchange compute a op b and b op a, which are equal bit for bit for
// every reduction railcc has, so every rank ends with the same bits.
//
// From 16 hosts of equal rank counts (railTree), log2 of the hosts would be the network peers
// of every rank (9 at 512 hosts): recursive doubling runs among the host's ranks only, through
// shared memory, and then each rail (the ranks of one local index, one per host) runs a binary
// tree: both children's sums received, then reduced in child order, the sum sent up, the
// whole sent back down (3 network peers, about 2 log2 of the hosts steps). Every rail holds
// the same host sums and reduces them in the same order, so every rank ends with the same bits.
// Where every host runs one rank (from 16 of them), the one binary tree of all ranks
// (treeRanks).

void Algorithms::allreduceTree(char* buf, size_t count, DataType dt, ReduceOp op, double scale) {
  const size_t bytes = count * dtypeSize(dt);
  if (op == ReduceOp::kPremulSum) scaleCopy(buf, buf, count, dt, scale);
  const ReduceOp across = acrossRanks(op);
  // With a binary tree between hosts (along a rail, or over every rank where each host runs
  // one and rail_ is empty), recursive doubling covers only this host's ranks.
  const int treeM = treeRanks(static_cast<int>(rail_.size()), place_);
  const bool tree = treeM > 0;
  auto at = [&](int j) { return tree ? localRanks_[static_cast<size_t>(j)] : j; };
  const schedule::Doubling d = tree ? schedule::doubling(static_cast<int>(localRanks_.size()), localIndex(rank_))
                                    : schedule::doubling(size_, rank_);
  auto one = [&](Transfer t) {
    std::vector<Transfer> xs{t};
    ch_.exchange(xs);
  };
  if (d.foldPeer >= 0)
    one(d.hands ? ch_.sendTo(at(d.foldPeer), buf, bytes) : ch_.recvReduce(at(d.foldPeer), buf, count, dt, across, 1.0));
  if (d.v >= 0) {
    // The partner reads what we send while we reduce its data into buf: send from a copy.
    if (treeScratch_.size() < bytes) treeScratch_.resize(bytes);
    for (int bit = 1; bit < d.p; bit <<= 1) {
      const int partner = at(schedule::doublingPartner(d, bit));
      if (bytes) transport::copyBytes(treeScratch_.data(), buf, bytes);
      std::vector<Transfer> xs{ch_.sendTo(partner, treeScratch_.data(), bytes),
                               ch_.recvReduce(partner, buf, count, dt, across, 1.0)};
      ch_.exchange(xs);
    }
  }
  if (d.foldPeer >= 0) one(d.hands ? ch_.recvFrom(at(d.foldPeer), buf, bytes) : ch_.sendTo(at(d.foldPeer), buf, bytes));
  if (tree) {
    const schedule::TreeLinks t = schedule::binaryTree(treeM, rail_.empty() ? rank_ : positionIn(rail_, rank_));
    auto railRank = [&](int i) { return rail_.empty() ? i : rail_[static_cast<size_t>(i)]; };
    if (t.nkids > 0) {  // both children's sums at once, reduced in child order
      if (treeScratch_.size() < 2 * bytes) treeScratch_.resize(2 * bytes);
      std::vector<Transfer> xs;
      for (int k = 0; k < t.nkids; ++k)
        xs.push_back(ch_.recvFrom(railRank(t.kids[k]), treeScratch_.data() + static_cast<size_t>(k) * bytes, bytes));
      ch_.exchange(xs);
      for (int k = 0; k < t.nkids; ++k)
        reduceInto(buf, treeScratch_.data() + static_cast<size_t>(k) * bytes, count, dt, across, 1.0);
    }
    if (t.parent >= 0) {
      one(ch_.sendTo(railRank(t.parent), buf, bytes));
      one(ch_.recvFrom(railRank(t.parent), buf, bytes));
    }
    if (t.nkids > 0) {
      std::vector<Transfer> xs;
      for (int k = 0; k < t.nkids; ++k) xs.push_back(ch_.sendTo(railRank(t.kids[k]), buf, bytes));
      ch_.exchange(xs);
    }
  }
  if (op == ReduceOp::kAvg) divideBy(buf, count, dt, size_);
  // The rule runs the tree on small buffers; one forced onto a large one (RAILCC_ALGO=tree)
  // does not keep a copy of its size for the life of the group.
  if (treeScratch_.size() > kTreeScratchKeep) std::vector<char>().swap(treeScratch_);
}


// The small broadcast across hosts: a binary tree along the root's rail, then a binary tree
// within each host (schedule::bcastTree). The chain takes n - 1 hops before the last rank has
// the payload (4,095 at 4,096 ranks); this takes the tree's depth, about log2 of the hosts plus
// log2 of a host's ranks, and then as many hops of empty acknowledgements back up, so that the
// root, like the chain's, returns only once every rank has taken a message naming the same
// root (a root the others disagree on fails on both sides in this call). A rank talks to at
// most its parent and four children, one of them across the network per rail child. Ranks
// are placed as ringOrder() lists them (host by host); where hosts hold unequal numbers of
// ranks, or one rank each, the whole group is one binary tree in that order.

void Algorithms::broadcastTree(char* buf, size_t bytes, int root) {
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
