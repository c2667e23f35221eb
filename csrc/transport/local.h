#pragma once
// What the ranks of one host share beyond their connections, as the engine sees it: each
// rank's doorbell and broadcast ring, the CPU each last waited on, a failure flag, and whether
// a local process is still alive. A transport that serves same-host peers through shared
// memory provides it (Setup::localDomain()); the engine never names that transport.

#include <sys/types.h>

#include "transport/broadcast_ring.h"
#include "transport/doorbell.h"

namespace railcc::transport {

/// True when process `pid` of this host (and pid namespace) has exited, a zombie included.
bool processGone(pid_t pid);

/// Indices are local ranks (a rank's position among its host's ranks); -1 means this rank.
/// Not thread-safe except wakeSelf(), markFailed() and the doorbells.
class LocalDomain {
 public:
  virtual ~LocalDomain() = default;
  /// The broadcast ring of local rank `index`.
  virtual BroadcastRing broadcastRing(int index) = 0;
  /// The doorbell of local rank `index`.
  virtual Doorbell* doorbell(int index) = 0;
  /// The CPU local rank `index` last waited on a peer from, -1 when not known.
  virtual int lastCpu(int index) = 0;
  /// Publishes the CPU this rank's waiting thread runs on.
  virtual void publishCpu(int cpu) = 0;
  /// Raises this rank's failure flag, which local peers see in Connection::checkAlive().
  virtual void markFailed() = 0;
  /// Lets go of what names this rank's shared memory (a file in /dev/shm) once every rank of
  /// the host it was set up with has mapped it; true once gone (or never named). One atomic load
  /// while not: the watchdog asks after set-up until it is (a name left behind by a crash is
  /// removed by the next job's sweep). Thread-safe.
  virtual bool releaseName() { return true; }
  /// Set-up succeeded: should the group end before every rank of the host mapped this rank's
  /// shared memory (made and destroyed at once), its name is left to the last of them to map
  /// it. Without this call (set-up failed: the peers fail too) or after markFailed(), the
  /// name goes with this object.
  virtual void keepNameForPeers() {}

  /// Wakes this rank's own sleeping thread (a new op was queued).
  void wakeSelf() { ring(doorbell(-1)); }
  /// Sleeps on this rank's doorbell (see sleepOn).
  template <typename F>
  void sleep(long timeoutUs, F&& recheck) {
    sleepOn(doorbell(-1), timeoutUs, recheck);
  }
};

}  // namespace railcc::transport
