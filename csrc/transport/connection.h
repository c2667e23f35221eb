#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>

#include "transport/copy.h"

namespace railcc::transport {

/// Where a buffer lives. Host memory is all the shm, socket and pipe transports move; CUDA
/// and DMABUF are for transports that register device memory with a NIC (verbs).
enum class MemoryKind { kHost, kCuda, kDmabuf };

/// A registered buffer: what Connection::regMr returns and isend/irecv accept. Register once,
/// reuse for many requests, deregister when the buffer goes (registration may be expensive).
struct MemRegion {
  void* addr = nullptr;
  size_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
  uint64_t handle = 0;  // the transport's own (an lkey/rkey pair, a dma-buf MR, ...)
};

/// A reliable, ordered byte stream to one peer, in both directions. Every call is
/// non-blocking: it moves what it can and returns. Errors (peer closed, reset, died) throw
/// railcc::Error with code kPeerFailure. Not thread-safe: one progress thread drives it.
///
/// Receiving has two forms: recv() copies out; peek()/consume() expose the bytes in place,
/// which lets the engine reduce straight out of shared memory or a staging buffer.
class Connection {
 public:
  virtual ~Connection() = default;

  /// Copies up to n bytes from p into the stream. Returns the number taken (0 when full).
  virtual size_t send(const void* p, size_t n) = 0;

  /// Returns a readable, contiguous region (possibly empty) without consuming it.
  virtual std::pair<const void*, size_t> peek() = 0;
  /// Consumes n bytes of the region returned by the last peek().
  virtual void consume(size_t n) = 0;

  /// Copies up to n bytes into p. Returns the number delivered (0 when nothing arrived).
  virtual size_t recv(void* p, size_t n) {
    auto [src, avail] = peek();
    size_t k = avail < n ? avail : n;
    if (k > 0) {
      copyBytes(p, src, k);
      consume(k);
    }
    return k;
  }

  /// True when send() would take at least one byte now. Memory-based transports answer it
  /// exactly (the engine checks it before sleeping so a freed FIFO is never missed); others
  /// may answer false and rely on pollFd().
  virtual bool canSend() { return false; }

  /// True once after something arrived for this connection that its pollFd() may no longer
  /// show (a completion taken from a queue it shares with others, on another connection's
  /// call): the engine then moves its transfers again before it sleeps.
  virtual bool takeNews() { return false; }

  /// A file descriptor to poll() for readiness, or -1 for memory-based transports, which
  /// wake the peer through its doorbell instead (the LocalDomain's, transport/local.h): the
  /// engine then sleeps on its own doorbell, not in poll().
  virtual int pollFd() const { return -1; }

  /// Transport name and peer address, for logs and error messages ("shm", "socket 1.2.3.4:5").
  virtual std::string describe() const = 0;

  /// Checks that the peer is still alive where the transport cannot see a close (shared
  /// memory). Throws kPeerFailure. Cheap enough to call a few times a second.
  virtual void checkAlive() {}

  /// True when the peer has flagged a failure of its own (memory-based transports; a socket
  /// peer shuts its connections down instead). One atomic load: checked before every op.
  virtual bool peerReportedFailure() { return false; }

  /// Tells the peer this side has failed and will not continue the stream: sockets are shut
  /// down so the peer sees a close at once. Thread-safe (may run on an aborting thread).
  virtual void markFailed() {}

  // --- Passing buffers by address (single copy through the kernel, RDMA reads) ------------
  // A large message may carry the address of the sender's buffer (and a key) instead of its
  // bytes; the receiver moves it straight out of the sender's memory into its destination and
  // then acknowledges, and only then is the send done. Same-host peers read it through the
  // kernel (CMA); RDMA peers through an RDMA READ of the registered buffer (rendezvous). The
  // stream keeps its order: address messages are acknowledged in turn.

