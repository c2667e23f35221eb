#pragma once
// Work the watchdog thread does after set-up, where a rank's set-up would otherwise wait for
// its peers': rank 0's rail check (one line per other host, in the store) and a shared-memory
// name let go once every rank of the host has mapped it. A step looks once and never waits; one
// not done is asked again after 1, 2, 4 ... ms, up to the watchdog's beat.

#include <chrono>
#include <functional>

namespace railcc::engine {

struct WatchdogTask {
  std::function<bool()> step;  // true: done (or given up)
  std::chrono::steady_clock::time_point next{};
  std::chrono::milliseconds pace{1};
};

}  // namespace railcc::engine
