// One-sided windows (window.h): a server thread per rank applies the puts and signals its peers
// send, each acknowledged once applied. Messages are a fixed header, then a put's bytes when
// they travel over the socket; the answer is a status and a text.

#include "transport/window.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "common/config.h"
#include "common/crypto.h"
#include "common/error.h"
#include "transport/shm/shm_segment.h"
#include "transport/socket/socket_transport.h"

namespace railcc::transport {

namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

constexpr uint32_t kMagic = 0x52574e31;  // "RWN1"
enum Kind : uint32_t { kHello = 1, kPut = 2, kPutRead = 3, kSignal = 4 };
enum Status : uint32_t { kOk = 0, kReadRefused = 1, kRefused = 2 };

struct Header {
  uint32_t magic = kMagic;
  uint32_t kind = 0;
  uint64_t gen = 0;     // hello: the sender's rank
  uint64_t offset = 0;  // bytes into the region; hello: the sender's pid
  uint64_t bytes = 0;   // hello: the token's length
  uint64_t addr = 0;    // kPutRead: where the bytes are in the sender's memory
};

struct Reply {
  uint32_t status = kOk;
  uint32_t textLen = 0;
};

// Waits for `events` on fd until the deadline; false at the deadline.
bool waitFd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000)));
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return false;
  }
}

// Whole-message I/O on a non-blocking fd. Returns "" or what went wrong.
std::string sendAll(int fd, const void* data, size_t n, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k > 0) {
      p += k, n -= static_cast<size_t>(k);
    } else if (k < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (!waitFd(fd, POLLOUT, deadline)) return "timed out sending";
    } else {
      return std::string("send: ") + strerror(errno);
    }
  }
  return "";
}

std::string recvAll(int fd, void* data, size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t k = ::recv(fd, p, n, 0);
    if (k > 0) {
      p += k, n -= static_cast<size_t>(k);
    } else if (k == 0) {
      return "the connection closed";
    } else if (errno == EAGAIN || errno == EINTR) {
      if (!waitFd(fd, POLLIN, deadline)) return "timed out receiving";
    } else {
      return std::string("recv: ") + strerror(errno);
    }
  }
  return "";
}

}  // namespace

struct WindowEndpoint::Impl {
  Directory dir;
  int rank;
  std::vector<WindowPeer> peers;
  std::string name;
  Millis timeout;
  std::string token = randomHex(16);
  std::unique_ptr<socket::Listener> listener;
  int wakeFd = -1;
  std::atomic<bool> stop{false};
  std::thread server;

  // This rank's region; the server thread writes into it while holding regMu.
  mutable std::mutex regMu;
  char* base = nullptr;
  size_t bytes = 0, elemSize = 0;
  std::string dtype;
  uint64_t gen = 0;  // registrations made so far; the current one's number while registered
  bool isRegistered = false;

  // Signals: got[r] counted by the server thread, used[r] by waitSignal.
  std::mutex sigMu;
  std::condition_variable sigCv;
  std::vector<uint64_t> got, used;
  std::vector<char> dropped;

  struct Region {
    uint64_t gen = 0;
    size_t bytes = 0, elemSize = 0;
    std::string dtype;
  };
  struct Link {
    std::mutex mu;
    int fd = -1;
    bool readAllowed = true;  // until the peer's kernel refused to read this process
    int pid = 0;
    std::string path = "-";
    Region region;
  };
  std::vector<std::unique_ptr<Link>> links;

  [[noreturn]] void fail(ErrorCode code, int peer, const std::string& op, const std::string& msg) const {
    Error e(code, name + ": " + op + " with rank " + std::to_string(peer) + " (host " +
                      peers[static_cast<size_t>(peer)].hostname + "): " + msg);
    e.ranks = {peer};
    e.hosts = {peers[static_cast<size_t>(peer)].hostname};
    e.op = "window " + op;
    e.ranksDead = code == ErrorCode::kPeerFailure;
    throw e;
  }

  bool shareMemoryWith(int peer) const {
    const auto &a = peers[static_cast<size_t>(rank)], &b = peers[static_cast<size_t>(peer)];
    return a.hostId == b.hostId && a.pidNs == b.pidNs && !a.pidNs.empty();
  }

