#pragma once
// The watchdog of one group (watchdog.cpp): a thread that publishes this rank's progress record
// every RAILCC_PROGRESS_INTERVAL_MS, finds stragglers and slow links, writes every store key
// after set-up (a frozen store blocks only it), does the work set-up left (watchdog_tasks.h) and
// asks the engine to check its GPU work; and, for the engine's error paths, what the other
// ranks' records say (who never called an op, who froze), the flight-recorder dump and the
// straggler report. Private to csrc/engine.
//
// Locks: Stragglers::mu guards what the thread found (health.h); WatchdogShared::mu what the
// thread shares with the engine (watchdog_tasks.h); traceMu_ one dump at a time. beats_ is the
// engine thread's (heartbeatStopped).

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/communicator.h"
#include "engine/health.h"
#include "engine/store.h"
#include "engine/telemetry.h"
#include "engine/watchdog_tasks.h"

namespace railcc::engine {

// What the watchdog asks of the engine around it (any thread).
class WatchdogHost {
 public:
  virtual std::string rankName(int r) const = 0;
  virtual std::string linkOf(int r) const = 0;
  virtual int globalRank(int r) const = 0;
  virtual std::exception_ptr brokenError() const = 0;
  /// Checks the group's GPU work and fails the group when some is late; `next` is when to look
  /// again at the latest.
  virtual void checkGpu(Clock::time_point* next) = 0;
  virtual bool gpuWatched() const = 0;

 protected:
  ~WatchdogHost() = default;
};

class Watchdog {
 public:
  // `peers` is filled in by set-up, before start(); `keep` keeps a store the glue owns alive
  // for a thread left behind (null: the caller's store, always joined).
  Watchdog(WatchdogHost& host, const CommOptions& opts, Telemetry& tele, int rank, int size,
           const std::vector<PeerInfo>& peers, Store* store, std::shared_ptr<Store> keep);

  // ---- life (the engine's set-up and teardown)
  /// Work set-up leaves for the thread (before start()).
  void addTask(WatchdogTask t) { wd_->tasks.push_back(std::move(t)); }
  bool keepsStore() const { return wd_->keep != nullptr; }
  /// Publishes a first progress record now and starts the thread.
  void start();
  /// Stops the thread; one blocked in an unreachable store is left behind after 2 s.
  void stop();

  // ---- the engine's error paths (any thread)
  /// Reads `key` within about `wait` even when the store itself hangs (its host frozen or the
  /// network cut): the read then runs on a helper thread that is left behind if it overruns.
  bool storeTryGet(const std::string& key, Millis wait, std::string& out);
  /// The store's host has exited (a store that watches its server; never for others).
  bool storeLost() { return store_->lost(); }
  /// Has the thread set `key` (a failure report) as soon as it can; waitPublished() gives it
  /// up to `wait` to have done so.
  void publish(const std::string& key, const std::string& value);
  void waitPublished(Millis wait);
  /// The StragglerError pending for the next op (RAILCC_STRAGGLER_ACTION=raise), once; a load
  /// of one flag per op when there is none.
  bool takeStraggler(std::string& msg, std::vector<int>& ranks) {
    return strag_.pending.load(std::memory_order_acquire) && takePendingStraggler(msg, ranks);
  }
  /// Engine thread: whether `peer`, waited on without a connection, stopped rewriting its
  /// progress record (ten of its intervals, 2 s at least); `why` then says so.
  bool heartbeatStopped(int peer, std::string& why);
  /// The progress of the ranks that have not finished op `seq`, for a timeout's message, and
  /// the ranks to blame (never called it, else frozen).
  std::string describePeerProgress(uint64_t seq, std::vector<int>& culprits);
  /// Of the global ranks `globals`, those still silent: gone, stopped, or not reporting.
  std::vector<int> stillSilent(const std::vector<int>& globals);
  std::string traceJson(const std::string& reason) const;
  std::string writeTrace(const std::string& reason, const std::string& dir = "") const;
  std::string stragglerReport();

 private:
  void loop(std::shared_ptr<WatchdogShared> w);  // the thread
  bool takePendingStraggler(std::string& msg, std::vector<int>& ranks);
  void checkStragglers();
  std::string progressRecord() const;
  const std::string& hostname() const { return peers_[static_cast<size_t>(rank_)].hostname; }
  bool ownDump(const std::string& path) const;  // absent, or written by this process
  // Links are compared with others of the same transport and direction: a send into a shm
  // FIFO with room is a memcpy, a receive waits for the sender's copy.
  std::string linkClass(const Telemetry::LinkStats& l) const;
  static constexpr int kMinLinkSamples = 3;  // fewer timed transfers say nothing about a link
  std::map<std::string, std::vector<double>> ratesByClass(const std::vector<Telemetry::LinkStats>& links) const;

  WatchdogHost& host_;
  const CommOptions& opts_;
  Telemetry& tele_;
  const int rank_, size_;
  const std::vector<PeerInfo>& peers_;
  Store* store_;
  std::shared_ptr<WatchdogShared> wd_;  // shared with the thread, so that it can be detached
  std::thread thread_;
  mutable std::mutex traceMu_;
  Stragglers strag_;
  struct Beat {
    std::string record;       // the peer's progress record as last read
    Clock::time_point since;  // when it was first read so
  };
  std::map<int, Beat> beats_;
};

}  // namespace railcc::engine
