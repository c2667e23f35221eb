// The socket transport's Connection (a non-blocking TCP stream with a staging buffer), the
// socket options it sets, and the listening socket set-up accepts on.
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
#include "transport/stats.h"

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

namespace {

class SocketConnection : public Connection {
 public:
  SocketConnection(int fd, std::string desc, size_t staging)
      : fd_(fd), desc_(std::move(desc)), cap_(staging < 4096 ? 4096 : staging) {}
  ~SocketConnection() override { ::close(fd_); }

  size_t send(const void* p, size_t n) override {
    if (n == 0) return 0;
    ssize_t r = ::send(fd_, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r >= 0) {
      addStat(StatKind::kSocket, Stat::kSendCopied, static_cast<uint64_t>(r));
      return static_cast<size_t>(r);
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
    RAILCC_THROW(kPeerFailure, "send to ", desc_, " failed: ", detail::errnoString());
  }

  std::pair<const void*, size_t> peek() override {
    if (begin_ == end_) {
      begin_ = end_ = 0;
      if (!buf_) buf_.reset(new char[cap_]);  // uninitialised: only the pages a receive writes are touched
      ssize_t r = ::recv(fd_, buf_.get(), cap_, MSG_DONTWAIT);
      handle(r);
      if (r > 0) end_ = static_cast<size_t>(r);
    }
    return {buf_.get() + begin_, end_ - begin_};
  }

  void consume(size_t n) override {
    begin_ += n;
    addStat(StatKind::kSocket, Stat::kRecvCopied, n);
  }

  size_t recv(void* p, size_t n) override {
    size_t got = 0;
    if (begin_ < end_) {
      got = std::min(n, end_ - begin_);
      copyBytes(p, buf_.get() + begin_, got);
      begin_ += got;
      if (got == n) {
        addStat(StatKind::kSocket, Stat::kRecvCopied, got);
        return got;
      }
    }
    // Large reads go straight into the destination: no staging copy.
    ssize_t r = ::recv(fd_, static_cast<char*>(p) + got, n - got, MSG_DONTWAIT);
    handle(r);
    if (r > 0) got += static_cast<size_t>(r);
    addStat(StatKind::kSocket, Stat::kRecvCopied, got);
    return got;
  }

  int pollFd() const override { return fd_; }
  std::string describe() const override { return "socket " + desc_; }
  // A connection nothing reads from now (the other lane of a pair whose op waits to connect)
  // still learns of a vanished peer: keepalive leaves its verdict in SO_ERROR.
  void checkAlive() override {
    int err = 0;
    socklen_t len = sizeof(err);
    if (getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err != 0)
      RAILCC_THROW(kPeerFailure, "connection to ", desc_, " failed: ", std::strerror(err));
  }
  void markFailed() override { ::shutdown(fd_, SHUT_RDWR); }

 private:
  void handle(ssize_t r) {
    if (r == 0) RAILCC_THROW(kPeerFailure, "connection to ", desc_, " was closed by the peer");
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      RAILCC_THROW(kPeerFailure, "receive from ", desc_, " failed: ", detail::errnoString());
  }

  int fd_;
  std::string desc_;
  // The staging buffer peek() receives into (reductions read it in place), made at the first
  // peek: a connection whose receives all go straight to their destination never has one.
  size_t cap_;
  std::unique_ptr<char[]> buf_;
  size_t begin_ = 0, end_ = 0;
};

}  // namespace

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
  // Every lower rank on another host dials this listener, two lanes and every channel at once:
  // a backlog of 128 overflows from 64 such ranks up, and a dropped SYN is retried after 1 s.
  // The kernel caps it at net.core.somaxconn.
  if (::listen(fd_, 65535) != 0) {
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