  void checkPeer(int peer, const char* op) const {
    RAILCC_CHECK_ARG(peer >= 0 && peer < static_cast<int>(peers.size()), name, ": ", op, " names rank ", peer,
                     ", but the group has ranks 0..", peers.size() - 1);
  }

  // --- the serving side -------------------------------------------------------------------

  struct Client {
    int fd;
    int rank = -1;  // -1 until its hello
    int pid = 0;
  };

  void answer(int fd, uint32_t status, const std::string& text) {
    Reply r{status, static_cast<uint32_t>(text.size())};
    auto deadline = Clock::now() + timeout;
    if (sendAll(fd, &r, sizeof(r), deadline).empty() && !text.empty()) sendAll(fd, text.data(), text.size(), deadline);
  }

  // Where a put of `n` bytes at `off` of registration `g` may land, or why not. Under regMu.
  std::string placeable(uint64_t g, uint64_t off, uint64_t n) const {
    if (!isRegistered || g != gen)
      return "rank " + std::to_string(rank) + " holds no region of that registration (its tensor was deregistered)";
    if (off > bytes || n > bytes - off)
      return "bytes " + std::to_string(off) + "..+" + std::to_string(n) + " fall outside rank " + std::to_string(rank) +
             "'s region of " + std::to_string(bytes) + " bytes";
    return "";
  }

  // One message from a client; false drops it.
  bool serve(Client& c) {
    Header h;
    auto deadline = Clock::now() + timeout;
    if (!recvAll(c.fd, &h, sizeof(h), deadline).empty() || h.magic != kMagic) return false;
    if (c.rank < 0) {  // the first message must prove the sender read this rank's token
      if (h.kind != kHello || h.bytes != token.size() || h.gen >= peers.size()) return false;
      std::string t(token.size(), '\0');
      if (!recvAll(c.fd, t.data(), t.size(), deadline).empty() ||
          !equalConstantTime(sha256(t.data(), t.size()), sha256(token.data(), token.size())))
        return false;
      c.rank = static_cast<int>(h.gen);
      c.pid = static_cast<int>(h.offset);
      {
        std::lock_guard<std::mutex> g(sigMu);  // a peer that dropped and came back counts again
        dropped[static_cast<size_t>(c.rank)] = 0;
      }
      answer(c.fd, kOk, "");
      return true;
    }
    if (h.kind == kSignal) {
      {
        std::lock_guard<std::mutex> g(sigMu);
        ++got[static_cast<size_t>(c.rank)];
      }
      sigCv.notify_all();
      answer(c.fd, kOk, "");
      return true;
    }
    if (h.kind != kPut && h.kind != kPutRead) return false;
    std::unique_lock<std::mutex> g(regMu);
    std::string why = placeable(h.gen, h.offset, h.bytes);
    if (h.kind == kPutRead) {
      if (why.empty()) {
        if (!shareMemoryWith(c.rank)) return false;
        int err = shm::readProcessMemory(c.pid, base + h.offset, h.addr, h.bytes);
        g.unlock();
        answer(c.fd, err == 0 ? kOk : kReadRefused, err == 0 ? "" : strerror(err));
      } else {
        g.unlock();
        answer(c.fd, kRefused, why);
      }
      return true;
    }
    if (why.empty()) {
      if (!recvAll(c.fd, base + h.offset, h.bytes, deadline).empty()) return false;
    } else {  // the bytes still come: read past them
      std::vector<char> sink(std::min<uint64_t>(h.bytes, 1 << 20));
      for (uint64_t left = h.bytes; left > 0;) {
        size_t k = static_cast<size_t>(std::min<uint64_t>(left, sink.size()));
        if (!recvAll(c.fd, sink.data(), k, deadline).empty()) return false;
        left -= k;
      }
    }
    g.unlock();
    answer(c.fd, why.empty() ? kOk : kRefused, why);
    return true;
  }

  void dropClient(const Client& c) {
    ::close(c.fd);
    if (c.rank < 0) return;
    {
      std::lock_guard<std::mutex> g(sigMu);
      dropped[static_cast<size_t>(c.rank)] = 1;
    }
    sigCv.notify_all();
  }

