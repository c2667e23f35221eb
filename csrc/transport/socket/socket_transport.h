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

/// What a connecting peer must present before any of its bytes reach a buffer.
struct Hello {
  uint64_t magic;
  uint8_t secret[16];
  int32_t srcRank;
  int32_t dstRank;
  int32_t lane;
  int32_t pad;
};

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

/// Connects to `to` and sends `hello`; waits for the acceptor's acknowledgement. Retries
/// refused connections until `deadline`. Blocks: yes, at most until the deadline. Throws
/// kTimeout / kPeerFailure naming the address.
int connectTo(const sockaddr_in& to, const Hello& hello, std::chrono::steady_clock::time_point deadline);

/// Reads a Hello from a freshly accepted fd (at most `wait`), and acknowledges it.
/// Returns false (and the caller closes the fd) when the bytes are not a valid hello.
bool readHello(int fd, Hello& out, std::chrono::milliseconds wait);
void ackHello(int fd);

/// Wraps a connected, handshaken fd. `stagingBytes` bounds the buffer peek() reads into.
std::unique_ptr<Connection> makeConnection(int fd, const std::string& peerDesc, size_t stagingBytes);

}  // namespace railcc::transport::socket
