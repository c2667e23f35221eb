#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "transport/copy.h"

namespace railcc::transport {

/// Where a buffer lives. Host only today; CUDA and DMABUF are for the cuda_ipc and ib
/// transports, which register memory before it is sent.
enum class MemoryKind { kHost, kCuda, kDmabuf };

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
      copyOut(p, src, k);
      consume(k);
    }
    return k;
  }

  /// True when send() would take at least one byte now. Memory-based transports answer it
  /// exactly (the engine checks it before sleeping so a freed FIFO is never missed); others
  /// may answer false and rely on pollFd().
  virtual bool canSend() { return false; }

  /// A file descriptor to poll() for readiness, or -1 for memory-based transports, which
  /// wake the peer through a doorbell instead.
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

 protected:
  static void copyOut(void* dst, const void* src, size_t n);
};

}  // namespace railcc::transport
