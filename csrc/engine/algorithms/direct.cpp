#include "engine/algorithms/algorithms.h"

namespace railcc::engine {

// The ops with one algorithm each, every peer at once or straight to and from the root: the
// direct all-gather, all-to-all, gather, scatter, the rooted reduce, the barrier, and the
// header rounds that other code uses to check a call.

void Algorithms::startPeers() {
  for (int s = 1; s < size_; ++s) ch_.progress(kCollLane, (rank_ + s) % size_);
}

void Algorithms::allgatherDirect(const char* in, size_t bytes, const std::vector<char*>& outs) {
  const int n = size_, r = rank_;
  char* own = outs[static_cast<size_t>(r)];
  const bool copyOwn = own != in && bytes;
  // Every peer at once: one synchronization instead of n-1, and nothing is reduced, so the
  // order in which the pieces land does not matter.
  std::vector<Transfer> xs;
  xs.reserve(2 * static_cast<size_t>(n));
  for (int s = 1; s < n; ++s) {
    int to = (r + s) % n, from = (r - s + n) % n;
    xs.push_back(ch_.sendTo(to, in, bytes));
    xs.push_back(ch_.recvFrom(from, outs[static_cast<size_t>(from)], bytes));
  }
  ch_.streamPieces(xs, bytes * static_cast<size_t>(n));
  ch_.singleCopy(xs);
  ch_.post(xs);
  if (copyOwn) {
    // Our own piece is copied while the peers already take theirs: a send passed by address
    // (single copy) is read from `in` by the peer's core meanwhile, one through the FIFO has
    // filled it.
    startPeers();
    copyOwnPiece(ch_, n, own, in, bytes);
  }
  ch_.complete(xs);
}

void Algorithms::alltoall(const std::vector<char*>& ins, const std::vector<size_t>& inCounts,
                          const std::vector<char*>& outs, const std::vector<size_t>& outCounts, DataType dt) {
  int n = size_, r = rank_;
  size_t es = dtypeSize(dt);
  size_t me = static_cast<size_t>(r);
  std::vector<Transfer> xs;
  xs.reserve(2 * static_cast<size_t>(n));
  for (int s = 1; s < n; ++s) {
    size_t to = static_cast<size_t>((r + s) % n), from = static_cast<size_t>((r - s + n) % n);
    xs.push_back(ch_.sendTo(static_cast<int>(to), ins[to], inCounts[to] * es));
    xs.push_back(ch_.recvFrom(static_cast<int>(from), outs[from], outCounts[from] * es));
  }
  size_t total = 0;
  for (size_t k : outCounts) total += k * es;
  ch_.streamPieces(xs, total);
  ch_.singleCopy(xs);
  ch_.post(xs);
  if (outs[me] != ins[me] && inCounts[me]) {
    // As the all-gather's own piece: copied once the peers have our blocks' addresses (or
    // their first bytes), so that they read while we copy instead of waiting for it.
    startPeers();
    transport::moveBytes(outs[me], ins[me], inCounts[me] * es);
  }
  ch_.complete(xs);
}

void Algorithms::gather(const char* in, size_t bytes, const std::vector<char*>& outs, int root) {
  int n = size_, r = rank_;
  std::vector<Transfer> xs;
  if (r != root) {
    xs.push_back(ch_.sendTo(root, in, bytes));
  } else {
    if (outs[static_cast<size_t>(r)] != in && bytes) transport::moveBytes(outs[static_cast<size_t>(r)], in, bytes);
    xs.reserve(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p)
      if (p != r) xs.push_back(ch_.recvFrom(p, outs[static_cast<size_t>(p)], bytes));
  }
  ch_.exchange(xs);
}

// The root's own piece is copied once the peers' sends are under way, as in alltoall().
void Algorithms::scatter(const std::vector<char*>& ins, char* out, size_t bytes, int root) {
  int n = size_, r = rank_;
  std::vector<Transfer> xs;
  if (r != root) {
    xs.push_back(ch_.recvFrom(root, out, bytes));
    ch_.exchange(xs);
    return;
  }
  xs.reserve(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p)
    if (p != r) xs.push_back(ch_.sendTo(p, ins[static_cast<size_t>(p)], bytes));
  ch_.post(xs);
  startPeers();
  if (ins[static_cast<size_t>(r)] != out && bytes) transport::moveBytes(out, ins[static_cast<size_t>(r)], bytes);
  ch_.complete(xs);
}

void Algorithms::reduce(char* buf, size_t count, DataType dt, ReduceOp op, double scale, int root) {
  int n = size_, r = rank_;
  size_t bytes = count * dtypeSize(dt);
  if (r != root) {
    std::vector<Transfer> xs{ch_.sendTo(root, buf, bytes)};
    ch_.exchange(xs);
    return;
  }
  if (op == ReduceOp::kPremulSum) scaleCopy(buf, buf, count, dt, scale);
  for (int s = 1; s < n; ++s) {  // in rank order from the root, so every run reduces alike
    std::vector<Transfer> xs{ch_.recvReduce((root + s) % n, buf, count, dt, op, scale)};
    ch_.exchange(xs);
  }
  if (op == ReduceOp::kAvg) divideBy(buf, count, dt, n);
}

void Algorithms::barrier() {
  // From 16 ranks across hosts, a one-byte all-reduce (by the rule: recursive doubling within
  // the host and a binary tree along each rail from 16 hosts): every rank has heard,
  // transitively, from every other before it returns, and the barrier meets no peer the small
  // all-reduce does not (3 network peers per rank, where a dissemination over all ranks meets
  // 2 log2 n: 23 at 4,096 ranks, each a connection with its buffers).
  if (barrierByAllreduce(place_)) {
    uint8_t b = 0;
    return allreduce(reinterpret_cast<char*>(&b), 1, DataType::kUInt8, ReduceOp::kMax, 1.0);
  }
  int n = size_, r = rank_;
  // Dissemination: after round k every rank has heard, transitively, from 2^(k+1) ranks.
  for (int k = 1; k < n; k *= 2) {
    std::vector<Transfer> xs{ch_.sendTo((r + k) % n, nullptr, 0), ch_.recvFrom((r - k + n) % n, nullptr, 0)};
    ch_.exchange(xs);
  }
}

void Algorithms::headerRound(std::vector<Transfer>& sends, std::vector<Transfer>& recvs) {
  sends.reserve(2 * static_cast<size_t>(size_));
  recvs.reserve(static_cast<size_t>(size_));
  for (int p = 0; p < size_; ++p)
    if (p != rank_) {
      sends.push_back(ch_.sendTo(p, nullptr, 0));
      recvs.push_back(ch_.recvFrom(p, nullptr, 0));
    }
}

void Algorithms::syncRound() {
  std::vector<Transfer> sends, recvs;
  headerRound(sends, recvs);
  sends.insert(sends.end(), recvs.begin(), recvs.end());
  ch_.exchange(sends);
}

}  // namespace railcc::engine
