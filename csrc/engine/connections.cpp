// Connections to peers beyond the set-up's rendezvous: the open files they need (checked at
// init), and those made at first use (RAILCC_RUNTIME_CONNECT): the channel layer asks for a
// (peer, lane) it meets without a connection; bootstrap kept the set-up that reaches the peer.
#include <dirent.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "common/log.h"
#include "engine/comm_impl.h"
#include "engine/records.h"

namespace railcc::engine {

// Files open now: Linux 6.2 and later give the count as the size of /proc/self/fd, one call
// (a first-use connection asks); older kernels say 0 there and the entries are counted.
static size_t openFiles() {
  struct stat st {};
  if (stat("/proc/self/fd", &st) == 0 && st.st_size > 0) return static_cast<size_t>(st.st_size);
  size_t open = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++open;
    closedir(d);
  }
  return open;
}

// Said at init, with the number needed, rather than as an EMFILE from deep inside a transport:
// raises the soft limit of open files where the hard limit allows (logged), else fails.
void checkFdLimit(size_t conns, const std::string& group, size_t want, const std::string& when) {
  if (conns == 0 && want == 0) return;
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return;
  size_t open = openFiles();
  constexpr size_t kSpare = 64;  // listeners, eventfds, and what torch and the program open later
  const size_t need = open + conns + kSpare, wanted = std::max(need, open + want + kSpare);
  if (wanted <= rl.rlim_cur) return;
  // Room for what may come, as far as the hard limit allows; what is needed now must fit.
  const rlim_t hard = rl.rlim_max == RLIM_INFINITY ? static_cast<rlim_t>(2 * wanted) : rl.rlim_max;
  const rlim_t target = std::min<rlim_t>(hard, static_cast<rlim_t>(2 * wanted));
  if (need <= hard && target > rl.rlim_cur) {
    rlimit up = rl;
    up.rlim_cur = target;
    if (setrlimit(RLIMIT_NOFILE, &up) == 0) {
      RAILCC_INFO(INIT, "raised the soft limit of open files (ulimit -n) from ", rl.rlim_cur, " to ", up.rlim_cur,
                  " at ", when, ": this rank needs ", conns, " connections to ranks on other hosts",
                  want > conns ? " now and may make up to " + std::to_string(want) + " at first use" : std::string());
      return;
    }
  }
  if (need <= rl.rlim_cur) return;  // what may come later is checked again when it comes
  RAILCC_THROW(kInvalidUsage, "railcc group '", group, "' at ", when, ": this rank needs about ", need, " open files (",
               conns, " connections to ranks on other hosts, ", open, " files open now, ", kSpare,
               " to spare) but ulimit -n allows ", rl.rlim_cur, " (hard limit ", rl.rlim_max,
               "): raise it to at least ", need, " (ulimit -n ", need,
               " in the job's shell, or LimitNOFILE= for a systemd service)");
}

uint8_t Links::nameOf(const std::string& n) {
  auto it = std::find(names.begin(), names.end(), n);
  if (it == names.end()) it = names.insert(it, n);
  return static_cast<uint8_t>(it - names.begin());
}

transport::PeerRecord CommImpl::recordOf(int peer, const LazyPeer& l) const {
  const PeerInfo& p = peers_[static_cast<size_t>(peer)];
  return {p.rank, p.hostId, p.hostname, p.pid, p.pidNs, l.endpoint, l.channels};
}

