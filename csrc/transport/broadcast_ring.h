#pragma once
// A broadcast ring: one producer, many consumers, in memory every rank of a host maps. The
// producer writes each byte once however many peers read it (a broadcast through per-peer
// FIFOs would copy it once per peer). Positions only grow; consumer c's position lives at
// heads[c], each on its own cache line. Shared memory provides one per rank (LocalDomain).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "transport/doorbell.h"

namespace railcc::transport {

/// Makes a ring's pages exist before its producer first writes to them, where the memory
/// under it reserves pages as they are first used (shared memory: see shm_segment.h). Owned
/// by whatever maps the ring; only the producer's ring has one.
class RingPages {
 public:
  virtual ~RingPages() = default;
  /// Makes the ring's bytes [0, end) exist. Throws kSystem where there is no room for them.
  virtual void reserveUpTo(size_t end) = 0;
  size_t ready = 0;  // bytes from the ring's start that exist
};

class BroadcastRing {
 public:
  BroadcastRing() = default;
  /// `owner`: the producer's doorbell, rung when a consumer frees space it may wait for.
  /// `pages`: where the producer's ring makes its pages exist as it first reaches them.
  BroadcastRing(Doorbell* owner, std::atomic<uint64_t>* tail, char* heads, char* data, size_t cap,
                RingPages* pages = nullptr)
      : owner_(owner), tail_(tail), heads_(heads), data_(data), cap_(cap), pages_(pages) {}

  // Producer side. `consumers` are the local indices that read this ring; `wakeUp` their doorbells.
  size_t write(const void* p, size_t n, const std::vector<int>& consumers, const std::vector<Doorbell*>& wakeUp);
  bool canWrite(const std::vector<int>& consumers) const;
  // Consumer side, as local index c.
  std::pair<const void*, size_t> peek(int c) const;
  void consume(int c, size_t n);
  bool readable(int c) const { return tail_->load(std::memory_order_acquire) > head(c).load(std::memory_order_relaxed); }
  size_t capacity() const { return cap_; }

  // Whole blocks, for ops that read parts of a peer's data where it lies. A block starts on a
  // 64-byte boundary and never wraps around the ring's end; the bytes skipped to get there
  // count as part of it. Producer and consumers work out the same skip from their positions,
  // which agree as long as every block is written and consumed by these calls with the same
  // sizes. A block of at most blockMax() bytes always fits once the consumers have caught up
  // (with the alignment and the skip, it takes less than 2 x blockMax() + 64 bytes).
  size_t blockMax() const { return cap_ % 64 == 0 && cap_ >= 256 ? cap_ / 2 - 64 : 0; }
  // Producer: where the next n-byte block goes, or nullptr while a consumer is too far behind.
  char* reserve(size_t n, const std::vector<int>& consumers) const;
  void publish(size_t n, const std::vector<Doorbell*>& wakeUp);
  // Consumer c: the next n-byte block once all of it is there, else nullptr.
  const char* block(int c, size_t n) const;
  void release(int c, size_t n);

 private:
  std::atomic<uint64_t>& head(int c) const { return *reinterpret_cast<std::atomic<uint64_t>*>(heads_ + 64 * c); }
  // The producer is about to write the ring's bytes below `end` (an offset from its start).
  void need(size_t end) const {
    if (pages_ != nullptr && end > pages_->ready) pages_->reserveUpTo(end);
  }
  Doorbell* owner_ = nullptr;
  std::atomic<uint64_t>* tail_ = nullptr;
  char* heads_ = nullptr;
  char* data_ = nullptr;
  size_t cap_ = 0;
  RingPages* pages_ = nullptr;
};

}  // namespace railcc::transport
