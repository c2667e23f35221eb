#pragma once
// The verbs transport's rules as pure functions, with no rdma-core header: which devices and
// ports a NCCL_IB_HCA spec takes, the GID of a RoCE port, the GPUDirect RDMA decision, and
// the memory a connection pins. Built whether or not the transport itself is (a host
// without infiniband/verbs.h), so `railcc doctor` asks these same functions (through
// railcc._C) on every host. Unit-tested without a device.

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/config.h"

namespace railcc::transport::verbs {

/// An NCCL_IB_HCA spec: "mlx5_0:1,mlx5_1" (prefixes, optional port), "^mlx5_2" excludes,
/// "=mlx5_0" matches names exactly. Empty: everything.
struct HcaFilter {
  bool exclude = false;
  bool exact = false;
  std::vector<std::pair<std::string, int>> items;  // name, port (-1: any)
};
HcaFilter parseHcaSpec(const std::string& spec);
bool hcaMatches(const HcaFilter& f, const std::string& dev, int port);

/// One entry of a port's GID table.
struct GidEntry {
  int index = 0;
  uint8_t raw[16] = {0};
  int roceVersion = 0;  // 1, 2, or 0 when the kernel does not say
  std::string netdev;   // the interface the GID belongs to ("" when unknown)
};
std::string formatGid(const uint8_t raw[16]);
bool gidIsZero(const uint8_t raw[16]);
bool gidIsLinkLocal(const uint8_t raw[16]);
bool gidIsIpv4Mapped(const uint8_t raw[16]);

/// NCCL's RoCE rule: a forced index (RAILCC_IB_GID_INDEX / NCCL_IB_GID_INDEX) wins when it
/// names a non-zero entry; otherwise the first entry of the wanted RoCE version and family,
/// not link-local, inside RAILCC_IB_ADDR_RANGE. Returns the index and says why in `why`; -1
/// (no such entry, or the forced index is empty) with `why` saying what is wrong and the fix.
int pickGid(const std::vector<GidEntry>& table, const Config& cfg, const std::string& where, std::string* why);

/// What the GPUDirect RDMA decision for one GPU and NIC rests on.
struct GdrFacts {
  std::string gpu;       // "GPU 0"
  std::string nic;       // "mlx5_0"
  std::string path;      // PCI path type between them: LOC, PIX, PXB, PHB, SYS ("" unknown)
  std::string level;     // RAILCC_NET_GDR_LEVEL / NCCL_NET_GDR_LEVEL
  bool dmabuf = false;   // the NIC takes dma-buf registrations (probed) and the kernel has it
  bool peermem = false;  // nvidia_peermem (or the legacy nv_mem) is loaded
};
enum class GdrMode { kDmabuf, kPeermem, kStaged };
struct GdrDecision {
  GdrMode mode = GdrMode::kStaged;
  std::string line;  // "GPUDirect RDMA enabled for GPU 0 <-> mlx5_0 (dma-buf)" or why not
  bool withinLevel = false;  // the path is known and within the level (staged then means no support)
};
GdrDecision decideGdr(const GdrFacts& f);

/// The largest receive ring a connection takes: RAILCC_BUFFSIZE above it is capped.
constexpr int64_t kMaxRingBytes = int64_t(1) << 29;  // 512 MiB
/// Bytes of each connection's receive ring (and of its send staging area): RAILCC_BUFFSIZE,
/// at most kMaxRingBytes.
size_t ringBytes(int64_t buffSize);
/// The buffer a connection reads rendezvous messages into where their destination cannot be
/// registered (RAILCC_IB_RNDV_BYTES > 0).
constexpr size_t kRndvBounceBytes = size_t(1) << 20;
/// Bytes a connection maps and registers (pinned): its receive ring and its send staging area,
/// and with `rendezvous` its bounce buffer.
size_t connectionPinnedBytes(int64_t buffSize, bool rendezvous = false);

}  // namespace railcc::transport::verbs