bool CommImpl::connectPeer(int peer, int lane) {
  LazyPeer& l = links_.peers.at(static_cast<size_t>(peer));
  if (!l.setup && !l.chooseLater)
    RAILCC_THROW(kInternal, "no connection to ", rankName(peer), ", and none to make at first use");
  const size_t ln = static_cast<size_t>(lane);
  try {
    if (l.endpointLater) {
      // The peer publishes its endpoint at the end of its init; a pair that meets before then
      // looks again, soon at first (a peer moments behind), then less often (a late one: the
      // asks of a whole job on one store), and the channel layer's sleep ends when the next
      // look is due (connectingFds), not at its 100 ms.
      const auto now = Clock::now();
      if (now < l.endpointRetry || !readEndpoint(peer, l)) {
        if (now >= l.endpointRetry) {
          // Rank 0 (or whoever hosted the store) finished and exited before this pair first
          // met: the address cannot be read any more, and no later look would find it.
          if (watchdog_.storeLost()) storeGoneAtFirstUse({peer}, "at first use");
          const Millis most = std::clamp(Millis(size_ * 3 / 20), Millis(10), Millis(100));  // 150 us a rank
          l.endpointRetry = now + std::min(most, Millis(int64_t(1) << std::min<int>(l.endpointMisses, 10)));
          if (l.endpointMisses < 255) ++l.endpointMisses;
        }
        links_.retryAt = std::min(links_.retryAt, l.endpointRetry);
        // Meanwhile, serve the listeners: peers that dial early, strangers.
        if (l.setup) l.setup->idle(Millis(0));
        else for (const auto& c : links_.choices) c.second->idle(Millis(0));
        return false;
      }
    }
    if (!l.started[ln]) {
      // Init made room for the connections collectives meet; send/recv and all-to-all may
      // meet more peers: said here with the number, not as an EMFILE from the transport.
      checkFdLimit(static_cast<size_t>(l.channels), opts_.name, 0,
                   "connecting to " + rankName(peer) + " at first use");
      l.started[ln] = true;
      const transport::PeerRecord rec = recordOf(peer, l);
      for (int ch = 0; ch < l.channels; ++ch) {
        if (peer > rank_) l.setup->connect(rec, lane, ch);
        else l.setup->accept(rec, lane, ch);
      }
    }
    // Moves every handshake of the set-up on (and answers peers that dialed early); the op's
    // own timeout bounds the wait, not this deadline.
    l.setup->progress(Clock::now() + std::chrono::hours(24), Millis(0));
    for (int ch = 0; ch < l.channels; ++ch)
      if (!l.setup->ready(peer, lane, ch)) return false;
  } catch (const Error& e) {
    // The handshake that failed may be another peer's: name that one.
    int who = e.ranks.empty() ? peer : e.ranks.front();
    if (e.tellPeers && who >= 0 && who < size_ && who != rank_) {
      // A handshake refused (the ranks hold different secrets: RAILCC_AUTH_KEY_FILE differs, or
      // a stranger answered): that rank is alive, so not "gone" and not one to shrink away; a
      // setting to fix, told to it too (fail() publishes the reason).
      const std::string& host = peers_[static_cast<size_t>(who)].hostname;
      Error named(ErrorCode::kInvalidUsage, "railcc group '" + opts_.name + "': connecting to " + rankName(who) + " (host " +
                                                host + ") at first use: " + e.what());
      named.ranks = {who};
      named.hosts = {host};
      named.tellPeers = true;
      throw named;
    }
    if (e.code() == ErrorCode::kPeerFailure && who >= 0 && who < size_ && who != rank_)
      peerFailed(who, std::string("connecting at first use: ") + e.what());
    if (e.code() == ErrorCode::kInvalidUsage && e.ranks.empty()) {
      // What the peer published was refused (its endpoint, read from the store): name whose.
      const std::string& host = peers_[static_cast<size_t>(peer)].hostname;
      Error named(e.code(), "railcc group '" + opts_.name + "': connecting to " + rankName(peer) + " (host " + host +
                                ") at first use: " + e.what());
      named.ranks = {peer};
      named.hosts = {host};
      throw named;
    }
    throw;
  }
  std::string desc;
  for (int ch = 0; ch < l.channels; ++ch) {
    ch_.adopt(lane, peer, ch, l.setup->take(peer, lane, ch));
    std::string d = ch_.chan(lane, peer, ch).conn->describe();
    desc += ch == 0 ? d : ", " + d.substr(d.find(' ') + 1);
  }
  if (lane == kCollLane || !l.named) {  // links are named after the collective lane's connection
    std::lock_guard<std::mutex> g(links_.mu);
    peers_[static_cast<size_t>(peer)].transport = desc;
    l.named = true;
  }
  RAILCC_INFO(INIT, "rank ", rank_, " -> peer ", peer, " (", peers_[static_cast<size_t>(peer)].hostname, ") lane ",
              lane, " connected at first use via ", desc);
  return true;
}

