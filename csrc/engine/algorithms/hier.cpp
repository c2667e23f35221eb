#include "engine/algorithms/algorithms.h"
#include "engine/algorithms/schedule.h"

namespace railcc::engine {

// All-reduce across hosts that each run the same number of ranks: reduce-scatter among the
// ranks of each host (shared memory), all-reduce each host's piece among the ranks that hold
// it on every host (one rail: the network), then all-gather on each host again. Every rank
// sends S/L bytes over the network where the flat pairwise schedule sends about S (L ranks
// per host, S the buffer's size), and each element is reduced once, by one rank, so every
// rank ends with the same bits. Each rank checks the headers of its host's ranks and of its
// rail; a rank that disagrees fails those, and their failure reaches the rest.
void Algorithms::allreduceHier(char* buf, size_t count, DataType dt, ReduceOp op, double scale) {
  const size_t es = dtypeSize(dt);
  const int L = static_cast<int>(localRanks_.size()), H = static_cast<int>(rail_.size());
  Blocks b(count, L, es);
  const int li = localIndex(rank_);
  char* piece = buf + b.offset(li);
  const size_t pc = b.count(li);
  pairwiseReduceScatter(localRanks_, buf, count, dt, op, scale);
  // The host's partial results are already scaled; an average divides once, at the end.
  ReduceOp across = acrossRanks(op);
  // The rail: pairwise up to kRingMinRanks hosts, then around a ring (two network peers per
  // rank however many hosts). Either way block j of the piece ends reduced at rail_[j].
  const bool ring = railRing(H, prefer_);
  if (ring) ringReduceScatter(rail_, piece, pc, dt, across);
  else pairwiseReduceScatter(rail_, piece, pc, dt, across, 1.0);
  if (op == ReduceOp::kAvg) {
    Blocks c(pc, H, es);
    const int hi = positionIn(rail_, rank_);
    divideBy(piece + c.offset(hi), c.count(hi), dt, size_);
  }
  if (ring) ringAllgatherBlocks(rail_, piece, pc, es);
  else pairwiseAllgather(rail_, piece, pc, es);
  pairwiseAllgather(localRanks_, buf, count, es);
}

// Reduce-scatter and all-gather across hosts that each run the same number of ranks (L), the
// way the per-host all-reduce does it: the network stage runs along rails (the ranks with the
// same local index, one per host, H of them), around a ring, so every rank's NIC carries its
// share and a rank meets two network peers however many hosts; the host stage is a pairwise
// exchange among the host's ranks (shared memory), whose messages carry a rail's worth of
// blocks (H at a time). ringOrder() lists the ranks host by host, so the rank of local index
// t on the j-th host is ringOrder()[j * L + t].
namespace {
int onHost(const std::vector<int>& order, int L, int host, int t) {
  return order[static_cast<size_t>(host * L + t)];
}
}  // namespace

// outs[r] receives rank r's `bytes`; ours is already in place.
void Algorithms::allgatherHier(const char*, size_t bytes, const std::vector<char*>& outs) {
  const std::vector<int>& order = ringOrder();
  const int L = static_cast<int>(localRanks_.size()), H = static_cast<int>(rail_.size());
  const int li = localIndex(rank_);
  // The rail: every rank gathers the blocks of its rail's ranks.
  std::vector<char*> blocks(static_cast<size_t>(H));
  for (int j = 0; j < H; ++j) blocks[static_cast<size_t>(j)] = outs[static_cast<size_t>(rail_[static_cast<size_t>(j)])];
  ringAllgather(rail_, blocks, std::vector<size_t>(static_cast<size_t>(H), bytes));
  // The host: each rank hands its rail's blocks to every other rank of the host.
  for (int s = 1; s < L; ++s) {
    const auto [to, from] = schedule::pairwiseStep(L, li, s);
    std::vector<Transfer> xs;
    xs.reserve(2 * static_cast<size_t>(H));
    for (int j = 0; j < H; ++j) {
      xs.push_back(ch_.sendTo(localRanks_[static_cast<size_t>(to)], outs[static_cast<size_t>(onHost(order, L, j, li))], bytes));
      xs.push_back(ch_.recvFrom(localRanks_[static_cast<size_t>(from)], outs[static_cast<size_t>(onHost(order, L, j, from))], bytes));
    }
    ch_.singleCopy(xs);
    ch_.exchange(xs);
  }
}

// ins[q] is our term of rank q's block (`count` elements). The host stage reduces, for each
// rank of our rail, the host's terms into an accumulator (our own first, then each host
// peer's); the rail stage reduce-scatters those H accumulators around the rail's ring, so the
// block of rail_[j] ends reduced at it.
void Algorithms::reduceScatterHier(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op,
                                   double scale) {
  const std::vector<int>& order = ringOrder();
  const int L = static_cast<int>(localRanks_.size()), H = static_cast<int>(rail_.size());
  const int li = localIndex(rank_);
  const size_t bytes = count * dtypeSize(dt);
  if (scratch_.size() < bytes * static_cast<size_t>(H)) scratch_.resize(bytes * static_cast<size_t>(H));
  char* acc = scratch_.data();
  for (int j = 0; j < H; ++j)
    ownTerm(acc + bytes * static_cast<size_t>(j), ins[static_cast<size_t>(rail_[static_cast<size_t>(j)])], count, dt, op, scale);
  for (int s = 1; s < L; ++s) {
    const auto [to, from] = schedule::pairwiseStep(L, li, s);
    std::vector<Transfer> xs;
    xs.reserve(2 * static_cast<size_t>(H));
    for (int j = 0; j < H; ++j) {
      xs.push_back(ch_.sendTo(localRanks_[static_cast<size_t>(to)], ins[static_cast<size_t>(onHost(order, L, j, to))], bytes));
      xs.push_back(ch_.recvReduce(localRanks_[static_cast<size_t>(from)], acc + bytes * static_cast<size_t>(j), count, dt, op, scale));
    }
    ch_.exchange(xs);
  }
  const ReduceOp across = acrossRanks(op);
  ringReduceScatter(rail_, acc, count * static_cast<size_t>(H), dt, across);
  const char* mine = acc + bytes * static_cast<size_t>(positionIn(rail_, rank_));
  if (bytes) transport::copyBytes(out, mine, bytes);
  if (op == ReduceOp::kAvg) divideBy(out, count, dt, size_);
  if (scratch_.size() > kScratchKeep) std::vector<char>().swap(scratch_);
}

}  // namespace railcc::engine
