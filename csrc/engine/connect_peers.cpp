#include "common/log.h"
#include "engine/comm_impl.h"

#include "common/crypto.h"
#include "common/strings.h"
#include "engine/records.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// Set-up's connections (called by bootstrap.cpp once the peers' records are read): opens every
// registered transport, publishes their endpoints in one store key, picks one per peer (logged
// with the reason) and connects every (peer, lane, channel) through it, now or, for a lazy
// set-up, at the pair's first use (connections.cpp).

namespace {

std::string lowered(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// One transport opened for this communicator.
struct Opened {
  std::string name;
  bool interHost = false;
  std::unique_ptr<transport::Setup> setup;
  bool done = false;
};

}  // namespace

void CommImpl::connectPeers(Store& store, const std::string& secretHex, Clock::time_point deadline,
                            const GetAll& getAll, const RailPlace& place) {
  const Config& cfg = opts_.config;
  transport::SetupContext ctx;
  ctx.rank = rank_;
  ctx.size = size_;
  ctx.lanes = kLanes;
  ctx.group = opts_.name;
  ctx.config = cfg;
  ctx.secret.resize(secretHex.size() / 2);
  if (!fromHex(secretHex, ctx.secret.data(), ctx.secret.size()))
    RAILCC_THROW(kInvalidUsage, "the group secret in the store is not hex ('", secretHex.substr(0, 80),
                 "'): a store record written by something other than railcc?");
  if (!cfg.authKeyFile.empty()) {
    // The store's secret alone proves only that a process can read the store; the key file's
    // content, which never enters the store, is what a connecting rank must also hold.
    Digest d = hmacSha256(readKeyFile(cfg.authKeyFile, "RAILCC_AUTH_KEY_FILE"), ctx.secret);
    ctx.secret.assign(d.begin(), d.end());
  }
  ctx.pidNs = peers_[static_cast<size_t>(rank_)].pidNs;
  ctx.localRanks = localRanks_;
  ctx.rail = place.rail;
  ctx.railIfs = place.railIfs;
  ctx.gpuNics = place.gpuNics;
  ctx.publish = [this](const std::string& k, const std::string& v) { store_->set(k, v); };
  ctx.peek = [this](const std::string& k, std::string& v) { return watchdog_.storeTryGet(k, Millis(2), v); };
  bool remote = static_cast<int>(localRanks_.size()) < size_;

  // RAILCC_NET / NCCL_NET names the transport between hosts (NCCL's "Socket" and "IB" too).
  std::string forced = lowered(cfg.net);
  if (forced == "ib") forced = "verbs";
  std::vector<Opened> open;
  std::string registered;
  bool forcedSeen = false;
  for (auto& reg : transport::registeredTransports()) {
    registered += (registered.empty() ? "" : ", ") + reg.name;
    std::unique_ptr<transport::Transport> t = reg.factory();
    bool inter = t->interHost();
    if (inter && (!remote || (!forced.empty() && reg.name != forced))) continue;
    std::string why;
    std::unique_ptr<transport::Setup> setup = t->open(ctx, why);
    if (inter && !forced.empty()) {
      forcedSeen = true;
      if (!setup)
        RAILCC_THROW(kInvalidUsage, "RAILCC_NET/NCCL_NET='", cfg.net, "' forces transport ", reg.name,
                     ", which cannot run here: ", why);
    }
    if (!setup) {
      RAILCC_INFO(INIT, "transport ", reg.name, " not used: ", why);
      continue;
    }
    open.push_back({reg.name, inter, std::move(setup)});
  }
  if (remote && !forced.empty() && !forcedSeen)
    RAILCC_THROW(kInvalidUsage, "RAILCC_NET/NCCL_NET='", cfg.net, "' names no registered transport between hosts; ",
                 "registered: ", registered);

  // Every endpoint in one store key, then the peers' in turn.
  std::string mine;
  for (auto& o : open) {
    std::string ep = o.setup->endpoint();
    mine += o.name + " " + std::to_string(o.setup->channels()) + " " + ep + "\n";
    // The address peers on other hosts reach us at during set-up ("-" when none dials us).
    if (o.interHost && peers_[static_cast<size_t>(rank_)].addr == "-" && !ep.empty()) peers_[static_cast<size_t>(rank_)].addr = ep;
  }
  // Not a transport: this rank's rails, for rank 0's check that the hosts agree.
  if (!place.line.empty()) mine += "rails 0 " + place.line + "\n";
  store.set("ep/" + std::to_string(rank_), mine);
  std::vector<std::string> railLines{place.line};

  // Per rank, as little as the choice needs: a peer's record is made from peers_ when a
  // transport needs it, and the reasons (the same for most peers) are kept once each.
  struct Choice {
    Opened* via = nullptr;
    int channels = 1;
    int why = -1;                // index in whys
    bool endpointLater = false;  // read at the pair's first use
    std::string endpoint;        // the peer's blob for `via`, where read now
  };
  std::vector<Choice> choice(static_cast<size_t>(size_));
  std::vector<std::string> whys;
  auto whyOf = [&whys](const std::string& w) {
    auto it = std::find(whys.begin(), whys.end(), w);
    if (it == whys.end()) it = whys.insert(it, w);
    return static_cast<int>(it - whys.begin());
  };
  auto recordOf = [this, &choice](int r) {
    const PeerInfo& p = peers_[static_cast<size_t>(r)];
    const Choice& c = choice[static_cast<size_t>(r)];
    return transport::PeerRecord{p.rank, p.hostId, p.hostname, p.pid, p.pidNs, c.endpoint, c.channels};
  };
  // While peers' endpoints are awaited, the transports serve what already reaches them.
  pump_ = [&open] {
    for (auto& o : open) o.setup->idle(Millis(open.size() > 1 ? 2 : 5));
  };
  struct NoPump {
    std::function<void()>& p;
    ~NoPump() { p = nullptr; }
  } noPump{pump_};
  std::vector<int> others;
  for (int r = 0; r < size_; ++r)
    if (r != rank_) others.push_back(r);
  // Where every transport that reaches other hosts connects at first use, a peer there is
  // only read about (its endpoint) when the pair first meets, and with several (verbs and TCP)
  // the transport is chosen then, in the same order as here: set-up reads this host's ranks'.
  std::vector<Opened*> firstUse;
  for (auto& o : open)
    if (o.interHost) firstUse.push_back(o.setup->lazy() ? &o : nullptr);
  if (std::find(firstUse.begin(), firstUse.end(), nullptr) != firstUse.end()) firstUse.clear();
  std::string firstUseNames;  // "verbs or socket"
  for (Opened* o : firstUse) firstUseNames += (firstUseNames.empty() ? "" : " or ") + o->name;
  std::vector<int> readNow;
  int laterWhy = -1;  // one reason for every pair met later: reach() without an endpoint is this side's
  for (int r : others) {
    if (firstUse.empty() || std::find(localRanks_.begin(), localRanks_.end(), r) != localRanks_.end()) {
      readNow.push_back(r);
      continue;
    }
    Choice& c = choice[static_cast<size_t>(r)];
    c.via = firstUse.front();  // the channel count of the pair: the first transport's
    c.channels = c.via->setup->channels();
    if (laterWhy < 0)
      laterWhy = whyOf(firstUse.size() == 1 ? c.via->setup->reach(recordOf(r)) + "; each peer's endpoint read then" +
                                                  (forced.empty() ? "" : ", forced by RAILCC_NET/NCCL_NET")
                                            : std::string("the first that both ends offer, chosen with each peer's endpoint"));
    c.why = laterWhy;
    c.endpointLater = true;
  }
  // Rank 0's rail check needs a line per host, not per rank: each other host's first rank's,
  // read off set-up's path (checkRails).
  std::vector<int> heads;
  if (rank_ == 0 && !firstUse.empty() && !place.line.empty()) {
    std::set<std::string> seen{peers_[static_cast<size_t>(rank_)].hostId};
    for (int r : others)
      if (seen.insert(peers_[static_cast<size_t>(r)].hostId).second) heads.push_back(r);
  }
  const std::vector<std::string> eps = getAll("ep/", readNow, "transport endpoints");
  std::vector<std::pair<std::string, transport::Setup*>> candidates;
  for (auto& o : open) candidates.push_back({o.name, o.setup.get()});
  for (size_t i = 0; i < readNow.size(); ++i) {
    const int r = readNow[i];
    auto theirs = parseEndpoints(eps[i], "railcc init of group '" + opts_.name + "': " + rankName(r));
    if (theirs.count("rails")) railLines.push_back(theirs["rails"].second);
    Choice& c = choice[static_cast<size_t>(r)];
    std::string why, tried;
    transport::PeerRecord rec = recordOf(r);
    const int k = firstReaching(candidates, theirs, rankName(r), rec, why, tried);
    if (k >= 0) {
      Opened& o = open[static_cast<size_t>(k)];
      c.via = &o;
      c.channels = std::max(1, std::min(o.setup->channels(), rec.channels));
      c.endpoint = rec.endpoint;
      if (o.interHost) peers_[static_cast<size_t>(r)].addr = rec.endpoint;
      c.why = whyOf(why + (o.interHost && !forced.empty() ? ", forced by RAILCC_NET/NCCL_NET" : ""));
    }
    if (!c.via) {
      Error err(ErrorCode::kInvalidUsage, "railcc init of group '" + opts_.name + "': no transport reaches " +
                                              rankName(r) + " (host " + peers_[static_cast<size_t>(r)].hostname +
                                              ") from rank " + std::to_string(rank_) + ":" +
                                              (tried.empty() ? std::string("\n  none is open here") : tried));
      err.ranks = {r};
      err.hosts = {peers_[static_cast<size_t>(r)].hostname};
      throw err;
    }
  }
  // Connections that hold a file descriptor (a socket or a verbs completion channel): those made
  // now, and of those made at first use the most a rank's collectives meet (a ring's two peers
  // and a small all-reduce's log2 n, on both lanes): init fails if these do not fit. Room for a
  // full mesh made at first use (send/recv, all-to-all to every peer) is made where the hard
  // limit allows, and checked again at each first use.
  size_t fdNow = 0, fdLazy = 0, lazyPeers = 0, lazyChannels = 1;
  for (int r : others) {
    const Choice& c = choice[static_cast<size_t>(r)];
    if (!c.via->interHost) continue;
    const size_t k = kLanes * static_cast<size_t>(c.channels);
    if (c.via->setup->lazy()) {
      fdLazy += k;
      ++lazyPeers;
      lazyChannels = std::max(lazyChannels, static_cast<size_t>(c.channels));
    } else {
      fdNow += k;
    }
  }
  size_t log2n = 0;
  while ((size_t(1) << log2n) < static_cast<size_t>(size_)) ++log2n;
  const size_t collPeers = std::min(lazyPeers, log2n + 3);
  checkFdLimit(fdNow + collPeers * kLanes * lazyChannels, opts_.name, fdNow + fdLazy);
  // The lower rank connects, the higher accepts: now, or at the pair's first op where the
  // transport makes connections at first use.
  links_.peers.assign(static_cast<size_t>(size_), LazyPeer{});
  for (int r : others) {
    Choice& c = choice[static_cast<size_t>(r)];
    if (c.via->setup->lazy()) {
      LazyPeer& l = links_.peers[static_cast<size_t>(r)];
      l.setup = c.via->setup.get();
      l.endpoint = c.endpoint;
      l.channels = c.channels;
      l.via = links_.nameOf(c.via->name);
      l.endpointLater = c.endpointLater;
      l.chooseLater = c.endpointLater && firstUse.size() > 1;
      if (l.chooseLater) l.setup = nullptr;  // chosen with the peer's endpoint (readEndpoint)
      continue;
    }
    const transport::PeerRecord rec = recordOf(r);
    for (int lane = 0; lane < kLanes; ++lane)
      for (int ch = 0; ch < c.channels; ++ch) {
        if (r > rank_) c.via->setup->connect(rec, lane, ch);
        else c.via->setup->accept(rec, lane, ch);
      }
  }

  if (rank_ == 0 && !place.line.empty()) checkRails(std::move(railLines), heads, deadline);

  // Drive every transport's connections until all are up. A peer that failed its own set-up
  // (its handshake with another rank failed authentication, say) ends the wait for it now.
  try {
    while (true) {
      bool all = true;
      for (auto& o : open) {
        if (!o.done) o.done = o.setup->lazy() || o.setup->progress(deadline, Millis(open.size() > 1 ? 5 : 100));
        all = all && o.done;
      }
      if (all) break;
      checkPeerInitFailure(store);
    }
  } catch (const Error& e) {
    if (health_.initFailSeen) throw;  // checkPeerInitFailure's, worded already
    Error err(e.code(), "railcc init of group '" + opts_.name + "': " + e.what());
    err.ranks = e.ranks;
    err.tellPeers = e.tellPeers;
    for (int r : e.ranks) err.hosts.push_back(peers_[static_cast<size_t>(r)].hostname);
    throw err;
  }
  // Peers left to their first use: one INFO line per way of reaching them, not one per peer.
  std::vector<std::pair<std::string, std::vector<int>>> laterLines;
  for (int r = 0; r < size_; ++r) {
    Choice& c = choice[static_cast<size_t>(r)];
    if (!c.via) continue;
    std::string desc;
    const LazyPeer& l = links_.peers[static_cast<size_t>(r)];
    if (l.setup || l.chooseLater) {
      ch_.setChannels(r, c.channels);  // the pair's channels are made when it first meets
      // Until the first lane is up; then its connection's description (linkOf, under links_.mu).
      const std::string via = l.chooseLater ? firstUseNames : c.via->name;
      peers_[static_cast<size_t>(r)].transport = via + " (not connected yet: connects at first use)";
      if (log::enabled(log::Level::kInfo, log::INIT)) {
        std::string how = "via " + via + " at first use (" + whys[static_cast<size_t>(c.why)] +
                          (c.channels > 1 ? "; " + std::to_string(c.channels) + " channels" : std::string()) + ")";
        auto it = std::find_if(laterLines.begin(), laterLines.end(), [&](const auto& g) { return g.first == how; });
        if (it == laterLines.end()) it = laterLines.insert(laterLines.end(), {std::move(how), {}});
        it->second.push_back(r);
      }
      continue;
    }
    ch_.setChannels(r, c.channels);
    for (int lane = 0; lane < kLanes; ++lane) {
      auto& chs = ch_.pair(lane, r);
      for (int ch = 0; ch < c.channels; ++ch) chs[static_cast<size_t>(ch)].conn = c.via->setup->take(r, lane, ch);
    }
    for (int ch = 0; ch < c.channels; ++ch) {
      std::string d = ch_.chan(kCollLane, r, ch).conn->describe();
      desc += ch == 0 ? d : ", " + d.substr(d.find(' ') + 1);
    }
    PeerInfo& p = peers_[static_cast<size_t>(r)];
    p.transport = desc;
    RAILCC_INFO(INIT, "rank ", rank_, " -> peer ", r, " (", p.hostname, ") via ", desc, " (", c.via->name, ": ",
                whys[static_cast<size_t>(c.why)], c.channels > 1 ? "; " + std::to_string(c.channels) + " channels" : std::string(), ")");
  }

  for (const auto& [how, ranks] : laterLines)
    RAILCC_INFO(INIT, "rank ", rank_, " -> peer", ranks.size() == 1 ? " " : "s ", rankSpans(ranks),
                ranks.size() == 1 ? " (" + peers_[static_cast<size_t>(ranks.front())].hostname + ") " : " ", how);

  // A shared-memory name goes once every rank of the host has mapped it: the watchdog asks
  // after set-up, so that no rank waits here for the host's slowest (a store round of its own,
  // one more pass over every rank of a host whose ranks share its cores).
  const bool chooseLater = std::any_of(links_.peers.begin(), links_.peers.end(), [](const LazyPeer& l) { return l.chooseLater; });
  for (auto& o : open) {
    if (auto d = o.setup->localDomain()) {
      ch_.setLocal(d);
      watchdog_.addTask({[weak = std::weak_ptr<transport::LocalDomain>(d)] {
        auto domain = weak.lock();
        return !domain || domain->releaseName();
      }});
    }
    const bool choice = chooseLater && std::find(firstUse.begin(), firstUse.end(), &o) != firstUse.end();
    if (choice) links_.choices.push_back({o.name, o.setup.get()});
    bool serves = choice || std::any_of(links_.peers.begin(), links_.peers.end(),
                                        [&](const LazyPeer& l) { return l.setup == o.setup.get(); });
    if (serves) links_.setups.push_back(std::move(o.setup));  // it makes connections for the group's life
    else o.setup->finish();
  }
}

}  // namespace railcc::engine
