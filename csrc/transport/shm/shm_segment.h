#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/local.h"
#include "transport/transport.h"

namespace railcc::transport::shm {

/// Header of one process's segment: its doorbell, which peers ring after they produced
/// data for it or freed space it was waiting for.
struct alignas(64) SegmentHeader {
  Doorbell door;
  std::atomic<uint32_t> failed;  // set when this process's communicator has failed
  int32_t pid;
  uint32_t nslots;
  // The CPU this process last waited on a peer from (-1: not known), so that a peer about to
  // spin for it can tell whether spinning would keep it off that CPU.
  std::atomic<int32_t> cpu;
  uint64_t fifoBytes;  // of each incoming FIFO
  uint64_t ringBytes;  // of the broadcast ring
  uint64_t magic;
  // Single copy (CMA): where this segment is mapped in its creator, so that a peer can test
  // reading the creator's memory (the magic above) before it relies on process_vm_readv.
  uint64_t selfAddr;
  // Same-host peers that have mapped this segment: its name can go once all have.
  std::atomic<uint32_t> attached;
  uint32_t hostRanks;  // its creator's group's ranks on this host: the last of the others to map it unlinks the name
};

/// One single-producer single-consumer byte FIFO. Positions only grow; the byte at
/// position p lives at data[p % capacity].
///
/// Single copy: a message may carry only the address of the producer's buffer, which the
/// consumer reads with process_vm_readv; `acked` counts the buffers it is done with (the
/// producer's send completes then), and `readable` says the consumer could read the
/// producer's memory when it connected (the producer sends addresses only then).
struct alignas(64) FifoHeader {
  alignas(64) std::atomic<uint64_t> head;  // consumer position
  alignas(64) std::atomic<uint64_t> tail;  // producer position
  alignas(64) std::atomic<uint64_t> acked;
  std::atomic<uint32_t> readable;
};

/// A mapped POSIX shared-memory segment. The creator unlinks the name once every peer has
/// mapped it (Domain::releaseName), so a killed job leaves nothing in /dev/shm.
///
/// The creator holds an exclusive flock() on the segment for as long as it lives (the kernel
/// drops it when the process dies, however it dies). That lock, not a pid, tells a live
/// segment from a stale one: a pid means nothing to a process in another pid namespace
/// (containers sharing /dev/shm), and a lock is seen by all of them.
class Segment {
 public:
  /// Creates a segment readable only by this user (0600), sized but with no page reserved
  /// (reserve()). Blocks: no. Throws kSystem naming the segment.
  Segment(const std::string& name, size_t bytes);
  /// Maps an existing segment. Throws kSystem naming the segment. `keepFd`: keep its fd open for
  /// ownerAlive() (a creator in another pid namespace); else it is closed once mapped, one fd
  /// less per same-host peer (such a creator's life is told by its pid).
  explicit Segment(const std::string& name, bool keepFd = true);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  /// The creator's: makes `bytes` from `offset` exist in /dev/shm now. Throws kSystem (naming
  /// /dev/shm's size as the likely cause) when they cannot.
  void reserve(size_t offset, size_t bytes);
  void unlink();
  /// Leaves the name to someone else (the last peer to map it): this object will not unlink it.
  void leaveName() { linked_.store(false); }
  char* data() const { return base_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  /// For a mapped peer's segment kept with its fd: whether its creator still holds it (is
  /// alive). One non-blocking flock() pair; cheap enough a few times a second.
  bool ownerAlive() const;

 private:
  std::string name_;
  int fd_ = -1;
  char* base_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;
  std::atomic<bool> linked_{false};
};

/// 16 random hex digits, for names in /dev/shm that no other process picks.
std::string randomToken();

/// The shared memory of one communicator on one process: its own segment (doorbell plus one
/// incoming FIFO per same-host rank) and the mapped segments of its same-host peers. It is
/// the LocalDomain the engine sees.
class Domain : public LocalDomain {
 public:
  /// `nslots` incoming FIFOs of `fifoBytes` each and a broadcast ring of `ringBytes`, in a
  /// segment with a random name (/railcc-<uid>-<pid>-<random>). Stale segments of this user
  /// are removed first (by the process's first Domain). Every rank of the host must use the
  /// same sizes (attach() checks).
  /// `singleCopy`: let same-host peers read this process's memory (prctl PR_SET_PTRACER, for
  /// Yama) and test, at connect(), whether we can read theirs.
  /// `hostRanks`: the ranks of this host that make one each, whose sum must fit in /dev/shm
  /// (checked here: FIFO pages are reserved only as they are first used).
  Domain(int nslots, size_t fifoBytes, size_t ringBytes, bool singleCopy = false, int hostRanks = 1);
  ~Domain() override;

