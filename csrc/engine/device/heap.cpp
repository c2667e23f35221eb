#include "engine/device/heap.h"

#include <cstdint>
#include <iterator>

namespace railcc::engine {

DeviceHeap::DeviceHeap(char* base, size_t bytes, int device, std::function<void(char*)> release)
    : base_(base), bytes_(bytes), device_(device), release_(std::move(release)) {
  // Carving starts at the region's first kAlign boundary (cudaMalloc's regions start on one).
  const size_t lead = (kAlign - reinterpret_cast<uintptr_t>(base) % kAlign) % kAlign;
  if (bytes_ > lead + kAlign) free_[lead] = (bytes_ - lead) / kAlign * kAlign;
}

DeviceHeap::~DeviceHeap() {
  if (!keep_ && release_ && base_) release_(base_);
}

char* DeviceHeap::take(size_t n) {
  if (n == 0 || n > bytes_) return nullptr;
  const size_t want = (n + kAlign - 1) / kAlign * kAlign;
  std::lock_guard<std::mutex> g(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < want) continue;
    const size_t off = it->first, left = it->second - want;
    free_.erase(it);
    if (left > 0) free_[off + want] = left;
    taken_[off] = want;
    return base_ + off;
  }
  return nullptr;
}

bool DeviceHeap::give(char* p) {
  if (p < base_ || p >= base_ + bytes_) return false;
  std::lock_guard<std::mutex> g(mu_);
  auto t = taken_.find(static_cast<size_t>(p - base_));
  if (t == taken_.end()) return false;
  size_t off = t->first, len = t->second;
  taken_.erase(t);
  auto next = free_.lower_bound(off);
  if (next != free_.end() && next->first == off + len) {  // merge with the range after
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {  // and with the one before
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += len;
      return true;
    }
  }
  free_[off] = len;
  return true;
}

size_t DeviceHeap::used() const {
  std::lock_guard<std::mutex> g(mu_);
  size_t u = 0;
  for (auto& [off, len] : taken_) u += len;
  return u;
}

void DeviceHeap::keep() {
  std::lock_guard<std::mutex> g(mu_);
  keep_ = true;
}

}  // namespace railcc::engine
