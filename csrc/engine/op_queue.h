#pragma once
// The op queue of one communicator (progress.cpp runs it): the ops callers queue, and the engine
// token. `OpQueue::mu` guards what callers share with the engine (and Health::abortWhy); the
// rest is the token holder's: the progress thread, or a caller running its own op in wait().

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/communicator.h"
#include "engine/wire.h"

namespace railcc::engine {

// Counts the ops of a communicator that exist (queued, running, or finished but not yet let
// go), for Communicator::drain: one atomic add when an op is queued, one sub when it goes.
class LiveOps {
 public:
  LiveOps() = default;
  LiveOps(const LiveOps&) = delete;
  LiveOps& operator=(const LiveOps&) = delete;
  ~LiveOps() {
    if (n_) n_->fetch_sub(1, std::memory_order_release);
  }
  void attach(std::atomic<int64_t>* n) {
    n_ = n;
    n_->fetch_add(1, std::memory_order_relaxed);
  }

 private:
  std::atomic<int64_t>* n_ = nullptr;
};

// One queued op: what every layer may know of it (OpStamp), its body, and its request.
struct Op : OpStamp {
  LiveOps live;
  bool p2p = false;
  std::function<void()> body;
  Transfer xfer;    // for sends and receives
  std::shared_ptr<DeviceSide> gpu;  // xfer's GPU memory (xfer.device), kept while the op lives
  bool anySource = false;
  bool device = false;  // runs through a GPU: only the progress thread, which set the device, runs it
  RequestPtr req;
};

struct OpQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::unique_ptr<Op>> queue;  // under mu: queued by callers
  std::atomic<size_t> queued{0};          // how many queue holds: the hot path reads this, not mu
  bool closing = false;                   // under mu: shutdown began, new ops fail at once
  // The engine token (under mu): whoever holds it (the progress thread, or a caller running
  // its own op in wait()) is the only thread touching channels, queues and transports.
  bool busy = false;
  bool kick = false;  // under mu: a caller left work behind: the progress thread should take the token
  std::atomic<uint64_t> collSeq{0};  // the last collective's sequence number (callers)
  // The token holder's: ops taken from `queue` (drainQueue), collectives in order, started
  // sends and receives, and receives from any source not matched yet.
  std::deque<std::unique_ptr<Op>> drained;
  std::deque<std::unique_ptr<Op>> coll;
  std::vector<std::unique_ptr<Op>> p2p;
  std::vector<std::unique_ptr<Op>> anySource;
  std::vector<int> p2pPeers;  // p2pPeers()'s, kept between calls
  std::thread thread;
  std::atomic<bool> stop{false};  // shutdown: finish what is queued, then exit
};

}  // namespace railcc::engine
