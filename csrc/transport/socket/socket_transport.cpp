// The socket transport's set-up: listeners on the chosen interfaces, the authenticated
// rendezvous, and one TCP connection per (peer, lane, channel). Where the topology names the
// rank's rail (SetupContext::rail), every channel of a pair runs between the two hosts' NICs
// of one rail (RAILCC_CROSS_NIC); otherwise channel c is bound to interface c of
// RAILCC_SOCKET_IFNAME in turn (a rail each).
#include <arpa/inet.h>
#include <sys/socket.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include "common/error.h"
#include "common/log.h"
#include "common/strings.h"
#include "transport/transport.h"
#include "transport/socket/rendezvous.h"
#include "transport/socket/socket_transport.h"

namespace railcc::transport::socket {
namespace {

constexpr int kMaxChannels = 64;  // slot = lane * kMaxChannels + channel in the handshake


// A published endpoint: "-" (nobody dials this rank), "ip:port,ip:port" (one listener per
// interface), or with rails "ip:port@0,ip:port@1;rail=1" (each listener's rail, and the rank's).
struct Blob {
  std::vector<std::pair<std::string, int>> addrs;  // (ip:port, rail or -1)
  int rail = -1;
  const std::string* onRail(int r) const {
    for (auto& a : addrs)
      if (r >= 0 && a.second == r) return &a.first;
    return nullptr;
  }
};

Blob parseBlob(const std::string& s) {
  Blob b;
  auto parts = split(s, ';');
  for (size_t i = 1; i < parts.size(); ++i)
    if (parts[i].rfind("rail=", 0) == 0) b.rail = std::atoi(parts[i].c_str() + 5);
  if (parts.empty() || parts[0] == "-") return b;
  for (const std::string& a : split(parts[0], ',')) {
    auto at = a.find('@');
    b.addrs.push_back({a.substr(0, at), at == std::string::npos ? -1 : std::atoi(a.c_str() + at + 1)});
  }
  return b;
}

class SocketSetup : public Setup {
 public:
  explicit SocketSetup(const SetupContext& ctx) : ctx_(ctx) {
    const Config& c = ctx.config;
    ifs_ = pickInterfaces(c.socketIfname);
    int64_t n = c.nchannels > 0 ? c.nchannels : c.nsocksPerThread * c.socketNthreads;
    n = std::min<int64_t>(n, c.maxNchannels);
    n = std::max<int64_t>(n, c.minNchannels);
    channels_ = static_cast<int>(std::min<int64_t>(n, kMaxChannels));
    pickRails();
  }

  std::string endpoint() override {
    // Connections are made when a pair first meets (at its first op, or at init for those
    // RAILCC_RUNTIME_CONNECT=0 has the engine connect then), so every rank with a peer on
    // another host listens for the group's life: the peers it dials knock on it (probe.h)
    // while they wait, to learn whether it still exists.
    if (static_cast<int>(ctx_.localRanks.size()) >= ctx_.size) return "-";  // every rank shares this host
    std::string blob, names;
    if (myRail_ >= 0) {  // a listener on every rail: a peer dials the one of the pair's rail
      for (auto& [r, itf] : railIf_) {
        listeners_.push_back(std::make_unique<Listener>(itf.addr));
        blob += (blob.empty() ? "" : ",") + formatAddr(listeners_.back()->addr()) + "@" + std::to_string(r);
        names += (names.empty() ? "" : ", ") + itf.name + " " + formatAddr(listeners_.back()->addr()) + " (rail " +
                 std::to_string(r) + ")";
      }
      blob += ";rail=" + std::to_string(myRail_);
    } else {
      size_t nl = std::min(ifs_.size(), static_cast<size_t>(channels_));
      for (size_t i = 0; i < nl; ++i) {
        listeners_.push_back(std::make_unique<Listener>(ifs_[i].addr));
        blob += (i ? "," : "") + formatAddr(listeners_.back()->addr());
        names += (i ? ", " : "") + ifs_[i].name + " " + formatAddr(listeners_.back()->addr());
      }
    }
    RAILCC_INFO(INIT, "listening on ", names, " for the group's life (connections when a pair first meets)");
    rv();  // made now, on the set-up's thread: markFailed() may come from another
    return blob;
  }

  int channels() const override { return channels_; }

