#include "transport/verbs/verbs_devices.h"

#include <arpa/inet.h>
#include <poll.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>

#include "common/error.h"
#include "common/log.h"

namespace railcc::transport::verbs {

// --- Devices -------------------------------------------------------------------------------

namespace {

std::string readLine(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

std::vector<GidEntry> readGids(const IbvLib* ibv, ibv_context* ctx, const std::string& dev, int port, int len) {
  std::vector<GidEntry> out;
  std::string base = "/sys/class/infiniband/" + dev + "/ports/" + std::to_string(port) + "/gid_attrs/";
  for (int i = 0; i < len && i < 1024; ++i) {
    ibv_gid g{};
    if (ibv->queryGid(ctx, static_cast<uint8_t>(port), i, &g) != 0) continue;
    GidEntry e;
    e.index = i;
    memcpy(e.raw, g.raw, 16);
    if (gidIsZero(e.raw)) continue;
    std::string type = readLine(base + "types/" + std::to_string(i));
    e.roceVersion = type.find("v2") != std::string::npos ? 2 : type.find("v1") != std::string::npos ? 1 : 0;
    e.netdev = readLine(base + "ndevs/" + std::to_string(i));
    out.push_back(e);
  }
  return out;
}

const char* mtuBytes(ibv_mtu m) {
  switch (m) {
    case IBV_MTU_256: return "256";
    case IBV_MTU_512: return "512";
    case IBV_MTU_1024: return "1024";
    case IBV_MTU_2048: return "2048";
    case IBV_MTU_4096: return "4096";
  }
  return "?";
}

}  // namespace

Device::Device(const IbvLib* ibv, ibv_device* dev, const std::string& name, int port, const Config& cfg)
    : ibv_(ibv), name_(name), port_(port) {
  ctx_ = ibv_->openDevice(dev);
  if (ctx_ == nullptr) RAILCC_THROW(kSystem, "cannot open RDMA device ", name_, ": ", detail::errnoString());
  try {
    if (ibv_->queryPort(ctx_, static_cast<uint8_t>(port_), &attr_) != 0)
      RAILCC_THROW(kSystem, "cannot query ", name_, " port ", port_);
    if (roce()) {
      auto table = readGids(ibv_, ctx_, name_, port_, attr_.gid_tbl_len);
      gidIndex_ = pickGid(table, cfg, name_ + " port " + std::to_string(port_), &gidWhy_);
      if (gidIndex_ < 0) RAILCC_THROW(kInvalidUsage, gidWhy_);
      for (const GidEntry& e : table)
        if (e.index == gidIndex_) {
          memcpy(gid_.raw, e.raw, 16);
          netdev_ = e.netdev;
        }
    } else if (cfg.ibGidIndex >= 0) {
      gidIndex_ = static_cast<int>(cfg.ibGidIndex);
      if (ibv_->queryGid(ctx_, static_cast<uint8_t>(port_), gidIndex_, &gid_) != 0)
        RAILCC_THROW(kInvalidUsage, name_, " port ", port_, " has no GID at index ", gidIndex_,
                     " (RAILCC_IB_GID_INDEX/NCCL_IB_GID_INDEX)");
    }
    pd_ = ibv_->allocPd(ctx_);
    if (pd_ == nullptr) RAILCC_THROW(kSystem, "cannot allocate a protection domain on ", name_, ": ", detail::errnoString());
    mrs_ = std::make_unique<MrCache>(ibv_, pd_, name_, static_cast<size_t>(cfg.ibMrCacheBytes));
    int fl = fcntl(ctx_->async_fd, F_GETFL);
    fcntl(ctx_->async_fd, F_SETFL, fl | O_NONBLOCK);
  } catch (...) {
    if (pd_) ibv_->deallocPd(pd_);
    ibv_->closeDevice(ctx_);
    throw;
  }
  RAILCC_INFO(IB, "RDMA device ", describe(), gidWhy_.empty() ? std::string() : "; " + gidWhy_);
  async_ = std::thread([this] { asyncLoop(); });
}

Device::~Device() {
  stop_ = true;
  if (async_.joinable()) async_.join();
  mrs_.reset();  // its registrations before the protection domain
  if (pd_ && ibv_->deallocPd(pd_) != 0) RAILCC_WARN(IB, "releasing the protection domain of ", name_, " failed");
  if (ibv_->closeDevice(ctx_) != 0) RAILCC_WARN(IB, "closing ", name_, " failed");
}

std::string Device::describe() const {
  std::string s = name_ + ":" + std::to_string(port_) + " (";
  if (roce())
    s += "RoCE, GID " + std::to_string(gidIndex_) + " " + formatGid(gid_.raw) + (netdev_.empty() ? "" : " on " + netdev_);
  else
    s += "InfiniBand, LID " + std::to_string(attr_.lid);
  return s + ", MTU " + mtuBytes(attr_.active_mtu) + ")";
}

bool Device::dmabufSupported() const {
  if (ibv_->regDmabufMr == nullptr) return false;
  errno = 0;
  ibv_mr* mr = ibv_->regDmabufMr(pd_, 0, 0, 0, -1, 0);
  if (mr != nullptr) {  // cannot happen with fd -1; never leak it if it does
    ibv_->deregMr(mr);
    return true;
  }
  return errno != EOPNOTSUPP && errno != EPROTONOSUPPORT;
}

GdrMode Device::gdrMode(int gpu) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = gdr_.find(gpu);
  return it == gdr_.end() ? GdrMode::kStaged : it->second;
}

bool Device::peermem() const {
  std::lock_guard<std::mutex> g(mu_);
  return peermem_;
}

void Device::setGdr(int gpu, GdrMode mode, bool peermem) {
  std::lock_guard<std::mutex> g(mu_);
  gdr_[gpu] = mode;
  peermem_ = peermem;
}

std::string Device::broken(uint32_t qpn) const {
  std::lock_guard<std::mutex> g(mu_);
  if (!brokenWhy_.empty()) return brokenWhy_;
  for (auto& [n, why] : qpFatal_)
    if (n == qpn) return why;
  return "";
}

void Device::asyncLoop() {
  while (!stop_) {
    pollfd p{ctx_->async_fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    ibv_async_event ev{};
    if (ibv_->getAsyncEvent(ctx_, &ev) != 0) continue;
    std::string what = std::string(ibv_->eventTypeStr(ev.event_type)) + " on " + name_ + " port " + std::to_string(port_);
    {
      std::lock_guard<std::mutex> g(mu_);
      switch (ev.event_type) {
        case IBV_EVENT_PORT_ERR:
          if (ev.element.port_num == port_)
            brokenWhy_ = "link error: " + name_ + " port " + std::to_string(port_) +
                         " went down (port error event): check the cable, the switch port and `ibv_devinfo -d " + name_ + "`";
          break;
        case IBV_EVENT_PORT_ACTIVE:
          if (ev.element.port_num == port_ && brokenWhy_.find("went down") != std::string::npos) brokenWhy_.clear();
          break;
        case IBV_EVENT_DEVICE_FATAL:
          brokenWhy_ = "link error: " + name_ + " reported a fatal device error: the NIC needs a reset (driver log: dmesg)";
          break;
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR:
          qpFatal_.push_back({ev.element.qp ? ev.element.qp->qp_num : 0u,
                              "link error: queue pair " + std::to_string(ev.element.qp ? ev.element.qp->qp_num : 0u) +
                                  " on " + name_ + " port " + std::to_string(port_) + " failed (" +
                                  ibv_->eventTypeStr(ev.event_type) + ")"});
          break;
        case IBV_EVENT_CQ_ERR:
          brokenWhy_ = "link error: a completion queue on " + name_ + " overran (" + what + ")";
          break;
        default:
          break;
      }
    }
    RAILCC_INFO(IB, "async event ", what);
    ibv_->ackAsyncEvent(&ev);
  }
}

std::vector<std::shared_ptr<Device>> openDevices(const Config& cfg, std::string* whyNot) {
  // libibverbs finds devices in this sysfs class and nowhere else: without it there are none to
  // find, and loading the library (with libnl and its netlink queries) would cost every rank of a
  // machine without RDMA a millisecond at init. A library named by RAILCC_IBVERBS_LIB is asked.
  struct stat st {};
  if (cfg.ibverbsLib.empty() && stat("/sys/class/infiniband_verbs", &st) != 0 && errno == ENOENT) {
    *whyNot = "no RDMA device found (no /sys/class/infiniband_verbs: no verbs device on this machine)";
    return {};
  }
  std::string why;
  const IbvLib* ibv = ibvLib(cfg.ibverbsLib, &why);
  if (ibv == nullptr) {
    *whyNot = why;
    return {};
  }
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<Device>> cache;  // "name:port:gid settings"
  std::lock_guard<std::mutex> g(mu);
  int n = 0;
  ibv_device** list = ibv->getDeviceList(&n);
  if (list == nullptr || n == 0) {
    if (list) ibv->freeDeviceList(list);
    *whyNot = "no RDMA device found by " + ibv->path;
    return {};
  }
  HcaFilter filter = parseHcaSpec(cfg.ibHca);
  std::vector<std::shared_ptr<Device>> out;
  std::string skipped;
  try {
    for (int i = 0; i < n; ++i) {
      std::string name = ibv->getDeviceName(list[i]);
      ibv_context* probe = ibv->openDevice(list[i]);
      if (probe == nullptr) {
        skipped += " " + name + " (cannot open)";
        continue;
      }
      std::vector<int> ports;
      for (int p = 1; p <= 16; ++p) {
        ibv_port_attr a{};
        if (ibv->queryPort(probe, static_cast<uint8_t>(p), &a) != 0) break;
        if (!hcaMatches(filter, name, p)) skipped += " " + name + ":" + std::to_string(p) + " (RAILCC_IB_HCA)";
        else if (a.state != IBV_PORT_ACTIVE) skipped += " " + name + ":" + std::to_string(p) + " (not ACTIVE)";
        else ports.push_back(p);
      }
      ibv->closeDevice(probe);
      for (int p : ports) {
        std::string key = ibv->path + "|" + name + ":" + std::to_string(p) + "|" + std::to_string(cfg.ibGidIndex) + "|" +
                          cfg.ibAddrFamily + "|" + cfg.ibAddrRange + "|" + std::to_string(cfg.ibRoceVersion);
        std::shared_ptr<Device> d = cache[key].lock();
        if (!d) cache[key] = d = std::make_shared<Device>(ibv, list[i], name, p, cfg);
        out.push_back(d);
      }
    }
  } catch (...) {
    ibv->freeDeviceList(list);
    throw;
  }
  ibv->freeDeviceList(list);
  if (out.empty()) *whyNot = "no usable RDMA port:" + skipped;
  return out;
}

}  // namespace railcc::transport::verbs
