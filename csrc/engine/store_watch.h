#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace railcc::engine {

/// An idle TCP connection to a store's server (a c10d TCPStore), one per server and process.
/// The kernel shows it readable at EOF the moment the server's process exits, so railcc learns
/// that the store is gone without calling it (every failed call through torch's client prints
/// a C++ backtrace). The server never sees a byte from it.
class StoreWatch {
 public:
  /// The watch of host:port, shared by every group of this process that uses that server and
  /// kept for the process's life (a new one only once the server went). Connecting waits at
  /// most 1 s; a server that cannot be reached is never reported gone.
  static std::shared_ptr<StoreWatch> of(const std::string& host, uint16_t port);
  StoreWatch(const std::string& host, uint16_t port);
  ~StoreWatch();
  StoreWatch(const StoreWatch&) = delete;
  StoreWatch& operator=(const StoreWatch&) = delete;

  /// True once the server closed the connection (its process exited). Blocks: no. Thread-safe.
  bool gone();

 private:
  int fd_ = -1;
  std::atomic<bool> gone_{false};
};

}  // namespace railcc::engine
