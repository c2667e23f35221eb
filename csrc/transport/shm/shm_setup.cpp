// The shared-memory transport's set-up: one segment per rank holding its incoming FIFOs and
// broadcast ring, published by name; peers on the same host map each other's, and the names
// are unlinked once every peer has mapped them (finish()).
#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include "common/error.h"
#include "common/log.h"
#include "transport/copy.h"
#include "transport/net.h"
#include "transport/shm/shm_transport.h"

namespace railcc::transport::shm {
namespace {

class ShmSetup : public Setup {
 public:
  explicit ShmSetup(const SetupContext& ctx) : ctx_(ctx), fifoBytes_(fifoBytes(ctx)) {
    domain_ = std::make_shared<Domain>(static_cast<int>(ctx.localRanks.size()) * ctx.lanes, fifoBytes_,
                                       static_cast<size_t>(ctx.config.buffSize));
  }

  // The segment's name and the sizes it was laid out with, so that a peer with other sizes is
  // refused by name before anything is mapped.
  std::string endpoint() override {
    return domain_->segmentName() + " " + std::to_string(fifoBytes_) + " " + std::to_string(ctx_.config.buffSize);
  }

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
    RAILCC_INFO(SHM, "shared memory: ", ctx_.localRanks.size(), " ranks on this host, FIFO of ", fifoBytes_,
                " bytes per peer, lane and direction, broadcast ring of ", ctx_.config.buffSize, " bytes");
  }

  std::shared_ptr<Domain> domain() const { return domain_; }

 private:
  int localIndex(int r) const {
    const auto& l = ctx_.localRanks;
    return static_cast<int>(std::find(l.begin(), l.end(), r) - l.begin());
  }
  void open(const PeerRecord& peer, int lane) {
    if (attached_.insert(peer.rank).second) {
      std::istringstream is(peer.endpoint);
      std::string name;
      unsigned long long fifo = 0, ring = 0;
      is >> name >> fifo >> ring;
      RAILCC_CHECK_ARG(fifo == fifoBytes_ && ring == static_cast<unsigned long long>(ctx_.config.buffSize), "rank ",
                       peer.rank, " set up shared memory with FIFOs of ", fifo, " bytes and a broadcast ring of ", ring,
                       ", rank ", ctx_.rank, " with ", fifoBytes_, " and ", ctx_.config.buffSize,
                       ": RAILCC_BUFFSIZE and RAILCC_SHM_FIFO_BYTES must be equal on every rank of a host");
      domain_->attach(localIndex(peer.rank), name);
    }
    bool samePidNs = peer.pidNs == ctx_.peers[static_cast<size_t>(ctx_.rank)].pidNs;
    conns_[{peer.rank, lane}] = domain_->connect(localIndex(ctx_.rank), localIndex(peer.rank), lane, ctx_.lanes, samePidNs);
  }

  // RAILCC_SHM_FIFO_BYTES, or by default RAILCC_BUFFSIZE down to what keeps the FIFOs that the
  // host's collectives write (n x (n-1) for n ranks, on one lane) within half the last-level
  // cache. Each op's data goes on where the last one stopped, so over a few ops a rank's
  // writes walk through all of every FIFO: with 4 ranks, 12 FIFOs of 4 MiB are 48 MiB, and
  // a 32 MiB cache misses on every piece. Never below 256 KiB (one piece, kPiece).
  static size_t fifoBytes(const SetupContext& ctx) {
    int64_t set = ctx.config.shmFifoBytes;
    RAILCC_CHECK_ARG(set == 0 || set >= 4096, "RAILCC_SHM_FIFO_BYTES=", set, ": must be 0 (sized by railcc) or at least 4096");
    if (set > 0) return static_cast<size_t>(set);
    size_t buff = static_cast<size_t>(ctx.config.buffSize), n = ctx.localRanks.size();
    size_t fit = lastLevelCacheBytes() / 2 / std::max<size_t>(n * (n - 1), 1);
    size_t p = size_t(256) << 10;
    while (p * 2 <= fit) p *= 2;
    return std::min(buff, p);
  }

  SetupContext ctx_;
  size_t fifoBytes_;
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
