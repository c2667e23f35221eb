#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/net.h"

namespace railcc::transport::shm {

/// True when process `pid` of this host has exited (including a zombie nobody reaped yet).
bool processGone(pid_t pid);

/// Header of one process's segment: its doorbell, which peers ring after they produced
/// data for it or freed space it was waiting for.
struct alignas(64) SegmentHeader {
  std::atomic<uint32_t> bell;
  std::atomic<uint32_t> sleeping;
  std::atomic<uint32_t> failed;  // set when this process's communicator has failed
  int32_t pid;
  uint32_t nslots;
  // The CPU this process last waited on a peer from (-1: not known), so that a peer about to
  // spin for it can tell whether spinning would keep it off that CPU.
  std::atomic<int32_t> cpu;
  uint64_t fifoBytes;  // of each incoming FIFO
  uint64_t ringBytes;  // of the broadcast ring
  uint64_t magic;
};

/// One single-producer single-consumer byte FIFO. Positions only grow; the byte at
/// position p lives at data[p % capacity].
struct alignas(64) RingHeader {
  alignas(64) std::atomic<uint64_t> head;  // consumer position
  alignas(64) std::atomic<uint64_t> tail;  // producer position
};

/// One producer, many consumers: a process's broadcast ring, which every same-host peer
/// reads. The producer writes each byte once however many peers read it (a broadcast through
/// per-peer FIFOs would copy it once per peer). Positions only grow; consumer c's position
/// lives at heads[c] in the producer's segment, each on its own cache line.
class BcastRing {
 public:
  BcastRing() = default;
  BcastRing(SegmentHeader* owner, std::atomic<uint64_t>* tail, char* heads, char* data, size_t cap)
      : owner_(owner), tail_(tail), heads_(heads), data_(data), cap_(cap) {}

  // Producer side. `consumers` are the local indices that read this ring.
  size_t write(const void* p, size_t n, const std::vector<int>& consumers, const std::vector<SegmentHeader*>& wake);
  bool canWrite(const std::vector<int>& consumers) const;
  // Consumer side, as local index c.
  std::pair<const void*, size_t> peek(int c) const;
  void consume(int c, size_t n);
  bool readable(int c) const { return tail_->load(std::memory_order_acquire) > head(c).load(std::memory_order_relaxed); }
  size_t capacity() const { return cap_; }

  // Whole blocks, for ops that read parts of a peer's data where it lies. A block starts on a
  // 64-byte boundary and never wraps around the ring's end; the bytes skipped to get there
  // count as part of it. Producer and consumers work out the same skip from their positions,
  // which agree as long as every block is written and consumed by these calls with the same
  // sizes. A block of at most blockMax() bytes always fits once the consumers have caught up
  // (with the alignment and the skip, it takes less than 2 x blockMax() + 64 bytes).
  size_t blockMax() const { return cap_ % 64 == 0 && cap_ >= 256 ? cap_ / 2 - 64 : 0; }
  // Producer: where the next n-byte block goes, or nullptr while a consumer is too far behind.
  char* reserve(size_t n, const std::vector<int>& consumers) const;
  void publish(size_t n, const std::vector<SegmentHeader*>& wake);
  // Consumer c: the next n-byte block once all of it is there, else nullptr.
  const char* block(int c, size_t n) const;
  void release(int c, size_t n);

 private:
  std::atomic<uint64_t>& head(int c) const { return *reinterpret_cast<std::atomic<uint64_t>*>(heads_ + 64 * c); }
  SegmentHeader* owner_ = nullptr;
  std::atomic<uint64_t>* tail_ = nullptr;
  char* heads_ = nullptr;
  char* data_ = nullptr;
  size_t cap_ = 0;
};

/// A mapped POSIX shared-memory segment. The creator unlinks the name as soon as every
/// peer has mapped it, so a killed job leaves nothing in /dev/shm.
///
/// The creator holds an exclusive flock() on the segment for as long as it lives (the kernel
/// drops it when the process dies, however it dies). That lock, not a pid, tells a live
/// segment from a stale one: a pid means nothing to a process in another pid namespace
/// (containers sharing /dev/shm), and a lock is seen by all of them.
class Segment {
 public:
  /// Creates a segment readable only by this user (0600). Blocks: no. Throws kSystem.
  Segment(const std::string& name, size_t bytes);
  /// Maps an existing segment. Throws kSystem naming the segment.
  explicit Segment(const std::string& name);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  void unlink();
  char* data() const { return base_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  /// For a mapped peer's segment: whether its creator still holds it (is alive). One
  /// non-blocking flock() pair; cheap enough a few times a second.
  bool ownerAlive() const;

 private:
  std::string name_;
  int fd_ = -1;
  char* base_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;
  bool linked_ = false;
};

/// The shared memory of one communicator on one process: its own segment (doorbell plus one
/// incoming FIFO per same-host rank) and the mapped segments of its same-host peers.
class Domain {
 public:
  /// `nslots` incoming FIFOs of `fifoBytes` each and a broadcast ring of `ringBytes`, in a
  /// segment with a random name (/railcc-<uid>-<pid>-<random>). Stale segments of this user
  /// are removed first. Every rank of the host must use the same sizes (attach() checks).
  Domain(int nslots, size_t fifoBytes, size_t ringBytes);
  ~Domain();