// The peer's endpoint, published at its init, for a pair set-up did not read about (records.h):
// false while it is not in the store yet (that rank is still in init; the op's timeout bounds
// the wait, and its message says the connection is not up).
bool CommImpl::readEndpoint(int peer, LazyPeer& l) {
  std::string v;
  if (!watchdog_.storeTryGet("ep/" + std::to_string(peer), Millis(0), v)) return false;  // one look (connectPeer paces them)
  const std::string who = "railcc group '" + opts_.name + "': " + rankName(peer) + " (host " +
                          peers_[static_cast<size_t>(peer)].hostname + ")";
  auto theirs = parseEndpoints(v, who);
  // Several transports between hosts: the first, in the order both ranks open them, that the
  // peer offers and this rank can reach it by (as set-up chooses for the pairs it reads about).
  if (l.chooseLater) {
    std::string why, tried;
    transport::PeerRecord rec = recordOf(peer, l);
    const int k = firstReaching(links_.choices, theirs, rankName(peer), rec, why, tried);
    if (k < 0) {
      Error err(ErrorCode::kInvalidUsage, who + ": no transport between hosts reaches it from rank " +
                                              std::to_string(rank_) + ":" + tried);
      err.ranks = {peer};
      err.hosts = {peers_[static_cast<size_t>(peer)].hostname};
      throw err;
    }
    l.setup = links_.choices[static_cast<size_t>(k)].second;
    l.via = links_.nameOf(links_.choices[static_cast<size_t>(k)].first);
    RAILCC_INFO(INIT, "rank ", rank_, " -> peer ", peer, " via ", links_.names[l.via], " (", why, "), chosen at first use");
  }
  const std::string& via = links_.names[l.via];
  const bool chosen = l.chooseLater;
  l.chooseLater = false;
  auto it = theirs.find(via);
  if (it == theirs.end())
    RAILCC_THROW(kInvalidUsage, who, " offers no ", via, " endpoint, the transport rank ", rank_,
                 " reaches other hosts through (set RAILCC_NET/NCCL_NET alike on every rank)");
  if (it->second.first != l.channels)
    RAILCC_THROW(kInvalidUsage, who, " offers ", it->second.first, " ", via, " channels per lane where rank ", rank_,
                 chosen ? " set up the pair's " + std::to_string(l.channels) +
                              " for its first transport between hosts (a pair chosen at first use keeps the count): "
                              "give the transports the same count (RAILCC_NCHANNELS for TCP, the NICs x "
                              "RAILCC_IB_QPS_PER_CONNECTION for verbs), set RAILCC_NET alike on every rank, or "
                              "RAILCC_RUNTIME_CONNECT=0"
                        : " has " + std::to_string(l.channels) + ": set the channel count (RAILCC_NCHANNELS, or "
                              "NCCL_NSOCKS_PERTHREAD x NCCL_SOCKET_NTHREADS) alike on every rank");
  l.endpoint = it->second.second;
  l.endpointLater = false;
  return true;
}

// Before the group's first collective moves a byte: the endpoints of the peers its collectives
// meet (collectivePeers), read while the store's host must still be up. An all_reduce,
// reduce_scatter, all_gather or barrier completes on no rank before every rank has joined it, so
// the store's host (rank 0 under a plain launch, whose exit takes the store along) cannot have
// finished such an op, let alone exited, while a rank still reads here; a pair first met in a
// later step (a ring's last hop to a rank that was still in its init when the op began) would
// otherwise find the store gone (CI saw two ranks wait out the harness that way). The wait is
// the op's: bounded by its timeout, which names the ranks still in their init.
void CommImpl::readCollectiveEndpoints(const Op& op) {
  std::vector<int> left;
  for (int p : algos_.collectivePeers())
    if (links_.peers[static_cast<size_t>(p)].endpointLater) left.push_back(p);
  const Clock::time_point began = Clock::now();
  const Clock::time_point deadline = began + op.timeout;
  Clock::time_point nextCheck = began + std::chrono::seconds(1);
  std::vector<pollfd> fds;
  std::vector<std::pair<int, int>> waitOn;
  auto readNamed = [&](int p) {
    try {
      return readEndpoint(p, links_.peers[static_cast<size_t>(p)]);
    } catch (Error& e) {  // what the peer published was refused: name whose
      if (e.ranks.empty()) {
        e.ranks = {p};
        e.hosts = {peers_[static_cast<size_t>(p)].hostname};
      }
      throw;
    }
  };
  for (Millis nap(1); !left.empty(); nap = std::min(nap * 2, Millis(100))) {
    size_t kept = 0;
    for (int p : left)
      if (!readNamed(p)) left[kept++] = p;
    left.resize(kept);
    if (left.empty()) break;
    checkInterrupted();
    // Shutdown waits for no peer's init (as ChannelLayer::idle gives up a second after it began).
    if (shuttingDown() && Clock::now() - began > Millis(1000))
      RAILCC_THROW(kAborted, "railcc group '", opts_.name, "' was shut down while its first collective waited for ",
                   left.size(), " peer(s) to finish their init");
    pumpP2P();  // sends and receives queued beside it move meanwhile
    if (watchdog_.storeLost()) storeGoneAtFirstUse(left, "before its first collective");
    if (Clock::now() >= nextCheck) {  // one that failed in its init said so
      nextCheck = Clock::now() + std::chrono::seconds(1);
      waitOn.clear();
      for (int p : left) waitOn.push_back({kCollLane, p});
      checkPeersReported(waitOn);
    }
    if (Clock::now() >= deadline) {
      std::string lines;
      std::vector<std::string> hosts;
      for (int p : left) {
        lines += "\n  " + peerName(p) + ": its init has not finished (its address is not in the store)";
        hosts.push_back(peers_[static_cast<size_t>(p)].hostname);
      }
      failTimedOut(lines, left, std::move(hosts), op.timeout);
    }
    // Meanwhile, serve the listeners (peers that dial early).
    fds.clear();
    const int ms = connectingFds(fds);
    poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(ms, nap.count())));
    for (auto& setup : links_.setups) setup->idle(Millis(0));
  }
  links_.collectiveRead = true;
}

