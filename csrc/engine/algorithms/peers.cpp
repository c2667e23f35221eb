#include <numeric>
#include <set>

#include "engine/algorithms/schedule.h"
#include "engine/comm_impl.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// The peers this rank's collectives meet on the collective lane, by the rule (chooseAlgo) at
// every size where its answer can change and the schedules the algorithms run by: all_reduce,
// reduce_scatter, all_gather, the barrier, and broadcast from rank 0 (DDP's and FSDP's root; a
// broadcast from another root, reduce, gather, scatter, send/recv and all-to-all meet their
// peers at first use). RAILCC_RUNTIME_CONNECT=0 connects these at init. The relation is
// symmetric (a ring's neighbours, a tree's parent and children, exchange partners), so both
// ends of every pair listed connect it. Kept beside the algorithms: a new one adds its peers
// here.

std::vector<int> CommImpl::collectivePeers() {
  std::set<int> out;
  auto add = [&](int p) {
    if (p != rank_) out.insert(p);
  };
  auto addAll = [&](const std::vector<int>& g) {
    for (int p : g) add(p);
  };
  auto addRing = [&](const std::vector<int>& g) {
    const int m = static_cast<int>(g.size()), i = positionIn(g, rank_);
    add(g[static_cast<size_t>((i + 1) % m)]);
    add(g[static_cast<size_t>((i + m - 1) % m)]);
  };
  auto addDoubling = [&](const std::vector<int>& g) {
    const schedule::Doubling d = schedule::doubling(static_cast<int>(g.size()), positionIn(g, rank_));
    if (d.foldPeer >= 0) add(g[static_cast<size_t>(d.foldPeer)]);
    if (d.v >= 0)
      for (int bit = 1; bit < d.p; bit <<= 1) add(g[static_cast<size_t>(schedule::doublingPartner(d, bit))]);
  };
  std::vector<int> all(static_cast<size_t>(size_));
  std::iota(all.begin(), all.end(), 0);
  const int64_t oneshot = std::max<int64_t>(place_.oneshotBytes, 0);
  const std::vector<size_t> sizes{0,
                                  1,
                                  static_cast<size_t>(kSharedCoresOneshotBytes),
                                  static_cast<size_t>(kSharedCoresOneshotBytes) + 1,
                                  static_cast<size_t>(oneshot),
                                  static_cast<size_t>(oneshot) + 1,
                                  size_t(1) << 40};
  for (AlgoOp op : {AlgoOp::kAllreduce, AlgoOp::kReduceScatter, AlgoOp::kAllgather, AlgoOp::kBroadcast})
    for (size_t bytes : sizes) switch (algoFor(op, bytes)) {
        case Algo::kOneShot:
        case Algo::kPairwise:
        case Algo::kDirect: addAll(all); break;
        case Algo::kRings: addAll(localRanks_); break;
        case Algo::kHier:  // the host's ranks, then the rail: pairwise (small all-reduce rails) or a ring
          addAll(localRanks_);
          if (op == AlgoOp::kAllreduce && !railRing(static_cast<int>(rail_.size()), prefer_)) addAll(rail_);
          else addRing(rail_);
          break;
        case Algo::kRing: addRing(ringOrder()); break;
        case Algo::kChain:
          if (!rail_.empty()) {  // as runBroadcastRailChain, from rank 0
            const std::vector<int>& order = ringOrder();
            const int L = static_cast<int>(localRanks_.size()), me = positionIn(order, rank_),
                      top = positionIn(order, 0);
            const schedule::ChainLinks c = schedule::railChain(size_ / L, L, top / L, top % L, me / L, me % L);
            for (int p : {c.from, c.to[0], c.to[1], c.acksFrom[0], c.acksFrom[1], c.tailAck, c.ackTo})
              if (p >= 0) add(order[static_cast<size_t>(p)]);
          } else {  // from rank 0: each rank's neighbours in rank order; the tail tells the root
            add((rank_ + 1) % size_);
            add((rank_ + size_ - 1) % size_);
          }
          break;
        case Algo::kTree:
          if (op == AlgoOp::kBroadcast) {  // as runBroadcastTree, from rank 0
            const std::vector<int>& order = ringOrder();
            const int L = rail_.empty() ? 1 : static_cast<int>(localRanks_.size()), me = positionIn(order, rank_),
                      top = positionIn(order, 0);
            const schedule::BcastLinks b = schedule::bcastTree(size_ / L, L, top / L, top % L, me / L, me % L);
            if (b.parent >= 0) add(order[static_cast<size_t>(b.parent)]);
            for (int k = 0; k < b.nkids; ++k) add(order[static_cast<size_t>(b.kids[k])]);
          } else if (const int m = treeRanks(static_cast<int>(rail_.size()), place_)) {  // as runAllreduceTree
            addDoubling(localRanks_);
            const std::vector<int>& g = rail_.empty() ? all : rail_;
            const schedule::TreeLinks t = schedule::binaryTree(m, positionIn(g, rank_));
            if (t.parent >= 0) add(g[static_cast<size_t>(t.parent)]);
            for (int k = 0; k < t.nkids; ++k) add(g[static_cast<size_t>(t.kids[k])]);
          } else {
            addDoubling(all);
          }
          break;
      }
  for (int k = 1; k < size_ && !barrierByAllreduce(place_); k *= 2) {  // the barrier's dissemination rounds
    add((rank_ + k) % size_);
    add((rank_ - k + size_) % size_);
  }
  return {out.begin(), out.end()};
}

}  // namespace railcc::engine
