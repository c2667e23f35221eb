#include "transport/verbs/gpu_registration.h"

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <set>

#include "common/log.h"
#include "transport/stats.h"

namespace railcc::transport::verbs {

GpuRegistration registerGpuMemory(const IbvLib& ibv, ibv_pd* pd, GpuMemory& gm, const void* p, size_t n, GdrMode mode,
                                  bool peermem, int access) {
  GpuRegistration r;
  if (mode == GdrMode::kStaged) {
    r.why = "GPUDirect RDMA is off for this GPU and NIC (see the decision logged at set-up)";
    return r;
  }
  static const uintptr_t pg = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t begin = a & ~(pg - 1), end = (a + n + pg - 1) & ~(pg - 1);
  void* const addr = reinterpret_cast<void*>(begin);
  const size_t len = end - begin;
  if (mode == GdrMode::kDmabuf) {
    const void* base = nullptr;
    size_t bytes = 0;
    std::string why;
    if (!ibv.regDmabufMr) {
      why = "this libibverbs has no ibv_reg_dmabuf_mr";
    } else if (gm.allocation(p, &base, &bytes, &why)) {
      const uintptr_t b = reinterpret_cast<uintptr_t>(base);
      if (begin < b || end > b + bytes) {
        why = "the buffer's pages reach beyond its allocation";
      } else {
        int fd = gm.dmabufFd(addr, len, &why);
        if (fd >= 0) {
          r.mr = ibv.regDmabufMr(pd, 0, len, begin, fd, access);
          int err = errno;
          close(fd);  // the registration holds its own reference to the dma-buf
          if (!r.mr) why = std::string("ibv_reg_dmabuf_mr: ") + strerror(err);
        }
      }
    }
    if (r.mr) {
      r.how = "dma-buf";
      addStat(StatKind::kVerbs, Stat::kRegistrations, 1);
      return r;
    }
    r.why = "dma-buf: " + why;
  }
  if (mode == GdrMode::kPeermem || peermem) {
    r.mr = ibv.regMr(pd, addr, len, access);
    if (r.mr) {
      r.how = "nvidia_peermem";
      addStat(StatKind::kVerbs, Stat::kRegistrations, 1);
      return r;
    }
    r.why += std::string(r.why.empty() ? "" : "; ") + "ibv_reg_mr of the device address (nvidia_peermem): " + strerror(errno);
  } else {
    r.why += "; nvidia_peermem is not loaded";
  }
  addStat(StatKind::kVerbs, Stat::kRegFailures, 1);
  return r;
}

std::string sayGpuRegistration(const std::string& dev, int gpu, const GpuRegistration& r) {
  const std::string g = "GPU " + std::to_string(gpu);
  std::string line = r.mr ? "GPUDirect RDMA: " + g + " memory registered with " + dev + " through " + r.how +
                                (r.why.empty() ? "" : " (" + r.why + ")") +
                                ": its sends and receives by rendezvous move without host copies"
                          : "GPUDirect RDMA: " + g + " memory could not be registered with " + dev + " (" + r.why +
                                "): its sends and receives are staged through host memory";
  static std::mutex mu;
  static std::set<std::string> said;
  std::lock_guard<std::mutex> lock(mu);
  if (said.insert(dev + "|" + g + "|" + r.how).second) RAILCC_INFO(IB, line);
  return line;
}

}  // namespace railcc::transport::verbs
