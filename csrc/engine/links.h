#pragma once
// A communicator's connections beyond the rendezvous (connections.cpp, bootstrap.cpp):
// connections made at first use (RAILCC_RUNTIME_CONNECT), the transports' set-ups that make
// them, kept for the group's life, and per peer the one that reaches it (null: connected at
// init, or ourselves; or, with `chooseLater`, one of `choices`, the first the peer's endpoint
// allows). Also what names each peer's link (PeerInfo::transport), which such a connection fills
// in later: `Links::mu` guards it from then on (CommImpl::linkOf). The rest is the engine
// thread's.

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/spin.h"
#include "engine/wire.h"
#include "transport/transport.h"

namespace railcc::engine {

struct LazyPeer {  // one per rank: the rest of the peer's record is peers_'s (recordOf)
  transport::Setup* setup = nullptr;
  std::string endpoint;  // the peer's blob for `via`
  int channels = 1;
  std::array<bool, kLanes> started{};  // per lane: connect()/accept() called
  bool named = false;          // peers_[peer].transport names a real connection
  bool endpointLater = false;  // endpoint not read yet: `via`'s line of the peer's ep/ key
  bool chooseLater = false;    // `setup` and `via` chosen among links_.choices with that endpoint
  uint8_t via = 0;             // the set-up's transport name: links_.names[via]
  uint8_t endpointMisses = 0;  // reads of its endpoint that found none: the next waits longer
  Clock::time_point endpointRetry{};  // no read before then
};
struct Links {
  mutable std::mutex mu;
  std::vector<std::unique_ptr<transport::Setup>> setups;  // engine thread (bootstrap) writes, then fixed
  std::vector<std::pair<std::string, transport::Setup*>> choices;  // several between hosts, in preference order
  std::vector<LazyPeer> peers;                              // engine thread
  std::vector<std::string> names;                           // LazyPeer::via
  Clock::time_point retryAt = Clock::time_point::max();     // the next endpoint read due (connectingFds)
  bool collectiveRead = false;  // the endpoints of every collective peer read (readCollectiveEndpoints)
  uint8_t nameOf(const std::string& n);                     // its index in names, added if new
};

}  // namespace railcc::engine
