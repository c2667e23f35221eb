#include "transport/socket/rendezvous.h"

#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/error.h"
#include "common/log.h"
#include "common/crypto.h"
#include "transport/socket/socket_transport.h"

namespace railcc::transport::socket {
namespace {

using Clock = std::chrono::steady_clock;

// Wire messages, little-endian:
//   hello  (dialer):   magic u64 | version i32 | src rank i32 | dst rank i32 | lane i32 | nonce 16
//   answer (acceptor): magic u64 | nonce 16 | HMAC("railcc server" | hello | nonce) 32
//   proof  (dialer):   HMAC("railcc client" | hello | acceptor's nonce) 32
//   ack    (acceptor): magic u64
constexpr uint64_t kHelloMagic = 0x7261696c63636832ull;   // "railcch2"
constexpr uint64_t kAnswerMagic = 0x7261696c63636132ull;  // "railcca2"
constexpr uint64_t kAckMagic = 0x7261696c63636f6bull;     // "railccok"
constexpr int32_t kVersion = 2;
constexpr size_t kNonce = 16, kHello = 8 + 16 + kNonce, kAnswer = 8 + kNonce + 32, kProof = 32, kAck = 8;
// An accepted connection must finish its handshake within this; a peer's dialer sends its
// part at once, so only a stranger (or a frozen peer, which then fails on its side) waits.
constexpr auto kHandshakeWait = std::chrono::seconds(10);
constexpr size_t kMaxPending = 256;      // accepted connections mid-handshake; the oldest goes first
constexpr size_t kMaxDroppedLogged = 8;  // a flood of strangers must not flood the log
// Peers publish their address only once they listen, and a Linux listener whose accept queue
// is full drops a connect rather than refusing it: refusals that go on this long, to a dial
// (every 50 ms) or a knock (probe.h, every 250 ms), mean the process (or its listener) is gone.
constexpr auto kRefusedMeansGone = std::chrono::milliseconds(500);

void put(std::vector<uint8_t>& v, uint64_t x, int bytes) {
  for (int i = 0; i < bytes; ++i) v.push_back(static_cast<uint8_t>(x >> (8 * i)));
}
uint64_t get(const std::vector<uint8_t>& v, size_t at, int bytes) {
  uint64_t x = 0;
  for (int i = 0; i < bytes; ++i) x |= uint64_t(v[at + static_cast<size_t>(i)]) << (8 * i);
  return x;
}

enum class Io { kDone, kAgain, kClosed, kError };

}  // namespace

struct Rendezvous::Conn {
  enum Phase { kWaitRetry, kConnecting, kSendHello, kRecvAnswer, kSendProof, kRecvAck,  // dialer
               kRecvHello, kSendAnswer, kRecvProof, kSendAck,                           // acceptor
               kParked,  // a hello for a (peer, lane) not expected yet, while registrations may still come
               kDone };
  int fd = -1;
  bool dialer = false;
  int peer = -1, lane = -1;
  sockaddr_in addr{};
  sockaddr_in from{};  // a dialer's local address (its channel's interface), or any
  Phase phase = kWaitRetry;
  std::vector<uint8_t> out, in, hello, nonce;
  size_t outDone = 0, inGot = 0;
  Clock::time_point since, retryAt, refusedSince;
  std::string lastError;

  ~Conn() {
    if (fd >= 0) ::close(fd);
  }
  std::string where() const { return formatAddr(addr); }
  void expect(size_t n) {
    in.assign(n, 0);
    inGot = 0;
  }
  void send(std::vector<uint8_t> bytes) {
    out = std::move(bytes);
    outDone = 0;
  }
  Io pushOut() {
    while (outDone < out.size()) {
      ssize_t r = ::send(fd, out.data() + outDone, out.size() - outDone, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (r > 0) {
        outDone += static_cast<size_t>(r);
      } else if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        return Io::kAgain;
      } else {
        lastError = detail::errnoString();
        return Io::kError;
      }
    }
    return Io::kDone;
  }
  Io pullIn() {
    while (inGot < in.size()) {
      ssize_t r = ::recv(fd, in.data() + inGot, in.size() - inGot, MSG_DONTWAIT);
      if (r > 0) {
        inGot += static_cast<size_t>(r);
      } else if (r == 0) {
        return Io::kClosed;
      } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
        return Io::kAgain;
      } else {
        lastError = detail::errnoString();
        return Io::kError;
      }
    }
    return Io::kDone;
  }
  short events() const {
    switch (phase) {
      case kConnecting: case kSendHello: case kSendProof: case kSendAnswer: case kSendAck: return POLLOUT;
      case kRecvAnswer: case kRecvAck: case kRecvHello: case kRecvProof: return POLLIN;
      default: return 0;
    }
  }
};