  const std::string& segmentName() const { return own_->name(); }
  /// Maps a peer's segment (by the name it published). Blocks: no. Throws kInvalidUsage when
  /// its header says it was laid out with other sizes (checkLayout).
  void attach(int localIndex, const std::string& name);
  /// Throws kInvalidUsage, naming `who` and both sets of sizes, unless a peer's segment with
  /// these sizes is laid out as ours.
  void checkLayout(const std::string& who, uint64_t nslots, uint64_t fifoBytes, uint64_t ringBytes) const;
  int slots() const { return nslots_; }
  size_t fifoBytes() const { return fifoBytes_; }
  size_t ringBytes() const { return ringBytes_; }
  /// Unlinks our own name once every peer has attached.
  void unlinkOwn() { own_->unlink(); }

  /// A connection whose outgoing FIFO is slot `myIndex` of the peer's segment and whose
  /// incoming FIFO is slot `peerIndex` of ours. `samePidNamespace`: the peer's pid in its
  /// segment header is one this process can look up.
  std::unique_ptr<Connection> connect(int myIndex, int peerIndex, int lane, int nlanes, bool samePidNamespace);

  /// The broadcast ring of local rank `index` (ours or an attached peer's).
  BcastRing bcastRing(int index);
  /// Segment header of local rank `index`, for doorbells.
  SegmentHeader* headerOf(int index);

  SegmentHeader* header() const { return reinterpret_cast<SegmentHeader*>(own_->data()); }
  /// Raises this process's failure flag, which peers see in Connection::checkAlive().
  void markFailed() { header()->failed.store(1); }
  /// Publishes the CPU this process's waiting thread runs on (a store only when it changed).
  void publishCpu(int cpu) {
    if (header()->cpu.load(std::memory_order_relaxed) != cpu) header()->cpu.store(cpu, std::memory_order_relaxed);
  }
  /// Wakes this process's progress thread (e.g. a new op was queued).
  void ringSelf();
  /// Sleeps until a peer rings the doorbell or `timeoutUs` passes. `recheck` runs after the
  /// sleeping flag is raised, so a ring that races with going to sleep is never lost: when
  /// it returns true (work is there) the call returns at once.
  template <typename F>
  void sleep(long timeoutUs, F&& recheck) {
    SegmentHeader* h = header();
    h->sleeping.store(1, std::memory_order_seq_cst);
    uint32_t v = h->bell.load(std::memory_order_seq_cst);
    if (!recheck()) futexWait(&h->bell, v, timeoutUs);
    h->sleeping.store(0, std::memory_order_relaxed);
  }

  static void ring(SegmentHeader* h);
  static void futexWait(std::atomic<uint32_t>* addr, uint32_t expected, long timeoutUs);
  static size_t segmentBytes(int nslots, size_t fifoBytes, size_t ringBytes);

  /// Removes this user's /dev/shm/railcc-* segments that no live process holds (see Segment).
  static int cleanStale();

 private:
  int nslots_;
  size_t fifoBytes_;
  size_t ringBytes_;
  std::unique_ptr<Segment> own_;
  std::vector<std::unique_ptr<Segment>> peers_;
};


/// The shared-memory transport for the registry (shm_setup.cpp).
std::unique_ptr<railcc::transport::Transport> makeTransport();
/// The domain behind a shared-memory Setup (its broadcast rings and doorbell serve the
/// same-host algorithms and the progress thread's sleep), or null for another transport's.
std::shared_ptr<Domain> domainOf(Setup* setup);

}  // namespace railcc::transport::shm