  const std::string& segmentName() const { return own_->name(); }
  /// Maps a peer's segment (by the name it published). Blocks: no. Throws kInvalidUsage when
  /// its header says it was laid out with other sizes (checkLayout). `samePidNamespace`: the
  /// peer's pid tells whether it lives, so its segment's fd need not stay open.
  void attach(int localIndex, const std::string& name, bool samePidNamespace = false);
  /// Throws kInvalidUsage, naming `who` and both sets of sizes, unless a peer's segment with
  /// these sizes is laid out as ours.
  void checkLayout(const std::string& who, uint64_t nslots, uint64_t fifoBytes, uint64_t ringBytes) const;
  int slots() const { return nslots_; }
  size_t fifoBytes() const { return fifoBytes_; }
  size_t ringBytes() const { return ringBytes_; }
  /// Unlinks our own name once the host's other ranks (`hostRanks` - 1) have all attached.
  bool releaseName() override;
  void keepNameForPeers() override { keepName_ = true; }

  /// A connection whose outgoing FIFO is slot `myIndex` of the peer's segment and whose
  /// incoming FIFO is slot `peerIndex` of ours. `samePidNamespace`: the peer's pid in its
  /// segment header is one this process can look up.
  std::unique_ptr<Connection> connect(int myIndex, int peerIndex, int lane, int nlanes, bool samePidNamespace);

  BroadcastRing broadcastRing(int index) override;
  Doorbell* doorbell(int index) override { return &headerOf(index)->door; }
  int lastCpu(int index) override { return headerOf(index)->cpu.load(std::memory_order_relaxed); }
  void publishCpu(int cpu) override {
    if (header()->cpu.load(std::memory_order_relaxed) != cpu) header()->cpu.store(cpu, std::memory_order_relaxed);
  }
  void markFailed() override { header()->failed.store(1); }

  /// Segment header of local rank `index` (-1: ours).
  SegmentHeader* headerOf(int index);
  SegmentHeader* header() const { return reinterpret_cast<SegmentHeader*>(own_->data()); }

  static size_t segmentBytes(int nslots, size_t fifoBytes, size_t ringBytes);
  /// Throws kSystem, naming /dev/shm's size, when `hostRanks` segments of `segmentBytes` cannot
  /// fit in it even empty of everything else.
  static void checkRoom(size_t segmentBytes, int hostRanks);

  /// Whether this process can read local rank `index`'s memory with process_vm_readv (tested
  /// once per peer on its segment header); when not, `why` says what the kernel answered.
  bool canReadPeer(int index, std::string* why);

  /// Removes this user's /dev/shm/railcc-* segments that no live process holds (see Segment).
  static int cleanStale();

 private:
  int nslots_;
  size_t fifoBytes_;
  size_t ringBytes_;
  std::unique_ptr<Segment> own_;
  std::vector<std::unique_ptr<Segment>> peers_;
  bool singleCopy_ = false;
  int hostRanks_ = 1;
  bool keepName_ = false;  // keepNameForPeers() was called
  std::vector<int> readable_;  // per peer: -1 not tested, 0 refused, 1 readable
  std::unique_ptr<RingPages> ringPages_;  // our broadcast ring's pages, reserved as first written
};

/// The shared-memory transport for the registry (shm_transport.cpp).
std::unique_ptr<railcc::transport::Transport> makeTransport();

/// The Connection over one FIFO pair (shm_connection.cpp): `out` in the peer's segment,
/// `in` in ours, each with `cap` bytes of data after its header.
std::unique_ptr<Connection> fifoConnection(FifoHeader* out, char* outData, SegmentHeader* peerHdr, FifoHeader* in,
                                           char* inData, size_t cap, const Segment* peerSeg, bool samePidNamespace);

/// Makes the pages of [p, p + bytes) (page-aligned, in a shared mapping) exist and writable in
/// this process (MADV_POPULATE_WRITE). Returns 0, or the errno: ENOMEM or EFAULT where
/// /dev/shm has no room for them.
int populateForWrite(char* p, size_t bytes);
/// Whether FIFO data pages are reserved by their producer at first use (this kernel populates
/// on request); where not, a segment's creator reserves every page at init.
bool lazyReservation();
/// Where a region of `cap` bytes reserved lazily, [0, `reserved`) so far, must be reserved to
/// before a write that reaches `end`: at least to `end` in whole pages, and one step further
/// that doubles with what exists (16 KiB first, `maxStep` at most). A small message makes a
/// few pages exist, not a piece of them; a stream makes one call per `maxStep`.
size_t nextReserve(size_t reserved, size_t end, size_t cap, size_t maxStep);
/// Makes the pages of such a region at `data` exist up to nextReserve()'s answer (populateForWrite)
/// and moves `reserved` there. Throws kSystem, naming /dev/shm where it is full and `what` (the
/// region, as "the shared-memory FIFO to ..."), never leaving a write to raise SIGBUS.
void reserveAhead(char* data, size_t& reserved, size_t end, size_t cap, size_t maxStep, const std::string& what);

/// Reads n bytes at `addr` in process `pid` into dst (process_vm_readv, in as many calls as
/// the kernel needs). Returns 0, or the errno of the call that failed.
int readProcessMemory(int pid, void* dst, uint64_t addr, size_t n);

}  // namespace railcc::transport::shm
