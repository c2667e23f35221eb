#pragma once
// Registered segments: blocks of memory from torch's caching allocator (a DDP bucket, any
// tensor) that the one-kernel ops (cuda/shots.h) read in place. Each segment is mapped by
// every peer once, through its CUDA IPC handle, and closed by every peer before its owner frees
// it, as CUDA requires. None of it costs a host round per op:
//
// * Every rank has a board (SegmentBoard) in host memory its group's ranks on the host share
//   (transport/host_shared.h): kSegSlots slots it alone writes (a segment's handle and size
//   under a generation, odd while live) and, per peer, the generation of each slot that peer
//   has caught up with (its ack).
// * The owner offers a segment when an op first meets a buffer in it (offer()), and that op
//   goes through the scratch as before. Each peer's watcher thread, woken by the owner's
//   doorbell, opens the handle, writes the pointer into the table its kernels read
//   (ShotPeers::segs) and acks. From the op after every peer has acked, place() names the
//   buffer in the segment and peers read it there.
// * Before the owner frees a segment (the allocator's SEGMENT_FREE, allocator_segments.h),
//   revoke() moves the slot's generation to even and waits until every peer has closed its
//   mapping and acked that generation (a peer whose group is torn down counts as done: it
//   closed everything). A peer that never answers is named in the log after the wait's bound.
//
// A peer that cannot open a handle acks with kAckRefused, and that segment goes through the
// scratch for as long as it lives. Thread-safety: place() and offer() come from the engine's
// thread, revoke() from whichever thread frees memory, catchUp() from the watcher.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/device_api.h"
#include "cuda/shots.h"
#include "transport/doorbell.h"

namespace railcc::engine {

struct SegmentSlot {
  std::atomic<uint32_t> gen;  // odd: live (handle, bytes), even: none; only the owner writes it
  uint32_t reserved;
  uint64_t bytes;
  unsigned char handle[cuda::kIpcHandleBytes];
};

/// One rank's board (zeroed memory is an empty board).
struct SegmentBoard {
  transport::Doorbell changed;  // rung by peers whose slots changed: wakes this rank's watcher
  transport::Doorbell acked;    // rung by peers that caught up with this rank's slots
  std::atomic<uint32_t> gone;   // this rank closed every mapping and stopped its watcher
  SegmentSlot slots[cuda::kSegSlots];
  std::atomic<uint32_t> ack[cuda::kMaxSignalPeers][cuda::kSegSlots];  // [q][s]: what peer q caught up with
};

constexpr uint32_t kAckRefused = 0x80000000u;  // or'ed into an ack: that peer could not map it

class SegmentRegistry {
 public:
  /// `boards[q]`: rank q's board as mapped here (boards[rank] is ours). `table`: the
  /// n * kSegSlots pointers the kernels read (ShotPeers::segs), host memory, zeroed.
  /// `revokeWait`: how long revoke() waits for peers to close a segment. `release` runs in the
  /// destructor: what keeps the boards mapped and the table allocated lets go there, so a
  /// revoke still running on another thread never reads them after teardown.
  SegmentRegistry(const cuda::DeviceApi& api, int rank, std::vector<SegmentBoard*> boards, char** table, int device,
                  std::chrono::milliseconds revokeWait, std::function<std::string(int)> rankName,
                  std::function<void()> release = nullptr);
  ~SegmentRegistry();
  SegmentRegistry(const SegmentRegistry&) = delete;
  SegmentRegistry& operator=(const SegmentRegistry&) = delete;

  // The owner's side.
  /// The place (cuda::shotSegmentPlace) of [p, p + bytes), wholly inside a segment every peer
  /// has mapped; cuda::kInScratch otherwise.
  uint64_t place(const void* p, size_t bytes);
  /// Offers the segment [base, base + bytes) to the peers (once: a segment offered, refused or
  /// unexportable is not offered again until revoked). False when it was not offered now.
  bool offer(char* base, size_t bytes);
  /// Whether [p, p + 1) lies in a segment this rank has offered (live or refused).
  bool offered(const void* p);
  /// A kernel that reads `place` (a segment's) was queued on `stream`: revoke() waits for it
  /// to finish before peers close the segment (the allocator frees a segment only after its
  /// blocks' last uses were queued, not run). Engine thread.
  void used(uint64_t place, void* stream);
  /// The segment at `base` is about to be freed: peers close it first (bounded wait). False
  /// when some peer did not answer in time (named in the log).
  bool revoke(const char* base);
  /// Every segment revoked (teardown), then the watcher stopped and every peer's segment
  /// closed here; the board says so (`gone`).
  void shutdown();

  // The peers' side.
  void startWatcher();
  /// Opens what peers offered, closes what they revoked, and acks both. Any thread.
  void catchUp();
  /// Mappings of peers' segments open here now.
  size_t mappedCount();

 private:
  struct Own {
    char* base = nullptr;
    size_t bytes = 0;
    uint32_t gen = 0;     // as on the board
    bool usable = false;  // every peer acked gen
    bool refused = false; // a peer could not map it, or the handle failed: scratch while it lives
    bool closing = false; // revoked, peers not all closed yet: not offered again meanwhile
    char* closingBase = nullptr;  // the segment being closed (a revoke of it waits for that)
    void* lastUse = nullptr;      // an event after the last kernel that read it
  };
  int peers() const { return static_cast<int>(boards_.size()); }
  bool changedSince();
  // Moves live slot s to its next (even) generation; false when it was not live.
  bool revokeLocked(size_t s);
  // Waits (unlocked) until every peer closed `slots` (slot, generation) or is gone, at most
  // revokeWait; false, naming the silent peers in the log, when some did not.
  bool waitClosed(std::unique_lock<std::mutex>& g, const std::vector<std::pair<size_t, uint32_t>>& slots);
  // Waits (unlocked) until the kernels queued on slot s's segment have finished, at most
  // revokeWait.
  void waitUnused(std::unique_lock<std::mutex>& g, size_t s);

  const cuda::DeviceApi& api_;
  const int rank_;
  std::vector<SegmentBoard*> boards_;
  char** table_;
  const int device_;
  const std::chrono::milliseconds revokeWait_;
  std::function<std::string(int)> rankName_;
  std::function<void()> release_;

  std::mutex ownMu_;
  std::condition_variable closed_;  // a slot's closing ended
  std::vector<Own> own_;  // [slot]
  std::vector<bool> silent_;  // [q]: did not answer a revoke in time once: not waited for again

  std::mutex peerMu_;
  std::vector<uint32_t> seen_;  // [q * kSegSlots + s]: the generation mapped (or unmapped) here

  std::thread watcher_;
  std::atomic<bool> stop_{false};
  bool shut_ = false;
};

/// The segment of torch's caching allocator that holds p (allocator_segments.h): false when
/// none the allocator's hook told of does.
bool findSegment(const void* p, char** base, size_t* bytes);
/// Lists a registry for segmentFreeing() while it lives.
void enlistSegments(const std::shared_ptr<SegmentRegistry>& r);

}  // namespace railcc::engine
