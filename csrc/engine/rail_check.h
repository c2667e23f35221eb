#pragma once
// Rank 0's check that the hosts of a job agree on their rails (engine/placement.cpp), also run
// by `railcc topo --all-ranks`. Each rank publishes one line:
//   host=H;rank=R;nic=mlx5_1;rail=1;rails=2;0=eth0@10.77.0.0/24;1=eth1@10.78.0.0/24
// ("-" for a rail NIC without an IPv4 interface).

#include <string>
#include <vector>

namespace railcc::engine {

struct RailCheck {
  int hosts = 0;
  int rails = 0;                      // the most rails any host has
  std::vector<std::string> problems;  // one sentence per disagreement, naming the hosts
  std::string agreed;                 // "rail 0 10.77.0.0/24, rail 1 10.78.0.0/24"
};
RailCheck checkRailLines(const std::vector<std::string>& lines);

}  // namespace railcc::engine