  /// Sends may pass addresses to this peer (it can read this process's memory).
  virtual bool peerReadsUs() { return false; }
  /// This process can read the peer's memory (and told it so): the other way round.
  virtual bool readsPeer() { return false; }
  /// Messages of at least this many bytes go by address where an algorithm allows it; `p2p`:
  /// a send/recv, whose send must still complete without the receiver where it did before.
  virtual size_t byAddressMinBytes(bool p2p) const { return ~size_t(0); }
  /// Makes [p, p + n) readable by the peer until its acknowledgement of this message, and
  /// says the key the peer needs. False: it cannot be (a registration was refused, said once
  /// by the transport): the bytes go on the stream instead.
  virtual bool exposeForRead(const void* p, size_t n, uint64_t* key) {
    *key = 0;
    return true;
  }
  /// Moves n bytes at `addr` (with `key`) in the peer's memory into dst. True once they have
  /// landed; false while they are on their way: call again with the same arguments. Throws
  /// kPeerFailure when the peer has gone or its memory can no longer be read.
  virtual bool readRemote(void* dst, uint64_t addr, uint64_t key, size_t n);
  /// Bytes a receive moves per readRemote() call (others' transfers move in between).
  virtual size_t readPieceBytes() const { return size_t(1) << 20; }
  /// Done with the peer's oldest buffer passed by address (wakes the peer). False when it
  /// cannot be said now (no room to post it): call again; the receive is not done until then.
  virtual bool ackRemote() { return true; }
  /// How many of this side's buffers passed by address the peer is done with.
  virtual uint64_t remoteAcked() { return 0; }

  // GPU memory (GPUDirect RDMA): only transports whose NIC can be given the GPU's memory take it;
  // for the others (and where registering it fails) the engine stages it through host memory.
  /// exposeForRead() for [p, p + n) of CUDA device `gpu`'s memory. False: not this way.
  virtual bool exposeDeviceForRead(const void* p, size_t n, int gpu, uint64_t* key) { return false; }
  /// Whether the message passed by address that is being received can be read straight into
  /// [dst, dst + n) of `gpu`'s memory; if so, it is made ready for the readRemote() calls into
  /// it that follow (until ackRemote()), and `keep` (what keeps that memory allocated) is held
  /// until the NIC can no longer write there, even if the op fails first. False: read it into
  /// host memory.
  virtual bool readsIntoDevice(void* dst, size_t n, int gpu, std::shared_ptr<void> keep) { return false; }

  // --- Memory registration and requests --------------------------------------------------
  // The engine's collectives drive the stream above: a message is a header the receiver
  // checks, then a payload it may reduce in place. Transports whose hardware moves whole
  // registered buffers (RDMA) also offer messages as requests, which is what this part is.
  // The defaults carry each request as one length-prefixed message on the stream, so every
  // transport supports them; a connection is used either as a stream or through requests.

  /// Registers [p, p + n) for requests. Host memory needs nothing on a stream transport;
  /// memory this transport cannot move throws kInvalidUsage naming the transport.
  virtual MemRegion regMr(void* p, size_t n, MemoryKind kind);
  virtual void deregMr(MemRegion& mr) { mr = MemRegion{}; }
  /// Starts sending n bytes of p (inside `mr`, or null for unregistered host memory).
  /// Returns a request id for test(). Blocks: no.
  virtual int isend(const void* p, size_t n, const MemRegion* mr);
  /// Starts receiving one message of at most n bytes into p. Returns a request id. Blocks: no.
  virtual int irecv(void* p, size_t n, const MemRegion* mr);
  /// Moves requests on; true once request `id` is done, with its size in `bytes`. A done
  /// request is forgotten. Requests complete in the order they were started, per direction.
  /// A message larger than its receive's n throws kInvalidUsage. Blocks: no.
  virtual bool test(int id, size_t* bytes);

 private:
  struct StreamRequest {
    int id;
    bool send;
    char* p;
    size_t n;
    uint64_t len;      // the message's length (a receive learns it from the prefix)
    size_t lenDone = 0;
    size_t done = 0;
    bool finished = false;
  };
  void progressRequests();
  std::deque<StreamRequest> sendReqs_, recvReqs_, doneReqs_;
  int nextReq_ = 1;
};

}  // namespace railcc::transport