namespace {
// Thrown inside advance() for an accepted connection that is not one of our peers'.
struct Stranger {
  std::string why;
  bool quiet = false;  // a peer's probe (probe.h), not worth a line in the log
};

Digest macOf(const std::vector<uint8_t>& secret, const char* label, const std::vector<uint8_t>& hello,
             const std::vector<uint8_t>& nonce) {
  std::vector<uint8_t> msg(label, label + std::strlen(label));
  msg.insert(msg.end(), hello.begin(), hello.end());
  msg.insert(msg.end(), nonce.begin(), nonce.end());
  return hmacSha256(secret, msg);
}
}  // namespace

Rendezvous::Rendezvous(std::vector<uint8_t> secret, int rank, Listener* listener)
    : secret_(std::move(secret)), rank_(rank) {
  if (listener) listeners_.push_back(listener);
}

void Rendezvous::addListener(Listener* listener) { listeners_.push_back(listener); }

Rendezvous::~Rendezvous() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  conns_.clear();
  for (auto& [key, v] : done_)
    if (v.first >= 0) ::close(v.first);
}

void Rendezvous::dial(int peer, int lane, const sockaddr_in& to, const sockaddr_in* from) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  auto c = std::make_unique<Conn>();
  c->dialer = true;
  c->peer = peer;
  c->lane = lane;
  c->addr = to;
  if (from) c->from = *from;
  c->retryAt = Clock::now();
  conns_.push_back(std::move(c));
  // At first use the peer may hold our hello unanswered (parked until its own first use of
  // this pair) and then fail without ever taking it: knock on its listener meanwhile, so a
  // peer whose group went away is reported instead of waited for until the op times out.
  // The first knock waits a while: a live peer has answered by then, and costs no probe.
  if (open_) watch(peer, to, Clock::now() + kFirstKnockAfter);
}

void Rendezvous::expect(int peer, int lane) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  RAILCC_CHECK_ARG(!listeners_.empty(), "rendezvous: rank ", peer, " is expected to connect, but nothing listens");
  expected_[{peer, lane}] = false;
}

void Rendezvous::watch(int peer, const sockaddr_in& listener, Clock::time_point firstKnock) {
  probes_.try_emplace(peer, listener, std::chrono::milliseconds(250), kRefusedMeansGone, firstKnock);
}

void Rendezvous::knock(Clock::time_point now) {
  for (auto p = probes_.begin(); p != probes_.end();) {
    const int peer = p->first;
    bool waiting = false;
    for (auto it = expected_.lower_bound({peer, INT32_MIN}); it != expected_.end() && it->first.first == peer; ++it)
      waiting = waiting || !it->second;
    for (auto& c : conns_) waiting = waiting || (c->dialer && c->peer == peer);
    if (!waiting) {  // it dialed, or answered ours: nothing more to knock for (a later accept() or dial() watches anew)
      p = probes_.erase(p);
      continue;
    }
    if (p->second.refused(now)) {
      Error e(ErrorCode::kPeerFailure, "rank " + std::to_string(peer) + " has not finished connecting with this rank, and its " +
                                           "listener at " + formatAddr(p->second.address()) + " refused connections for " +
                                           std::to_string(kRefusedMeansGone.count()) + " ms (" + p->second.lastError() +
                                           "): its process has exited or given up on the group");
      e.ranks = {peer};
      throw e;
    }
    ++p;
  }
}

