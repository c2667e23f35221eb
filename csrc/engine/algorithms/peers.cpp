#include <algorithm>
#include <set>

#include "engine/algorithms/plan.h"
#include "engine/algorithms/table.h"
#include "engine/algorithms/algorithms.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// The peers this rank's collectives meet on the collective lane, by the rule (chooseAlgo) at
// every size where its answer can change and the schedules the algorithms run by: all_reduce,
// reduce_scatter, all_gather, the barrier, and broadcast from rank 0 (DDP's and FSDP's root; a
// broadcast from another root, reduce, gather, scatter, send/recv and all-to-all meet their
// peers at first use). RAILCC_RUNTIME_CONNECT=0 connects these at init. The relation is
// symmetric (a ring's neighbours, a tree's parent and children, exchange partners), so both
// ends of every pair listed connect it. The peers are those of each algorithm's plan (its row
// in table.cpp, the same the simulation plays), step by step: nothing here names an algorithm.


PlanShape Algorithms::planShape() {
  PlanShape s;
  s.size = size_;
  s.hostRanks = static_cast<int>(localRanks_.size());
  s.railRanks = static_cast<int>(rail_.size());
  s.hostsEven = !rail_.empty();
  s.hostsOfOne = place_.hostsOfOne;
  s.railWidth = s.hostsEven ? s.hostRanks : 1;
  s.railRing = railRing(s.railRanks, prefer_);
  s.treeRanks = treeRanks(s.railRanks, place_);
  return s;
}

std::vector<int> Algorithms::collectivePeers() {
  std::set<int> out;
  auto add = [&](int p) {
    if (p != rank_) out.insert(p);
  };
  const PlanShape shape = planShape();
  const RankLayout layout(rank_, ringOrder(), localRanks_, rail_);
  const int64_t oneshot = std::max<int64_t>(place_.oneshotBytes, 0);
  const std::vector<size_t> sizes{0,
                                  1,
                                  static_cast<size_t>(kSharedCoresOneshotBytes),
                                  static_cast<size_t>(kSharedCoresOneshotBytes) + 1,
                                  static_cast<size_t>(oneshot),
                                  static_cast<size_t>(oneshot) + 1,
                                  size_t(1) << 40};
  Step st;
  for (AlgoOp op : {AlgoOp::kAllreduce, AlgoOp::kReduceScatter, AlgoOp::kAllgather, AlgoOp::kBroadcast})
    for (size_t bytes : sizes)
      for (const Phase& p : algoRow(algoFor(op, bytes)).plan(shape, layout, op, bytes))
        for (int k = 0, steps = stepsOf(p, shape, layout); k < steps; ++k) {
          stepOf(p, shape, layout, k, st);
          for (const auto& [to, b] : st.sends) add(to);
          for (int from : st.recvs) add(from);
        }
  for (int k = 1; k < size_ && !barrierByAllreduce(place_); k *= 2) {  // the barrier's dissemination rounds
    add((rank_ + k) % size_);
    add((rank_ - k + size_) % size_);
  }
  return {out.begin(), out.end()};
}

}  // namespace railcc::engine
