#pragma once
// Rank 0's check that the hosts of a job agree on their rails (engine/placement.cpp), also run
// by `railcc topo --all-ranks`. Each rank publishes one line:
//   host=H;rank=R;nic=mlx5_1;rail=1;rails=2;0=eth0@10.77.0.0/24;1=eth1@10.78.0.0/24
// ("-" for a rail NIC without an IPv4 interface).

#include <chrono>
#include <string>
#include <vector>

namespace railcc::engine {

class Store;

struct RailCheck {
  int hosts = 0;
  int rails = 0;                      // the most rails any host has
  std::vector<std::string> problems;  // one sentence per disagreement, naming the hosts
  std::string agreed;                 // "rail 0 10.77.0.0/24, rail 1 10.78.0.0/24"
};
RailCheck checkRailLines(const std::vector<std::string>& lines);

/// Logs what checkRailLines finds: a warning per problem, else one INFO line.
void reportRails(const std::vector<std::string>& lines);

/// Rank 0's check while the other hosts' lines are still to come: each is in the endpoint a
/// host's first rank publishes during its set-up, which rank 0's own set-up need not wait for.
/// The watchdog thread looks for them without waiting (railCheckStep, a WatchdogTask), and
/// gives up at `giveUp` (set-up's deadline) saying so at INFO.
struct RailCheckLater {
  std::string group;
  std::vector<std::string> lines;  // read at set-up: this host's ranks'
  std::vector<std::string> keys;   // "ep/<rank>", one rank of each other host
  std::chrono::steady_clock::time_point giveUp;
};
/// One read of the store, waiting at most `wait`; true when the check is made or given up.
bool railCheckStep(Store& store, RailCheckLater& r, std::chrono::milliseconds wait = std::chrono::milliseconds(0));

}  // namespace railcc::engine
