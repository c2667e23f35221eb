#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <sys/socket.h>

namespace railcc::engine {

/// Watches a store's server (a c10d TCPStore) through the connection this process already has
/// to it (torch's own client socket), found by its peer address: the kernel shows that socket
/// readable at EOF the moment the server's process exits, so railcc learns that the store is
/// gone without calling it (every failed call through torch's client prints a C++ backtrace).
///
/// It never opens a connection of its own: a TCPStore server looks up the name of every
/// connection it accepts (reverse DNS, in its one thread), and where the resolver is slow each
/// new connection stalls every rank's store calls for its timeout (5 s for 1 connection in 51
/// here). It only peeks (MSG_PEEK | MSG_DONTWAIT): torch's reads see every byte as before.
class StoreWatch {
 public:
  /// The watch of host:port, shared by every group of this process that uses that server and
  /// kept for the process's life (a new one once the server went: a new store may listen there).
  static std::shared_ptr<StoreWatch> of(const std::string& host, uint16_t port);
  StoreWatch(const std::string& host, uint16_t port);
  StoreWatch(const StoreWatch&) = delete;
  StoreWatch& operator=(const StoreWatch&) = delete;

  /// True once the server closed the connection (its process exited). While no socket of this
  /// process is connected to the server (yet), false: such a server is never reported gone.
  /// Blocks: no (looks for the socket in /proc/self/fd at most once a second). Thread-safe.
  bool gone();
  /// The watched socket's fd, or -1 (for tests).
  int watchedFd();

 private:
  bool find();          // looks for a socket connected to the server; mu_ held
  bool stillOurs() const;  // the fd still is the socket found; mu_ held

  std::vector<sockaddr_storage> addrs_;  // the server's addresses (and port), resolved once
  std::mutex mu_;
  int fd_ = -1;
  ino_t ino_ = 0;
  dev_t dev_ = 0;
  std::chrono::steady_clock::time_point lastFind_{};
  std::atomic<bool> gone_{false};
};

}  // namespace railcc::engine
