// Set-up of the verbs transport: which ports serve this rank, the endpoint blob, and
// connecting queue pairs.
//
// The blob names only this rank's ports, and a pair's queue pairs are made when the pair
// first meets (at its first op, or at init for the pairs RAILCC_RUNTIME_CONNECT=0 has the
// engine connect then): each side makes its own (with its ring) and publishes it under a key
// of the pair (QPN, PSN, the ring's address and rkey), reads the peer's, moves its queue pair
// to RTR and RTS, and says so under a second key; it writes to the peer only once the peer has
// said so, so no write reaches a queue pair not yet ready to receive. A rank pins rings only
// for the peers its ops meet, and the blob's size does not grow with the job.

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "common/error.h"
#include "common/log.h"
#include "common/strings.h"
#include "transport/verbs/verbs_connection.h"

namespace railcc::transport::verbs {

// Every field comes from another process's store record: each is checked for its type and
// range, and a malformed blob is refused whole (never read past a field list, never thrown).
bool parseBlob(const std::string& s, Blob* b) {
  auto parts = split(s, ';');
  if (parts.empty() || parts[0] != "verbs1") return false;
  for (size_t i = 1; i < parts.size(); ++i) {
    auto f = split(parts[i], ',');
    if (f.empty()) return false;
    unsigned long long u[6] = {0};
    if (f[0] == "d" && f.size() == 6) {
      QpInfo d;
      d.dev = f[1];
      if (d.dev.empty() || !parseUint(f[2], 0xffff, u[0]) || !fromHex(f[3], d.gid, 16) || !parseUint(f[4], 5, u[1]) ||
          u[1] < 1 || (f[5] != "0" && f[5] != "1"))
        return false;
      d.lid = static_cast<uint16_t>(u[0]);
      d.mtu = static_cast<int>(u[1]);
      d.roce = f[5] == "1";
      b->devs.push_back(d);
    } else if (f[0] == "c" && f.size() == 10) {
      long long to = 0, lane = 0, ch = 0;
      if (!parseInt(f[1], 0, (1 << 30), to) || !parseInt(f[2], 0, 255, lane) || !parseInt(f[3], 0, 4095, ch) ||
          !parseUint(f[4], b->devs.empty() ? 0 : b->devs.size() - 1, u[0]) || b->devs.empty() ||
          !parseUint(f[5], 0xffffff, u[1]) || !parseUint(f[6], 0xffffff, u[2]) || !parseUint(f[7], ~0ull, u[3]) ||
          !parseUint(f[8], 0xffffffffull, u[4]) || !parseUint(f[9], 1ull << 40, u[5]) || u[5] == 0)
        return false;
      QpInfo q = b->devs[u[0]];
      q.qpn = static_cast<uint32_t>(u[1]);
      q.psn = static_cast<uint32_t>(u[2]);
      q.ringAddr = u[3];
      q.rkey = static_cast<uint32_t>(u[4]);
      q.ringBytes = u[5];
      b->conns[{static_cast<int>(to), static_cast<int>(lane), static_cast<int>(ch)}] = q;
    } else {
      return false;
    }
  }
  return true;
}

namespace {

using Key = std::tuple<int, int, int>;  // peer, lane, channel

std::string peerName(const PeerRecord& p) { return "rank " + std::to_string(p.rank) + " (host " + p.hostname + ")"; }

// What GPUDirect RDMA can use on a device, probed once per process and device; said once at
// INFO, with the decision for each GPU of this host and that device (the topology's path).
void logGdr(Device& d, const SetupContext& ctx) {
  static std::mutex mu;
  static std::map<std::string, std::pair<bool, bool>> caps;  // device -> (dma-buf, peermem)
  static std::set<std::string> said;
  std::lock_guard<std::mutex> g(mu);
  auto it = caps.find(d.name());
  if (it == caps.end()) {
    bool peermem = false;
    for (const char* f : {"/sys/kernel/mm/memory_peers/nv_mem/version", "/sys/kernel/mm/memory_peers/nv_mem_nc/version",
                          "/sys/module/nvidia_peermem/version"})
      peermem = peermem || access(f, F_OK) == 0;
    it = caps.emplace(d.name(), std::make_pair(d.dmabufSupported(), peermem)).first;
    auto [dmabuf, pm] = it->second;
    RAILCC_INFO(IB, "GPUDirect RDMA on ", d.name(), ": dma-buf ", dmabuf ? "supported" : "unsupported", ", nvidia_peermem ",
                pm ? "loaded" : "not loaded", dmabuf || pm ? "" : ": CUDA buffers between hosts are staged through host memory");
  }
  for (const GpuNicPath& p : ctx.gpuNics) {
    if (p.nic != d.name()) continue;
    GdrFacts f{p.gpu, p.nic, p.path, ctx.config.netGdrLevel, it->second.first, it->second.second};
    GdrDecision decision = decideGdr(f);
    if (said.insert(p.gpu + "|" + p.nic).second) RAILCC_INFO(IB, decision.line);
    // Every Device opened is told (one made after an earlier group's went away, too). "GPU <n>":
    // the topology names GPUs in CUDA's order (engine/placement.cpp).
    if (p.gpu.rfind("GPU ", 0) == 0) d.setGdr(std::atoi(p.gpu.c_str() + 4), decision.mode, it->second.second);
  }
}

class VerbsSetup : public Setup {
 public:
  VerbsSetup(const SetupContext& ctx, std::vector<std::shared_ptr<Device>> devs, std::string railWhy)
      : ctx_(ctx), devs_(std::move(devs)), railWhy_(std::move(railWhy)) {
    channels_ = static_cast<int>(devs_.size() * static_cast<size_t>(ctx_.config.ibQpsPerConn));
    ring_ = ringBytes(ctx_.config.buffSize);
    for (auto& d : devs_) logGdr(*d, ctx_);
  }

