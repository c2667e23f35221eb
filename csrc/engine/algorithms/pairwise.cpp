#include <numeric>

#include "engine/algorithms/algorithms.h"
#include "engine/algorithms/schedule.h"

namespace railcc::engine {

// Pairwise schedules: at step s rank r sends to r+s and receives from r-s, so every step pairs
// distinct peers and the order of every reduction is fixed.

void Algorithms::pairwiseReduceScatter(const std::vector<int>& g, char* buf, size_t count, DataType dt, ReduceOp op,
                                       double scale) {
  const int m = static_cast<int>(g.size()), i = positionIn(g, rank_);
  const size_t es = dtypeSize(dt);
  Blocks b(count, m, es);
  char* mine = buf + b.offset(i);
  if (op == ReduceOp::kPremulSum) scaleCopy(mine, mine, b.count(i), dt, scale);
  for (int s = 1; s < m; ++s) {
    const auto [to, from] = schedule::pairwiseStep(m, i, s);
    std::vector<Transfer> xs{ch_.sendTo(g[static_cast<size_t>(to)], buf + b.offset(to), b.count(to) * es),
                             ch_.recvReduce(g[static_cast<size_t>(from)], mine, b.count(i), dt, op, scale)};
    ch_.exchange(xs);
  }
}

void Algorithms::pairwiseAllgather(const std::vector<int>& g, char* buf, size_t count, size_t es) {
  const int m = static_cast<int>(g.size()), i = positionIn(g, rank_);
  Blocks b(count, m, es);
  for (int s = 1; s < m; ++s) {
    const auto [to, from] = schedule::pairwiseStep(m, i, s);
    std::vector<Transfer> xs{ch_.sendTo(g[static_cast<size_t>(to)], buf + b.offset(i), b.count(i) * es),
                             ch_.recvFrom(g[static_cast<size_t>(from)], buf + b.offset(from), b.count(from) * es)};
    ch_.singleCopy(xs);
    ch_.exchange(xs);
  }
}

void Algorithms::allreducePairwise(char* buf, size_t count, DataType dt, ReduceOp op, double scale) {
  const int n = size_, r = rank_;
  const size_t es = dtypeSize(dt);
  std::vector<int> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  pairwiseReduceScatter(all, buf, count, dt, op, scale);
  Blocks b(count, n, es);
  char* mine = buf + b.offset(r);
  if (op == ReduceOp::kAvg) divideBy(mine, b.count(r), dt, n);
  if (place_.shmRings) {  // as the rule says (chooseAlgo): the all-gather half through the rings
    std::vector<size_t> sizes(static_cast<size_t>(n));
    std::vector<char*> outs(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p) {
      sizes[static_cast<size_t>(p)] = b.count(p) * es;
      outs[static_cast<size_t>(p)] = buf + b.offset(p);
    }
    return shmRingsGather(mine, sizes, outs, false);
  }
  pairwiseAllgather(all, buf, count, es);
}

void Algorithms::reduceScatterPairwise(const std::vector<char*>& ins, char* out, size_t count, DataType dt,
                                       ReduceOp op, double scale) {
  const int n = size_, r = rank_;
  const size_t bytes = count * dtypeSize(dt);
  const char* mine = ins[static_cast<size_t>(r)];
  // Pairwise over separate input buffers (pairwiseReduceScatter works on one buffer in blocks).
  ownTerm(out, mine, count, dt, op, scale);
  for (int s = 1; s < n; ++s) {
    const auto [to, from] = schedule::pairwiseStep(n, r, s);
    std::vector<Transfer> xs{ch_.sendTo(to, ins[static_cast<size_t>(to)], bytes), ch_.recvReduce(from, out, count, dt, op, scale)};
    ch_.exchange(xs);
  }
  if (op == ReduceOp::kAvg) divideBy(out, count, dt, n);
}

}  // namespace railcc::engine
