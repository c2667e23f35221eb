#pragma once
// Who owns a buffer of user memory. A transport that registers user memory with a NIC may keep
// the registration for the next op only while the memory is still the same allocation: a buffer
// freed and its address handed to a new one would otherwise be read from the old pages (a
// registration pins them). The layer that knows the allocations (the c10d glue: a tensor's
// allocation, whose freeing it watches) notes an owner for each large buffer before handing
// it to the engine; the
// transport caches a registration only under a living owner, and registers for one use
// where there is none.
#include <atomic>
#include <cstddef>
#include <memory>

namespace railcc::transport {

class MemoryOwner {
 public:
  virtual ~MemoryOwner() = default;
  /// True while the allocation noted with this owner still holds the noted range. Thread-safe.
  virtual bool alive() const = 0;
};

/// The owner an allocator marks when it frees the memory (the glue's allocation watch, the
/// engine's pinned staging).
class FreedFlag : public MemoryOwner {
 public:
  bool alive() const override { return !freed.load(std::memory_order_acquire); }
  std::atomic<bool> freed{false};
};

/// Buffers of at least this many bytes are worth noting (a transport registering user memory
/// asked for them, wantMemoryOwners()); ~0 while none has.
size_t memoryOwnersMinBytes();
/// A transport that would cache registrations asks for owners of buffers >= minBytes.
void wantMemoryOwners(size_t minBytes);
/// Notes the owner of [base, base + bytes); replaces an earlier owner of the same base.
void noteMemoryOwner(const void* base, size_t bytes, std::shared_ptr<const MemoryOwner> owner);
/// The living owner noted for a range covering [p, p + n), and that range; null when none.
std::shared_ptr<const MemoryOwner> memoryOwnerOf(const void* p, size_t n, const void** base = nullptr,
                                                 size_t* bytes = nullptr);

}  // namespace railcc::transport
