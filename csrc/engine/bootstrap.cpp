#include "engine/comm_impl.h"

#include "transport/socket/auth.h"
#include "transport/socket/rendezvous.h"
#include "transport/socket/socket_transport.h"

namespace railcc::engine {

std::string hostIdentity(const Config& cfg) {
  if (!cfg.hostId.empty()) return cfg.hostId;
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  struct stat st {};
  unsigned long long netns = 0;
  if (stat("/proc/self/ns/net", &st) == 0) netns = static_cast<unsigned long long>(st.st_ino);
  return boot + ":" + std::to_string(netns);
}

// ---------------------------------------------------------------------------------------
// Bootstrap

namespace {

// The pid namespace of this process ("pid:[4026531836]"): pids mean something only within one.
std::string pidNamespace() {
  char buf[64] = {0};
  ssize_t n = readlink("/proc/self/ns/pid", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "unknown";
}


sockaddr_in parseAddr(const std::string& s) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  auto colon = s.rfind(':');
  inet_pton(AF_INET, s.substr(0, colon).c_str(), &a.sin_addr);
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(s.substr(colon + 1))));
  return a;
}

}  // namespace

CommImpl::CommImpl(Store& store, CommOptions opts)
    : opts_(std::move(opts)), store_(&store), rank_(opts_.rank), size_(opts_.size) {
  RAILCC_CHECK_ARG(size_ >= 1, "world size must be >= 1, got ", size_);
  RAILCC_CHECK_ARG(rank_ >= 0 && rank_ < size_, "rank ", rank_, " is out of range for world size ", size_);
  log::setThreadRank(rank_);
  wakeFd_.fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  RAILCC_SYSCHECK(wakeFd_.fd, "eventfd");
  userPool_ = std::make_shared<CallbackPool>(rank_);
  wd_ = std::make_shared<WatchdogShared>();
  wd_->keep = opts_.storeKeepAlive;
  wd_->store = store_;
  tele_ = std::make_unique<Telemetry>(rank_, size_, static_cast<size_t>(std::max<int64_t>(opts_.config.traceSize, 1)),
                                      static_cast<size_t>(std::max<int64_t>(opts_.config.stragglerWindow, 1)));
  arrivals_.assign(static_cast<size_t>(size_), 0);
  lagFlagged_.assign(static_cast<size_t>(size_), false);
  try {
    bootstrap(store);
  } catch (const Error&) {
    std::rethrow_exception(globalized(std::current_exception()));
  }
  hostname_ = peers_[static_cast<size_t>(rank_)].hostname;
  streamMin_ = std::max<size_t>(transport::lastLevelCacheBytes() / localRanks_.size(), size_t(1) << 20);
  for (const PeerInfo& p : peers_) shmPeer_.push_back(p.transport == "shm");
  // A first progress record now, so that a rank frozen before the watchdog's first beat is
  // still told apart from one that never published anything.
  if (size_ > 1 && opts_.config.progressIntervalMs > 0) store.set("progress/" + std::to_string(rank_), progressRecord());
  lastProgress_ = lastAliveCheck_ = Clock::now();
  thread_ = std::thread([this] { progressLoop(); });
  if (size_ > 1) watchdog_ = std::thread([this, w = wd_] { watchdogLoop(w); });
}

CommImpl::~CommImpl() { shutdown(); }

