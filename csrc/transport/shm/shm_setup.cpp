// The shared-memory transport's set-up: one segment per rank holding its incoming FIFOs and
// broadcast ring, published by name; peers on the same host map each other's, and the names
// are unlinked once every peer has mapped them (finish()).
#include <algorithm>
#include <map>
#include <set>

#include "common/log.h"
#include "transport/net.h"
#include "transport/shm/shm_transport.h"

namespace railcc::transport::shm {
namespace {

class ShmSetup : public Setup {
 public:
  explicit ShmSetup(const SetupContext& ctx) : ctx_(ctx) {
    domain_ = std::make_shared<Domain>(static_cast<int>(ctx.localRanks.size()) * ctx.lanes,
                                       static_cast<size_t>(ctx.config.buffSize));
  }

  std::string endpoint() override { return domain_->segmentName(); }

  std::string reach(const PeerRecord& peer) override {
    const auto& local = ctx_.localRanks;
    return std::find(local.begin(), local.end(), peer.rank) != local.end() ? "same host" : "";
  }

  void connect(const PeerRecord& peer, int lane, int channel) override { open(peer, lane); }
  void accept(const PeerRecord& peer, int lane, int channel) override { open(peer, lane); }
  bool progress(std::chrono::steady_clock::time_point, std::chrono::milliseconds) override { return true; }

  std::unique_ptr<Connection> take(int peer, int lane, int channel) override {
    return std::move(conns_.at({peer, lane}));
  }

  bool finishAfterPeers() const override { return true; }
  void finish() override {
    domain_->unlinkOwn();
    RAILCC_INFO(SHM, "shared memory: ", ctx_.localRanks.size(), " ranks on this host, FIFO of ",
                ctx_.config.buffSize, " bytes per peer, lane and direction");
  }

  std::shared_ptr<Domain> domain() const { return domain_; }

 private:
  int localIndex(int r) const {
    const auto& l = ctx_.localRanks;
    return static_cast<int>(std::find(l.begin(), l.end(), r) - l.begin());
  }
  void open(const PeerRecord& peer, int lane) {
    if (attached_.insert(peer.rank).second) domain_->attach(localIndex(peer.rank), peer.endpoint);
    bool samePidNs = peer.pidNs == ctx_.peers[static_cast<size_t>(ctx_.rank)].pidNs;
    conns_[{peer.rank, lane}] = domain_->connect(localIndex(ctx_.rank), localIndex(peer.rank), lane, ctx_.lanes, samePidNs);
  }

  SetupContext ctx_;
  std::shared_ptr<Domain> domain_;
  std::set<int> attached_;
  std::map<std::pair<int, int>, std::unique_ptr<Connection>> conns_;
};

class ShmTransport : public railcc::transport::Transport {
 public:
  std::string name() const override { return "shm"; }
  bool interHost() const override { return false; }
  std::unique_ptr<Setup> open(const SetupContext& ctx, std::string& whyNot) override {
    if (ctx.config.shmDisable) {
      whyNot = "RAILCC_SHM_DISABLE=1";
      return nullptr;
    }
    if (ctx.localRanks.size() < 2) {
      whyNot = "no other rank of the group on this host";
      return nullptr;
    }
    return std::make_unique<ShmSetup>(ctx);
  }
};

}  // namespace

std::unique_ptr<railcc::transport::Transport> makeTransport() { return std::make_unique<ShmTransport>(); }

std::shared_ptr<Domain> domainOf(Setup* setup) {
  auto* s = dynamic_cast<ShmSetup*>(setup);
  return s ? s->domain() : nullptr;
}

}  // namespace railcc::transport::shm
