#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

// Memory copies that every transport may use.
namespace railcc::transport {

/// copyBytes()'s vector loop, for the copies it sends there (n >= 2048).
void copyAcrossPageAlias(char* dst, const char* src, size_t n);

/// memcpy, except where the destination lies 1-63 bytes past the source modulo a 4 KiB page.
/// There glibc's memcpy of 4 KiB up to the L2 size uses `rep movsb`, which on AMD Zen 4 (this
/// project's CI machine; glibc 2.36) ran at 3-4 GB/s where the same copy one cache line further
/// on ran at 57 in cache and 22-29 from memory (64-256 KiB pieces; 256 KiB is the shared-memory
/// FIFO's unit); those copies go through a vector loop. Where the offset falls depends on where
/// a tensor and the FIFO's stream position happen to lie: a 16 MiB broadcast whose every piece
/// fell there took 4-9 ms against 0.7-0.9.
/// Regions must not overlap (moveBytes() for those).
inline void copyBytes(void* dst, const void* src, size_t n) {
  uintptr_t ahead = (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(src)) & 4095;
  if (n >= 2048 && ahead - 1 < 63) copyAcrossPageAlias(static_cast<char*>(dst), static_cast<const char*>(src), n);
  else std::memcpy(dst, src, n);
}

/// memmove with copyBytes()'s care: regions that may overlap (an in-place call whose output
/// is a view of its input).
inline void moveBytes(void* dst, const void* src, size_t n) {
  auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  if (d + n <= s || s + n <= d) copyBytes(dst, src, n);
  else std::memmove(dst, src, n);
}

/// memcpy with non-temporal stores: for large destinations that will not be read again soon
/// (a collective's result bigger than the last-level cache). Writing around the cache saves
/// the read-for-ownership of every destination line; measured here 40 GB/s against 20-25
/// for memcpy into a 64 MiB destination, while memcpy wins below the cache size. Ends with a
/// store fence, so the data is visible to another thread once the caller publishes it.
void streamCopy(void* dst, const void* src, size_t n);

/// Bytes of the last-level cache shared by this CPU (sysfs; 32 MiB when unknown).
size_t lastLevelCacheBytes();

}  // namespace railcc::transport