void CommImpl::connectRemote(Store& store, const std::vector<int>& remote, const std::string& secretHex,
                             Clock::time_point deadline, const GetFrom& getFrom) {
  const Config& cfg = opts_.config;
  std::vector<uint8_t> secret;
  for (size_t i = 0; i + 1 < secretHex.size(); i += 2)
    secret.push_back(static_cast<uint8_t>(std::stoi(secretHex.substr(i, 2), nullptr, 16)));
  PeerInfo& self = peers_[static_cast<size_t>(rank_)];
  self.addr = "-";  // until some peer dials us
  std::unique_ptr<transport::socket::Listener> listener;  // closed when set-up is done
  if (std::any_of(remote.begin(), remote.end(), [&](int r) { return r < rank_; })) {
    sockaddr_in bindAddr{};
    std::string ifname = transport::socket::pickInterface(cfg.socketIfname, bindAddr);
    listener = std::make_unique<transport::socket::Listener>(bindAddr);
    self.addr = transport::socket::formatAddr(listener->addr());
    RAILCC_INFO(INIT, "listening on ", ifname, " ", self.addr, " until the peers on other hosts have connected");
    store.set("addr/" + std::to_string(rank_), self.addr);
  }
  transport::socket::Rendezvous rv(secret, rank_, listener.get());
  for (int r : remote) {
    PeerInfo& p = peers_[static_cast<size_t>(r)];
    if (r > rank_) p.addr = getFrom("addr/" + std::to_string(r), r, "TCP address");
    for (int lane = 0; lane < kLanes; ++lane) {
      if (r > rank_) rv.dial(r, lane, parseAddr(p.addr));
      else rv.expect(r, lane);
    }
  }
  try {
    rv.run(deadline);
  } catch (const Error& e) {
    Error err(e.code(), "railcc init of group '" + opts_.name + "': " + e.what());
    err.ranks = e.ranks;
    for (int r : e.ranks) err.hosts.push_back(peers_[static_cast<size_t>(r)].hostname);
    throw err;
  }
  for (int r : remote) {
    std::string where = r > rank_ ? peers_[static_cast<size_t>(r)].addr : rv.remoteAddress(r, 0);
    for (int lane = 0; lane < kLanes; ++lane)
      chans_[lane][static_cast<size_t>(r)].conn =
          transport::socket::makeConnection(rv.take(r, lane), where, static_cast<size_t>(cfg.stagingSize));
    peers_[static_cast<size_t>(r)].transport = "socket " + where;
  }
}

