#include "engine/store_watch.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>

namespace railcc::engine {
namespace {

// The IPv4 address of a socket address (IPv4, or IPv4-mapped IPv6) in network order, for
// comparing; false for any other address.
bool v4Of(const sockaddr_storage& s, in_addr* out, uint16_t* port) {
  if (s.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&s);
    *out = a->sin_addr;
    *port = ntohs(a->sin_port);
    return true;
  }
  if (s.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&s);
    if (!IN6_IS_ADDR_V4MAPPED(&a->sin6_addr)) return false;
    std::memcpy(&out->s_addr, a->sin6_addr.s6_addr + 12, 4);
    *port = ntohs(a->sin6_port);
    return true;
  }
  return false;
}

bool sameEndpoint(const sockaddr_storage& a, const sockaddr_storage& b) {
  in_addr x{}, y{};
  uint16_t px = 0, py = 0;
  if (v4Of(a, &x, &px) && v4Of(b, &y, &py)) return px == py && x.s_addr == y.s_addr;
  if (a.ss_family != AF_INET6 || b.ss_family != AF_INET6) return false;
  const auto* p = reinterpret_cast<const sockaddr_in6*>(&a);
  const auto* q = reinterpret_cast<const sockaddr_in6*>(&b);
  return p->sin6_port == q->sin6_port && std::memcmp(&p->sin6_addr, &q->sin6_addr, sizeof(in6_addr)) == 0;
}

}  // namespace

std::shared_ptr<StoreWatch> StoreWatch::of(const std::string& host, uint16_t port) {
  static std::mutex mu;
  static auto* all = new std::map<std::string, std::shared_ptr<StoreWatch>>;  // outlives exit-time groups
  std::lock_guard<std::mutex> g(mu);
  std::string key = host + ":" + std::to_string(port);
  auto& w = (*all)[key];
  if (!w || w->gone()) w = std::make_shared<StoreWatch>(host, port);
  return w;
}

StoreWatch::StoreWatch(const std::string& host, uint16_t port) {
  // Resolved as torch's client resolved it when it connected (a numeric address asks no one).
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    if (a->ai_addrlen > sizeof(sockaddr_storage)) continue;
    sockaddr_storage s{};
    std::memcpy(&s, a->ai_addr, a->ai_addrlen);
    addrs_.push_back(s);
  }
  freeaddrinfo(res);
}

bool StoreWatch::stillOurs() const {
  struct stat st {};
  return fd_ >= 0 && fstat(fd_, &st) == 0 && S_ISSOCK(st.st_mode) && st.st_ino == ino_ && st.st_dev == dev_;
}

bool StoreWatch::find() {
  fd_ = -1;
  lastFind_ = std::chrono::steady_clock::now();
  if (addrs_.empty()) return false;
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return false;
  while (dirent* e = readdir(d)) {
    char* end = nullptr;
    long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dirfd(d)) continue;
    struct stat st {};
    if (fstat(static_cast<int>(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    sockaddr_storage peer{};
    socklen_t len = sizeof(peer);
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &len) != 0) continue;
    for (const sockaddr_storage& a : addrs_) {
      if (!sameEndpoint(peer, a)) continue;
      fd_ = static_cast<int>(fd);
      ino_ = st.st_ino;
      dev_ = st.st_dev;
      break;
    }
    if (fd_ >= 0) break;
  }
  closedir(d);
  return fd_ >= 0;
}

bool StoreWatch::gone() {
  if (gone_.load()) return true;
  std::lock_guard<std::mutex> g(mu_);
  if (!stillOurs()) {
    // Not found yet, or torch closed the socket (its fd may now be something else): look again,
    // at most once a second.
    if (std::chrono::steady_clock::now() - lastFind_ < std::chrono::seconds(1) || !find()) return false;
  }
  char c;
  ssize_t r = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) gone_.store(true);
  return gone_.load();
}

int StoreWatch::watchedFd() {
  std::lock_guard<std::mutex> g(mu_);
  if (!stillOurs() && !find()) return -1;
  return fd_;
}

}  // namespace railcc::engine
