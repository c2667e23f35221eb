#pragma once

#include <netinet/in.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace railcc::transport::socket {

/// An IPv4 address and port in text form for logs: "10.0.0.2:41234".
std::string formatAddr(const sockaddr_in& a);

/// Picks the interface to bind from an NCCL-style spec ("eth,ib" prefixes, "^docker,lo"
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

/// Wraps a connected, handshaken fd. `stagingBytes` bounds the buffer peek() reads into.
std::unique_ptr<Connection> makeConnection(int fd, const std::string& peerDesc, size_t stagingBytes);

}  // namespace railcc::transport::socket
