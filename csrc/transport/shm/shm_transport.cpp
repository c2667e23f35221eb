// The shared-memory transport's set-up: one segment per rank holding its incoming FIFOs and
// broadcast ring, published by name; peers on the same host map each other's, and each name
// is unlinked once every peer has mapped it (Domain::releaseName, which the watchdog asks after
// set-up: no rank waits for that).
#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include "common/error.h"
#include "common/log.h"
#include "transport/transport.h"
#include "transport/shm/shm_segment.h"

namespace railcc::transport::shm {
namespace {

class ShmSetup : public Setup {
 public:
  explicit ShmSetup(const SetupContext& ctx) : ctx_(ctx) {
    domain_ = std::make_shared<Domain>(static_cast<int>(ctx.localRanks.size()) * ctx.lanes, fifoBytes(ctx),
                                       static_cast<size_t>(ctx.config.buffSize), ctx.config.cmaBytes != 0,
                                       static_cast<int>(ctx.localRanks.size()));
  }

  // The segment's name and the sizes it was laid out with, so that a peer with other sizes is
  // refused by rank before anything is mapped (every rank sees the mismatch, where a failed
  // attach would unlink the segment under a peer that has not mapped it yet).
  std::string endpoint() override {
    return domain_->segmentName() + " " + std::to_string(domain_->slots()) + " " + std::to_string(domain_->fifoBytes()) +
           " " + std::to_string(domain_->ringBytes());
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

  void finish() override {
    RAILCC_INFO(SHM, "shared memory: ", ctx_.localRanks.size(), " ranks on this host, FIFO of ", domain_->fifoBytes(),
                " bytes per peer, lane and direction, broadcast ring of ", ctx_.config.buffSize, " bytes");
  }

  std::shared_ptr<LocalDomain> localDomain() override { return domain_; }

 private:
  int localIndex(int r) const {
    const auto& l = ctx_.localRanks;
    return static_cast<int>(std::find(l.begin(), l.end(), r) - l.begin());
  }
  void open(const PeerRecord& peer, int lane) {
    bool samePidNs = peer.pidNs == ctx_.pidNs;
    if (attached_.insert(peer.rank).second) {
      std::istringstream is(peer.endpoint);
      std::string name;
      uint64_t slots = 0, fifo = 0, ring = 0;
      is >> name >> slots >> fifo >> ring;
      domain_->checkLayout("rank " + std::to_string(peer.rank), slots, fifo, ring);
      try {
        domain_->attach(localIndex(peer.rank), name, samePidNs);
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kPeerFailure) throw;
        // The peer's own failure is its to say (its init failure record): this one names it only.
        Error err(ErrorCode::kPeerFailure, "rank " + std::to_string(peer.rank) + " (pid " + std::to_string(peer.pid) + "): " + e.what());
        err.ranks = {peer.rank};
        throw err;
      }
    }
    conns_[{peer.rank, lane}] = domain_->connect(localIndex(ctx_.rank), localIndex(peer.rank), lane, ctx_.lanes, samePidNs);
  }

  // RAILCC_SHM_FIFO_BYTES, or RAILCC_BUFFSIZE. Not made smaller by default: a rank's writes walk
  // through the whole of every FIFO over a few ops, so 4 ranks' twelve 4 MiB FIFOs (48 MiB)
  // overflow a 32 MiB cache, and 1 MiB FIFOs sped up a 4-rank all-to-all on 2 cores in two A/B
  // sets of three (not in a third); but small FIFOs slowed the pipelined ops: 8 ranks on 2 cores,
  // reduce 1.2-3.5x slower with 256 KiB FIFOs, and 2 ranks with a core each 1.3-4.7x slower with
  // 256 KiB, up to 1.7x with 1 MiB (docs/history/).
  static size_t fifoBytes(const SetupContext& ctx) {
    int64_t set = ctx.config.shmFifoBytes;
    RAILCC_CHECK_ARG(set == 0 || set >= 4096, "RAILCC_SHM_FIFO_BYTES=", set, ": must be 0 (RAILCC_BUFFSIZE) or at least 4096");
    return static_cast<size_t>(set > 0 ? set : ctx.config.buffSize);
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

}  // namespace railcc::transport::shm
