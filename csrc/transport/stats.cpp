#include "transport/stats.h"

namespace railcc::transport {
namespace {

StatRow rows[static_cast<size_t>(StatKind::kCount)];

constexpr const char* kKindNames[] = {"shm", "socket", "verbs", "device"};
constexpr const char* kStatNames[] = {"send_copied_bytes", "recv_copied_bytes", "single_copied_bytes",
                                      "rdma_written_bytes", "rdma_zero_copy_bytes", "registrations",
                                      "registration_cache_hits", "registration_failures", "registered_bytes",
                                      "gpu_direct_bytes", "host_rounds", "device_kernels", "device_in_place",
                                      "device_signal_steps"};
static_assert(sizeof(kStatNames) / sizeof(kStatNames[0]) == static_cast<size_t>(Stat::kCount));
static_assert(sizeof(kKindNames) / sizeof(kKindNames[0]) == static_cast<size_t>(StatKind::kCount));

}  // namespace

StatRow& statRow(StatKind k) { return rows[static_cast<size_t>(k)]; }

std::vector<std::pair<std::string, std::vector<std::pair<std::string, uint64_t>>>> statsSnapshot() {
  std::vector<std::pair<std::string, std::vector<std::pair<std::string, uint64_t>>>> out;
  for (size_t k = 0; k < static_cast<size_t>(StatKind::kCount); ++k) {
    std::vector<std::pair<std::string, uint64_t>> row;
    for (size_t s = 0; s < static_cast<size_t>(Stat::kCount); ++s)
      row.emplace_back(kStatNames[s], rows[k].v[s].load(std::memory_order_relaxed));
    out.emplace_back(kKindNames[k], std::move(row));
  }
  return out;
}

void resetStats() {
  for (auto& r : rows)
    for (size_t s = 0; s < static_cast<size_t>(Stat::kCount); ++s)
      if (s != static_cast<size_t>(Stat::kRegisteredBytes)) r.v[s].store(0, std::memory_order_relaxed);
}

}  // namespace railcc::transport
