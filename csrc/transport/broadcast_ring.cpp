#include "transport/broadcast_ring.h"

#include <algorithm>

#include "transport/copy.h"
#include "transport/stats.h"

namespace railcc::transport {

size_t BroadcastRing::write(const void* p, size_t n, const std::vector<int>& consumers,
                        const std::vector<Doorbell*>& wakeUp) {
  uint64_t tail = tail_->load(std::memory_order_relaxed);
  uint64_t low = tail;
  for (int c : consumers) low = std::min<uint64_t>(low, head(c).load(std::memory_order_acquire));
  size_t space = cap_ - static_cast<size_t>(tail - low);
  size_t k = n < space ? n : space;
  if (k == 0) return 0;
  size_t off = static_cast<size_t>(tail % cap_);
  size_t first = k < cap_ - off ? k : cap_ - off;
  need(k > first ? cap_ : off + first);
  copyBytes(data_ + off, p, first);
  if (k > first) copyBytes(data_, static_cast<const char*>(p) + first, k - first);
  tail_->store(tail + k, std::memory_order_seq_cst);
  for (Doorbell* d : wakeUp) wake(d);
  addStat(StatKind::kShm, Stat::kSendCopied, k);
  return k;
}

bool BroadcastRing::canWrite(const std::vector<int>& consumers) const {
  uint64_t tail = tail_->load(std::memory_order_relaxed);
  for (int c : consumers)
    if (tail - head(c).load(std::memory_order_seq_cst) >= cap_) return false;
  return true;
}

std::pair<const void*, size_t> BroadcastRing::peek(int c) const {
  uint64_t h = head(c).load(std::memory_order_relaxed);
  uint64_t tail = tail_->load(std::memory_order_acquire);
  size_t avail = static_cast<size_t>(tail - h);
  size_t off = static_cast<size_t>(h % cap_);
  return {data_ + off, avail < cap_ - off ? avail : cap_ - off};
}

void BroadcastRing::consume(int c, size_t n) {
  head(c).store(head(c).load(std::memory_order_relaxed) + n, std::memory_order_seq_cst);
  wake(owner_);  // the producer may wait for space
  addStat(StatKind::kShm, Stat::kRecvCopied, n);
}

namespace {
// Start of an n-byte block written at stream position pos of a ring of cap bytes.
uint64_t blockStart(uint64_t pos, size_t n, size_t cap) {
  uint64_t s = (pos + 63) & ~uint64_t(63);
  if (s % cap + n > cap) s += cap - s % cap;
  return s;
}
}  // namespace

char* BroadcastRing::reserve(size_t n, const std::vector<int>& consumers) const {
  uint64_t tail = tail_->load(std::memory_order_relaxed);
  uint64_t low = tail;
  // seq_cst, as in canWrite(): this also runs as the recheck after raising the sleeping flag.
  for (int c : consumers) low = std::min<uint64_t>(low, head(c).load(std::memory_order_seq_cst));
  uint64_t s = blockStart(tail, n, cap_);
  if (s + n - low > cap_) return nullptr;
  need(static_cast<size_t>(s % cap_) + n);
  return data_ + s % cap_;
}

void BroadcastRing::publish(size_t n, const std::vector<Doorbell*>& wakeUp) {
  tail_->store(blockStart(tail_->load(std::memory_order_relaxed), n, cap_) + n, std::memory_order_seq_cst);
  for (Doorbell* d : wakeUp) wake(d);
  addStat(StatKind::kShm, Stat::kSendCopied, n);
}

const char* BroadcastRing::block(int c, size_t n) const {
  uint64_t s = blockStart(head(c).load(std::memory_order_relaxed), n, cap_);
  return tail_->load(std::memory_order_seq_cst) >= s + n ? data_ + s % cap_ : nullptr;
}

void BroadcastRing::release(int c, size_t n) {
  head(c).store(blockStart(head(c).load(std::memory_order_relaxed), n, cap_) + n, std::memory_order_seq_cst);
  wake(owner_);
  addStat(StatKind::kShm, Stat::kRecvCopied, n);
}

}  // namespace railcc::transport
