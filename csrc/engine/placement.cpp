#include <arpa/inet.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "common/interfaces.h"
#include "common/log.h"
#include "common/strings.h"
#include "engine/comm_impl.h"
#include "engine/rail_check.h"
#include "engine/records.h"
#include "engine/store.h"
#include "topology/rails.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// Where this rank sits: the machine's topology (hwloc, or RAILCC_TOPO_FILE, discovered once
// per process and file), the NIC and rail the rail assignment gives this rank among the ranks
// of its host, and the interface of every rail NIC of the host. The transports between hosts
// get it as a hint (transport::SetupContext); the first communicator that spans hosts logs it
// at INFO once per process. Rank 0 compares the hosts' rails (checkRails). Discovery never
// fails init: without it the transports pick interfaces as before.

namespace {

struct Discovered {
  std::shared_ptr<const topology::Topology> topo;
  std::string error;
};

// `wait` false: where another process of the machine is discovering, nothing (not cached).
Discovered discoverOnce(const std::string& file, const std::string& hwlocLib, int64_t shareSec, bool wait = true) {
  static std::mutex mu;
  static std::map<std::string, Discovered> cache;
  std::lock_guard<std::mutex> g(mu);
  auto it = cache.find(file);
  if (it != cache.end()) return it->second;
  Discovered d;
  try {
    topology::DiscoverOptions o;
    o.xmlFile = file;
    o.hwlocLib = hwlocLib;
    const char* tmp = std::getenv("TMPDIR");
    const std::string dir = tmp && *tmp ? tmp : "/tmp";
    topology::Topology t;
    if (wait) t = topology::discoverShared(o, dir, shareSec);
    else if (!topology::discoverSharedNow(o, dir, shareSec, t)) return d;
    d.topo = std::make_shared<const topology::Topology>(std::move(t));
  } catch (const std::exception& e) {
    d.error = e.what();
  }
  return cache[file] = d;
}

// "10.77.0.0/24" for an interface's first IPv4 address, "" when it has none or is down.
std::string subnetOf(const std::string& ifname) {
  std::vector<InterfaceAddr> all;
  try {
    all = listInterfaces();
  } catch (const Error&) {
    return "";
  }
  for (const auto& a : all) {
    if (a.name != ifname || !a.up || a.mask.sin_family != AF_INET) continue;
    uint32_t ip = ntohl(a.addr.sin_addr.s_addr);
    uint32_t mask = ntohl(a.mask.sin_addr.s_addr);
    in_addr net{htonl(ip & mask)};
    char buf[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &net, buf, sizeof buf);
    return std::string(buf) + "/" + std::to_string(__builtin_popcount(mask));
  }
  return "";
}

std::map<std::string, std::string> fields(const std::string& line) {
  std::map<std::string, std::string> out;
  for (const std::string& kv : split(line, ';')) {
    auto eq = kv.find('=');
    if (eq != std::string::npos) out[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return out;
}

}  // namespace

// While set-up waits for rank 0's placement record, a group that spans hosts by the launcher's
// word (more ranks than it puts on a host) reads the machine's topology, which placeRank would
// otherwise wait for after it: where none is shared yet, the first rank of the machine to get
// here discovers, so its discovery overlaps the store rendezvous instead of adding to it (the
// machine's other ranks, 7 of 8 on a GPU host, waited for it idle). A rank that finds another
// process discovering goes on; placeRank waits for that file as before. Not done where the
// group may be one host: there placeRank needs no topology at all.
void CommImpl::discoverEarly() {
  const Config& cfg = opts_.config;
  if (opts_.ranksPerHostHint > 0 && size_ > opts_.ranksPerHostHint)
    discoverOnce(cfg.topoFile, cfg.hwlocLib, cfg.topoShareSec, false);
}

RailPlace CommImpl::placeRank() {
  const Config& cfg = opts_.config;
  const PeerInfo& self = peers_[static_cast<size_t>(rank_)];
  int local = 0, localIdx = 0;
  bool otherHost = false;
  for (const PeerInfo& p : peers_) {
    if (p.hostId != self.hostId) {
      otherHost = true;
      continue;
    }
    if (p.rank == rank_) localIdx = local;
    ++local;
  }
  RailPlace place;
  if (!otherHost && cfg.topoDumpFile.empty()) return place;
  static std::mutex mu;
  static bool logged = false;
  bool first = false;
  {
    std::lock_guard<std::mutex> g(mu);
    first = !logged;
    logged = true;
  }
  Discovered d = discoverOnce(cfg.topoFile, cfg.hwlocLib, cfg.topoShareSec);
  if (!d.topo) {
    if (first) RAILCC_WARN(INIT, "topology unknown (", d.error, "); interfaces are picked without it");
    return place;
  }
  const topology::Topology& t = *d.topo;
  if (first && !cfg.topoDumpFile.empty() && localIdx == 0 && t.xml.empty()) {
    RAILCC_WARN(INIT, "RAILCC_TOPO_DUMP_FILE: not written, the topology came from ", t.source, " and only hwloc writes XML");
  } else if (first && !cfg.topoDumpFile.empty() && localIdx == 0) {  // one writer per host; %h names it
    std::string path = cfg.topoDumpFile;
    for (size_t at; (at = path.find("%h")) != std::string::npos;) path.replace(at, 2, self.hostname);
    std::ofstream f(path);
    f << t.xml;
    if (!f) RAILCC_WARN(INIT, "RAILCC_TOPO_DUMP_FILE=", path, ": cannot write it");
  }
  // The GPU of a rank is known at its first CUDA op, not here: ranks are placed by order.
  auto rails = topology::assignRails(t, std::vector<topology::RankPlace>(static_cast<size_t>(local)));
  const topology::Assignment& a = rails[static_cast<size_t>(localIdx)];
  place.why = a.why;
  // Each rail NIC's interface: the first of its netdevs with an IPv4 address here.
  std::string line;
  for (size_t nic : t.railNics()) {
    std::string name, subnet;
    for (const std::string& dev : t.nics[nic].netdevs)
      if (!(subnet = subnetOf(dev)).empty()) {
        name = dev;
        break;
      }
    place.railIfs.push_back(name);
    line += ";" + std::to_string(place.railIfs.size() - 1) + "=" + (name.empty() ? "-" : name + "@" + subnet);
  }
  for (size_t g = 0; g < t.gpus.size(); ++g)
    for (size_t n = 0; n < t.nics.size(); ++n)
      if (t.nics[n].rdma) place.gpuNics.push_back({"GPU " + std::to_string(g), t.nics[n].name, topology::pathName(t.path(g, n))});
  if (a.nic >= 0) {
    place.rail = a.rail;
    place.nic = t.nics[static_cast<size_t>(a.nic)].name;
  }
  place.line = "host=" + self.hostname + ";rank=" + std::to_string(rank_) + ";nic=" + (place.nic.empty() ? "-" : place.nic) +
               ";rail=" + std::to_string(place.rail) + ";rails=" + std::to_string(place.railIfs.size()) + line;
  if (first) {
    std::string dev = place.rail >= 0 ? place.railIfs[static_cast<size_t>(place.rail)] : "";
    RAILCC_INFO(INIT, "topology from ", t.source, ": ", t.gpus.size(), " GPUs, ", t.railNics().size(), " rail NICs, ",
                t.numaNodes, " NUMA nodes; local rank ", localIdx, " of ", local, " on ", self.hostname, ": ", a.why,
                place.rail < 0 ? "" : dev.empty() ? ", which has no IPv4 interface here" : ", interface " + dev);
  }
  return place;
}

RailCheck checkRailLines(const std::vector<std::string>& lines) {
  constexpr int kMaxRails = 256;  // NICs per host, well past any machine's
  struct Host {
    std::string name;
    int rails = 0;
    std::map<int, std::string> ifs;  // rail -> "eth1@10.78.0.0/24" or "-"
  };
  std::vector<Host> hosts;
  std::vector<std::string> bad;
  std::set<std::string> seen;
  for (const std::string& line : lines) {
    auto f = fields(line);
    if (f["host"].empty() || !seen.insert(f["host"]).second) continue;
    Host h;
    h.name = f["host"];
    // Another rank's record: a rail count no host can have is said, not allocated for.
    long long rails = 0;
    if (!parseInt(f["rails"], 0, kMaxRails, rails)) {
      bad.push_back("host " + h.name + " published rails=" + f["rails"].substr(0, 24) + " (expected 0 to " +
                    std::to_string(kMaxRails) + "); its rails are left out of the check");
      continue;
    }
    h.rails = static_cast<int>(rails);
    for (int r = 0; r < h.rails; ++r) h.ifs[r] = f[std::to_string(r)];
    hosts.push_back(h);
  }
  RailCheck out;
  out.problems = bad;
  out.hosts = static_cast<int>(hosts.size());
  for (const Host& h : hosts) out.rails = std::max(out.rails, h.rails);
  if (hosts.size() < 2 || out.rails == 0) return out;
  std::map<int, std::vector<std::string>> byCount;
  for (const Host& h : hosts) byCount[h.rails].push_back(h.name);
  auto names = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size() && i < 8; ++i) s += (i ? ", " : "") + v[i];
    return v.size() > 8 ? s + " and " + std::to_string(v.size() - 8) + " more" : s;
  };
  if (byCount.size() > 1) {
    std::string s = "hosts disagree on the number of rails (NICs):";
    for (auto& [n, hs] : byCount) s += " " + std::to_string(n) + " on " + names(hs) + ";";
    out.problems.push_back(s + " ranks on the missing rails send over another rail's NIC");
  }
  for (int r = 0; r < out.rails; ++r) {
    std::map<std::string, std::vector<std::string>> bySubnet;  // subnet -> hosts
    for (const Host& h : hosts) {
      auto it = h.ifs.find(r);
      if (it == h.ifs.end()) continue;
      auto at = it->second.find('@');
      bySubnet[at == std::string::npos ? "no IPv4 address" : it->second.substr(at + 1)].push_back(
          h.name + " (" + it->second.substr(0, at) + ")");
    }
    if (bySubnet.size() > 1) {
      std::string s = "rail " + std::to_string(r) + " is not one network:";
      for (auto& [net, hs] : bySubnet) s += " " + net + " on " + names(hs) + ";";
      out.problems.push_back(s + " its NICs on different subnets may not reach each other");
    } else if (!bySubnet.empty()) {
      out.agreed += (out.agreed.empty() ? "" : ", ") + std::string("rail ") + std::to_string(r) + " " + bySubnet.begin()->first;
    }
  }
  return out;
}

