#include "transport/socket/socket_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "common/error.h"
#include "common/log.h"

namespace railcc::transport::socket {
namespace {

void setNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

}  // namespace

void tuneSocket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int buf = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  // A host that vanishes (power, cable, kernel panic) sends no FIN or RST. While nothing is
  // in flight, keepalive probes after 2 s of silence find it within about 5 s. There is no
  // TCP_USER_TIMEOUT: it also ends connections whose live peer just has not read for a while
  // (zero window), which a rank late to a collective does; data stuck in flight is left to
  // the op timeout.
  int idle = 2, intvl = 1, cnt = 3;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
}

bool matchSpec(const std::string& name, const std::string& spec) {
  std::string s = spec;
  bool exclude = false, exact = false;
  if (!s.empty() && s[0] == '^') {
    exclude = true;
    s = s.substr(1);
  }
  if (!s.empty() && s[0] == '=') {
    exact = true;
    s = s.substr(1);
  }
  bool hit = false;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    std::string tok = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (!tok.empty()) {
      if (exact ? name == tok : name.compare(0, tok.size(), tok) == 0) hit = true;
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return exclude ? !hit : hit;
}

namespace {

class SocketConnection : public Connection {
 public:
  SocketConnection(int fd, std::string desc, size_t staging)
      : fd_(fd), desc_(std::move(desc)), buf_(staging < 4096 ? 4096 : staging) {}
  ~SocketConnection() override { ::close(fd_); }

  size_t send(const void* p, size_t n) override {
    if (n == 0) return 0;
    ssize_t r = ::send(fd_, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r >= 0) return static_cast<size_t>(r);
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
    RAILCC_THROW(kPeerFailure, "send to ", desc_, " failed: ", detail::errnoString());
  }

  std::pair<const void*, size_t> peek() override {
    if (begin_ == end_) {
      begin_ = end_ = 0;
      ssize_t r = ::recv(fd_, buf_.data(), buf_.size(), MSG_DONTWAIT);
      handle(r);
      if (r > 0) end_ = static_cast<size_t>(r);
    }
    return {buf_.data() + begin_, end_ - begin_};
  }

  void consume(size_t n) override { begin_ += n; }

  size_t recv(void* p, size_t n) override {
    size_t got = 0;
    if (begin_ < end_) {
      got = std::min(n, end_ - begin_);
      copyBytes(p, buf_.data() + begin_, got);
      begin_ += got;
      if (got == n) return got;
    }
    // Large reads go straight into the destination: no staging copy.
    ssize_t r = ::recv(fd_, static_cast<char*>(p) + got, n - got, MSG_DONTWAIT);
    handle(r);
    if (r > 0) got += static_cast<size_t>(r);
    return got;
  }

  int pollFd() const override { return fd_; }
  std::string describe() const override { return "socket " + desc_; }
  void markFailed() override { ::shutdown(fd_, SHUT_RDWR); }

 private:
  void handle(ssize_t r) {
    if (r == 0) RAILCC_THROW(kPeerFailure, "connection to ", desc_, " was closed by the peer");
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      RAILCC_THROW(kPeerFailure, "receive from ", desc_, " failed: ", detail::errnoString());
  }

  int fd_;
  std::string desc_;
  std::vector<char> buf_;
  size_t begin_ = 0, end_ = 0;
};

}  // namespace

std::string formatAddr(const sockaddr_in& a) {
  char ip[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &a.sin_addr, ip, sizeof(ip));
  return std::string(ip) + ":" + std::to_string(ntohs(a.sin_port));
}

std::vector<Interface> chooseInterfaces(const std::vector<InterfaceAddr>& addrs, const std::string& spec) {
  std::vector<Interface> chosen;
  Interface loopback;
  for (const InterfaceAddr& i : addrs) {
    if (!i.up) continue;
    bool ok = spec.empty() ? matchSpec(i.name, "^docker,lo") : matchSpec(i.name, spec);
    // Without a spec, the first match only; with one, every match (one address per name).
    bool dup = std::any_of(chosen.begin(), chosen.end(), [&](const Interface& c) { return c.name == i.name; });
    if (ok && !dup && (chosen.empty() || !spec.empty())) chosen.push_back({i.name, i.addr});
    if (i.loopback && loopback.name.empty()) loopback = {i.name, i.addr};
  }
  // A machine with no network at all: every peer is local, loopback is right.
  if (chosen.empty() && spec.empty() && !loopback.name.empty()) chosen.push_back(loopback);
  for (auto& c : chosen) c.addr.sin_port = 0;
  return chosen;
}

std::vector<Interface> pickInterfaces(const std::string& spec) {
  ifaddrs* list = nullptr;
  RAILCC_SYSCHECK(getifaddrs(&list), "getifaddrs");
  std::vector<InterfaceAddr> addrs;
  std::vector<std::string> seen;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    InterfaceAddr a;
    a.name = i->ifa_name;
    a.up = (i->ifa_flags & IFF_UP) != 0;
    a.loopback = (i->ifa_flags & IFF_LOOPBACK) != 0;
    a.addr = *reinterpret_cast<sockaddr_in*>(i->ifa_addr);
    if (a.up) seen.push_back(a.name);
    addrs.push_back(a);
  }
  freeifaddrs(list);
  std::vector<Interface> chosen = chooseInterfaces(addrs, spec);
  if (chosen.empty()) {
    std::string all;
    for (auto& s : seen) all += (all.empty() ? "" : ", ") + s;
    RAILCC_THROW(kInvalidUsage, "RAILCC_SOCKET_IFNAME/NCCL_SOCKET_IFNAME='", spec,
                 "' matches no up IPv4 interface; interfaces here: ", all);
  }
  return chosen;
}

std::string pickInterface(const std::string& spec, sockaddr_in& addr) {
  Interface first = pickInterfaces(spec).front();
  addr = first.addr;
  return first.name;
}

Listener::Listener(const sockaddr_in& bindAddr) {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  RAILCC_SYSCHECK(fd_, "socket");
  int one = 1;
  setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  addr_ = bindAddr;
  if (::bind(fd_, reinterpret_cast<const sockaddr*>(&addr_), sizeof(addr_)) != 0) {
    std::string err = detail::errnoString();
    ::close(fd_);
    RAILCC_THROW(kSystem, "bind to ", formatAddr(bindAddr), ": ", err);
  }
  socklen_t len = sizeof(addr_);
  getsockname(fd_, reinterpret_cast<sockaddr*>(&addr_), &len);
  if (::listen(fd_, 128) != 0) {
    std::string err = detail::errnoString();
    ::close(fd_);
    RAILCC_THROW(kSystem, "listen on ", formatAddr(addr_), ": ", err);
  }
  setNonBlocking(fd_);
}

Listener::~Listener() {
  if (fd_ >= 0) ::close(fd_);
}

int Listener::accept(sockaddr_in* from) {
  socklen_t len = sizeof(*from);
  int fd = ::accept4(fd_, reinterpret_cast<sockaddr*>(from), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) return -1;
  tuneSocket(fd);
  return fd;
}

std::unique_ptr<Connection> makeConnection(int fd, const std::string& peerDesc, size_t stagingBytes) {
  return std::make_unique<SocketConnection>(fd, peerDesc, stagingBytes);
}

}  // namespace railcc::transport::socket
