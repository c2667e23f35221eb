#include "common/error.h"
#include "engine/algorithms/algorithms.h"
#include "engine/algorithms/schedule.h"
#include "engine/algorithms/table.h"

namespace railcc::engine {

Algorithms::Algorithms(ChannelLayer& ch, const Config& config, Telemetry& tele, int rank, int size, Group g)
    : ch_(ch),
      config_(config),
      tele_(tele),
      rank_(rank),
      size_(size),
      peers_(g.peers),
      localRanks_(g.localRanks),
      rail_(g.rail),
      place_(g.place),
      prefer_(g.prefer) {}

// Each op's entry where the rule (chooseAlgo, through algoFor) has a choice: the row of the
// table it returns runs the op. The ops with one algorithm each are in direct.cpp.

void Algorithms::allreduce(char* buf, size_t count, DataType dt, ReduceOp op, double scale) {
  const AlgoRow& row = algoRow(algoFor(AlgoOp::kAllreduce, count * dtypeSize(dt)));
  RAILCC_CHECK_EQ(row.allreduce != nullptr, true);
  (this->*row.allreduce)(buf, count, dt, op, scale);
}

// Fuses small buffers into buckets of RAILCC_BUCKET_SIZE; one all-reduce per bucket.
void Algorithms::allreduceCoalesced(const std::vector<char*>& bufs, const std::vector<size_t>& counts, DataType dt,
                                    ReduceOp op, double scale) {
  size_t es = dtypeSize(dt);
  size_t cap = static_cast<size_t>(std::max<int64_t>(config_.bucketSize, 1)) / es * es;
  size_t i = 0;
  while (i < bufs.size()) {
    // A tensor that fills a bucket alone is reduced in place; smaller ones are packed.
    if (counts[i] * es >= cap || cap == 0) {
      allreduce(bufs[i], counts[i], dt, op, scale);
      ++i;
      continue;
    }
    if (bucket_.size() < cap) bucket_.resize(cap);
    size_t j = i, used = 0;
    while (j < bufs.size() && used + counts[j] * es <= cap) {
      if (counts[j]) transport::copyBytes(bucket_.data() + used, bufs[j], counts[j] * es);
      used += counts[j] * es;
      ++j;
    }
    allreduce(bucket_.data(), used / es, dt, op, scale);
    used = 0;
    for (size_t k = i; k < j; ++k) {
      if (counts[k]) transport::copyBytes(bufs[k], bucket_.data() + used, counts[k] * es);
      used += counts[k] * es;
    }
    i = j;
  }
}

void Algorithms::broadcast(char* buf, size_t bytes, int root) {
  if (size_ == 1) return;
  const AlgoRow& row = algoRow(algoFor(AlgoOp::kBroadcast, bytes));
  RAILCC_CHECK_EQ(row.broadcast != nullptr, true);
  (this->*row.broadcast)(buf, bytes, root);
}

// An all-gather's own piece, from the input to its place in the output: written around the
// cache where the whole result is larger than this rank's share of it (it saves reading every
// destination line first; the FIFO receives of such a result do the same).
void copyOwnPiece(const ChannelLayer& ch, int n, char* own, const char* in, size_t bytes) {
  const bool apart = own + bytes <= in || in + bytes <= own;
  if (apart && ch.streamPiece(bytes * static_cast<size_t>(n), bytes)) transport::streamCopy(own, in, bytes);
  else transport::moveBytes(own, in, bytes);
}

void Algorithms::allgather(const char* in, size_t bytes, const std::vector<char*>& outs) {
  char* own = outs[static_cast<size_t>(rank_)];
  const AlgoRow& row = algoRow(algoFor(AlgoOp::kAllgather, bytes));
  RAILCC_CHECK_EQ(row.allgather != nullptr, true);
  if (!row.copiesOwnPiece && own != in && bytes) copyOwnPiece(ch_, size_, own, in, bytes);
  (this->*row.allgather)(in, bytes, outs);
}

void Algorithms::reduceScatter(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op,
                               double scale) {
  const AlgoRow& row = algoRow(algoFor(AlgoOp::kReduceScatter, count * dtypeSize(dt)));
  RAILCC_CHECK_EQ(row.reduceScatter != nullptr, true);
  (this->*row.reduceScatter)(ins, out, count, dt, op, scale);
}

}  // namespace railcc::engine
