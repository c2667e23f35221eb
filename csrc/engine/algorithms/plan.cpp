#include "engine/algorithms/plan.h"

#include "engine/algorithms/schedule.h"

namespace railcc::engine {

uint64_t blockBytes(size_t count, int m, int j, size_t es) {
  const size_t base = count / static_cast<size_t>(m), rem = count % static_cast<size_t>(m);
  return (base + (static_cast<size_t>(j) < rem ? 1 : 0)) * es;
}

namespace {

// The broadcast tree and the rail chain from rank 0, in kRing indices.
schedule::BcastLinks bcastLinks(const PlanShape& s, const Layout& l) {
  const int L = s.railWidth, top = l.rootIndex(), me = l.me(Order::kRing);
  return schedule::bcastTree(s.size / L, L, top / L, top % L, me / L, me % L);
}
schedule::ChainLinks chainLinks(const PlanShape& s, const Layout& l) {
  const int L = s.railWidth, top = l.rootIndex(), me = l.me(Order::kRing);
  return schedule::railChain(s.size / L, L, top / L, top % L, me / L, me % L);
}

}  // namespace

void stepOf(const Phase& p, const PlanShape& shape, const Layout& layout, int k, Step& out) {
  out.clear();
  const int m = p.m, i = layout.me(p.order);
  auto at = [&](int j) { return layout.at(p.order, j); };
  auto ring = [&](int j) { return layout.at(Order::kRing, j); };
  const size_t es = shape.es;
  switch (p.kind) {
    case Kind::kRingReduce: {
      const auto s = schedule::ringReduceStep(m, i, k);
      out.sends.push_back({at(schedule::mod(i + 1, m)), blockBytes(p.count, m, s.send, es)});
      out.recvs.push_back(at(schedule::mod(i - 1, m)));
      break;
    }
    case Kind::kRingGather: {
      const auto s = schedule::ringGatherStep(m, i, k);
      out.sends.push_back({at(schedule::mod(i + 1, m)), blockBytes(p.count, m, s.send, es)});
      out.recvs.push_back(at(schedule::mod(i - 1, m)));
      break;
    }
    case Kind::kPairReduce:
    case Kind::kPairGather:
    case Kind::kPairSeparate: {
      const auto s = schedule::pairwiseStep(m, i, k + 1);
      const uint64_t b = p.kind == Kind::kPairSeparate ? p.count
                         : blockBytes(p.count, m, p.kind == Kind::kPairReduce ? s.to : i, es);
      out.sends.push_back({at(s.to), b});
      out.recvs.push_back(at(s.from));
      break;
    }
    case Kind::kPairBlocks: {
      const auto s = schedule::pairwiseStep(m, i, k + 1);
      for (int j = 0; j < p.per; ++j) out.sends.push_back({at(s.to), p.count});
      for (int j = 0; j < p.per; ++j) out.recvs.push_back(at(s.from));
      break;
    }
    case Kind::kAll:
      for (int j = 0; j < m; ++j)
        if (j != i) {
          out.sends.push_back({at(j), p.count});
          out.recvs.push_back(at(j));
        }
      break;
    case Kind::kDoubling: {
      const schedule::Doubling d = schedule::doubling(m, i);
      const bool fold = d.foldPeer >= 0;
      if (fold && (k == 0 || k == schedule::doublingSteps(d) - 1)) {
        const bool send = (k == 0) == d.hands;  // hands on first, takes the result back last
        if (send) out.sends.push_back({at(d.foldPeer), p.count});
        else out.recvs.push_back(at(d.foldPeer));
      } else {
        const int partner = schedule::doublingPartner(d, 1 << (k - (fold ? 1 : 0)));
        out.sends.push_back({at(partner), p.count});
        out.recvs.push_back(at(partner));
      }
      break;
    }
    case Kind::kTree: {  // children in, up, back down, out to the children
      const schedule::TreeLinks t = schedule::binaryTree(m, i);
      const int j = k - (t.nkids > 0 ? 1 : 0);
      if (j < 0)
        for (int c = 0; c < t.nkids; ++c) out.recvs.push_back(at(t.kids[c]));
      else if (t.parent >= 0 && j == 0) out.sends.push_back({at(t.parent), p.count});
      else if (t.parent >= 0 && j == 1) out.recvs.push_back(at(t.parent));
      else
        for (int c = 0; c < t.nkids; ++c) out.sends.push_back({at(t.kids[c]), p.count});
      break;
    }
    case Kind::kBcastTree: {  // from the parent; to the children, their acknowledgements back; up
      const schedule::BcastLinks b = bcastLinks(shape, layout);
      const int j = k - (b.parent >= 0 ? 1 : 0);
      if (j < 0) {
        out.recvs.push_back(ring(b.parent));
      } else if (j == 0 && b.nkids > 0) {
        for (int c = 0; c < b.nkids; ++c) out.sends.push_back({ring(b.kids[c]), p.count});
        for (int c = 0; c < b.nkids; ++c) out.recvs.push_back(ring(b.kids[c]));
      } else {
        out.sends.push_back({ring(b.parent), 0});
      }
      break;
    }
    case Kind::kRailChain: {  // from the rail or host before; on, with the acknowledgements; up the rail
      const schedule::ChainLinks c = chainLinks(shape, layout);
      const int j = k - (c.from >= 0 ? 1 : 0);
      if (j < 0) {
        out.recvs.push_back(ring(c.from));
      } else if (j == 0 && (c.nto > 0 || c.nacks > 0 || c.tailAck >= 0)) {
        for (int t = 0; t < c.nto; ++t) out.sends.push_back({ring(c.to[t]), p.count});
        for (int t = 0; t < c.nacks; ++t) out.recvs.push_back(ring(c.acksFrom[t]));
        if (c.tailAck >= 0) out.sends.push_back({ring(c.tailAck), 0});
      } else {
        out.sends.push_back({ring(c.ackTo), 0});
      }
      break;
    }
    case Kind::kChain:  // from index 0: receive, then forward; the tail tells the root
      if (i == 0) {
        if (m > 1) out.sends.push_back({at(1), p.count});
        if (m > 1) out.recvs.push_back(at(m - 1));
      } else if (k == 0) {
        out.recvs.push_back(at(i - 1));
      } else {
        out.sends.push_back({at(i == m - 1 ? 0 : i + 1), i == m - 1 ? 0 : p.count});
      }
      break;
  }
}

int stepsOf(const Phase& p, const PlanShape& shape, const Layout& layout) {
  switch (p.kind) {
    case Kind::kBcastTree: return schedule::bcastSteps(bcastLinks(shape, layout));
    case Kind::kRailChain: return schedule::railChainSteps(chainLinks(shape, layout));
    case Kind::kTree: return schedule::treeSteps(schedule::binaryTree(p.m, layout.me(p.order)));
    case Kind::kDoubling: return schedule::doublingSteps(schedule::doubling(p.m, layout.me(p.order)));
    case Kind::kChain: return p.m < 2 ? 0 : layout.me(p.order) == 0 ? 1 : 2;
    default: return p.steps;
  }
}

}  // namespace railcc::engine
