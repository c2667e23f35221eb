#pragma once
// RDMA devices for the verbs transport: the opened device (context, protection domain,
// async-event thread) that connections share, and which devices and ports to open. The rules
// they follow (NCCL_IB_HCA syntax, the RoCE GID, the GPUDirect RDMA decision) are in
// verbs_rules.h, which builds without rdma-core.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "transport/verbs/ibv_lib.h"
#include "transport/verbs/mr_cache.h"
#include "transport/verbs/verbs_rules.h"

namespace railcc::transport::verbs {

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

  /// Registrations of user memory on this device (rendezvous), shared by its connections.
  MrCache& mrCache() { return *mrs_; }

  /// The GPUDirect RDMA decision for CUDA device `gpu` with this port (set at set-up from the
  /// topology's PCI paths; kStaged for a GPU it never named), and whether nvidia_peermem is
  /// loaded. Thread-safe.
  GdrMode gdrMode(int gpu) const;
  bool peermem() const;
  void setGdr(int gpu, GdrMode mode, bool peermem);

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
  std::unique_ptr<MrCache> mrs_;
  ibv_port_attr attr_{};
  int gidIndex_ = -1;
  ibv_gid gid_{};
  std::string netdev_, gidWhy_;
  mutable std::mutex mu_;
  std::string brokenWhy_;
  std::vector<std::pair<uint32_t, std::string>> qpFatal_;
  std::map<int, GdrMode> gdr_;  // by CUDA device
  bool peermem_ = false;
  std::atomic<bool> stop_{false};
  std::thread async_;
};

/// The ports this process may use under `cfg` (RAILCC_IB_HCA, ACTIVE ports only), opened
/// once per process and shared. Empty with `whyNot` set when there are none.
std::vector<std::shared_ptr<Device>> openDevices(const Config& cfg, std::string* whyNot);

}  // namespace railcc::transport::verbs