void Rendezvous::startConnect(Conn& c) {
  c.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  RAILCC_SYSCHECK(c.fd, "socket");
  tuneSocket(c.fd);
  c.phase = Conn::kConnecting;
  if (c.from.sin_addr.s_addr != 0) {
    // Leave through the interface of this channel: bind its address, any port.
    sockaddr_in src = c.from;
    src.sin_port = 0;
    if (::bind(c.fd, reinterpret_cast<const sockaddr*>(&src), sizeof(src)) != 0) {
      std::string err = detail::errnoString();
      ::close(c.fd);
      c.fd = -1;
      RAILCC_THROW(kSystem, "bind to ", formatAddr(src), " to reach ", formatAddr(c.addr), ": ", err);
    }
  }
  if (::connect(c.fd, reinterpret_cast<const sockaddr*>(&c.addr), sizeof(c.addr)) == 0 || errno == EINPROGRESS)
    return;  // advance() finds out on POLLOUT
  int err = errno;
  ::close(c.fd);
  c.fd = -1;
  c.phase = Conn::kWaitRetry;
  c.lastError = std::strerror(err);
  c.retryAt = Clock::now() + std::chrono::milliseconds(50);
}

void Rendezvous::drop(size_t i, const std::string& why, bool quiet) {
  if (quiet) {
    conns_.erase(conns_.begin() + static_cast<std::ptrdiff_t>(i));
    return;
  }
  Conn& c = *conns_[i];
  std::string line = c.where() + ": " + why;
  if (dropped_.size() < kMaxDroppedLogged)
    RAILCC_WARN(NET, "dropped an unauthenticated connection from ", line);
  dropped_.push_back(line);
  conns_.erase(conns_.begin() + static_cast<std::ptrdiff_t>(i));
}

void Rendezvous::finishClientHello(Conn& c) {
  // The acceptor checks what we claim before it answers anything.
  if (get(c.in, 0, 8) != kHelloMagic) throw Stranger{"it did not send railcc's handshake"};
  auto version = static_cast<int32_t>(get(c.in, 8, 4));
  if (version != kVersion)
    throw Stranger{"railcc handshake version " + std::to_string(version) + ", this build speaks " +
                   std::to_string(kVersion)};
  int src = static_cast<int32_t>(get(c.in, 12, 4)), dst = static_cast<int32_t>(get(c.in, 16, 4));
  int lane = static_cast<int32_t>(get(c.in, 20, 4));
  if (dst != rank_) throw Stranger{"it asked for rank " + std::to_string(dst) + ", this is rank " + std::to_string(rank_)};
  auto it = expected_.find({src, lane});
  if (it == expected_.end() && open_) {
    c.peer = src;  // what it claims, judged again once expect() calls have come (step())
    c.lane = lane;
    c.phase = Conn::kParked;
    return;
  }
  if (it == expected_.end())
    throw Stranger{"rank " + std::to_string(src) + " lane " + std::to_string(lane) + " does not connect to this rank"};
  if (it->second) throw Stranger{"rank " + std::to_string(src) + " lane " + std::to_string(lane) + " is connected already"};
  c.peer = src;
  c.lane = lane;
  c.hello = c.in;
  c.nonce = randomBytes(kNonce);
  std::vector<uint8_t> answer;
  put(answer, kAnswerMagic, 8);
  answer.insert(answer.end(), c.nonce.begin(), c.nonce.end());
  Digest mac = macOf(secret_, "railcc server", c.hello, c.nonce);
  answer.insert(answer.end(), mac.begin(), mac.end());
  c.send(std::move(answer));
  c.phase = Conn::kSendAnswer;
}

void Rendezvous::finishServerHello(Conn& c) {
  std::string who = "rank " + std::to_string(c.peer) + " at " + c.where();
  if (get(c.in, 0, 8) != kAnswerMagic) {
    Error e(ErrorCode::kPeerFailure, who + " did not answer with railcc's handshake (another program at this address?)");
    e.ranks = {c.peer};
    e.tellPeers = true;
    throw e;
  }
  c.nonce.assign(c.in.begin() + 8, c.in.begin() + 8 + kNonce);
  Digest theirs;
  std::copy(c.in.begin() + 8 + kNonce, c.in.end(), theirs.begin());
  if (!equalConstantTime(theirs, macOf(secret_, "railcc server", c.hello, c.nonce))) {
    Error e(ErrorCode::kPeerFailure, who + " failed authentication: it does not hold this group's secret "
                                           "(RAILCC_AUTH_KEY_FILE differs between the ranks, or a process of another "
                                           "job listens at this address)");
    e.ranks = {c.peer};
    e.tellPeers = true;
    throw e;
  }
  Digest proof = macOf(secret_, "railcc client", c.hello, c.nonce);
  c.send(std::vector<uint8_t>(proof.begin(), proof.end()));
  c.phase = Conn::kSendProof;
}

