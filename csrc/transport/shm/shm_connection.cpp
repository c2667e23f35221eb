// The shm transport's Connection: a pair of single-producer FIFOs in the two ranks' segments
// (shm_segment.h lays them out), one written by each side, with futex wake-ups.
#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/error.h"
#include "common/log.h"
#include "transport/shm/shm_segment.h"
#include "transport/stats.h"

namespace railcc::transport::shm {

// Bytes moved per FIFO update. Publishing in pieces lets the consumer copy out while the
// producer is still copying in; one 4 MiB memcpy per update made the two take turns.
constexpr size_t kPiece = 256u << 10;

namespace {

class ShmConnection : public Connection {
 public:
  ShmConnection(FifoHeader* out, char* outData, SegmentHeader* peerHdr, FifoHeader* in, char* inData, size_t cap,
                const Segment* peerSeg)
      : out_(out), outData_(outData), peerHdr_(peerHdr), in_(in), inData_(inData), cap_(cap), peerSeg_(peerSeg),
        populated_(lazyReservation() ? 0 : cap), headSeen_(out->head.load(std::memory_order_acquire)) {}

  size_t send(const void* p, size_t n) override {
    uint64_t tail = out_->tail.load(std::memory_order_relaxed);
    // The consumer's position as last read: its line moves to the consumer's core on every
    // consume, so reading it on every send would add a cache miss to each message's path.
    // Only a short FIFO makes us look again.
    size_t space = cap_ - static_cast<size_t>(tail - headSeen_);
    if (space < std::min(n, kPiece)) {
      headSeen_ = out_->head.load(std::memory_order_acquire);
      space = cap_ - static_cast<size_t>(tail - headSeen_);
    }
    size_t k = std::min({n, space, kPiece});
    if (k == 0) return 0;
    size_t off = static_cast<size_t>(tail % cap_);
    size_t first = k < cap_ - off ? k : cap_ - off;
    // Positions only grow, so the bytes below `off` were written before: the FIFO's pages are
    // reserved up to the furthest byte written so far, in steps of a piece.
    if (off + first > populated_) reserveUpTo(off + first);
    copyBytes(outData_ + off, p, first);
    if (k > first) copyBytes(outData_, static_cast<const char*>(p) + first, k - first);
    out_->tail.store(tail + k, std::memory_order_seq_cst);
    wake(&peerHdr_->door);
    addStat(StatKind::kShm, Stat::kSendCopied, k);
    return k;
  }

  bool canSend() override {
    uint64_t tail = out_->tail.load(std::memory_order_relaxed);
    if (tail - headSeen_ < cap_) return true;
    headSeen_ = out_->head.load(std::memory_order_seq_cst);  // seq_cst: the recheck before sleeping
    return tail - headSeen_ < cap_;
  }

  std::pair<const void*, size_t> peek() override {
    uint64_t head = in_->head.load(std::memory_order_relaxed);
    uint64_t tail = in_->tail.load(std::memory_order_acquire);
    size_t avail = static_cast<size_t>(tail - head);
    size_t off = static_cast<size_t>(head % cap_);
    size_t k = avail < cap_ - off ? avail : cap_ - off;
    return {inData_ + off, k};
  }

  void consume(size_t n) override {
    uint64_t head = in_->head.load(std::memory_order_relaxed);
    in_->head.store(head + n, std::memory_order_seq_cst);
    // The producer may be asleep waiting for space.
    wake(&peerHdr_->door);
    addStat(StatKind::kShm, Stat::kRecvCopied, n);
  }

  size_t recv(void* p, size_t n) override {
    size_t got = 0;
    while (got < n) {
      auto [src, avail] = peek();
      size_t k = std::min({avail, n - got, kPiece});
      if (k == 0) break;
      copyBytes(static_cast<char*>(p) + got, src, k);
      consume(k);
      got += k;
    }
    return got;
  }

  std::string describe() const override { return "shm"; }

  bool peerReadsUs() override { return out_->readable.load(std::memory_order_relaxed) != 0; }
  bool readsPeer() override { return in_->readable.load(std::memory_order_relaxed) != 0; }

  bool readRemote(void* dst, uint64_t addr, uint64_t, size_t n) override {
    int err = readProcessMemory(peerHdr_->pid, dst, addr, n);
    if (err == 0) {
      addStat(StatKind::kShm, Stat::kSingleCopied, n);
      return true;
    }
    checkAlive();  // a peer that exited says so
    RAILCC_THROW(kPeerFailure, "reading ", n, " bytes of its memory (single copy) failed: ", strerror(err));
  }

  bool ackRemote() override {
    in_->acked.fetch_add(1, std::memory_order_seq_cst);
    wake(&peerHdr_->door);
    return true;
  }

  uint64_t remoteAcked() override { return out_->acked.load(std::memory_order_acquire); }

  bool peerReportedFailure() override { return peerHdr_->failed.load(std::memory_order_relaxed) != 0; }

  void checkAlive() override {
    if (peerHdr_->failed.load())
      RAILCC_THROW(kPeerFailure, "it reported a failure of its own");
    // Where the peer's pid is ours to read, it decides (a peer that only destroyed this group
    // frees its segment but lives on, and one whose forked child inherited the lock is still
    // gone). From another pid namespace its pid means nothing: its lock goes when it dies.
    if (samePidNamespace_ ? processGone(peerHdr_->pid) : !peerSeg_->ownerAlive())
      RAILCC_THROW(kPeerFailure, "its process ", peerHdr_->pid, " on this host exited");
  }

 private:
  // The peer's FIFO pages this side writes, made to exist before the first write reaches them
  // (shm_segment.h, lazyReservation): a /dev/shm that has run out is an error here, not a SIGBUS.
  void reserveUpTo(size_t end) {
    reserveAhead(outData_, populated_, end, cap_, kPiece,
                 "the shared-memory FIFO to the same-host process " + std::to_string(peerHdr_->pid));
  }

  FifoHeader* out_;
  char* outData_;
  SegmentHeader* peerHdr_;
  FifoHeader* in_;
  char* inData_;
  size_t cap_;
  const Segment* peerSeg_;
  size_t populated_;  // bytes of the FIFO's data reserved (from its start)
  // The consumer's position when this side last read it: never ahead of the real one, so the
  // space it leaves is never more than there is (the consumer is done with what it passed).
  uint64_t headSeen_;
 public:
  bool samePidNamespace_ = false;
};

}  // namespace

int readProcessMemory(int pid, void* dst, uint64_t addr, size_t n) {
  size_t done = 0;
  while (done < n) {
    iovec local{static_cast<char*>(dst) + done, n - done};
    iovec remote{reinterpret_cast<void*>(addr + done), n - done};
    ssize_t k = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return errno;
    if (k == 0) return EFAULT;
    done += static_cast<size_t>(k);
  }
  return 0;
}

std::unique_ptr<Connection> fifoConnection(FifoHeader* out, char* outData, SegmentHeader* peerHdr, FifoHeader* in,
                                           char* inData, size_t cap, const Segment* peerSeg, bool samePidNamespace) {
  auto conn = std::make_unique<ShmConnection>(out, outData, peerHdr, in, inData, cap, peerSeg);
  conn->samePidNamespace_ = samePidNamespace;
  return conn;
}

}  // namespace railcc::transport::shm
