#include "engine/algorithms/schedule.h"
#include "engine/comm_impl.h"

namespace railcc::engine {

namespace {
constexpr size_t kTreeScratchKeep = 1u << 20;
}  // namespace

// ---------------------------------------------------------------------------------------
// Recursive doubling: for small all-reduces, ceil(log2 n) + 2 steps at most instead of the
// ring's 2(n-1), each exchanging the whole buffer with one partner. With p the largest power
// of two up to n, the first 2(n-p) ranks pair up: each even one hands its buffer to the odd
// one after it and waits for the result. The p ranks left exchange with the rank whose
// virtual index differs in one bit, one bit per step. A rank talks to at most log2(p) + 1
// peers. Both sides of an exchange compute a op b and b op a, which are equal bit for bit for
// every reduction railcc has, so every rank ends with the same bits.

void CommImpl::runAllreduceTree(char* buf, size_t count, DataType dt, ReduceOp op, double scale) {
  const int n = size_, r = rank_;
  const size_t bytes = count * dtypeSize(dt);
  if (op == ReduceOp::kPremulSum) scaleCopy(buf, buf, count, dt, scale);
  const ReduceOp across = acrossRanks(op);
  const schedule::Doubling d = schedule::doubling(n, r);
  if (d.foldPeer >= 0) {
    std::vector<Transfer> xs{d.hands ? ch_.sendTo(d.foldPeer, buf, bytes) : ch_.recvReduce(d.foldPeer, buf, count, dt, across, 1.0)};
    ch_.exchange(xs);
  }
  if (d.v >= 0) {
    // The partner reads what we send while we reduce its data into buf: send from a copy.
    if (treeScratch_.size() < bytes) treeScratch_.resize(bytes);
    for (int bit = 1; bit < d.p; bit <<= 1) {
      const int partner = schedule::doublingPartner(d, bit);
      if (bytes) transport::copyBytes(treeScratch_.data(), buf, bytes);
      std::vector<Transfer> xs{ch_.sendTo(partner, treeScratch_.data(), bytes),
                               ch_.recvReduce(partner, buf, count, dt, across, 1.0)};
      ch_.exchange(xs);
    }
  }
  if (d.foldPeer >= 0) {
    std::vector<Transfer> xs{d.hands ? ch_.recvFrom(d.foldPeer, buf, bytes) : ch_.sendTo(d.foldPeer, buf, bytes)};
    ch_.exchange(xs);
  }
  if (op == ReduceOp::kAvg) divideBy(buf, count, dt, n);
  // The rule runs the tree on small buffers; one forced onto a large one (RAILCC_ALGO=tree)
  // does not keep a copy of its size for the life of the group.
  if (treeScratch_.size() > kTreeScratchKeep) std::vector<char>().swap(treeScratch_);
}

}  // namespace railcc::engine
