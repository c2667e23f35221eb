#include "engine/store_watch.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <map>
#include <mutex>

namespace railcc::engine {

std::shared_ptr<StoreWatch> StoreWatch::of(const std::string& host, uint16_t port) {
  // Kept for the process's life, not only while a group holds it: a TCPStore server looks up
  // the name of every connection it accepts (reverse DNS, in its one thread), so a watch made
  // anew for each group made every new_group/init after the last group's end risk stalling
  // the whole job for a slow resolver's timeout (5 s in 1 of ~200 set-ups here). One fd per
  // store server. A watch that saw its server go is replaced: a new store may listen there.
  static std::mutex mu;
  static auto* all = new std::map<std::string, std::shared_ptr<StoreWatch>>;  // outlives exit-time groups
  std::lock_guard<std::mutex> g(mu);
  std::string key = host + ":" + std::to_string(port);
  auto& w = (*all)[key];
  if (!w || w->gone()) w = std::make_shared<StoreWatch>(host, port);
  return w;
}

StoreWatch::StoreWatch(const std::string& host, uint16_t port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return;
  for (addrinfo* a = res; a != nullptr && fd_ < 0; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    pollfd p{fd, POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof(err);
    if (rc != 0 && (errno != EINPROGRESS || poll(&p, 1, 1000) != 1 ||
                    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0)) {
      ::close(fd);
      continue;
    }
    fd_ = fd;
  }
  freeaddrinfo(res);
}

StoreWatch::~StoreWatch() {
  if (fd_ >= 0) ::close(fd_);
}

bool StoreWatch::gone() {
  if (gone_.load() || fd_ < 0) return gone_.load();
  char c;
  ssize_t r = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) gone_.store(true);
  return gone_.load();
}

}  // namespace railcc::engine
