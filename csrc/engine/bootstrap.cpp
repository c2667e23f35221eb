#include "common/log.h"
#include "engine/comm_impl.h"

#include <sched.h>

#include "common/crypto.h"
#include "common/strings.h"
#include "common/waits.h"
#include "engine/choice_settings.h"
#include "engine/records.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// Bootstrap

namespace {

// opts.rank, once the world size and the rank are checked (before any member uses them).
int checkedRank(const CommOptions& o) {
  RAILCC_CHECK_ARG(o.size >= 1, "world size must be >= 1, got ", o.size);
  RAILCC_CHECK_ARG(o.rank >= 0 && o.rank < o.size, "rank ", o.rank, " is out of range for world size ", o.size);
  return o.rank;
}

// The options with the group's timeout kept within what the clock can add (common/waits.h).
CommOptions withBoundedWait(CommOptions o) {
  RAILCC_CHECK_ARG(o.timeout.count() > 0, "group '", o.name, "': a timeout of ", o.timeout.count(),
                   " ms; give a positive one");
  o.timeout = boundedWait(o.timeout);
  return o;
}

}  // namespace

CommImpl::CommImpl(Store& store, CommOptions opts)
    : opts_(withBoundedWait(std::move(opts))),
      store_(&store),
      rank_(checkedRank(opts_)),
      size_(opts_.size),
      tele_(std::make_unique<Telemetry>(rank_, size_, static_cast<size_t>(std::max<int64_t>(opts_.config.traceSize, 1)),
                                        static_cast<size_t>(std::max<int64_t>(opts_.config.stragglerWindow, 1)))),
      ch_(*this, opts_.config, *tele_, rank_, size_) {
  log::setThreadRank(rank_);
  userPool_ = std::make_shared<CallbackPool>(rank_);
  try {
    bootstrap(store);
  } catch (const Error& e) {
    publishInitFailure(store, e);
    std::rethrow_exception(globalized(std::current_exception()));
  }
  hostname_ = peers_[static_cast<size_t>(rank_)].hostname;
  // Spinning in place only pays where no rank of this host waits for our core; there it
  // lasts the whole spin window, since a yield would hand the core to any other busy process
  // (a data loader beside a rank) for the rest of its time slice. busyFor() still yields where
  // the scheduler has put the peer on our CPU.
  std::vector<bool> shm;
  for (const PeerInfo& p : peers_) shm.push_back(p.transport == "shm");
  const bool hostAllShm =
      std::all_of(localRanks_.begin(), localRanks_.end(), [&](int r) { return r == rank_ || shm[static_cast<size_t>(r)]; });
  ch_.setShmPeers(std::move(shm), localRanks_,
                  std::max<size_t>(transport::lastLevelCacheBytes() / localRanks_.size(), size_t(1) << 20),
                  hostSharesCores_ ? 0 : opts_.config.spinUs, cmaBytesFor(opts_.config.cmaBytes, hostSharesCores_));
  place_.size = size_;
  place_.localRanks = static_cast<int>(localRanks_.size());
  place_.shmRings = algos_.shmRingsCover();
  place_.shmRingSlices = place_.shmRings && algos_.shmRingSlice() > 0;
  place_.hostsEven = !rail_.empty();
  place_.oneshotBytes = opts_.config.oneshotBytes;
  // The rule counts on single copy only where this rank reads every peer of its host (each
  // rank's own tries at connect: the kernel's policy and the pid namespaces are the host's, so
  // its ranks agree; a container's seccomp refusing process_vm_readv keeps the rings).
  const bool readsHost = std::all_of(localRanks_.begin(), localRanks_.end(), [&](int r) {
    const auto& conn = ch_.chan(kCollLane, r).conn;
    return r == rank_ || (conn && conn->readsPeer());
  });
  place_.cmaBytes = readsHost ? cmaBytesFor(opts_.config.cmaBytes, hostSharesCores_) : 0;
  place_.cudaIpc = opts_.config.cudaIpc && size_ > 1 && static_cast<int>(localRanks_.size()) == size_;
  std::string ignored;
  prefer_ = parseAlgos(opts_.config.algo, &ignored);
  if (!ignored.empty()) RAILCC_INFO(COLL, "RAILCC_ALGO/NCCL_ALGO: railcc has no ", ignored, " algorithm; the rule decides instead");
  if (rank_ == 0) RAILCC_INFO(COLL, "group '", opts_.name, "' algorithms: ", describeRule(place_, prefer_));
  if (size_ > 1 && !opts_.config.runtimeConnect) {
    try {
      connectAtInit(Clock::now() + Millis(opts_.config.initTimeoutSec * 1000));
    } catch (const Error& e) {
      publishInitFailure(store, e);
      std::rethrow_exception(globalized(std::current_exception()));
    }
  }
  watchdog_.start();  // its first progress record goes out now
  q_.thread = std::thread([this] { progressLoop(); });
  enlist();
  algos_.ringOrder();  // worked out now, once: read from any thread from here on (time estimates)
  // Set-up succeeded: should the group end before every rank of the host mapped its shared
  // memory, the name waits for them (not where one reaches this rank otherwise: it never will).
  if (ch_.local() && hostAllShm) ch_.local()->keepNameForPeers();
}