void CommImpl::bootstrap(Store& store) {
  const Config& cfg = opts_.config;
  auto t0 = Clock::now();
  Millis initTimeout(cfg.initTimeoutSec * 1000);
  auto deadline = t0 + initTimeout;
  auto left = [&] { return std::max(Millis(1), std::chrono::duration_cast<Millis>(deadline - Clock::now())); };
  const std::string hostId = hostIdentity(cfg);
  // Waits in slices; between them, a same-host rank whose process has exited fails init at
  // once instead of after RAILCC_INIT_TIMEOUT.
  auto waitKey = [&](const std::string& key) {
    while (true) {
      try {
        return store.get(key, std::min(left(), Millis(1000)));
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kTimeout || Clock::now() >= deadline) throw;
      }
      for (const PeerInfo& p : peers_) {
        // Only peers we will share memory with, and only in our pid namespace: a pid of another
        // namespace names some other process here, or none.
        if (cfg.shmDisable || p.pid <= 0 || p.rank == rank_ || p.hostId != hostId || p.pidNs != pidNamespace() ||
            !transport::shm::processGone(p.pid))
          continue;
        Error err(ErrorCode::kPeerFailure, "railcc init of group '" + opts_.name + "': " + rankName(p.rank) +
                                               " (host " + p.hostname + ", pid " + std::to_string(p.pid) +
                                               ") exited during init");
        err.ranks = {p.rank};
        err.hosts = {p.hostname};
        throw err;
      }
    }
  };
  GetFrom getFrom = [&](const std::string& key, int r, const char* what) {
    try {
      return waitKey(key);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kPeerFailure) throw;
      Error err(e.code() == ErrorCode::kTimeout ? ErrorCode::kTimeout : e.code(),
                "railcc init of group '" + opts_.name + "': " + rankName(r) + " did not publish its " +
                    what + " within RAILCC_INIT_TIMEOUT=" + std::to_string(cfg.initTimeoutSec) +
                    " s; it never reached init_process_group or died during it (" + e.what() + ")");
      err.ranks = {r};
      throw err;
    }
  };

  // The group secret, shared through the store (which every member trusts, as in c10d): each
  // TCP connection proves it holds it by challenge-response before we read into a buffer.
  std::string secret;
  if (rank_ == 0) {
    secret = transport::socket::randomHex(32);
    store.set("secret", secret);
  } else {
    secret = getFrom("secret", 0, "group secret");
  }

  peers_.resize(static_cast<size_t>(size_));
  char hn[256] = {0};
  gethostname(hn, sizeof(hn) - 1);
  const std::string pidNs = pidNamespace();
  const std::string me = hostId + "|" + hn + "|" + std::to_string(getpid()) + "|" + pidNs;
  store.set("peer/" + std::to_string(rank_), me);
  for (int r = 0; r < size_; ++r) {
    std::string v = r == rank_ ? me : getFrom("peer/" + std::to_string(r), r, "host identity");
    auto f = split(v, '|');
    RAILCC_CHECK_EQ(f.size(), size_t(4));
    PeerInfo& p = peers_[static_cast<size_t>(r)];
    p.rank = r;
    p.hostId = f[0];
    p.hostname = f[1];
    p.pid = std::stoi(f[2]);
    p.pidNs = f[3];
    p.addr = "-";  // set for the peers that listen, in connectRemote
  }
  for (int r = 0; r < size_; ++r)
    if (peers_[static_cast<size_t>(r)].hostId == hostId && !cfg.shmDisable) localRanks_.push_back(r);
  if (localRanks_.empty()) localRanks_.push_back(rank_);
  if (localRanks_.size() > 1 && static_cast<int>(localRanks_.size()) < size_) {
    std::vector<std::string> order;  // hosts by their lowest rank
    std::map<std::string, std::vector<int>> byHost;
    for (int r = 0; r < size_; ++r) {
      const std::string& h = peers_[static_cast<size_t>(r)].hostId;
      if (byHost[h].empty()) order.push_back(h);
      byHost[h].push_back(r);
    }
    bool even = true;
    for (auto& [h, ranks] : byHost) even = even && ranks.size() == localRanks_.size();
    if (even)
      for (const std::string& h : order) rail_.push_back(byHost[h][static_cast<size_t>(localIndex(rank_))]);
  }
  if (opts_.config.spinUs < 0) RAILCC_THROW(kInvalidUsage, "RAILCC_SPIN_US must be 0 or more, got ", opts_.config.spinUs);

  chans_.resize(kLanes);
  for (auto& lane : chans_) lane = std::vector<Channel>(static_cast<size_t>(size_));

  // Same host: shared memory. Each rank creates one segment holding its incoming FIFOs and
  // maps its neighbours'; names are unlinked as soon as everyone has mapped them.
  if (localRanks_.size() > 1) {
    size_t slot = static_cast<size_t>(cfg.buffSize);
    shm_ = std::make_unique<transport::shm::Domain>(static_cast<int>(localRanks_.size()) * kLanes, slot);
    store.set("shm/" + std::to_string(rank_), shm_->segmentName());
    for (int r : localRanks_)
      if (r != rank_) shm_->attach(localIndex(r), getFrom("shm/" + std::to_string(r), r, "shared-memory segment"));
    store.set("shmok/" + std::to_string(rank_), "1");
    for (int r : localRanks_)
      if (r != rank_) getFrom("shmok/" + std::to_string(r), r, "shared-memory mapping");
    shm_->unlinkOwn();
    for (int r : localRanks_) {
      if (r == rank_) continue;
      for (int lane = 0; lane < kLanes; ++lane)
        chans_[lane][static_cast<size_t>(r)].conn = shm_->connect(localIndex(rank_), localIndex(r), lane, kLanes,
                                                                   peers_[static_cast<size_t>(r)].pidNs == pidNs);
      peers_[static_cast<size_t>(r)].transport = "shm";
    }
    RAILCC_INFO(SHM, "shared memory: ", localRanks_.size(), " ranks on this host, FIFO of ", slot,
                " bytes per peer, lane and direction");
  }

  // Other hosts: TCP. The lower rank dials, the higher accepts; only a rank that some peer
  // dials listens, and only until set-up is done.
  std::vector<int> remote;
  for (int r = 0; r < size_; ++r)
    if (r != rank_ && !chans_[0][static_cast<size_t>(r)].conn) remote.push_back(r);
  if (!remote.empty()) connectRemote(store, remote, secret, deadline, getFrom);
  if (!remote.empty())
    RAILCC_WARN(NET, "TCP sockets serve ", remote.size(), " peer(s)", cfg.shmDisable ? " (RAILCC_SHM_DISABLE=1)" : "",
                "; there is no RDMA transport in this build");

  for (int r = 0; r < size_; ++r)
    if (r != rank_)
      RAILCC_INFO(INIT, "rank ", rank_, " -> peer ", r, " (", peers_[static_cast<size_t>(r)].hostname, ") via ",
                  peers_[static_cast<size_t>(r)].transport);
  RAILCC_INFO(INIT, "group '", opts_.name, "' rank ", rank_, "/", size_, " ready in ",
              std::chrono::duration_cast<Millis>(Clock::now() - t0).count(), " ms");
}

}  // namespace railcc::engine