void Rendezvous::finishProof(Conn& c) {
  Digest theirs;
  std::copy(c.in.begin(), c.in.end(), theirs.begin());
  if (!equalConstantTime(theirs, macOf(secret_, "railcc client", c.hello, c.nonce)))
    throw Stranger{"it claimed to be rank " + std::to_string(c.peer) + " but failed authentication"};
  std::vector<uint8_t> ack;
  put(ack, kAckMagic, 8);
  c.send(std::move(ack));
  c.phase = Conn::kSendAck;
}

bool Rendezvous::advance(Conn& c) {
  auto peerFailure = [&](const std::string& what) {
    Error e(ErrorCode::kPeerFailure, "rank " + std::to_string(c.peer) + " at " + c.where() + " " + what);
    e.ranks = {c.peer};
    return e;
  };
  while (true) {
    Io io = Io::kDone;
    switch (c.phase) {
      case Conn::kConnecting: {
        int err = 0;
        socklen_t len = sizeof(err);
        if (getsockopt(c.fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
        if (err == EINPROGRESS || err == EALREADY) return true;
        if (err != 0) {
          ::close(c.fd);
          c.fd = -1;
          c.lastError = std::strerror(err);
          auto now = Clock::now();
          if (err == ECONNREFUSED) {
            if (c.refusedSince == Clock::time_point{}) c.refusedSince = now;
            if (now - c.refusedSince > kRefusedMeansGone)
              throw peerFailure("refused connections for " + std::to_string(kRefusedMeansGone.count()) +
                                " ms: the process that published this address has exited");
          } else {
            c.refusedSince = {};
          }
          c.phase = Conn::kWaitRetry;
          c.retryAt = now + std::chrono::milliseconds(50);
          return true;
        }
        c.hello.clear();
        put(c.hello, kHelloMagic, 8);
        put(c.hello, static_cast<uint32_t>(kVersion), 4);
        put(c.hello, static_cast<uint32_t>(rank_), 4);
        put(c.hello, static_cast<uint32_t>(c.peer), 4);
        put(c.hello, static_cast<uint32_t>(c.lane), 4);
        std::vector<uint8_t> nonce = randomBytes(kNonce);
        c.hello.insert(c.hello.end(), nonce.begin(), nonce.end());
        c.send(c.hello);
        c.phase = Conn::kSendHello;
        continue;
      }
      case Conn::kSendHello: case Conn::kSendProof: case Conn::kSendAnswer: case Conn::kSendAck:
        io = c.pushOut();
        break;
      case Conn::kRecvAnswer: case Conn::kRecvAck: case Conn::kRecvHello: case Conn::kRecvProof:
        io = c.pullIn();
        break;
      default:
        return true;
    }
    if (io == Io::kAgain) return true;
    if (io != Io::kDone) {
      std::string how = io == Io::kClosed ? "closed the connection" : "failed (" + c.lastError + ")";
      if (!c.dialer && c.phase == Conn::kRecvHello && c.inGot >= 8 && get(c.in, 0, 8) == kProbeMagic)
        throw Stranger{"a probe", true};
      if (!c.dialer) throw Stranger{how + " during the handshake"};
      throw peerFailure(how + " during railcc's handshake: it refused this rank's credentials "
                              "(does it belong to another job or group?)");
    }
    switch (c.phase) {
      case Conn::kSendHello: c.expect(kAnswer); c.phase = Conn::kRecvAnswer; break;
      case Conn::kRecvAnswer: finishServerHello(c); break;
      case Conn::kSendProof: c.expect(kAck); c.phase = Conn::kRecvAck; break;
      case Conn::kRecvAck: {
        if (get(c.in, 0, 8) != kAckMagic) throw peerFailure("did not acknowledge railcc's handshake");
        // Having answered within the handshake, this socket is in delayed-ACK (interactive)
        // mode: the acceptor's last bytes would wait up to 40 ms for our ACK. Unacknowledged
        // data turns off keepalive, so a link cut meanwhile would go unnoticed on that side.
        int one = 1;
        setsockopt(c.fd, IPPROTO_TCP, TCP_QUICKACK, &one, sizeof(one));
        c.phase = Conn::kDone;
        return true;
      }
      case Conn::kRecvHello: finishClientHello(c); break;
      case Conn::kSendAnswer: c.expect(kProof); c.phase = Conn::kRecvProof; break;
      case Conn::kRecvProof: finishProof(c); break;
      case Conn::kSendAck: c.phase = Conn::kDone; return true;
      default: return true;
    }
  }
}

void Rendezvous::run(Clock::time_point deadline) {
  while (!step(deadline, std::chrono::milliseconds(100))) {
  }
}

bool Rendezvous::step(Clock::time_point deadline, std::chrono::milliseconds budget) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  {
    // Finished connections leave the list; their fds wait in done_.
    for (size_t i = 0; i < conns_.size();) {
      Conn& c = *conns_[i];
      if (c.phase != Conn::kDone) {
        ++i;
        continue;
      }
      if (!c.dialer) expected_[{c.peer, c.lane}] = true;
      done_[{c.peer, c.lane}] = {c.fd, formatAddr(c.addr)};
      c.fd = -1;
      conns_.erase(conns_.begin() + static_cast<std::ptrdiff_t>(i));
    }
    // Parked hellos: answered once their (peer, lane) is expected, judged once nothing more is.
    for (size_t i = 0; i < conns_.size();) {
      Conn& c = *conns_[i];
      if (c.phase == Conn::kParked && (!open_ || expected_.count({c.peer, c.lane}))) {
        // Its handshake resumes now: the stall clock below counts from here, not from the
        // accept (a hello parked for more than 10 s would otherwise be dropped at once).
        c.since = Clock::now();
        try {
          finishClientHello(c);
        } catch (const Stranger& s) {
          drop(i, s.why);
          continue;
        }
      }
      ++i;
    }
    bool waiting = awaiting();
    bool dialing = std::any_of(conns_.begin(), conns_.end(), [](auto& c) { return c->dialer; });
    if (!waiting && !dialing) {
      if (!finished_) closeStrangers();
      finished_ = true;
      return true;
    }

    auto now = Clock::now();
    if (now >= deadline) {
      std::string missing;
      std::vector<int> ranks;
      for (auto& c : conns_)
        if (c->dialer) {
          missing += "\n  connecting to rank " + std::to_string(c->peer) + " at " + c->where() + " (lane " +
                     std::to_string(c->lane) + "): " + (c->lastError.empty() ? "no answer" : c->lastError);
          ranks.push_back(c->peer);
        }
      for (auto& [key, arrived] : expected_)
        if (!arrived) {
          missing += "\n  rank " + std::to_string(key.first) + " never connected (lane " + std::to_string(key.second) + ")";
          ranks.push_back(key.first);
        }
      if (!dropped_.empty()) {
        missing += "\n  meanwhile " + std::to_string(dropped_.size()) +
                   " connection(s) that failed railcc's handshake were dropped (not group members), first: " +
                   dropped_.front();
      }
      std::sort(ranks.begin(), ranks.end());
      ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
      Error e(ErrorCode::kTimeout, "TCP connections not set up within RAILCC_INIT_TIMEOUT:" + missing);
      e.ranks = ranks;
      throw e;
    }
    if (open_) knock(now);
    // Accepted connections that stall are strangers (or frozen peers): out, whatever they hold.
    for (size_t i = 0; i < conns_.size();) {
      if (!conns_[i]->dialer && conns_[i]->phase != Conn::kParked && now - conns_[i]->since > kHandshakeWait)
        drop(i, "no complete railcc handshake within 10 s");
      else
        ++i;
    }
    auto wake = std::min(deadline, now + budget);
    for (auto& c : conns_) {
      if (c->dialer && c->phase == Conn::kWaitRetry) {
        if (c->retryAt <= now) startConnect(*c);
        else wake = std::min(wake, c->retryAt);
      }
    }
    std::vector<pollfd> fds;
    std::vector<Conn*> who;
    const size_t nlisten = pollSet(fds, &who);
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count();
    if (poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(ms, 0))) < 0 && errno != EINTR)
      RAILCC_THROW(kSystem, "poll: ", detail::errnoString());

    std::vector<Conn*> ready;
    for (size_t i = 0; i < fds.size(); ++i)
      if (fds[i].revents && who[i]) ready.push_back(who[i]);
    for (Conn* c : ready) {
      auto it = std::find_if(conns_.begin(), conns_.end(), [c](auto& p) { return p.get() == c; });
      try {
        advance(*c);
      } catch (const Stranger& s) {
        drop(static_cast<size_t>(it - conns_.begin()), s.why, s.quiet);
      }
    }
    for (size_t i = 0; i < nlisten; ++i)
      if (fds[i].revents) {
        sockaddr_in from{};
        int fd;
        while ((fd = listeners_[i]->accept(&from)) >= 0) adopt(fd, from);
      }
  }
  return false;
}