void reportRails(const std::vector<std::string>& lines) {
  RailCheck c = checkRailLines(lines);
  for (const std::string& p : c.problems) RAILCC_WARN(INIT, "rail check across ", c.hosts, " hosts: ", p);
  if (c.hosts < 2 || c.rails == 0) return;
  if (c.problems.empty()) RAILCC_INFO(INIT, "rail check: ", c.hosts, " hosts agree on ", c.rails, " rails (", c.agreed, ")");
}

bool railCheckStep(Store& store, RailCheckLater& r, Millis wait) {
  bool read = false;  // the endpoints are in: what fails after this is not worth another look
  try {
    const std::vector<std::string> eps = store.getAll(r.keys, wait);  // with no wait, one look
    read = true;
    for (size_t i = 0; i < eps.size(); ++i) {
      Endpoints t = parseEndpoints(eps[i], "railcc group '" + r.group + "': " + r.keys[i]);
      if (t.count("rails")) r.lines.push_back(t["rails"].second);
    }
  } catch (const std::exception& e) {
    if (!read && std::chrono::steady_clock::now() < r.giveUp) return false;
    const std::string what = e.what();
    RAILCC_INFO(INIT, "group '", r.group, "': rail check not made: ", what.substr(0, what.find('\n')));
    return true;
  }
  reportRails(r.lines);
  return true;
}

