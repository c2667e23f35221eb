#pragma once
// One rank's side of a one-sided (RMA) window among the ranks of a group: each rank registers
// a region of its own memory, and any rank writes into a peer's region (put) and tells it so
// (signal), without the peer taking part beyond waiting for the signal (wait_signal).
//
// Every rank serves its region from a thread of its own, on a TCP listener of the rank's
// interface. A put is remote-complete when it returns: the target has the bytes in its region
// (the target's thread acknowledged them), so a signal sent after it is seen after the data.
// Between ranks of one host (one pid namespace) a put moves no data over the socket: the
// target's thread reads it straight out of the writer's memory (process_vm_readv, one copy),
// while the writer waits; where the kernel refuses that, the bytes go over the socket. A put
// never writes into a region the target no longer has: its thread checks each put against the
// registration it holds. Connections are made at first use and authenticated by a token only
// the group's store holds.
//
// The ranks exchange their addresses and registrations through a directory (the group's
// store) under the window's own keys. Thread-safe: puts and signals from several threads.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace railcc::transport {

/// Where a window keeps its keys: set, get (waits for the key up to a timeout, then throws
/// railcc::Error kTimeout) and add, as a store offers them.
struct Directory {
  std::function<void(const std::string&, const std::string&)> set;
  std::function<std::string(const std::string&, std::chrono::milliseconds)> get;
  std::function<int64_t(const std::string&, int64_t)> add;
};

/// Who a peer is, for messages and for deciding whether it shares this host.
struct WindowPeer {
  std::string hostId;    // ranks with equal ids and pid namespaces may read each other's memory
  std::string hostname;  // for people
  std::string pidNs;      // its pid namespace ("pid:[...]"); empty: unknown, memory never read
};

class WindowEndpoint {
 public:
  /// Opens this rank's listener and publishes its address under the window's keys. Not
  /// collective: peers look the address up at first use. `peers` holds every rank, this one
  /// included; `name` names the window in messages ("window 2 of group 'default'").
  WindowEndpoint(Directory dir, int rank, std::vector<WindowPeer> peers, std::string name,
                 std::chrono::milliseconds timeout);
  ~WindowEndpoint();
  WindowEndpoint(const WindowEndpoint&) = delete;
  WindowEndpoint& operator=(const WindowEndpoint&) = delete;

  /// Collective: this rank's region is [base, base + bytes), elements of `elemSize` bytes of
  /// type `dtype` (a name puts are checked against). Throws kInvalidUsage if one is registered.
  void registerRegion(void* base, size_t bytes, size_t elemSize, const std::string& dtype);
  /// Collective: returns once every rank has deregistered (so no put is in flight into any
  /// region), or throws kTimeout naming how many had. Throws kInvalidUsage if none is.
  void deregister(std::chrono::milliseconds timeout);
  bool registered() const;

  /// Writes `bytes` at `src` (elements of `dtype`) into rank `dst`'s region at element
  /// `offsetElems`; returns once they are there. Checks the type and the bounds against the
  /// region `dst` registered (kInvalidUsage); a peer gone or silent throws kPeerFailure or
  /// kTimeout naming it and its host.
  void put(const void* src, size_t bytes, const std::string& dtype, int dst, size_t offsetElems,
           std::chrono::milliseconds timeout);
  /// Adds one to the count of signals `peer` holds from this rank; returns once it has.
  void signal(int peer, std::chrono::milliseconds timeout);
  /// Waits until `peer` has signalled this rank once more than this rank consumed, and
  /// consumes that one. Throws kTimeout (or kPeerFailure once the peer's connection dropped).
  void waitSignal(int peer, std::chrono::milliseconds timeout);
  /// How the last put to `peer` travelled: "process_vm_readv", "socket", "memcpy" (this rank), or "-".
  std::string pathTo(int peer) const;

  int rank() const;
  int size() const;
  const std::string& name() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace railcc::transport
