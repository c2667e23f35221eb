#include "engine/algorithms/schedule.h"
#include "engine/comm_impl.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// Algorithms without a reduction order to keep or with one root: the chain broadcast (the
// tree is in bcast_tree.cpp), the rooted reduce, gather and scatter, the direct all-gather and
// all-to-all (every peer at once), the pairwise reduce-scatter of separate input buffers, and
// the barrier. Each op's
// entry here asks the rule (chooseAlgo, through algoFor) where there is a choice.

namespace {
// A chain's tail acknowledges to `to` once the header of its receive (xs.front(), from `from`)
// is in: every rank before it then agreed on the call. A tail whose predecessor is `to` itself
// vouches only for itself, which `to` checks in the acknowledgement's header: it sends it at
// once, so that rank waits a one-way trip, not a round trip (two ranks; a host of two).
void tailAcknowledges(const Channels& ch, std::vector<Transfer>& xs, int from, int to) {
  xs.push_back(ch.sendTo(to, nullptr, 0));
  if (from == to) return;
  xs.front().gates = true;
  xs.back().after = &xs.front();
}
}  // namespace

void CommImpl::runBroadcast(char* buf, size_t bytes, int root) {
  if (size_ == 1) return;
  const AlgoRow& row = algoRow(algoFor(AlgoOp::kBroadcast, bytes));
  RAILCC_CHECK_EQ(row.broadcast != nullptr, true);
  (this->*row.broadcast)(buf, bytes, root);
}

void CommImpl::runBroadcastChains(char* buf, size_t bytes, int root) {
  if (!rail_.empty()) return runBroadcastRailChain(buf, bytes, root);
  runBroadcastChain(buf, bytes, root);
}

// Hosts with equal numbers of ranks (two or more): a chain along the root's rail, and from each
// of its ranks one through that host (schedule::railChain), in ringOrder()'s host-by-host order.
void CommImpl::runBroadcastRailChain(char* buf, size_t bytes, int root) {
  const std::vector<int>& order = ringOrder();
  const int L = static_cast<int>(localRanks_.size()), H = size_ / L;
  const int me = positionIn(order, rank_), top = positionIn(order, root);
  const schedule::ChainLinks c = schedule::railChain(H, L, top / L, top % L, me / L, me % L);
  auto rankAt = [&](int i) { return order[static_cast<size_t>(i)]; };
  std::vector<Transfer> xs;
  xs.reserve(5);  // no reallocation: the forwarding sends point at the receive
  if (c.from >= 0) xs.push_back(ch_.recvFrom(rankAt(c.from), buf, bytes));
  for (int k = 0; k < c.nto; ++k) {
    xs.push_back(ch_.sendTo(rankAt(c.to[k]), buf, bytes));
    if (c.from >= 0) xs.back().limit = &xs.front().done;
  }
  for (int k = 0; k < c.nacks; ++k) xs.push_back(ch_.recvFrom(rankAt(c.acksFrom[k]), nullptr, 0));
  if (c.tailAck >= 0) tailAcknowledges(ch_, xs, rankAt(c.from), rankAt(c.tailAck));  // the header, not the payload
  ch_.zeroCopy(xs);
  ch_.exchange(xs);
  if (c.ackTo >= 0) {
    std::vector<Transfer> ack{ch_.sendTo(rankAt(c.ackTo), nullptr, 0)};
    ch_.exchange(ack);
  }
}

void CommImpl::runBroadcastChain(char* buf, size_t bytes, int root) {
  int n = size_, r = rank_;
  int pos = (r - root + n) % n;
  // A pipelined chain: each rank forwards bytes as soon as they arrive, and takes them only
  // after checking its predecessor's header, which carries the root. Once the tail has taken
  // that header (so every rank before it agreed on the root), it sends the root an empty
  // message: a root that the others do not agree on fails in this call, on both sides,
  // instead of returning as if its data had been taken (and the mismatch surfacing one op
  // later). The root waits for the tail's header, not for its whole payload; on two ranks
  // not even that (tailAcknowledges).
  std::vector<Transfer> xs;
  xs.reserve(3);
  if (pos > 0) xs.push_back(ch_.recvFrom((r - 1 + n) % n, buf, bytes));
  if (pos < n - 1) {
    xs.push_back(ch_.sendTo((r + 1) % n, buf, bytes));
    if (pos > 0) xs.back().limit = &xs.front().done;
  }
  if (pos == 0) {
    xs.push_back(ch_.recvFrom((root + n - 1) % n, nullptr, 0));
  } else if (pos == n - 1) {
    tailAcknowledges(ch_, xs, (r - 1 + n) % n, root);
  }
  ch_.zeroCopy(xs);  // the root's send (a forwarding send streams what has arrived)
  ch_.exchange(xs);
}

