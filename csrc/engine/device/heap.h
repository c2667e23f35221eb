#pragma once
// A rank's heap: one device allocation per group, mapped by every peer once (at the group's
// CUDA IPC set-up), from which allocate_tensor carves communication buffers
// (RAILCC_CUDA_SHOTS, RAILCC_CUDA_HEAP_BYTES). A one-kernel op whose buffers lie in it tells
// its peers their offsets (cuda/shots.h, ShotWhere) and they reach them in place: no copy into
// the scratch and no host exchange per op. Here: the region and its first-fit carving. Any
// thread may carve or give back (a tensor is made on its caller's thread and freed on whichever
// thread drops it), and the region outlives its group while a buffer in it does.

#include <cstddef>
#include <functional>
#include <map>
#include <mutex>

namespace railcc::engine {

class DeviceHeap {
 public:
  static constexpr size_t kAlign = 512;  // every buffer starts on it: 16-byte loads, whole lines
  // `release` gives the region back to the runtime, once the last holder lets go (unless kept).
  DeviceHeap(char* base, size_t bytes, int device, std::function<void(char*)> release);
  ~DeviceHeap();
  DeviceHeap(const DeviceHeap&) = delete;
  DeviceHeap& operator=(const DeviceHeap&) = delete;

  char* base() const { return base_; }
  size_t bytes() const { return bytes_; }
  int device() const { return device_; }
  /// `n` bytes (rounded up to kAlign) from the lowest free range that holds them, or nullptr
  /// when none does (or n is 0).
  char* take(size_t n);
  /// Gives back a buffer from take(); anything else is a caller's bug and is refused (false).
  bool give(char* p);
  size_t used() const;
  /// Peers may still map the region: leave it to the process's exit instead of releasing it.
  void keep();

 private:
  char* const base_;
  const size_t bytes_;
  const int device_;
  std::function<void(char*)> release_;
  mutable std::mutex mu_;
  std::map<size_t, size_t> free_;   // offset -> bytes, neighbours merged
  std::map<size_t, size_t> taken_;  // offset -> bytes
  bool keep_ = false;
};

}  // namespace railcc::engine
