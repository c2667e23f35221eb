#pragma once

#include <array>
#include <cstdint>
#include <utility>
#include <mutex>
#include <string>
#include <vector>

namespace railcc::engine {

/// Wall-clock microseconds since the epoch: comparable across ranks of one host, and across
/// hosts as far as their clocks agree (NTP keeps that within about a millisecond).
int64_t wallMicros();
/// CPU time of this whole process, in microseconds.
int64_t processCpuMicros();

/// What one communicator remembers about its recent ops, its peers' arrival times and its
/// links. Feeds the flight recorder dump, the progress record published through the store,
/// and straggler detection. Thread-safe: callers queue ops, the progress thread runs them,
/// and anyone may ask for a dump.
class Telemetry {
 public:
  enum class State : uint8_t { kQueued, kRunning, kCompleted, kFailed };

  struct OpTrace {
    uint64_t id = 0;   // 1, 2, ... over all ops of the communicator
    uint64_t seq = 0;  // collective sequence number, 0 for send/recv
    const char* op = "";     // static strings (opKindName, dtypeName, ...): no allocation per op
    const char* dtype = "";
    const char* redop = "";
    int root = -1;
    uint64_t count = 0;
    State state = State::kQueued;
    int64_t enqueueUs = 0, startUs = 0, endUs = 0;
    // Bytes per peer the op moved, one row per peer it met (a few for most algorithms, every
    // peer only for all-to-all): not one slot per rank of the group, so the recorder's memory
    // does not grow with the job. Rows of one peer may repeat until compacted (rowsOf()).
    struct PeerBytes {
      int peer;
      uint64_t sent, recvd;
    };
    std::vector<PeerBytes> bytes;
    size_t compactAt = 0;  // compact `bytes` once it holds this many rows
    std::vector<int> waitingOn;         // peers with unfinished transfers when it failed
    std::string error;                  // first line
  };

  struct LagStats {
    double meanUs = 0, maxUs = 0;
    int ops = 0;
  };
  struct LinkStats {
    int peer = -1;
    bool send = false;
    uint64_t bytes = 0;
    int64_t busyUs = 0;
    int samples = 0;
    double gbps() const { return busyUs > 0 ? static_cast<double>(bytes) / static_cast<double>(busyUs) / 1e3 : 0; }
  };

  Telemetry(int rank, int size, size_t ringSize, size_t window);

  // Flight recorder. Every call is cheap (a lock and a slot write). Names must be static strings.
  // `startedUs` > 0: the op starts as it is queued (a caller running it at once), which saves
  // opStarted's lock.
  uint64_t opQueued(uint64_t seq, const char* op, const char* dtype, const char* redop, int root, uint64_t count,
                    int64_t startedUs = 0);
  // `seq` updates the progress counters even when the op's slot was overwritten (more ops in
  // flight than the ring holds).
  void opStarted(uint64_t id, uint64_t seq, int64_t nowUs = wallMicros());
  void opBytes(uint64_t id, int peer, uint64_t sent, uint64_t recvd);
  /// Several peers' bytes under one lock: {peer, sent, received} each.
  void opBytes(uint64_t id, const std::vector<std::array<uint64_t, 3>>& rows);
  /// With `startUs`, the start times of the op as (rank, time): this rank's and what each peer
  /// it heard from stamped in its messages; they update those ranks' lag windows, under the
  /// same lock as the trace.
  void opFinished(uint64_t id, uint64_t seq, const std::string& error, const std::vector<int>& waitingOn,
                  const std::vector<std::pair<int, int64_t>>* startUs = nullptr);
  /// One transfer of `bytes` that kept a link busy for `busyUs`.
  void linkSample(int peer, bool send, uint64_t bytes, int64_t busyUs);

  /// Lag of every rank (as this rank saw them arrive) over the window.
  std::vector<LagStats> lags() const;
  /// Throughput per peer and direction over the window (links that carried nothing are left out).
  std::vector<LinkStats> links() const;

  /// Sequence numbers of the last collective queued, started and finished, and its name.
  struct Progress {
    uint64_t enqueued = 0, started = 0, completed = 0;
    const char* lastOp = "";
  };
  Progress progress() const;

  /// JSON array of the ring, oldest first.
  std::string opsJson() const;
  /// JSON of links() and lags().
  std::string linksJson() const;
  std::string lagsJson() const;

 private:
  void arrivalsLocked(const std::vector<std::pair<int, int64_t>>& startUs);  // with mu_ held
  OpTrace* find(uint64_t id);  // under mu_; null once overwritten
  static void addBytes(OpTrace& t, int peer, uint64_t sent, uint64_t recvd);  // under mu_
  static constexpr size_t kKeepRows = 64;  // a slot keeps room for this many rows between ops

  int rank_, size_;
  size_t window_;
  mutable std::mutex mu_;
  std::vector<OpTrace> ring_;
  uint64_t nextId_ = 1;
  Progress progress_;
  // per rank: recent lags (ring of window_)
  std::vector<std::vector<double>> lag_;
  std::vector<size_t> lagPos_;
  // per peer and direction: recent samples
  struct Sample {
    uint64_t bytes;
    int64_t busyUs;
  };
  std::vector<std::vector<Sample>> link_[2];
  std::vector<size_t> linkPos_[2];
};

/// Escapes a string for a JSON literal (quotes included).
std::string jsonString(const std::string& s);
/// Reads the number that follows "key" in a flat JSON record this engine wrote (a progress record).
bool jsonNumber(const std::string& doc, const char* key, long long& out);
/// `v` printed with the printf format `f` ("%.1f").
std::string formatNumber(const char* f, double v);

}  // namespace railcc::engine