CommImpl::~CommImpl() { shutdown(); }

void CommImpl::bootstrap(Store& store) {
  const Config& cfg = opts_.config;
  auto t0 = Clock::now();
  Millis initTimeout(cfg.initTimeoutSec * 1000);
  auto deadline = t0 + initTimeout;
  auto left = [&] { return std::max(Millis(1), std::chrono::duration_cast<Millis>(deadline - Clock::now())); };
  const std::string hostId = hostIdentity(cfg);
  // Waits in slices; between them, a same-host rank whose process has exited fails init at
  // once instead of after RAILCC_INIT_TIMEOUT.
  // `from`: the rank whose keys these are, or -1 for every rank's.
  auto waitKeys = [&](const std::vector<std::string>& keys, int from) {
    while (true) {
      try {
        return store.getAll(keys, std::min(left(), Millis(pump_ ? 20 : 1000)));
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kTimeout || Clock::now() >= deadline) throw;
      }
      if (pump_) pump_();
      // A peer that failed its own set-up says why; another group of ours may have seen a
      // rank we wait for die. Either ends the wait now rather than at RAILCC_INIT_TIMEOUT.
      checkPeerInitFailure(store);
      for (int r = from < 0 ? 0 : from; r < (from < 0 ? size_ : from + 1); ++r) {
        if (r == rank_) continue;
        std::string seen = seenDeadElsewhere(globalRank(r));
        if (seen.empty()) seen = goneElsewhere(globalRank(r));  // e.g. a shrink's survivor that died after the views agreed
        if (!seen.empty()) {
          Error err(ErrorCode::kPeerFailure, "railcc init of group '" + opts_.name + "': " + rankName(r) +
                                                 " is dead, as " + seen);
          err.ranks = {r};
          err.ranksDead = true;
          health_.initFailSeen = true;
          throw err;
        }
      }
      for (const PeerInfo& p : peers_) {
        // Only peers we will share memory with, and only in our pid namespace: a pid of another
        // namespace names some other process here, or none.
        if (cfg.shmDisable || p.pid <= 0 || p.rank == rank_ || p.hostId != hostId || p.pidNs != pidNamespace() ||
            !transport::processGone(p.pid))
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
      return waitKeys({key}, r).front();
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kPeerFailure) throw;
      Error err(e.code() == ErrorCode::kTimeout ? ErrorCode::kTimeout : e.code(),
                "railcc init of group '" + opts_.name + "': " + rankName(r) + " did not publish its " +
                    what + " within RAILCC_INIT_TIMEOUT=" + std::to_string(cfg.initTimeoutSec) +
                    " s; it never reached init_process_group or died during it (store key '" + key + "' still unset after " +
                    std::to_string(std::chrono::duration_cast<Millis>(Clock::now() - t0).count() / 1000.0).substr(0, 6) + " s)");
      err.ranks = {r};
      throw err;
    }
  };
  // `prefix<r>` of each of `ranks`, in one batched read once all are there: O(1) store calls
  // per rank, not a wait per peer. A wait that runs out names the first rank whose key is missing.
  GetAll getAll = [&](const std::string& prefix, const std::vector<int>& ranks, const char* what) {
    std::vector<std::string> keys;
    keys.reserve(ranks.size());
    for (int r : ranks) keys.push_back(prefix + std::to_string(r));
    try {
      return waitKeys(keys, ranks.size() == 1 ? ranks.front() : -1);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kTimeout) throw;
      for (int r : ranks) getFrom(prefix + std::to_string(r), r, what);  // throws for the first one missing
      throw;
    }
  };
  // The group secret, shared through the store (which every member trusts, as in c10d): each
  // TCP connection proves it holds it by challenge-response before we read into a buffer.
  // Rank 0 sets it before its placement record; the others read it once they have that, so it
  // costs no wait of its own (a wait is a level of store asks: see records.h).
  std::string secret;
  // Rank 0's algorithm settings ride along with it: every rank compares its own with them.
  const std::string settings = choiceSettingsRecord(cfg);
  if (rank_ == 0) {
    secret = randomHex(32);
    store.set("secret", secret + settings);
  }

  auto since = [](Clock::time_point t) { return std::chrono::duration_cast<Millis>(Clock::now() - t).count(); };
  const long long cpu0 = processCpuMicros();
  const Clock::time_point tPeers = Clock::now();  // then the topology, then the connections
  peers_.resize(static_cast<size_t>(size_));
  char hn[256] = {0};
  gethostname(hn, sizeof(hn) - 1);
  const std::string pidNs = pidNamespace();
  const std::string me = hostId + "|" + hn + "|" + std::to_string(getpid()) + "|" + pidNs + "|" + affinityHex();
  store.set("peer/" + std::to_string(rank_), me);  // read by the ranks of this host only
  // Every rank's host, combined in groups by whichever rank completes each (records.h): a rank
  // waits only for the whole.
  auto partName = [&](int level, int index) {
    const auto [first, last] = gatherSpan(size_, level, index);
    return "railcc init of group '" + opts_.name + "': " +
           (level == 0 ? rankName(index) : "the host map of ranks " + std::to_string(first) + "-" + std::to_string(last));
  };
  HostMap placed = HostMap::one(hostId, hn);
  // A wait that runs out names a rank that never came (each publishes peer/ first), else a part
  // whose merge never came.
  auto wholeMap = [&]() {
    try {
      return waitKeys({"hosts"}, -1).front();  // any rank may be the one holding the gather up: watch all
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kTimeout) throw;
      for (int r = 0; r < size_; ++r)
        if (r != rank_) getFrom("peer/" + std::to_string(r), r, "host identity");
      throwMissingPart(store, size_, cfg.initTimeoutSec, partName);
      throw;
    }
  };
  const bool whole = size_ > 1 && combineHostMap(store, rank_, size_, placed, left(), opts_.name, partName);
  discoverEarly();  // the topology, while the placement gathers (placement.cpp)
  if (size_ > 1 && !whole) placed = HostMap::decode(wholeMap(), "railcc init of group '" + opts_.name + "': the host map", size_);
  if (rank_ != 0) {
    secret = getFrom("secret", 0, "group secret");
    const size_t cut = std::min(secret.find('\n'), secret.size());
    checkSettingsAlike(settings, secret.substr(cut), "railcc init of group '" + opts_.name + "': ", rankName(rank_),
                       rankName(0));
    secret.resize(cut);
  }
  const std::vector<int> hostOf = placed.hostOfRank();
  if (static_cast<int>(hostOf.size()) != size_ || placed.hosts[static_cast<size_t>(hostOf[static_cast<size_t>(rank_)])].id != hostId)
    RAILCC_THROW(kInvalidUsage, "railcc init of group '", opts_.name, "': the host map in the store names ", hostOf.size(),
                 " ranks for a group of ", size_, " or another host for this rank (", hostId,
                 "): another job or group is using the same store prefix?");
  std::vector<int> sameHost;  // the others on this host: their full records
  for (int r = 0; r < size_; ++r) {
    PeerInfo& p = peers_[static_cast<size_t>(r)];
    const HostMap::Host& h = placed.hosts[static_cast<size_t>(hostOf[static_cast<size_t>(r)])];
    p.rank = r;
    p.hostId = h.id;
    p.hostname = h.name;
    p.addr = "-";  // the inter-host endpoint, set in connectPeers
    if (r != rank_ && h.id == hostId) sameHost.push_back(r);
  }
  std::vector<std::string> records = getAll("peer/", sameHost, "host record"), cpus;
  records.push_back(me);
  sameHost.push_back(rank_);
  for (size_t i = 0; i < sameHost.size(); ++i) {
    const int r = sameHost[i];
    auto f = parsePeerRecord(records[i], "railcc init of group '" + opts_.name + "': " + rankName(r));
    PeerInfo& p = peers_[static_cast<size_t>(r)];
    if (f[0] != p.hostId)
      RAILCC_THROW(kInvalidUsage, "railcc init of group '", opts_.name, "': ", rankName(r), "'s host record names host ",
                   f[0], " where the placement says ", p.hostId, ": a store record written by something other than railcc?");
    cpus.push_back(f[4]);
    p.pid = std::atoi(f[2].c_str());  // checked by parsePeerRecord
    p.pidNs = f[3];
  }
  // Of other hosts' ranks only the host is known here (their pid, in a failure message, is read
  // then). Whether cores are shared matters to the rule only where one host holds every rank.
  hostSharesCores_ = ranksOutnumberCpus(cpus);
  // Hosts of one name are one machine whose host ids were set apart (RAILCC_HOST_ID: a test
  // bed, or containers of one node): their ranks share its cores too, and must not spin.
  int machineRanks = 0;
  for (int r = 0; r < size_; ++r) machineRanks += peers_[static_cast<size_t>(r)].hostname == hn;
  cpu_set_t mine;
  const int myCpus = sched_getaffinity(0, sizeof(mine), &mine) == 0 ? CPU_COUNT(&mine) : 0;
  if (!hostSharesCores_ && myCpus > 0 && machineRanks > myCpus && machineRanks > static_cast<int>(sameHost.size())) {
    hostSharesCores_ = true;
    RAILCC_INFO(INIT, "group '", opts_.name, "': ", machineRanks, " ranks are on hosts named ", hn,
                " (other host ids, one machine) with ", myCpus, " CPUs for this one: waits yield rather than spin");
  }
  place_.sharedCores = hostSharesCores_ && static_cast<int>(sameHost.size()) == size_;
  for (int r = 0; r < size_; ++r)
    if (peers_[static_cast<size_t>(r)].hostId == hostId && !cfg.shmDisable) localRanks_.push_back(r);
  if (localRanks_.empty()) localRanks_.push_back(rank_);
  if (localRanks_.size() > 1 && static_cast<int>(localRanks_.size()) < size_) {
    // The host map's hosts are in order of their lowest rank: rail_ takes them in that order.
    std::vector<std::vector<int>> byHost(placed.hosts.size());
    for (int r = 0; r < size_; ++r) byHost[static_cast<size_t>(hostOf[static_cast<size_t>(r)])].push_back(r);
    bool even = true;
    for (const auto& ranks : byHost) even = even && ranks.size() == localRanks_.size();
    if (even)
      for (const auto& ranks : byHost) rail_.push_back(ranks[static_cast<size_t>(positionIn(localRanks_, rank_))]);
  }
  place_.hostsOfOne = size_ > 1 && static_cast<int>(placed.hosts.size()) == size_;  // the tree's rail: all ranks
  if (opts_.config.spinUs < 0) RAILCC_THROW(kInvalidUsage, "RAILCC_SPIN_US must be 0 or more, got ", opts_.config.spinUs);

  const long long peersMs = since(tPeers), peersCpu = processCpuMicros();
  const Clock::time_point tTopo = Clock::now();
  RailPlace place = placeRank();
  const long long topoMs = since(tTopo), topoCpu = processCpuMicros();
  const Clock::time_point tConn = Clock::now();
  if (size_ > 1) connectPeers(store, secret, deadline, getAll, place);

  // Where set-up time went: the waits include the slowest rank's lateness; the CPU (of the
  // whole process, from the group secret on) is this rank's own work.
  auto ms = [](long long us) { return std::to_string(us / 1000) + "." + std::to_string(us % 1000 / 100); };
  const long long cpuEnd = processCpuMicros();
  RAILCC_INFO(INIT, "group '", opts_.name, "' rank ", rank_, "/", size_, " ready in ", since(t0),
              " ms (peer records ", peersMs, " ms, topology ", topoMs,
              ", endpoints and connections ", since(tConn), "); CPU ", ms(cpuEnd - cpu0), " ms (peer records ",
              ms(peersCpu - cpu0), ", topology ", ms(topoCpu - peersCpu), ", endpoints and connections ",
              ms(cpuEnd - topoCpu), ")");
}

}  // namespace railcc::engine