  void run() {
    std::vector<Client> clients;
    std::vector<pollfd> fds;
    while (!stop.load()) {
      fds.assign({{wakeFd, POLLIN, 0}, {listener->fd(), POLLIN, 0}});
      for (const Client& c : clients) fds.push_back({c.fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 500) <= 0) continue;
      if (fds[0].revents) break;
      std::vector<Client> next;
      for (size_t i = 0; i < clients.size(); ++i) {
        if (fds[i + 2].revents == 0 || serve(clients[i])) {
          next.push_back(clients[i]);
        } else {
          dropClient(clients[i]);
        }
      }
      if (fds[1].revents) {
        sockaddr_in from{};
        for (int fd; (fd = listener->accept(&from)) >= 0;) next.push_back(Client{fd});
      }
      clients.swap(next);
    }
    for (const Client& c : clients) ::close(c.fd);
  }

  // --- the writing side -------------------------------------------------------------------

  // The link to `peer`, connected and greeted. Under link.mu.
  void connect(int peer, Link& link, Clock::time_point deadline) {
    if (link.fd >= 0) return;
    std::istringstream rec(dir.get("addr/" + std::to_string(peer), timeout));
    std::string where, peerToken;
    int pid = 0;
    rec >> where >> pid >> peerToken;
    sockaddr_in to{};
    try {
      to = socket::parseAddr(where);
    } catch (const Error& e) {
      fail(ErrorCode::kInternal, peer, "connect", std::string("its window record is damaged: ") + e.what());
    }
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) fail(ErrorCode::kSystem, peer, "connect", std::string("socket: ") + strerror(errno));
    std::string err;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0 && errno != EINPROGRESS) {
      err = std::string("connect to ") + where + ": " + strerror(errno);
    } else if (!waitFd(fd, POLLOUT, deadline)) {
      err = "connect to " + where + " timed out";
    } else {
      int soErr = 0;
      socklen_t len = sizeof(soErr);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &soErr, &len);
      if (soErr != 0) err = std::string("connect to ") + where + ": " + strerror(soErr);
    }
    if (err.empty()) {
      socket::tuneSocket(fd);
      Header h;
      h.kind = kHello;
      h.gen = static_cast<uint64_t>(rank);
      h.offset = static_cast<uint64_t>(getpid());
      h.bytes = peerToken.size();
      Reply r;
      err = sendAll(fd, &h, sizeof(h), deadline);
      if (err.empty()) err = sendAll(fd, peerToken.data(), peerToken.size(), deadline);
      if (err.empty()) err = recvAll(fd, &r, sizeof(r), deadline);
      if (err.empty() && r.status != kOk) err = "it refused this rank's greeting";
    }
    if (!err.empty()) {
      ::close(fd);
      fail(ErrorCode::kPeerFailure, peer, "connect", err + " (its process or its window is gone)");
    }
    link.fd = fd;
    link.pid = pid;
  }

  // Sends one message (and `extra` bytes) and reads the answer. Under link.mu.
  Reply exchange(int peer, Link& link, const Header& h, const void* extra, size_t extraBytes, std::string& text,
                 Clock::time_point deadline, const char* op) {
    connect(peer, link, deadline);
    Reply r;
    std::string err = sendAll(link.fd, &h, sizeof(h), deadline);
    if (err.empty() && extraBytes > 0) err = sendAll(link.fd, extra, extraBytes, deadline);
    if (err.empty()) err = recvAll(link.fd, &r, sizeof(r), deadline);
    if (err.empty() && r.textLen > 0) {
      text.assign(std::min<uint32_t>(r.textLen, 4096), '\0');
      err = recvAll(link.fd, text.data(), text.size(), deadline);
    }
    if (!err.empty()) {
      ::close(link.fd);
      link.fd = -1;
      fail(err.find("timed out") == 0 ? ErrorCode::kTimeout : ErrorCode::kPeerFailure, peer, op,
           err + " after " + std::to_string(timeout.count()) + " ms at most");
    }
    return r;
  }

  // What `peer` registered for this rank's current registration. Under link.mu.
  const Region& regionOf(int peer, Link& link) {
    uint64_t g;
    {
      std::lock_guard<std::mutex> lk(regMu);
      RAILCC_CHECK_ARG(isRegistered, name, ": put before tensor_register (collective: every rank registers its "
                       "tensor first)");
      g = gen;
    }
    if (link.region.gen == g) return link.region;
    std::istringstream rec(dir.get("reg/" + std::to_string(g) + "/" + std::to_string(peer), timeout));
    Region r;
    r.gen = g;
    rec >> r.bytes >> r.elemSize >> r.dtype;
    if (r.elemSize == 0 || r.dtype.empty()) fail(ErrorCode::kInternal, peer, "put", "its registration record is damaged");
    link.region = r;
    return link.region;
  }
};

