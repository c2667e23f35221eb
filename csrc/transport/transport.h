#pragma once
// The transport plug-in contract. A transport is a folder under csrc/transport/ and one line
// in registry.cpp; the engine's bootstrap and algorithms know transports only through this.
//
// Modelled on NCCL's net plug-in, for one communicator at a time:
//   open()      -> a Setup for this communicator, or nullptr with the reason it cannot serve
//   endpoint()  -> an opaque blob ("listen"); the engine publishes it through the c10d store
//   reach()     -> whether (and why) this side can reach a peer from that peer's blob
//   connect() / accept() start one connection each, progress() drives them all without
//                  blocking (resumable; the engine calls it until it answers true)
//   take()      -> the finished Connection (connection.h): a byte stream with memory
//                  registration and request-based sends and receives
// The lower rank of a pair connects, the higher accepts. A pair holds `channels` connections
// per lane (the smaller of the two sides' offers), each bound to one local interface or NIC.

#include <poll.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "transport/connection.h"

namespace railcc::transport {

class LocalDomain;

/// What a transport may know of a peer at set-up.
struct PeerRecord {
  int rank = -1;
  std::string hostId;    // equal on ranks that share memory
  std::string hostname;
  int pid = 0;
  std::string pidNs;     // pid namespace: a pid means something only within one
  std::string endpoint;  // the blob this transport's Setup published on that rank
  int channels = 1;      // connections per lane that rank offers
};

/// A GPU of this host and an RDMA NIC, with the PCI path between them (PIX, PXB, PHB, SYS),
/// from the topology: what GPUDirect RDMA decisions rest on.
struct GpuNicPath {
  std::string gpu;   // "GPU 0"
  std::string nic;   // "mlx5_0"
  std::string path;
};

/// One communicator's set-up, as every transport sees it.
struct SetupContext {
  int rank = 0;
  int size = 1;
  int lanes = 1;                  // independent streams per pair (collectives, send/recv)
  std::string group;              // for logs
  Config config;
  std::vector<uint8_t> secret;    // the group secret, for transports that authenticate
  std::string pidNs;              // this rank's pid namespace (PeerRecord::pidNs); a peer's record
                                  // comes with connect()/accept()/reach(), never a list of every rank
  std::vector<int> localRanks;    // ranks that share this host's memory, this one included
  // From the topology, when known (else -1 and empty): this rank's rail, and per rail of this
  // host the network interface of its NIC ("" where it has none with an IPv4 address).
  // Transports between hosts keep a rank's traffic on its rail's NIC.
  int rail = -1;
  std::vector<std::string> railIfs;
  std::vector<GpuNicPath> gpuNics;  // every GPU x RDMA NIC pair of this host (topology)
  // The group's store, for what a pair made at first use must tell each other beyond the
  // endpoints (a verbs queue pair's number): publish sets a key of this group; peek reads one
  // without waiting more than a few milliseconds (false while it is unset). Unset in tests
  // that drive a Setup alone (verbs, which needs them, then does not open).
  std::function<void(const std::string&, const std::string&)> publish;
  std::function<bool(const std::string&, std::string&)> peek;
};

class Setup {
 public:
  virtual ~Setup() = default;
  /// This rank's endpoint blob ("" when it needs none). Called once, before any connect.
  virtual std::string endpoint() = 0;
  /// How many connections per lane this rank offers a peer (interfaces x sockets, NICs x QPs).
  virtual int channels() const { return 1; }
  /// Why this side can reach `peer` ("same host", "both have an IPv4 interface"), or "" when
  /// it cannot. `peer.endpoint` is the blob the peer published; empty (a pair whose endpoint is
  /// read at its first use), the answer is this side's alone, and set-up asks it once per group.
  virtual std::string reach(const PeerRecord& peer) = 0;
  /// Starts the connection (peer, lane, channel) from this side (the lower rank). Blocks: no.
  virtual void connect(const PeerRecord& peer, int lane, int channel) = 0;
  /// Expects the peer to connect (peer, lane, channel) to this side. Blocks: no.
  virtual void accept(const PeerRecord& peer, int lane, int channel) = 0;
  /// Called, with nothing registered yet or more to come, while bootstrap waits for peers'
  /// endpoints: serve what already arrives (a listener's strangers) for up to `budget`.
  virtual void idle(std::chrono::milliseconds budget) {}
  /// Moves every started connection on; true once all are done. May wait up to `budget` for
  /// something to happen (a poll), never longer. Throws railcc::Error with the peer in
  /// `ranks` (kPeerFailure, kTimeout at `deadline`).
  virtual bool progress(std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds budget) = 0;
  /// Connections made at their first use (RAILCC_RUNTIME_CONNECT): connect()/accept() may come
  /// at any time during the group's life, progress() serves them (and peers that dial early)
  /// and never reports done, ready() says which are up, and finish() is never called: the
  /// setup lives as long as the group.
  virtual bool lazy() const { return false; }
  /// Lazy setups, while a rank waits for connections to come up: appends the fds whose
  /// readiness moves a handshake on (listeners, handshakes in flight) and returns how long the
  /// caller may sleep in poll() before progress() must run anyway (a dial to retry, a knock
  /// due), in ms. The default has no fds: look again in a millisecond.
  virtual int pollFds(std::vector<pollfd>& out) { return 1; }
  /// (peer, lane, channel) is up and may be taken. Lazy setups only.
  virtual bool ready(int peer, int lane, int channel) { return false; }
  /// This rank has failed (lazy setups): peers that dial it from now on, or wait in its
  /// backlog, are refused. Thread-safe (may run on an aborting thread).
  virtual void markFailed() {}
  /// The finished connection (once progress() returned true); the caller owns it.
  virtual std::unique_ptr<Connection> take(int peer, int lane, int channel) = 0;
  /// This rank's connections are up (its peers may still be taking theirs): release what no
  /// peer needs any more. What peers may still open (a shared-memory name) goes later, when
  /// they have (LocalDomain::releaseName). Blocks: no.
  virtual void finish() {}
  /// What this rank shares with the peers of its host (doorbells, broadcast rings), for a
  /// transport that maps their memory; null for any other.
  virtual std::shared_ptr<LocalDomain> localDomain() { return nullptr; }
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string name() const = 0;
  /// False for a transport that only reaches ranks sharing this host's memory.
  virtual bool interHost() const = 0;
  /// A Setup for one communicator, or nullptr with `whyNot` set (no device, disabled, ...).
  virtual std::unique_ptr<Setup> open(const SetupContext& ctx, std::string& whyNot) = 0;
};

using TransportFactory = std::function<std::unique_ptr<Transport>()>;

/// Registers a transport under `name`. Lower `preference` is tried first for a peer pair;
/// a name registered twice replaces the first. Thread-safe.
void registerTransport(const std::string& name, int preference, TransportFactory factory);
/// Removes a transport registered by name (tests). Thread-safe.
void unregisterTransport(const std::string& name);

struct Registered {
  std::string name;
  int preference;
  TransportFactory factory;
};
/// Every registered transport, most preferred first: the built-ins (registry.cpp) plus any
/// registered at run time.
std::vector<Registered> registeredTransports();

}  // namespace railcc::transport
