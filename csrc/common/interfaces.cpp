#include "common/interfaces.h"

#include <ifaddrs.h>
#include <net/if.h>

#include <chrono>
#include <mutex>

#include "common/error.h"

namespace railcc {

std::vector<InterfaceAddr> listInterfaces() {
  // Long enough to cover one set-up, short enough that a group made after an interface came
  // up or went down sees it.
  constexpr auto kFresh = std::chrono::seconds(1);
  static std::mutex mu;
  static std::vector<InterfaceAddr> cached;
  static std::chrono::steady_clock::time_point taken;  // the epoch until the first listing
  std::lock_guard<std::mutex> g(mu);
  auto now = std::chrono::steady_clock::now();
  if (taken != std::chrono::steady_clock::time_point{} && now - taken < kFresh) return cached;
  ifaddrs* list = nullptr;
  RAILCC_SYSCHECK(getifaddrs(&list), "getifaddrs");
  std::vector<InterfaceAddr> addrs;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    InterfaceAddr a;
    a.name = i->ifa_name;
    a.up = (i->ifa_flags & IFF_UP) != 0;
    a.loopback = (i->ifa_flags & IFF_LOOPBACK) != 0;
    a.addr = *reinterpret_cast<sockaddr_in*>(i->ifa_addr);
    if (i->ifa_netmask) {
      a.mask = *reinterpret_cast<sockaddr_in*>(i->ifa_netmask);
      a.mask.sin_family = AF_INET;  // some systems leave a netmask's family unset
    }
    addrs.push_back(a);
  }
  freeifaddrs(list);
  cached = addrs;
  taken = now;
  return addrs;
}

}  // namespace railcc