// `lines`: this host's ranks' (and, where set-up read every endpoint, all); `heads`: one rank of
// each other host, whose lines are in their endpoints. Those are published during each rank's
// set-up, so reading them in rank 0's held it (the root of set-up's gather and of the first
// ops' trees) until the last host's: 128 ranks on fake hosts finished their first all_reduce
// 10-50 ms after the others were ready. The check only speaks, never fails init, so with the
// store kept alive by the glue the watchdog makes it (railCheckStep); a caller's store (tests)
// is read here, as it may be gone once set-up returns.
void CommImpl::checkRails(std::vector<std::string> lines, const std::vector<int>& heads, Clock::time_point deadline) {
  static std::mutex mu;
  static bool done = false;  // once per process: every group spanning the same hosts agrees alike
  {
    std::lock_guard<std::mutex> g(mu);
    if (done) return;
    done = true;
  }
  auto later = std::make_shared<RailCheckLater>();
  later->group = opts_.name;
  later->lines = std::move(lines);
  for (int r : heads) later->keys.push_back("ep/" + std::to_string(r));
  later->giveUp = deadline;
  if (later->keys.empty()) return reportRails(later->lines);
  if (watchdog_.keepsStore()) {  // the watchdog thread, started after set-up, runs it from then on
    watchdog_.addTask({[later, store = store_] { return railCheckStep(*store, *later); }});
    return;
  }
  later->giveUp = Clock::now();  // one read, waiting within set-up's deadline
  railCheckStep(*store_, *later, std::max(std::chrono::duration_cast<Millis>(deadline - later->giveUp), Millis(0)));
}

}  // namespace railcc::engine