  std::string reach(const PeerRecord& peer) override {
    if (myRail_ >= 0) return "TCP on rail " + std::to_string(myRail_) + " (" + railIf_[myRail_].name + ")";
    std::string why = "TCP over " + ifs_[0].name;
    for (size_t i = 1; i < std::min(ifs_.size(), static_cast<size_t>(channels_)); ++i) why += "+" + ifs_[i].name;
    return why;
  }

  void connect(const PeerRecord& peer, int lane, int channel) override {
    Blob b = parseBlob(peer.endpoint);
    if (b.addrs.empty())
      RAILCC_THROW(kInternal, "rank ", peer.rank, " published no TCP listener, yet rank ", ctx_.rank, " must dial it");
    std::string to = b.addrs[static_cast<size_t>(channel) % b.addrs.size()].first;
    // Several interfaces: leave through this channel's own, so each rail carries its share.
    const sockaddr_in* from = ifs_.size() > 1 ? &ifs_[static_cast<size_t>(channel) % ifs_.size()].addr : nullptr;
    if (myRail_ >= 0) railRoute(peer, b, to, from);
    rv().dial(peer.rank, lane * kMaxChannels + channel, parseAddr(to), from);
    where_[{peer.rank, lane * kMaxChannels + channel}] = to;
  }

  void accept(const PeerRecord& peer, int lane, int channel) override {
    rv().expect(peer.rank, lane * kMaxChannels + channel);
    // Nothing of the peer's to watch until it dials: knock on its listener, the first time
    // after the same wait as a dialer's.
    Blob b = parseBlob(peer.endpoint);
    if (!b.addrs.empty())
      rv().watch(peer.rank, parseAddr(b.addrs.front().first), std::chrono::steady_clock::now() + Rendezvous::kFirstKnockAfter);
  }

  void idle(std::chrono::milliseconds budget) override {
    if (listeners_.empty()) return;
    rv().keepOpen(true);
    rv_->step(std::chrono::steady_clock::now() + std::chrono::hours(1), budget);
  }

  bool progress(std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds budget) override {
    if (!rv_) return true;
    rv_->keepOpen(true);
    return rv_->step(deadline, budget);
  }

  bool lazy() const override { return true; }
  int pollFds(std::vector<pollfd>& out) override { return rv_ ? rv_->pollFds(out) : 100; }
  void markFailed() override {
    // shutdown() of a listening socket resets the connections in its backlog and refuses new
    // ones; the fd stays ours (closed with the setup), so the engine thread's poll is safe.
    for (auto& l : listeners_) ::shutdown(l->fd(), SHUT_RDWR);
    // And what the rendezvous holds: a peer that finished a handshake with us that we never
    // took counts the connection as up, and would wait on it until its op timed out.
    if (rv_) rv_->shutdownAll();
  }
  bool ready(int peer, int lane, int channel) override {
    return rv_ && rv_->ready(peer, lane * kMaxChannels + channel);
  }

  std::unique_ptr<Connection> take(int peer, int lane, int channel) override {
    int slot = lane * kMaxChannels + channel;
    auto it = where_.find({peer, slot});
    std::string where = it != where_.end() ? it->second : rv_->remoteAddress(peer, slot);
    int fd = rv_->take(peer, slot);
    return makeConnection(fd, where + localSide(fd), static_cast<size_t>(ctx_.config.stagingSize));
  }

  void finish() override {
    rv_.reset();
    listeners_.clear();
  }

 private:
  Rendezvous& rv() {
    if (!rv_) {
      rv_ = std::make_unique<Rendezvous>(ctx_.secret, ctx_.rank, nullptr);
      for (auto& l : listeners_) rv_->addListener(l.get());
    }
    return *rv_;
  }

  // With the rank's rail known and its interface usable here (up, IPv4, not excluded by
  // RAILCC_SOCKET_IFNAME): the interface of every rail of this host, and myRail_.
  void pickRails() {
    if (ctx_.rail < 0 || static_cast<size_t>(ctx_.rail) >= ctx_.railIfs.size()) return;
    const std::string& mine = ctx_.railIfs[static_cast<size_t>(ctx_.rail)];
    if (mine.empty()) return;  // placement already said its NIC has no IPv4 interface
    std::string exact;
    for (const std::string& n : ctx_.railIfs)
      if (!n.empty()) exact += (exact.empty() ? "=" : ",") + n;
    std::vector<Interface> usable;
    try {
      usable = pickInterfaces(ctx_.config.socketIfname.empty() ? exact : ctx_.config.socketIfname);
    } catch (const Error&) {
    }
    for (size_t r = 0; r < ctx_.railIfs.size(); ++r)
      for (const Interface& i : usable)
        if (i.name == ctx_.railIfs[r]) railIf_[static_cast<int>(r)] = i;
    if (railIf_.count(ctx_.rail)) {
      myRail_ = ctx_.rail;
    } else {
      RAILCC_INFO(INIT, "rail ", ctx_.rail, "'s interface ", mine, " is not among RAILCC_SOCKET_IFNAME='",
                  ctx_.config.socketIfname, "': TCP ignores the rails");
      railIf_.clear();
    }
  }