  int channels() const override { return channels_; }
  bool lazy() const override { return true; }

  std::string endpoint() override {
    std::string s = "verbs1";
    for (auto& d : devs_) s += ";" + devLine(*d);
    return s;  // queue pairs are made per pair when it first meets
  }

  std::string reach(const PeerRecord& peer) override {
    if (peer.endpoint.empty())  // read at the pair's first use, and checked then
      return std::string("RDMA ports here (") + devs_[0]->name() + (devs_[0]->roce() ? " RoCE" : " InfiniBand") + ")" +
             railWhy_;
    const Blob* theirs = portsOf(peer);
    if (!theirs) return "";
    return std::string("both have RDMA ports (") + devs_[0]->name() + (devs_[0]->roce() ? " RoCE" : " InfiniBand") +
           " <-> " + theirs->devs[0].dev + ")" + railWhy_;
  }

  void connect(const PeerRecord& peer, int lane, int channel) override { start(peer, lane, channel); }
  void accept(const PeerRecord& peer, int lane, int channel) override { start(peer, lane, channel); }

  bool progress(std::chrono::steady_clock::time_point, std::chrono::milliseconds) override {
    exchange();
    return false;  // connections at first use never end
  }

  bool ready(int peer, int lane, int channel) override { return done_.count({peer, lane, channel}) != 0; }
  int pollFds(std::vector<pollfd>&) override { return pending_.empty() ? 100 : 1; }  // the store has no fd

  std::unique_ptr<Connection> take(int peer, int lane, int channel) override {
    auto it = done_.find({peer, lane, channel});
    if (it == done_.end()) RAILCC_THROW(kInternal, "verbs: no connection to rank ", peer, " lane ", lane, " channel ", channel);
    std::unique_ptr<Connection> c = std::move(it->second);
    done_.erase(it);
    return c;
  }

  void finish() override { blobs_.clear(); }

 private:
  // A queue pair made at first use, until the peer's is known and then until the peer's is ready.
  struct Pending {
    std::unique_ptr<VerbsConnection> conn;
    bool connected = false;  // ours is in RTS, and said so
  };

  static std::string devLine(const Device& d) {
    return "d," + d.name() + ":" + std::to_string(d.port()) + "," + std::to_string(d.lid()) + "," + toHex(d.gid().raw, 16) +
           "," + std::to_string(d.mtu()) + "," + (d.roce() ? "1" : "0");
  }
  // Store keys of one direction of a pair's (lane, channel): the queue pair `from` made for
  // `to`, and `from` ready to receive on it.
  static std::string qpKey(int from, int to, int lane, int ch) {
    return "vq/" + std::to_string(from) + "/" + std::to_string(to) + "/" + std::to_string(lane) + "/" + std::to_string(ch);
  }
  static std::string readyKey(int from, int to, int lane, int ch) {
    return "vr/" + std::to_string(from) + "/" + std::to_string(to) + "/" + std::to_string(lane) + "/" + std::to_string(ch);
  }

  // At first use: the peer's ports (its endpoint, parsed once), where one can talk to ours;
  // else null (InfiniBand and Ethernet ports cannot talk, or the endpoint is malformed).
  // The group's completion queues on device `dev`: one channel (fd) per device, not per peer.
  std::shared_ptr<CqHub> hubFor(size_t dev) {
    if (hubs_.size() < devs_.size()) hubs_.resize(devs_.size());
    if (!hubs_[dev]) hubs_[dev] = std::make_shared<CqHub>(devs_[dev], VerbsConnection::completionsPerQp());
    return hubs_[dev];
  }

  const Blob* portsOf(const PeerRecord& peer) {
    auto it = blobs_.find(peer.rank);
    if (it != blobs_.end()) return &it->second;
    Blob b;
    if (!parseBlob(peer.endpoint, &b) || b.devs.empty() || b.devs[0].roce != devs_[0]->roce()) return nullptr;
    return &(blobs_[peer.rank] = std::move(b));
  }

