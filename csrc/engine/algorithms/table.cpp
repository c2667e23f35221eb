#include "engine/algorithms/table.h"

#include "common/error.h"
#include "engine/algorithms/algorithms.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// Each algorithm's plan: the phases one rank's schedule goes through, as its run functions
// (named in its row below) go through them.

namespace {

using Phases = std::vector<Phase>;

Phases planOneShot(const PlanShape& s, const Layout&, AlgoOp, size_t bytes) {
  return {{Kind::kAll, Order::kRanks, s.size, bytes, 1}};  // every rank's whole buffer to every peer
}

Phases planPairwise(const PlanShape& s, const Layout&, AlgoOp op, size_t bytes) {
  const int n = s.size;
  const size_t count = bytes / s.es;
  if (op == AlgoOp::kReduceScatter) return {{Kind::kPairSeparate, Order::kRanks, n, bytes, n - 1}};
  return {{Kind::kPairReduce, Order::kRanks, n, count, n - 1}, {Kind::kPairGather, Order::kRanks, n, count, n - 1}};
}

Phases planRing(const PlanShape& s, const Layout&, AlgoOp op, size_t bytes) {
  const int n = s.size;
  const size_t count = bytes / s.es, all = count * static_cast<size_t>(n);
  if (op == AlgoOp::kReduceScatter) return {{Kind::kRingReduce, Order::kRing, n, all, n - 1}};
  if (op == AlgoOp::kAllgather) return {{Kind::kRingGather, Order::kRing, n, all, n - 1}};
  return {{Kind::kRingReduce, Order::kRing, n, count, n - 1}, {Kind::kRingGather, Order::kRing, n, count, n - 1}};
}

// Per host, then per rail (then per host again).
Phases planHier(const PlanShape& s, const Layout& l, AlgoOp op, size_t bytes) {
  const int L = s.hostRanks, R = s.railRanks;
  const size_t count = bytes / s.es;
  if (op == AlgoOp::kReduceScatter)  // the host's terms for each rank of the rail, then the rail's ring
    return {{Kind::kPairBlocks, Order::kHost, L, bytes, L - 1, R},
            {Kind::kRingReduce, Order::kRail, R, count * static_cast<size_t>(R), R - 1}};
  if (op == AlgoOp::kAllgather)  // the rail's ring, then the rail's blocks to each rank of the host
    return {{Kind::kRingGather, Order::kRail, R, count * static_cast<size_t>(R), R - 1},
            {Kind::kPairBlocks, Order::kHost, L, bytes, L - 1, R}};
  const size_t piece = blockBytes(count, L, l.me(Order::kHost), 1);
  const Kind reduce = s.railRing ? Kind::kRingReduce : Kind::kPairReduce;
  const Kind gather = s.railRing ? Kind::kRingGather : Kind::kPairGather;
  return {{Kind::kPairReduce, Order::kHost, L, count, L - 1},
          {reduce, Order::kRail, R, piece, R - 1},
          {gather, Order::kRail, R, piece, R - 1},
          {Kind::kPairGather, Order::kHost, L, count, L - 1}};
}

// All-reduce: recursive doubling, or within the host and then a binary tree along the rail;
// broadcast: a binary tree along the root's rail, then within each host.
Phases planTree(const PlanShape& s, const Layout&, AlgoOp op, size_t bytes) {
  if (op == AlgoOp::kBroadcast) return {{Kind::kBcastTree, Order::kRing, s.size, bytes}};
  if (s.treeRanks > 0)
    return {{Kind::kDoubling, Order::kHost, s.hostRanks, bytes}, {Kind::kTree, Order::kRail, s.treeRanks, bytes}};
  return {{Kind::kDoubling, Order::kRanks, s.size, bytes}};
}

Phases planChain(const PlanShape& s, const Layout&, AlgoOp, size_t bytes) {
  if (s.hostsEven) return {{Kind::kRailChain, Order::kRing, s.size, bytes}};
  return {{Kind::kChain, Order::kRanks, s.size, bytes}};
}

// The shared-memory broadcast rings: every rank of the host (a one-host group), whatever the op.
Phases planRings(const PlanShape& s, const Layout&, AlgoOp, size_t bytes) {
  return {{Kind::kAll, Order::kHost, s.hostRanks, bytes, 1}};
}

std::string plain(const PlanShape&, AlgoOp) { return ""; }
std::string hierRails(const PlanShape& s, AlgoOp op) {
  return op != AlgoOp::kAllreduce || s.railRing ? " (rails: ring)" : " (rails: pairwise)";
}
std::string treeShape(const PlanShape& s, AlgoOp op) {
  if (!(op == AlgoOp::kBroadcast ? s.hostsEven : s.treeRanks > 0)) return "";
  return s.hostsOfOne ? " (binary tree)" : " (rails: binary tree)";
}
std::string chainRails(const PlanShape& s, AlgoOp) { return s.hostsEven ? " (rails)" : ""; }

}  // namespace

// ---------------------------------------------------------------------------------------
// The rows. Run functions live in the algorithm's file (algorithms/*.cpp).

const AlgoRow& algoRow(Algo a) {
  using C = Algorithms;
  static const AlgoRow rows[] = {
      {Algo::kOneShot, &C::allreduceOneShot, &C::reduceScatterOneShot, nullptr, nullptr, false, planOneShot, true, plain},
      {Algo::kShmRings, &C::allreduceShmRings, &C::reduceScatterShmRings, &C::allgatherShmRings, &C::broadcastShmRings, false,
       planRings, false, plain},
      {Algo::kHier, &C::allreduceHier, &C::reduceScatterHier, &C::allgatherHier, nullptr, false, planHier, true,
       hierRails},
      {Algo::kPairwise, &C::allreducePairwise, &C::reduceScatterPairwise, nullptr, nullptr, false, planPairwise, true,
       plain},
      {Algo::kChain, nullptr, nullptr, nullptr, &C::broadcastChains, false, planChain, true, chainRails},
      {Algo::kDirect, nullptr, nullptr, &C::allgatherDirect, nullptr, true, planOneShot, true, plain},
      {Algo::kRing, &C::allreduceRing, &C::reduceScatterRing, &C::allgatherRing, nullptr, false, planRing, true,
       plain},
      {Algo::kTree, &C::allreduceTree, nullptr, nullptr, &C::broadcastTree, false, planTree, true, treeShape},
  };
  for (const AlgoRow& r : rows)
    if (r.algo == a) return r;
  RAILCC_THROW(kInternal, "no row in the algorithm table for ", algoName(a));
}

}  // namespace railcc::engine
