#include <fstream>

#include "engine/comm_impl.h"
#include "topology/rails.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// Where this rank sits: the machine's topology (hwloc, or RAILCC_TOPO_FILE) and the NIC and
// rail the rail assignment gives this rank among the ranks of its host, logged at INFO once
// per process, by the first communicator that spans hosts (or that is asked to dump).
// Discovery never fails init: without it the transports pick interfaces as before.

void CommImpl::logPlacement() {
  const Config& cfg = opts_.config;
  const std::string& me = peers_[static_cast<size_t>(rank_)].hostId;
  int local = 0, localIdx = 0;
  bool otherHost = false;
  for (const PeerInfo& p : peers_) {
    if (p.hostId != me) {
      otherHost = true;
      continue;
    }
    if (p.rank == rank_) localIdx = local;
    ++local;
  }
  if (!otherHost && cfg.topoDumpFile.empty()) return;
  static std::mutex mu;
  static bool done = false;
  {
    std::lock_guard<std::mutex> g(mu);
    if (done) return;
    done = true;
  }
  try {
    topology::DiscoverOptions o;
    o.xmlFile = cfg.topoFile;
    topology::Topology t = topology::discover(o);
    if (!cfg.topoDumpFile.empty() && localIdx == 0) {  // one writer per host; %h names it
      std::string path = cfg.topoDumpFile;
      for (size_t at; (at = path.find("%h")) != std::string::npos;)
        path.replace(at, 2, peers_[static_cast<size_t>(rank_)].hostname);
      std::ofstream f(path);
      f << t.xml;
      if (!f) RAILCC_WARN(INIT, "RAILCC_TOPO_DUMP_FILE=", path, ": cannot write it");
    }
    // The GPU of a rank is known at its first CUDA op, not here: ranks are placed by order.
    auto rails = topology::assignRails(t, std::vector<topology::RankPlace>(static_cast<size_t>(local)));
    RAILCC_INFO(INIT, "topology from ", t.source, ": ", t.gpus.size(), " GPUs, ", t.railNics().size(), " rail NICs, ",
                t.numaNodes, " NUMA nodes; local rank ", localIdx, " of ", local, " on ", peers_[static_cast<size_t>(rank_)].hostname,
                ": ", rails[static_cast<size_t>(localIdx)].why);
  } catch (const std::exception& e) {
    RAILCC_WARN(INIT, "topology unknown (", e.what(), "); interfaces are picked without it");
  }
}

}  // namespace railcc::engine
