#include "engine/algorithms/algorithms.h"
#include "engine/algorithms/plan.h"
#include "engine/algorithms/table.h"

namespace railcc::engine {

// What an op would take, read off the plan the op runs by (the rule's row, as dispatch.cpp
// runs it): the same steps the simulation plays and the peer count walks, each costed on this
// rank's links. A model, not a measurement: steps never overlap, and a step waits only for
// its own messages.

namespace {

// A step: the largest latency of the peers it meets, then its sends and its receives side by
// side (links are full duplex). A receive carries what the step sends to a peer where it
// sends (the schedules are symmetric), else the phase's whole message (a broadcast's).
double stepUs(const Step& st, uint64_t message, const std::vector<Algorithms::LinkCost>& byPeer) {
  double latency = 0, sendUs = 0, recvUs = 0;
  uint64_t each = 0;
  for (const auto& [peer, bytes] : st.sends) {
    const Algorithms::LinkCost& c = byPeer[static_cast<size_t>(peer)];
    latency = std::max(latency, c.latencyUs);
    sendUs += static_cast<double>(bytes) * c.usPerByte;
    each = std::max<uint64_t>(each, bytes);
  }
  if (st.sends.empty()) each = message;
  for (int peer : st.recvs) {
    const Algorithms::LinkCost& c = byPeer[static_cast<size_t>(peer)];
    latency = std::max(latency, c.latencyUs);
    recvUs += static_cast<double>(each) * c.usPerByte;
  }
  return latency + std::max(sendUs, recvUs);
}

}  // namespace

double Algorithms::estimateUs(OpKind kind, size_t bytes, const std::vector<LinkCost>& byPeer) {
  if (size_ < 2) return 0;
  AlgoOp op;
  switch (kind) {
    case OpKind::kAllreduce:
    case OpKind::kAllreduceCoalesced: op = AlgoOp::kAllreduce; break;
    case OpKind::kReduceScatter: op = AlgoOp::kReduceScatter; break;
    case OpKind::kAllgather: op = AlgoOp::kAllgather; break;
    case OpKind::kBroadcast: op = AlgoOp::kBroadcast; break;
    default: {
      // One shape each: every peer once, to or from the root (reduce, gather, scatter) or at
      // once (all-to-all); the barrier's dissemination rounds carry nothing.
      double us = 0;
      if (kind == OpKind::kBarrier) {
        for (int k = 1; k < size_; k *= 2) us += byPeer[static_cast<size_t>((rank_ + k) % size_)].latencyUs;
        return us;
      }
      Step st;
      for (int p = 0; p < size_; ++p)
        if (p != rank_) st.sends.push_back({p, bytes});
      return stepUs(st, bytes, byPeer);
    }
  }
  PlanShape shape = planShape();
  shape.es = 1;  // the plan cuts bytes, not elements: block sizes differ by at most an element
  const RankLayout layout(rank_, ringOrder(), localRanks_, rail_);
  double us = 0;
  Step st;
  for (const Phase& p : algoRow(algoFor(op, bytes)).plan(shape, layout, op, bytes)) {
    const int steps = stepsOf(p, shape, layout);
    for (int k = 0; k < steps; ++k) {
      st.clear();
      stepOf(p, shape, layout, k, st);
      us += stepUs(st, p.count, byPeer);
    }
  }
  return us;
}

}  // namespace railcc::engine