void CommImpl::storeGoneAtFirstUse(const std::vector<int>& peers, const char* when) {
  std::string names;
  for (int p : peers) names += (names.empty() ? "" : ", ") + rankName(p) + " (host " + peers_[static_cast<size_t>(p)].hostname + ")";
  throw Error(ErrorCode::kPeerFailure,
              "railcc group '" + opts_.name + "': cannot connect to " + names + " " + when +
                (peers.size() > 1 ? ": their addresses are" : ": its address is") + " in the c10d store, and the store is gone (its host, usually rank 0 or the launcher, "
                "has exited). Keep the store's host up until every rank is done (torchrun's agent does; a plain "
                "launch needs rank 0 to wait, e.g. a barrier before it exits), or set RAILCC_RUNTIME_CONNECT=0 to "
                "connect the collectives' peers at init");
}

// RAILCC_RUNTIME_CONNECT=0: the pairs this rank's collectives meet (collectivePeers), connected
// before init returns, through the same first-use set-ups (both ends list the pair); every
// other pair still connects at its first use. A peer that does not answer by the deadline
// fails init naming it; one that died is named as at first use.
void CommImpl::connectAtInit(Clock::time_point deadline) {
  std::vector<int> left;
  for (int p : algos_.collectivePeers()) {
    const LazyPeer& l = links_.peers.at(static_cast<size_t>(p));
    if (l.setup || l.chooseLater) left.push_back(p);
  }
  const size_t total = left.size();
  const Clock::time_point t0 = Clock::now();
  std::vector<pollfd> fds;
  while (!left.empty()) {
    left.erase(std::remove_if(left.begin(), left.end(), [&](int p) { return connectPeer(p, kCollLane); }), left.end());
    if (left.empty()) break;
    if (Clock::now() >= deadline) {
      std::string names;
      for (int p : left) names += (names.empty() ? "" : ", ") + rankName(p) + " (host " + peers_[static_cast<size_t>(p)].hostname + ")";
      Error err(ErrorCode::kTimeout, "railcc init of group '" + opts_.name + "' (RAILCC_RUNTIME_CONNECT=0): no connection to " +
                                         names + " within RAILCC_INIT_TIMEOUT: still in its init, or unreachable");
      err.ranks = left;
      for (int p : left) err.hosts.push_back(peers_[static_cast<size_t>(p)].hostname);
      throw err;
    }
    fds.clear();
    const int ms = connectingFds(fds);
    poll(fds.data(), fds.size(), std::max(1, ms));
  }
  if (total)
    RAILCC_INFO(INIT, "rank ", rank_, ": connected at init the ", total, " peer(s) on other hosts its collectives meet (",
                std::chrono::duration_cast<Millis>(Clock::now() - t0).count(),
                " ms; RAILCC_RUNTIME_CONNECT=0); the rest at first use");
}

int CommImpl::connectingFds(std::vector<pollfd>& out) {
  int ms = 100;
  for (auto& s : links_.setups) ms = std::min(ms, s->pollFds(out));
  const auto due = std::exchange(links_.retryAt, Clock::time_point::max());  // an endpoint read (connectPeer)
  if (due != Clock::time_point::max()) {
    const auto left = std::chrono::ceil<Millis>(due - Clock::now()).count();
    ms = static_cast<int>(std::clamp<int64_t>(left, 1, ms));
  }
  return ms;
}

}  // namespace railcc::engine
