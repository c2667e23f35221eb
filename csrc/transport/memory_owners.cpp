#include "transport/memory_owners.h"

#include <atomic>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>

namespace railcc::transport {
namespace {

struct Noted {
  uintptr_t end;
  std::shared_ptr<const MemoryOwner> owner;
};

std::atomic<size_t> minBytes{~size_t(0)};
std::mutex mu;
std::map<uintptr_t, Noted> noted;  // by base; ranges of living owners do not overlap
constexpr size_t kMaxNoted = 4096;

}  // namespace

size_t memoryOwnersMinBytes() { return minBytes.load(std::memory_order_relaxed); }

void wantMemoryOwners(size_t n) {
  size_t cur = minBytes.load();
  while (n < cur && !minBytes.compare_exchange_weak(cur, n)) {
  }
}

void noteMemoryOwner(const void* base, size_t bytes, std::shared_ptr<const MemoryOwner> owner) {
  auto b = reinterpret_cast<uintptr_t>(base);
  std::lock_guard<std::mutex> g(mu);
  // The same buffer in op after op: noted already.
  auto same = noted.find(b);
  if (same != noted.end() && same->second.end == b + bytes && same->second.owner == owner) return;
  // Owners whose memory is gone are forgotten as new ones come (their ranges may be reused).
  if (noted.size() >= kMaxNoted) {
    for (auto it = noted.begin(); it != noted.end();) it = it->second.owner->alive() ? std::next(it) : noted.erase(it);
    if (noted.size() >= kMaxNoted) noted.erase(noted.begin());
  }
  // Living allocations do not overlap: whatever the new range meets belonged to freed memory.
  auto it = noted.lower_bound(b);
  if (it != noted.begin() && std::prev(it)->second.end > b) noted.erase(std::prev(it));
  while (it != noted.end() && it->first < b + bytes) it = noted.erase(it);
  noted[b] = Noted{b + bytes, std::move(owner)};
}

std::shared_ptr<const MemoryOwner> memoryOwnerOf(const void* p, size_t n, const void** base, size_t* bytes) {
  auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> g(mu);
  auto it = noted.upper_bound(a);
  if (it == noted.begin()) return nullptr;
  --it;
  if (a + n > it->second.end || !it->second.owner->alive()) return nullptr;
  if (base) *base = reinterpret_cast<const void*>(it->first);
  if (bytes) *bytes = it->second.end - it->first;
  return it->second.owner;
}

}  // namespace railcc::transport
