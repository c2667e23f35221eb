// The socket transport's set-up: listeners on the chosen interfaces, the authenticated
// rendezvous, and one TCP connection per (peer, lane, channel), channel c bound to interface
// c of RAILCC_SOCKET_IFNAME in turn (a rail each).
#include <arpa/inet.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "common/error.h"
#include "common/log.h"
#include "transport/net.h"
#include "transport/socket/rendezvous.h"
#include "transport/socket/socket_transport.h"

namespace railcc::transport::socket {
namespace {

constexpr int kMaxChannels = 64;  // slot = lane * kMaxChannels + channel in the handshake

sockaddr_in parseAddr(const std::string& s) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  auto colon = s.rfind(':');
  if (colon == std::string::npos || inet_pton(AF_INET, s.substr(0, colon).c_str(), &a.sin_addr) != 1)
    RAILCC_THROW(kInvalidUsage, "socket endpoint '", s, "' is not ip:port");
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(s.substr(colon + 1))));
  return a;
}

std::vector<std::string> splitList(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream is(s);
  while (std::getline(is, cur, ',')) out.push_back(cur);
  return out;
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
  }

  std::string endpoint() override {
    // Only a rank that some peer on another host dials (a lower rank) listens, and only until
    // set-up is done.
    const auto& local = ctx_.localRanks;
    bool dialed = false;
    for (int r = 0; r < ctx_.rank; ++r) dialed = dialed || std::find(local.begin(), local.end(), r) == local.end();
    if (!dialed) return "-";
    std::string blob, names;
    size_t nl = std::min(ifs_.size(), static_cast<size_t>(channels_));
    for (size_t i = 0; i < nl; ++i) {
      listeners_.push_back(std::make_unique<Listener>(ifs_[i].addr));
      blob += (i ? "," : "") + formatAddr(listeners_.back()->addr());
      names += (i ? ", " : "") + ifs_[i].name + " " + formatAddr(listeners_.back()->addr());
    }
    RAILCC_INFO(INIT, "listening on ", names, " until the peers on other hosts have connected");
    return blob;
  }

  int channels() const override { return channels_; }

  std::string reach(const PeerRecord& peer) override {
    std::string why = "TCP over " + ifs_[0].name;
    for (size_t i = 1; i < std::min(ifs_.size(), static_cast<size_t>(channels_)); ++i) why += "+" + ifs_[i].name;
    return why;
  }

  void connect(const PeerRecord& peer, int lane, int channel) override {
    auto addrs = splitList(peer.endpoint);
    if (addrs.empty() || addrs[0] == "-")
      RAILCC_THROW(kInternal, "rank ", peer.rank, " published no TCP listener, yet rank ", ctx_.rank, " must dial it");
    const std::string& to = addrs[static_cast<size_t>(channel) % addrs.size()];
    // Several interfaces: leave through this channel's own, so each rail carries its share.
    const sockaddr_in* from = ifs_.size() > 1 ? &ifs_[static_cast<size_t>(channel) % ifs_.size()].addr : nullptr;
    rv().dial(peer.rank, lane * kMaxChannels + channel, parseAddr(to), from);
    where_[{peer.rank, lane * kMaxChannels + channel}] = to;
  }

  void accept(const PeerRecord& peer, int lane, int channel) override {
    rv().expect(peer.rank, lane * kMaxChannels + channel);
  }

  void idle(std::chrono::milliseconds budget) override {
    if (listeners_.empty()) return;
    rv().keepOpen(true);
    rv_->step(std::chrono::steady_clock::now() + std::chrono::hours(1), budget);
  }

  bool progress(std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds budget) override {
    if (!rv_) return true;
    rv_->keepOpen(false);
    return rv_->step(deadline, budget);
  }

  std::unique_ptr<Connection> take(int peer, int lane, int channel) override {
    int slot = lane * kMaxChannels + channel;
    auto it = where_.find({peer, slot});
    std::string where = it != where_.end() ? it->second : rv_->remoteAddress(peer, slot);
    return makeConnection(rv_->take(peer, slot), where, static_cast<size_t>(ctx_.config.stagingSize));
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

  SetupContext ctx_;
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

std::unique_ptr<railcc::transport::Transport> makeTransport() { return std::make_unique<SocketTransport>(); }

}  // namespace railcc::transport::socket
