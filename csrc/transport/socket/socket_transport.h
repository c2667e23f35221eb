#pragma once

#include <netinet/in.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/interfaces.h"
#include "transport/transport.h"

namespace railcc::transport::socket {

/// An IPv4 address and port in text form for logs: "10.0.0.2:41234".
std::string formatAddr(const sockaddr_in& a);
/// The inverse: "10.0.0.2:41234" to an address; throws kInvalidUsage naming what is wrong.
sockaddr_in parseAddr(const std::string& s);

struct Interface {
  std::string name;
  sockaddr_in addr{};  // port 0
};

/// RAILCC_SOCKET_IFNAME / NCCL_SOCKET_IFNAME matching of one interface name: comma-separated
/// prefixes; a leading ^ excludes them, a leading = (after any ^) matches names exactly.
bool matchSpec(const std::string& name, const std::string& spec);

using railcc::InterfaceAddr;  // common/interfaces.h

/// The rule behind pickInterfaces, on a given list (getifaddrs' order): empty when nothing
/// matches. Pure, so `railcc doctor` asks it about a host's interfaces.
std::vector<Interface> chooseInterfaces(const std::vector<InterfaceAddr>& addrs, const std::string& spec);

/// Every up IPv4 interface an NCCL-style spec names ("eth,ib" prefixes, "^docker,lo"
/// excludes, "=eth0" exact), in the system's order; with an empty spec, only the first up,
/// non-loopback, non-docker one (else loopback). Throws kInvalidUsage naming the spec if
/// nothing matches. Each interface is one rail for the socket transport's channels.
std::vector<Interface> pickInterfaces(const std::string& spec);

/// The first of pickInterfaces(spec). Picks the interface to bind from an NCCL-style spec ("eth,ib" prefixes, "^docker,lo"
/// excludes, "=eth0" exact). Empty spec: the first up, non-loopback, non-docker interface
/// with an IPv4 address, else loopback. Throws kInvalidUsage naming the spec if nothing
/// matches. Returns the interface name and fills `addr` (port 0).
std::string pickInterface(const std::string& spec, sockaddr_in& addr);

/// Sets the options every railcc TCP connection uses (no Nagle, 4 MiB buffers, keepalive).
void tuneSocket(int fd);

/// A listening TCP socket. accept() is non-blocking.
class Listener {
 public:
  explicit Listener(const sockaddr_in& bindAddr);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  const sockaddr_in& addr() const { return addr_; }
  int fd() const { return fd_; }
  /// Returns a connected fd or -1 when none is pending. Blocks: no.
  int accept(sockaddr_in* from);

 private:
  int fd_ = -1;
  sockaddr_in addr_{};
};

/// The socket transport for the registry (socket_transport.cpp).
std::unique_ptr<railcc::transport::Transport> makeTransport();

/// Wraps a connected, handshaken fd. `stagingBytes` bounds the buffer peek() reads into.
std::unique_ptr<Connection> makeConnection(int fd, const std::string& peerDesc, size_t stagingBytes);

}  // namespace railcc::transport::socket
