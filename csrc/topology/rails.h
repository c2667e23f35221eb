#pragma once
// Which NIC each local rank sends through: the rail assignment.
//
// A rank with a GPU takes the NIC nearest it (best path type), then the least used so far
// (ranks whose GPUs share a switch with several NICs spread over them), then the fastest
// link, then the lowest index. A rank without a GPU does the same with the NUMA node it runs
// on in place of the GPU (a NIC on its node counts as PHB, any other as SYS). The rail of a
// rank is the index of its NIC among Topology::railNics() of its host, so "rail r" names the
// NICs with the same role on every host.

#include <string>
#include <vector>

#include "topology/topology.h"

namespace railcc::topology {

struct RankPlace {
  int gpu = -1;   // index into Topology::gpus, -1 for none
  int numa = -1;  // NUMA node the rank runs on, -1 when unknown or several
};

struct Assignment {
  int nic = -1;   // index into Topology::nics, -1 when the host has none
  int rail = -1;  // position of that NIC in Topology::railNics()
  Path path = Path::kSYS;
  std::string why;  // "GPU 0000:17:00.0 -> mlx5_0 PIX" and the like, for logs and `railcc topo`
};

/// One assignment per entry of `ranks` (the host's local ranks, in local order).
std::vector<Assignment> assignRails(const Topology& topo, const std::vector<RankPlace>& ranks);

}  // namespace railcc::topology