WindowEndpoint::WindowEndpoint(Directory dir, int rank, std::vector<WindowPeer> peers, std::string name,
                               std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.dir = std::move(dir);
  m.rank = rank;
  m.peers = std::move(peers);
  m.name = std::move(name);
  m.timeout = timeout;
  RAILCC_CHECK_ARG(rank >= 0 && rank < static_cast<int>(m.peers.size()), m.name, ": rank ", rank, " of ",
                   m.peers.size());
  m.got.assign(m.peers.size(), 0);
  m.used.assign(m.peers.size(), 0);
  m.dropped.assign(m.peers.size(), 0);
  for (size_t i = 0; i < m.peers.size(); ++i) m.links.push_back(std::make_unique<Impl::Link>());
  sockaddr_in addr{};
  socket::pickInterface(Config::fromEnv().socketIfname, addr);
  m.listener = std::make_unique<socket::Listener>(addr);
  m.wakeFd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  RAILCC_SYSCHECK(m.wakeFd, "eventfd");
  m.server = std::thread([&m] { m.run(); });
  m.dir.set("addr/" + std::to_string(rank),
            socket::formatAddr(m.listener->addr()) + " " + std::to_string(getpid()) + " " + m.token);
}

WindowEndpoint::~WindowEndpoint() {
  Impl& m = *impl_;
  m.stop = true;
  uint64_t one = 1;
  [[maybe_unused]] ssize_t k = ::write(m.wakeFd, &one, sizeof(one));
  if (m.server.joinable()) m.server.join();
  ::close(m.wakeFd);
  for (auto& l : m.links)
    if (l->fd >= 0) ::close(l->fd);
  {
    std::lock_guard<std::mutex> g(m.sigMu);
    std::fill(m.dropped.begin(), m.dropped.end(), 1);
  }
  m.sigCv.notify_all();
}

void WindowEndpoint::registerRegion(void* base, size_t bytes, size_t elemSize, const std::string& dtype) {
  Impl& m = *impl_;
  RAILCC_CHECK_ARG(elemSize > 0 && dtype.find_first_of(" \n") == std::string::npos, m.name,
                   ": a region needs an element size and a dtype name");
  uint64_t g;
  {
    std::lock_guard<std::mutex> lk(m.regMu);
    RAILCC_CHECK_ARG(!m.isRegistered, m.name, ": a tensor is registered already: tensor_deregister() it first");
    m.base = static_cast<char*>(base);
    m.bytes = bytes;
    m.elemSize = elemSize;
    m.dtype = dtype;
    g = ++m.gen;
    m.isRegistered = true;
  }
  m.dir.set("reg/" + std::to_string(g) + "/" + std::to_string(m.rank),
            std::to_string(bytes) + " " + std::to_string(elemSize) + " " + dtype);
}

void WindowEndpoint::deregister(std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  uint64_t g;
  {
    std::lock_guard<std::mutex> lk(m.regMu);
    RAILCC_CHECK_ARG(m.isRegistered, m.name, ": tensor_deregister() with no tensor registered");
    g = m.gen;
  }
  const std::string key = "dereg/" + std::to_string(g);
  int64_t n = m.dir.add(key, 1);
  const auto deadline = Clock::now() + timeout;
  for (auto nap = Millis(1); n < static_cast<int64_t>(m.peers.size()); n = m.dir.add(key, 0)) {
    if (Clock::now() >= deadline)
      RAILCC_THROW(kTimeout, m.name, ": tensor_deregister waited ", timeout.count(), " ms and ", n, " of ",
                   m.peers.size(), " ranks had called it (it is collective); this rank's tensor stays registered");
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, Millis(20));
  }
  std::lock_guard<std::mutex> lk(m.regMu);
  m.isRegistered = false;
  m.base = nullptr;
  m.bytes = 0;
}

bool WindowEndpoint::registered() const {
  std::lock_guard<std::mutex> lk(impl_->regMu);
  return impl_->isRegistered;
}

