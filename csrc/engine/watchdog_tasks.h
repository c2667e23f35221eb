#pragma once
// The watchdog thread's shared state (WatchdogShared, under its `mu`), and the work it does
// after set-up, where a rank's set-up would otherwise wait for
// its peers': rank 0's rail check (one line per other host, in the store) and a shared-memory
// name let go once every rank of the host has mapped it. A step looks once and never waits; one
// not done is asked again after 1, 2, 4 ... ms, up to the watchdog's beat.

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/store.h"

namespace railcc::engine {

struct WatchdogTask {
  std::function<bool()> step;  // true: done (or given up)
  std::chrono::steady_clock::time_point next{};
  std::chrono::milliseconds pace{1};
};

// What the watchdog thread shares with its communicator, kept alive by both (shared_ptr) so that
// the thread can be detached at teardown: the progress record, stragglers, what set-up left
// (tasks), and every store write after set-up (a frozen store blocks only the watchdog).
struct WatchdogShared {
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false, exited = false, drained = true;
  bool inComm = false;  // the watchdog uses the communicator outside `mu` (GPU checks): teardown waits
  std::vector<std::pair<std::string, std::string>> publish;  // keys to set now (failure reports)
  std::shared_ptr<Store> keep;  // keeps the store alive for a detached watchdog
  Store* store = nullptr;
  std::vector<WatchdogTask> tasks;  // set before the thread starts, then its own
};

}  // namespace railcc::engine
