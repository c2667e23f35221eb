#include <map>

#include "engine/algorithms/schedule.h"
#include "engine/algorithms/algorithms.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// Rings: every rank talks to its two neighbours only, whatever the group's size, so a rank
// needs two peers' connections and buffers, not n-1. An all-reduce is a reduce-scatter and an
// all-gather around the ring, 2(n-1) steps, each moving 1/n of the buffer: every rank sends
// 2(n-1)/n of it in all, the least any all-reduce can. The ring runs through the ranks host
// by host (ringOrder), so only one hop per host boundary crosses the network.

// Hosts in the order of their lowest rank, each host's ranks in rank order. The placement is
// fixed once the group is set up: worked out at the first ring op, kept for the rest.
const std::vector<int>& Algorithms::ringOrder() {
  if (!ring_.empty()) return ring_;
  std::map<std::string, size_t> slot;
  std::vector<std::vector<int>> byHost;
  for (int r = 0; r < size_; ++r) {
    auto [it, fresh] = slot.emplace(peers_[static_cast<size_t>(r)].hostId, byHost.size());
    if (fresh) byHost.emplace_back();
    byHost[it->second].push_back(r);
  }
  ring_.reserve(static_cast<size_t>(size_));
  for (const auto& h : byHost) ring_.insert(ring_.end(), h.begin(), h.end());
  return ring_;
}

// Block j ends reduced at g[j]. At step s a rank sends block i-1-s, which it reduced in the
// step before (its own input at s = 0), and reduces block i-2-s from its predecessor: each
// block's sum is built along the ring in one order, by one rank per term.
void Algorithms::ringReduceScatter(const std::vector<int>& g, char* buf, size_t count, DataType dt, ReduceOp op) {
  const int m = static_cast<int>(g.size()), i = positionIn(g, rank_);
  const size_t es = dtypeSize(dt);
  Blocks b(count, m, es);
  const int next = g[static_cast<size_t>((i + 1) % m)], prev = g[static_cast<size_t>((i + m - 1) % m)];
  for (int s = 0; s < m - 1; ++s) {
    const auto [sb, rb] = schedule::ringReduceStep(m, i, s);
    std::vector<Transfer> xs{ch_.sendTo(next, buf + b.offset(sb), b.count(sb) * es),
                             ch_.recvReduce(prev, buf + b.offset(rb), b.count(rb), dt, op, 1.0)};
    ch_.exchange(xs);
  }
}

// Each block travels once around the ring from the rank that holds it.
void Algorithms::ringAllgather(const std::vector<int>& g, const std::vector<char*>& blocks, const std::vector<size_t>& sizes) {
  const int m = static_cast<int>(g.size()), i = positionIn(g, rank_);
  const int next = g[static_cast<size_t>((i + 1) % m)], prev = g[static_cast<size_t>((i + m - 1) % m)];
  for (int s = 0; s < m - 1; ++s) {
    const auto [send, recv] = schedule::ringGatherStep(m, i, s);
    const size_t sb = static_cast<size_t>(send), rb = static_cast<size_t>(recv);
    std::vector<Transfer> xs{ch_.sendTo(next, blocks[sb], sizes[sb]), ch_.recvFrom(prev, blocks[rb], sizes[rb])};
    ch_.zeroCopy(xs);  // a receive that copies: RDMA may read the block from where it lies
    ch_.exchange(xs);
  }
}

void Algorithms::ringAllgatherBlocks(const std::vector<int>& g, char* buf, size_t count, size_t es) {
  const int m = static_cast<int>(g.size());
  Blocks b(count, m, es);
  std::vector<char*> blocks(static_cast<size_t>(m));
  std::vector<size_t> sizes(static_cast<size_t>(m));
  for (int j = 0; j < m; ++j) {
    blocks[static_cast<size_t>(j)] = buf + b.offset(j);
    sizes[static_cast<size_t>(j)] = b.count(j) * es;
  }
  ringAllgather(g, blocks, sizes);
}

void Algorithms::allreduceRing(char* buf, size_t count, DataType dt, ReduceOp op, double scale) {
  const size_t es = dtypeSize(dt);
  // Partial sums travel, so a factor is applied once, up front, and an average divides once.
  if (op == ReduceOp::kPremulSum) scaleCopy(buf, buf, count, dt, scale);
  const ReduceOp across = acrossRanks(op);
  const std::vector<int>& g = ringOrder();
  const int m = static_cast<int>(g.size()), i = positionIn(g, rank_);
  ringReduceScatter(g, buf, count, dt, across);
  Blocks b(count, m, es);
  if (op == ReduceOp::kAvg) divideBy(buf + b.offset(i), b.count(i), dt, size_);
  ringAllgatherBlocks(g, buf, count, es);
}

// Reduce-scatter of separate inputs (ins[j] is our term of block j, `count` elements each)
// around the ring: the partial sum of a block travels and grows by one term per hop, as in
// ringReduceScatter, and ends at its owner in `out`. The inputs are the caller's and stay
// untouched, so partial sums live in two scratch blocks, one sent while the other fills: the
// block a rank reduces at step s is the one it sends at step s + 1.
void Algorithms::reduceScatterRing(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op,
                                   double scale) {
  const std::vector<int>& g = ringOrder();
  const int m = static_cast<int>(g.size()), i = positionIn(g, rank_);
  const size_t bytes = count * dtypeSize(dt);
  const ReduceOp across = acrossRanks(op);
  const int next = g[static_cast<size_t>((i + 1) % m)], prev = g[static_cast<size_t>((i + m - 1) % m)];
  // Our term of a block, scaled once where the op says so, into `dst`.
  auto own = [&](char* dst, int block) { ownTerm(dst, ins[static_cast<size_t>(g[static_cast<size_t>(block)])], count, dt, op, scale); };
  if (m == 1) return own(out, i);
  if (scratch_.size() < 2 * bytes) scratch_.resize(2 * bytes);
  char* acc[2] = {scratch_.data(), scratch_.data() + bytes};
  own(acc[0], schedule::ringReduceStep(m, i, 0).send);
  for (int s = 0; s < m - 1; ++s) {
    const int rb = schedule::ringReduceStep(m, i, s).recv;
    char* into = s == m - 2 ? out : acc[(s + 1) % 2];
    own(into, rb);
    std::vector<Transfer> xs{ch_.sendTo(next, acc[s % 2], bytes), ch_.recvReduce(prev, into, count, dt, across, 1.0)};
    ch_.exchange(xs);
  }
  if (op == ReduceOp::kAvg) divideBy(out, count, dt, size_);
  if (scratch_.size() > kScratchKeep) std::vector<char>().swap(scratch_);
}

// outs[r] receives rank r's `bytes` (ours is already in place).
void Algorithms::allgatherRing(const char*, size_t bytes, const std::vector<char*>& outs) {
  const std::vector<int>& g = ringOrder();
  std::vector<char*> blocks;
  blocks.reserve(g.size());
  for (int r : g) blocks.push_back(outs[static_cast<size_t>(r)]);
  ringAllgather(g, blocks, std::vector<size_t>(g.size(), bytes));
}

}  // namespace railcc::engine