void WindowEndpoint::put(const void* src, size_t bytes, const std::string& dtype, int dst, size_t offsetElems,
                         std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  m.checkPeer(dst, "put");
  Impl::Link& link = *m.links[static_cast<size_t>(dst)];
  std::lock_guard<std::mutex> lk(link.mu);
  const auto deadline = Clock::now() + timeout;
  const Impl::Region& r = m.regionOf(dst, link);
  RAILCC_CHECK_ARG(dtype == r.dtype, m.name, ": put of ", dtype, " into rank ", dst, "'s window of ", r.dtype);
  const size_t capacity = r.elemSize ? r.bytes / r.elemSize : 0;
  RAILCC_CHECK_ARG(offsetElems <= capacity && bytes / r.elemSize <= capacity - offsetElems, m.name, ": put of ",
                   bytes / r.elemSize, " elements at offset ", offsetElems, " into rank ", dst, "'s window of ",
                   capacity, " elements");
  if (bytes == 0) return;
  Header h;
  h.gen = r.gen;
  h.offset = offsetElems * r.elemSize;
  h.bytes = bytes;
  if (dst == m.rank) {
    std::lock_guard<std::mutex> g(m.regMu);
    std::string why = m.placeable(h.gen, h.offset, h.bytes);
    if (!why.empty()) m.fail(ErrorCode::kInvalidUsage, dst, "put", why);
    std::memmove(m.base + h.offset, src, bytes);
    link.path = "memcpy";
    return;
  }
  std::string text;
  if (link.readAllowed && m.shareMemoryWith(dst)) {
    h.kind = kPutRead;
    h.addr = reinterpret_cast<uint64_t>(src);
    Reply rep = m.exchange(dst, link, h, nullptr, 0, text, deadline, "put");
    if (rep.status == kOk) {
      link.path = "process_vm_readv";
      return;
    }
    if (rep.status == kRefused) m.fail(ErrorCode::kInvalidUsage, dst, "put", text);
    link.readAllowed = false;  // its kernel may not read this process: the bytes go over the socket
  }
  h.kind = kPut;
  h.addr = 0;
  Reply rep = m.exchange(dst, link, h, src, bytes, text, deadline, "put");
  if (rep.status != kOk) m.fail(ErrorCode::kInvalidUsage, dst, "put", text);
  link.path = "socket";
}

void WindowEndpoint::signal(int peer, std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  m.checkPeer(peer, "signal");
  if (peer == m.rank) {
    {
      std::lock_guard<std::mutex> g(m.sigMu);
      ++m.got[static_cast<size_t>(peer)];
    }
    m.sigCv.notify_all();
    return;
  }
  Impl::Link& link = *m.links[static_cast<size_t>(peer)];
  std::lock_guard<std::mutex> lk(link.mu);
  Header h;
  h.kind = kSignal;
  std::string text;
  Reply rep = m.exchange(peer, link, h, nullptr, 0, text, Clock::now() + timeout, "signal");
  if (rep.status != kOk) m.fail(ErrorCode::kPeerFailure, peer, "signal", text);
}

void WindowEndpoint::waitSignal(int peer, std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  m.checkPeer(peer, "wait_signal");
  const size_t p = static_cast<size_t>(peer);
  std::unique_lock<std::mutex> g(m.sigMu);
  const bool arrived = m.sigCv.wait_for(g, timeout, [&] { return m.got[p] > m.used[p] || m.dropped[p]; });
  if (arrived && m.got[p] > m.used[p]) {
    ++m.used[p];
    return;
  }
  g.unlock();
  if (arrived)
    m.fail(ErrorCode::kPeerFailure, peer, "wait_signal", "its connection to this rank dropped before it signalled");
  m.fail(ErrorCode::kTimeout, peer, "wait_signal",
         "no signal came in " + std::to_string(timeout.count()) + " ms (it has not called signal(" +
             std::to_string(m.rank) + ") as often as this rank waits for it, or it is stuck)");
}

std::string WindowEndpoint::pathTo(int peer) const {
  impl_->checkPeer(peer, "path");
  Impl::Link& link = *impl_->links[static_cast<size_t>(peer)];
  std::lock_guard<std::mutex> lk(link.mu);
  return link.path;
}

int WindowEndpoint::rank() const { return impl_->rank; }
int WindowEndpoint::size() const { return static_cast<int>(impl_->peers.size()); }
const std::string& WindowEndpoint::name() const { return impl_->name; }

}  // namespace railcc::transport