  // Which of the peer's listeners a rail-bound rank dials, and from which interface.
  void railRoute(const PeerRecord& peer, const Blob& b, std::string& to, const sockaddr_in*& from) {
    int want = ctx_.config.crossNic == 1 && b.rail >= 0 ? b.rail : myRail_;
    const std::string* at = b.onRail(want);
    if (!at && b.rail >= 0 && (at = b.onRail(b.rail))) {
      if (warned_.insert(peer.rank).second) {
        std::string msg = "rank " + std::to_string(peer.rank) + " (host " + peer.hostname + ") has no interface on rail " +
                          std::to_string(want) + ": its traffic with rank " + std::to_string(ctx_.rank) +
                          " crosses to its own rail " + std::to_string(b.rail);
        if (ctx_.config.crossNic == 0) RAILCC_WARN(INIT, msg, " (RAILCC_CROSS_NIC/NCCL_CROSS_NIC=0)");
        else RAILCC_INFO(INIT, msg);
      }
      want = b.rail;
    }
    if (!at) return;  // the peer has no rails: as without them
    to = *at;
    // Leave through the interface on the destination's rail where there is one (the same
    // network), else through this rank's own.
    auto it = railIf_.find(ctx_.config.crossNic == 1 ? myRail_ : want);
    from = it != railIf_.end() ? &it->second.addr : &railIf_[myRail_].addr;
  }

  // " from eth1 (rail 1)": the local end of a connection, for logs and the straggler report.
  std::string localSide(int fd) {
    sockaddr_in a{};
    socklen_t len = sizeof a;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return "";
    for (auto& [r, itf] : railIf_)
      if (itf.addr.sin_addr.s_addr == a.sin_addr.s_addr) return " from " + itf.name + " (rail " + std::to_string(r) + ")";
    for (const Interface& itf : ifs_)
      if (itf.addr.sin_addr.s_addr == a.sin_addr.s_addr) return " from " + itf.name;
    return "";
  }

  SetupContext ctx_;
  std::map<int, Interface> railIf_;  // rail -> this host's interface on it
  int myRail_ = -1;
  std::set<int> warned_;
  std::vector<Interface> ifs_;
  int channels_ = 1;
  std::vector<std::unique_ptr<Listener>> listeners_;
  std::unique_ptr<Rendezvous> rv_;
  std::map<std::pair<int, int>, std::string> where_;  // (peer, slot) -> address dialed
};

class SocketTransport : public railcc::transport::Transport {
 public:
  std::string name() const override { return "socket"; }
  bool interHost() const override { return true; }
  std::unique_ptr<Setup> open(const SetupContext& ctx, std::string& whyNot) override {
    return std::make_unique<SocketSetup>(ctx);
  }
};

}  // namespace

sockaddr_in parseAddr(const std::string& s) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  auto colon = s.rfind(':');
  if (colon == std::string::npos || inet_pton(AF_INET, s.substr(0, colon).c_str(), &a.sin_addr) != 1)
    RAILCC_THROW(kInvalidUsage, "socket endpoint '", quoteBytes(s, 80), "' is not ip:port");
  long long port = 0;
  if (!parseInt(s.substr(colon + 1), 1, 65535, port))
    RAILCC_THROW(kInvalidUsage, "socket endpoint '", quoteBytes(s, 64), "' has port '", quoteBytes(s.substr(colon + 1), 16),
                 "', not a number from 1 to 65535");
  a.sin_port = htons(static_cast<uint16_t>(port));
  return a;
}

std::unique_ptr<railcc::transport::Transport> makeTransport() { return std::make_unique<SocketTransport>(); }

}  // namespace railcc::transport::socket
