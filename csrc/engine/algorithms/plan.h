#pragma once
// An algorithm's plan: the phases of one rank's schedule for an op, each written once, in the
// algorithm's row of the table (table.cpp), and the steps of a phase from the step functions the
// algorithms themselves run by (schedule.h). Read by the scale simulation (simulate.cpp, every
// rank's steps played against each other) and by the peer count (peers.cpp, the peers a rank's
// steps meet, connected at init by RAILCC_RUNTIME_CONNECT=0): neither names an algorithm.
//
// A plan speaks of indices in the orders a group's ranks are numbered in (Order), not of
// ranks; a Layout turns them into ranks: the simulation's ranks are host by host (every order
// is arithmetic), a communicator's come from its set-up (ringOrder(), its host's and rail's
// ranks).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "engine/algorithms/choose.h"

namespace railcc::engine {

enum class Order : uint8_t {
  kRanks,  // the group's ranks in rank order
  kRing,   // host by host (ringOrder()): rings, and the broadcast tree and rail chain from rank 0
  kHost,   // this rank's host's ranks
  kRail,   // this rank's rail: one rank of each host (every rank, where hosts hold one each)
};

/// A rank's view of the orders.
class Layout {
 public:
  virtual ~Layout() = default;
  virtual int at(Order o, int index) const = 0;  // the rank at `index` of order `o`
  virtual int me(Order o) const = 0;             // this rank's index in `o`
  virtual int rootIndex() const = 0;             // rank 0's index in kRing (broadcasts from rank 0)
};

/// A communicator's orders, from what its set-up found: ringOrder(), its host's ranks, its
/// rail's (empty where hosts hold one rank each: then every rank).
class RankLayout : public Layout {
 public:
  RankLayout(int rank, const std::vector<int>& ring, const std::vector<int>& host, const std::vector<int>& rail)
      : rank_(rank), ring_(ring), host_(host), rail_(rail) {}
  int at(Order o, int j) const override {
    const size_t i = static_cast<size_t>(j);
    switch (o) {
      case Order::kRing: return ring_[i];
      case Order::kHost: return host_[i];
      case Order::kRail: return rail_.empty() ? j : rail_[i];
      default: return j;
    }
  }
  int me(Order o) const override {
    switch (o) {
      case Order::kRing: return index(ring_);
      case Order::kHost: return index(host_);
      case Order::kRail: return rail_.empty() ? rank_ : index(rail_);
      default: return rank_;
    }
  }
  int rootIndex() const override { return static_cast<int>(std::find(ring_.begin(), ring_.end(), 0) - ring_.begin()); }

 private:
  int index(const std::vector<int>& g) const { return static_cast<int>(std::find(g.begin(), g.end(), rank_) - g.begin()); }
  int rank_;
  const std::vector<int>&ring_, &host_, &rail_;
};

/// What a plan may depend on: the same on every rank of the group.
struct PlanShape {
  int size = 1;
  int hostRanks = 1;  // ranks of this rank's host (each host's, where the plan uses it)
  int railRanks = 1;  // ranks of a rail
  int railWidth = 1;  // ranks per host where hosts hold equal numbers (two or more), else 1
  size_t es = 1;      // bytes per element
  bool hostsEven = false, hostsOfOne = false;
  bool railRing = false;  // hier's all-reduce runs its rails as rings (railRing() in choose.h)
  int treeRanks = 0;      // the small all-reduce's binary tree (treeRanks() in choose.h), 0 for none
};

enum class Kind {
  kRingReduce, kRingGather,              // around the order: reduce-scatter, all-gather (count: elements)
  kPairReduce, kPairGather,              // pairwise exchanges of one buffer's blocks (count: elements)
  kPairSeparate,                         // pairwise, one separate buffer to each peer (count: bytes)
  kPairBlocks,                           // pairwise, `per` messages of `count` bytes a step
  kAll,                                  // every peer at once (count: bytes)
  kDoubling,                             // recursive doubling, whole buffers (count: bytes)
  kTree,                                 // a binary tree: in, up, down, out (count: bytes)
  kChain,                                // a chain from index 0 whose tail acknowledges it (count: bytes)
  kBcastTree, kRailChain,                // from rank 0 along rails, then within each host (count: bytes)
};

struct Phase {
  Kind kind;
  Order order;
  int m;          // indices 0..m-1 of `order` take part
  size_t count;
  int steps = 0;  // for the kinds whose steps do not follow from the schedule
  int per = 1;
};

struct Step {
  std::vector<std::pair<int, uint64_t>> sends;  // (rank, bytes)
  std::vector<int> recvs;                       // ranks, once per message
  void clear() {
    sends.clear();
    recvs.clear();
  }
};

/// An algorithm's plan of one op of `bytes` bytes (reduce_scatter, all_gather: one rank's block)
/// for the rank `layout` is of; broadcasts from rank 0.
using PlanFn = std::vector<Phase> (*)(const PlanShape& shape, const Layout& layout, AlgoOp op, size_t bytes);

/// The bytes of block j when `count` elements of `es` bytes are cut into m blocks (as the
/// engine's Blocks does: the first count % m blocks one element larger).
uint64_t blockBytes(size_t count, int m, int j, size_t es);
/// Step k of phase `p` for the rank `layout` is of.
void stepOf(const Phase& p, const PlanShape& shape, const Layout& layout, int k, Step& out);
/// How many steps phase `p` takes on that rank.
int stepsOf(const Phase& p, const PlanShape& shape, const Layout& layout);

}  // namespace railcc::engine