void CommImpl::runReduce(char* buf, size_t count, DataType dt, ReduceOp op, double scale, int root) {
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

// An all-gather's own piece, from the input to its place in the output: written around the
// cache where the whole result is larger than this rank's share of it (it saves reading every
// destination line first; the FIFO receives of such a result do the same).
static void copyOwnPiece(const Channels& ch, int n, char* own, const char* in, size_t bytes) {
  const bool apart = own + bytes <= in || in + bytes <= own;
  if (apart && ch.streamPiece(bytes * static_cast<size_t>(n), bytes)) transport::streamCopy(own, in, bytes);
  else transport::moveBytes(own, in, bytes);
}

void CommImpl::runAllgather(const char* in, size_t bytes, const std::vector<char*>& outs) {
  char* own = outs[static_cast<size_t>(rank_)];
  const AlgoRow& row = algoRow(algoFor(AlgoOp::kAllgather, bytes));
  RAILCC_CHECK_EQ(row.allgather != nullptr, true);
  if (!row.copiesOwnPiece && own != in && bytes) copyOwnPiece(ch_, size_, own, in, bytes);
  (this->*row.allgather)(in, bytes, outs);
}

void CommImpl::runAllgatherShmRings(const char* in, size_t bytes, const std::vector<char*>& outs) {
  runShmRingsGather(in, std::vector<size_t>(outs.size(), bytes), outs, true);
}

void CommImpl::runAllgatherDirect(const char* in, size_t bytes, const std::vector<char*>& outs) {
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
    for (int s = 1; s < n; ++s) ch_.progress(kCollLane, (r + s) % n);
    copyOwnPiece(ch_, n, own, in, bytes);
  }
  ch_.complete(xs);
}

void CommImpl::runReduceScatter(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op,
                                double scale) {
  const AlgoRow& row = algoRow(algoFor(AlgoOp::kReduceScatter, count * dtypeSize(dt)));
  RAILCC_CHECK_EQ(row.reduceScatter != nullptr, true);
  (this->*row.reduceScatter)(ins, out, count, dt, op, scale);
}

void CommImpl::runReduceScatterOneShot(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op,
                                       double scale) {
  auto blockOf = [&ins](int p) { return static_cast<const char*>(ins[static_cast<size_t>(p)]); };
  oneshotReduce(blockOf, out, count, dt, op, scale);
}

void CommImpl::runReduceScatterPairwise(const std::vector<char*>& ins, char* out, size_t count, DataType dt,
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

void CommImpl::runAlltoall(const std::vector<char*>& ins, const std::vector<size_t>& inCounts,
                           const std::vector<char*>& outs, const std::vector<size_t>& outCounts, DataType dt) {
  int n = size_, r = rank_;
  size_t es = dtypeSize(dt);
  size_t me = static_cast<size_t>(r);
  if (outs[me] != ins[me] && inCounts[me]) transport::moveBytes(outs[me], ins[me], inCounts[me] * es);
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
  ch_.exchange(xs);
}

void CommImpl::runGather(const char* in, size_t bytes, const std::vector<char*>& outs, int root) {
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

void CommImpl::runScatter(const std::vector<char*>& ins, char* out, size_t bytes, int root) {
  int n = size_, r = rank_;
  std::vector<Transfer> xs;
  if (r != root) {
    xs.push_back(ch_.recvFrom(root, out, bytes));
  } else {
    if (ins[static_cast<size_t>(r)] != out && bytes) transport::moveBytes(out, ins[static_cast<size_t>(r)], bytes);
    xs.reserve(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p)
      if (p != r) xs.push_back(ch_.sendTo(p, ins[static_cast<size_t>(p)], bytes));
  }
  ch_.exchange(xs);
}

void CommImpl::runBarrier() {
  // From 16 ranks across hosts, a one-byte all-reduce (by the rule: recursive doubling within
  // the host and a binary tree along each rail from 16 hosts): every rank has heard,
  // transitively, from every other before it returns, and the barrier meets no peer the small
  // all-reduce does not (3 network peers per rank, where a dissemination over all ranks meets
  // 2 log2 n: 23 at 4,096 ranks, each a connection with its buffers).
  if (barrierByAllreduce(place_)) {
    uint8_t b = 0;
    return runAllreduce(reinterpret_cast<char*>(&b), 1, DataType::kUInt8, ReduceOp::kMax, 1.0);
  }
  int n = size_, r = rank_;
  // Dissemination: after round k every rank has heard, transitively, from 2^(k+1) ranks.
  for (int k = 1; k < n; k *= 2) {
    std::vector<Transfer> xs{ch_.sendTo((r + k) % n, nullptr, 0), ch_.recvFrom((r - k + n) % n, nullptr, 0)};
    ch_.exchange(xs);
  }
}

}  // namespace railcc::engine