bool Rendezvous::awaiting() const {
  return open_ || std::any_of(expected_.begin(), expected_.end(), [](auto& e) { return !e.second; });
}

size_t Rendezvous::pollSet(std::vector<pollfd>& fds, std::vector<Conn*>* who) const {
  size_t nlisten = 0;
  if (awaiting())
    for (Listener* l : listeners_) {
      fds.push_back({l->fd(), POLLIN, 0});
      if (who) who->push_back(nullptr);
      ++nlisten;
    }
  for (auto& c : conns_)
    if (c->fd >= 0 && c->events()) {
      fds.push_back({c->fd, c->events(), 0});
      if (who) who->push_back(c.get());
    }
  return nlisten;
}

int Rendezvous::pollFds(std::vector<pollfd>& out) const {
  pollSet(out, nullptr);
  auto now = Clock::now();
  long long ms = 50;  // knocks (every 250 ms) and stalled handshakes are checked in step()
  for (auto& c : conns_) {
    if (c->dialer && c->phase == Conn::kWaitRetry)
      ms = std::min<long long>(ms, std::chrono::duration_cast<std::chrono::milliseconds>(c->retryAt - now).count());
    else if (c->phase == Conn::kDone)
      ms = 0;  // to be moved to the finished ones
  }
  return static_cast<int>(std::max<long long>(ms, 0));
}

