#pragma once
// RDMA devices for the verbs transport: which devices and ports to use (NCCL_IB_HCA syntax),
// the GID of a RoCE port (NCCL's rule), the GPUDirect RDMA decision, and the opened device
// (context, protection domain, async-event thread) that connections share.

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "transport/verbs/ibv_lib.h"

namespace railcc::transport::verbs {

// --- Pure rules (unit-tested without a device) -----------------------------------------

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
/// not link-local, inside RAILCC_IB_ADDR_RANGE; else the first usable one. Returns the index
/// and says why in `why`; -1 with `why` saying what is wrong (the fix included).
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
};
GdrDecision decideGdr(const GdrFacts& f);

// --- Devices -----------------------------------------------------------------------------

/// One RDMA port opened for use: its context and protection domain, shared by every
/// connection on it, and a thread that turns the device's async events (port down, QP or
/// device fatal) into a reason the connections report.
class Device {
 public:
  Device(const IbvLib* ibv, ibv_device* dev, const std::string& name, int port, const Config& cfg);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  const IbvLib* ibv() const { return ibv_; }
  ibv_context* ctx() const { return ctx_; }
  ibv_pd* pd() const { return pd_; }
  const std::string& name() const { return name_; }
  int port() const { return port_; }
  bool roce() const { return attr_.link_layer == IBV_LINK_LAYER_ETHERNET; }
  uint16_t lid() const { return attr_.lid; }
  ibv_mtu mtu() const { return attr_.active_mtu; }
  int gidIndex() const { return gidIndex_; }
  const ibv_gid& gid() const { return gid_; }
  const std::string& netdev() const { return netdev_; }
  /// "rxe0:1 (RoCE v2, GID 1 ::ffff:10.77.0.1 on vrail0, MTU 1024)".
  std::string describe() const;
  /// The dma-buf probe (NCCL's: a registration of fd -1 fails with EBADF where supported).
  bool dmabufSupported() const;

  /// Why the port or device stopped working (an async event), or "" while it is fine.
  /// `qpn`: also a fatal event of that queue pair. Thread-safe.
  std::string broken(uint32_t qpn) const;

 private:
  void asyncLoop();

  const IbvLib* ibv_;
  std::string name_;
  int port_;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_port_attr attr_{};
  int gidIndex_ = -1;
  ibv_gid gid_{};
  std::string netdev_, gidWhy_;
  mutable std::mutex mu_;
  std::string brokenWhy_;
  std::vector<std::pair<uint32_t, std::string>> qpFatal_;
  std::atomic<bool> stop_{false};
  std::thread async_;
};

/// The ports this process may use under `cfg` (RAILCC_IB_HCA, ACTIVE ports only), opened
/// once per process and shared. Empty with `whyNot` set when there are none.
std::vector<std::shared_ptr<Device>> openDevices(const Config& cfg, std::string* whyNot);

}  // namespace railcc::transport::verbs
