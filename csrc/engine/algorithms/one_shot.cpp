#include <cstring>

#include "engine/algorithms/algorithms.h"

namespace railcc::engine {

// One shot: every rank sends its whole buffer (or, for reduce-scatter, each peer's block) to
// every peer in one step, and reduces what it received in rank order.

void Algorithms::oneshotReduce(const std::function<const char*(int)>& blockOf, char* out, size_t count, DataType dt,
                               ReduceOp op, double scale) {
  int n = size_, r = rank_;
  size_t bytes = count * dtypeSize(dt), stride = pad8(bytes);
  if (scratch_.size() < stride * static_cast<size_t>(n)) scratch_.resize(stride * static_cast<size_t>(n));
  char* sc = scratch_.data();
  auto slot = [&](int p) { return sc + stride * static_cast<size_t>(p); };
  const char* own = blockOf(r);
  // The sum starts from block `lead` (rank 0's) and takes the others in rank order. With two
  // ranks each starts from its own instead: a op b and b op a round alike for sum, avg,
  // product, min, max and the bitwise ops (NaN payloads aside), not for premul_sum (in half
  // precision fp16(fp16(s*a) + s*b) and fp16(fp16(s*b) + s*a) can differ). The rank that leads
  // accumulates in `out` from its own block where it is; the others in the lead's slot, reading
  // their own block where it is, and copy the sum out once. (A lead whose `out` overlaps its
  // block in part goes through its slot too.)
  const int lead = n == 2 && op != ReduceOp::kPremulSum ? r : 0;
  const bool inOut = r == lead && (out == own || out + bytes <= own || own + bytes <= out);
  std::vector<Transfer>& xs = oneshotXs_;  // kept between calls: no allocation per op
  xs.clear();
  xs.reserve(2 * static_cast<size_t>(n));
  for (int p = 0; p < n; ++p)
    if (p != r) {
      xs.push_back(ch_.sendTo(p, blockOf(p), bytes));
      xs.push_back(ch_.recvFrom(p, slot(p), bytes));
    }
  if (r == lead && !inOut) transport::copyBytes(slot(lead), own, bytes);
  ch_.exchange(xs);  // every block sent: `out` may be written now
  char* acc = inOut ? out : slot(lead);
  const char* first = inOut ? own : slot(lead);
  if (op == ReduceOp::kPremulSum) scaleCopy(acc, first, count, dt, scale);
  else if (acc != first) std::memmove(acc, first, bytes);
  for (int p = 0; p < n; ++p)
    if (p != lead) reduceInto(acc, p == r ? own : slot(p), count, dt, op, scale);
  if (!inOut) transport::copyBytes(out, acc, bytes);
  if (op == ReduceOp::kAvg) divideBy(out, count, dt, n);
}

void Algorithms::allreduceOneShot(char* buf, size_t count, DataType dt, ReduceOp op, double scale) {
  oneshotReduce([buf](int) { return buf; }, buf, count, dt, op, scale);
}

void Algorithms::reduceScatterOneShot(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op,
                                      double scale) {
  auto blockOf = [&ins](int p) { return static_cast<const char*>(ins[static_cast<size_t>(p)]); };
  oneshotReduce(blockOf, out, count, dt, op, scale);
}

}  // namespace railcc::engine
