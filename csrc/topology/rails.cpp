#include "topology/rails.h"

#include <tuple>

namespace railcc::topology {

std::vector<Assignment> assignRails(const Topology& topo, const std::vector<RankPlace>& ranks) {
  const std::vector<size_t> cand = topo.railNics();
  std::vector<int> load(topo.nics.size(), 0);
  std::vector<Assignment> out;
  for (const RankPlace& r : ranks) {
    Assignment a;
    bool haveGpu = r.gpu >= 0 && static_cast<size_t>(r.gpu) < topo.gpus.size();
    auto pathTo = [&](size_t n) {
      if (haveGpu) return topo.path(static_cast<size_t>(r.gpu), n);
      const int numa = topo.nics[n].pci.numa;
      return r.numa >= 0 && numa == r.numa ? Path::kPHB : (r.numa < 0 || numa < 0 ? Path::kPHB : Path::kSYS);
    };
    auto key = [&](size_t n) {
      return std::make_tuple(static_cast<int>(pathTo(n)), load[n], -topo.nics[n].pci.linkGBs, n);
    };
    for (size_t i = 0; i < cand.size(); ++i)
      if (a.nic < 0 || key(cand[i]) < key(static_cast<size_t>(a.nic))) {
        a.nic = static_cast<int>(cand[i]);
        a.rail = static_cast<int>(i);
      }
    if (a.nic >= 0) {
      ++load[static_cast<size_t>(a.nic)];
      a.path = pathTo(static_cast<size_t>(a.nic));
      const Nic& nic = topo.nics[static_cast<size_t>(a.nic)];
      a.why = (haveGpu ? "GPU " + topo.gpus[static_cast<size_t>(r.gpu)].pci.busId
                       : "NUMA node " + (r.numa >= 0 ? std::to_string(r.numa) : std::string("unknown"))) +
              " -> " + nic.name + " (rail " + std::to_string(a.rail) + ", " + pathName(a.path) + ")";
    } else {
      a.why = "no NIC on this host";
    }
    out.push_back(a);
  }
  return out;
}

}  // namespace railcc::topology