void Rendezvous::adopt(int fd, const sockaddr_in& from) {
  size_t pending = 0;
  for (auto& c : conns_) pending += !c->dialer;
  if (pending >= kMaxPending) {
    for (size_t i = 0; i < conns_.size(); ++i)
      if (!conns_[i]->dialer) {
        drop(i, "still mid-handshake when " + std::to_string(kMaxPending) + " more connections waited");
        break;
      }
  }
  auto c = std::make_unique<Conn>();
  c->fd = fd;
  c->addr = from;
  c->since = Clock::now();
  c->expect(kHello);
  c->phase = Conn::kRecvHello;
  conns_.push_back(std::move(c));
  try {
    advance(*conns_.back());  // its hello is often there already
  } catch (const Stranger& s) {
    drop(conns_.size() - 1, s.why, s.quiet);
  }
}

void Rendezvous::closeStrangers() {
  // Every group member is in. Whatever else reached the listener (accepted or still in its
  // backlog) is a stranger: each is named in the log, with what it sent if that is already
  // here, before the listener closes and the kernel resets them.
  for (Listener* l : listeners_) {
    sockaddr_in from{};
    int fd;
    while ((fd = l->accept(&from)) >= 0) adopt(fd, from);
  }
  // Only accepted connections are left: run() returns once no dial is under way.
  while (!conns_.empty()) drop(conns_.size() - 1, "still mid-handshake when set-up ended");
}

int Rendezvous::take(int peer, int lane) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  auto it = done_.find({peer, lane});
  RAILCC_CHECK_ARG(it != done_.end() && it->second.first >= 0, "rendezvous: no connection for rank ", peer, " lane ",
                   lane);
  int fd = it->second.first;
  it->second.first = -1;
  return fd;
}

void Rendezvous::shutdownAll() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  for (auto& c : conns_)
    if (c->fd >= 0) ::shutdown(c->fd, SHUT_RDWR);
  for (auto& [key, v] : done_)
    if (v.first >= 0) ::shutdown(v.first, SHUT_RDWR);
}

std::string Rendezvous::remoteAddress(int peer, int lane) const {
  auto it = done_.find({peer, lane});
  return it == done_.end() ? std::string() : it->second.second;
}

}  // namespace railcc::transport::socket
