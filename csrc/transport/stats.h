#pragma once
// Counters that say how each transport moved the bytes: how many the CPU copied on the way in
// and out, how many the kernel or the NIC moved straight between buffers, and how often memory
// was registered with a NIC. Process-wide (every group of the process adds to them), one
// relaxed atomic add per call that moves bytes; read by railcc.stats() and railcc-bench --stats.
#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace railcc::transport {

// kDevice is not a transport: the device layer's own counts (host rounds, one-kernel ops).
enum class StatKind : uint8_t { kShm, kSocket, kVerbs, kDevice, kCount };

enum class Stat : uint8_t {
  kSendCopied,      // bytes the CPU copied into a transport's buffer (FIFO, socket, staging area)
  kRecvCopied,      // bytes the CPU took out of one (copied, or reduced in place from it)
  kSingleCopied,    // bytes copied once, straight from the peer's buffer by the kernel (CMA)
  kRdmaWritten,     // bytes the NIC wrote from a staging area into the peer's ring (eager)
  kRdmaZeroCopy,    // bytes the NIC read straight from the sender's buffer into the receiver's
  kRegistrations,   // memory registrations made for user buffers
  kRegCacheHits,    // user buffers found already registered
  kRegFailures,     // registrations refused (the message was copied instead)
  kRegisteredBytes, // bytes of user memory registered now (cached)
  kGpuDirect,       // bytes the NIC read from or wrote into GPU memory here (GPUDirect RDMA)
  kHostRounds,      // kDevice: rounds between the ranks' hosts inside CUDA IPC ops (events, votes)
  kDeviceKernels,   // kDevice: one-kernel collectives launched (no host round inside)
  kDeviceInPlace,   // kDevice: of those, the ones whose input peers read in place (registered)
  kDeviceSignalSteps,  // kDevice: CUDA IPC steps ordered by the streams' signals (no host round)
  kCount
};

struct StatRow {
  std::array<std::atomic<uint64_t>, static_cast<size_t>(Stat::kCount)> v{};
};

StatRow& statRow(StatKind k);

inline void addStat(StatKind k, Stat s, uint64_t n) {
  statRow(k).v[static_cast<size_t>(s)].fetch_add(n, std::memory_order_relaxed);
}
inline void subStat(StatKind k, Stat s, uint64_t n) {
  statRow(k).v[static_cast<size_t>(s)].fetch_sub(n, std::memory_order_relaxed);
}

/// Every transport's counters by name ("shm" -> {"send_copied_bytes": ...}).
std::vector<std::pair<std::string, std::vector<std::pair<std::string, uint64_t>>>> statsSnapshot();
/// Zeroes every counter but the registered bytes (which are what is held now).
void resetStats();

}  // namespace railcc::transport
