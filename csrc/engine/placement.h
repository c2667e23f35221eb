#pragma once
// This rank's place in the machine's topology (placement.cpp): its NIC and rail, read at init
// (early where the group spans hosts) and logged once per process; what rank 0's cross-host rail
// check compares.

#include <string>
#include <vector>

#include "transport/transport.h"

namespace railcc::engine {

struct RailPlace {
  int rail = -1;                     // -1: unknown (one host, no topology, no NIC)
  std::string nic;                   // "mlx5_1"
  std::vector<std::string> railIfs;  // per rail of this host, its NIC's IPv4 interface ("" none)
  std::string why;
  std::string line;                  // published to the peers for checkRails
  std::vector<transport::GpuNicPath> gpuNics;  // for the GPUDirect RDMA decisions
};

}  // namespace railcc::engine