  void start(const PeerRecord& peer, int lane, int ch) {
    if (!portsOf(peer)) {
      Error e(ErrorCode::kInvalidUsage, "verbs: " + peerName(peer) + " offers no RDMA port this rank's " +
                                            devs_[0]->name() + " can talk to (its endpoint: '" +
                                            peer.endpoint.substr(0, 200) + "')");
      e.ranks = {peer.rank};
      throw e;
    }
    const size_t dev = static_cast<size_t>(ch) % devs_.size();
    Pending p;
    p.conn = std::make_unique<VerbsConnection>(devs_[dev], ring_, ctx_.config, peerName(peer), hubFor(dev));
    const QpInfo q = p.conn->local();
    // A blob of one port and one queue pair, which parseBlob reads like a whole endpoint.
    ctx_.publish(qpKey(ctx_.rank, peer.rank, lane, ch),
                 "verbs1;" + devLine(*devs_[dev]) + ";c," + std::to_string(peer.rank) + "," + std::to_string(lane) + "," +
                     std::to_string(ch) + ",0," + std::to_string(q.qpn) + "," + std::to_string(q.psn) + "," +
                     std::to_string(q.ringAddr) + "," + std::to_string(q.rkey) + "," + std::to_string(q.ringBytes));
    pending_[{peer.rank, lane, ch}] = std::move(p);
  }

  // One store read per call (each waits a few milliseconds at most), for the pending pairs in
  // turn, so that one whose peer is busy elsewhere holds up no other: the peer's queue pair, or
  // its word that it is ready to receive.
  void exchange() {
    if (pending_.empty()) return;
    auto it = pending_.upper_bound(turn_);
    if (it == pending_.end()) it = pending_.begin();
    turn_ = it->first;
    auto [peer, lane, ch] = it->first;
    Pending& p = it->second;
    std::string v;
    if (!p.connected) {
      if (!ctx_.peek(qpKey(peer, ctx_.rank, lane, ch), v)) return;
      Blob b;
      auto q = b.conns.end();
      if (parseBlob(v, &b)) q = b.conns.find({ctx_.rank, lane, ch});
      if (q == b.conns.end()) {
        Error e(ErrorCode::kInvalidUsage, "verbs: rank " + std::to_string(peer) + "'s queue pair for lane " +
                                              std::to_string(lane) + " channel " + std::to_string(ch) +
                                              " in the store is malformed ('" + v.substr(0, 200) + "')");
        e.ranks = {peer};
        throw e;
      }
      try {
        p.conn->connectTo(q->second);
      } catch (Error& e) {
        e.ranks = {peer};
        throw;
      }
      ctx_.publish(readyKey(ctx_.rank, peer, lane, ch), "1");
      p.connected = true;
      return;
    }
    if (!ctx_.peek(readyKey(peer, ctx_.rank, lane, ch), v)) return;
    done_[it->first] = std::move(p.conn);
    pending_.erase(it);
    return;
  }

  SetupContext ctx_;
  std::vector<std::shared_ptr<Device>> devs_;
  std::vector<std::shared_ptr<CqHub>> hubs_;
  std::string railWhy_;
  int channels_ = 1;
  size_t ring_ = 0;
  std::map<Key, std::unique_ptr<VerbsConnection>> done_;
  std::map<int, Blob> blobs_;
  std::map<Key, Pending> pending_;
  Key turn_{-1, -1, -1};  // the pending pair read last
};

class VerbsTransport : public railcc::transport::Transport {
 public:
  std::string name() const override { return "verbs"; }
  bool interHost() const override { return true; }
  std::unique_ptr<Setup> open(const SetupContext& ctx, std::string& whyNot) override {
    if (ctx.config.ibDisable) {
      whyNot = "disabled by RAILCC_IB_DISABLE/NCCL_IB_DISABLE=1";
      return nullptr;
    }
    if (!ctx.publish || !ctx.peek) {  // a pair's queue pairs are exchanged through the group's store
      whyNot = "no store to exchange queue pairs through";
      return nullptr;
    }
    std::vector<std::shared_ptr<Device>> devs = openDevices(ctx.config, &whyNot);
    if (devs.empty()) return nullptr;
    // Rendezvous caches registrations under the owners the glue notes: from the first op on.
    if (ctx.config.ibRndvBytes > 0 && ctx.config.ibMrCacheBytes > 0)
      wantMemoryOwners(std::max<size_t>(static_cast<size_t>(ctx.config.ibRndvBytes), 4096));
    // With a topology, the rank's traffic stays on its rail: the port whose interface is the
    // rail's. Without one (or for InfiniBand ports, which have no interface), every port in turn.
    std::string railWhy;
    if (ctx.rail >= 0 && static_cast<size_t>(ctx.rail) < ctx.railIfs.size() && !ctx.railIfs[ctx.rail].empty()) {
      for (auto& d : devs)
        if (d->netdev() == ctx.railIfs[ctx.rail]) {
          devs = {d};
          railWhy = "; rail " + std::to_string(ctx.rail) + " on " + d->name();
          break;
        }
    }
    return std::make_unique<VerbsSetup>(ctx, std::move(devs), railWhy);
  }
};

}  // namespace

std::unique_ptr<railcc::transport::Transport> makeTransport() { return std::make_unique<VerbsTransport>(); }

}  // namespace railcc::transport::verbs
