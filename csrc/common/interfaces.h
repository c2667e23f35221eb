#pragma once
// The machine's IPv4 interface addresses, listed once for every layer that asks during a set-up.

#include <netinet/in.h>

#include <string>
#include <vector>

namespace railcc {

/// One IPv4 address of an interface, as getifaddrs lists them.
struct InterfaceAddr {
  std::string name;
  bool up = false;
  bool loopback = false;
  sockaddr_in addr{};
  sockaddr_in mask{};  // the netmask; sin_family 0 where the system gave none
};

/// The machine's IPv4 addresses in getifaddrs order. One listing (a netlink dump of every
/// link and address) serves every caller for a second: a set-up asks several times (placement
/// once per rail NIC netdev, the socket transport for its interfaces and its rails), and a
/// job's ranks set up at once. Thread-safe; throws kSystem if the system cannot list them.
std::vector<InterfaceAddr> listInterfaces();

}  // namespace railcc
