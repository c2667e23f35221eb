#pragma once
// How a group stands, two parts of a communicator that its threads share: Health (whether it
// failed, why, and which ranks it learned dead since) and Stragglers (what the watchdog found of
// slow ranks and links). Each names the lock that guards it; the rest is one thread's, as said.
// Private to csrc/engine, like comm_impl.h, which owns one of each.

#include <atomic>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine/spin.h"

namespace railcc::engine {

struct Health {
  std::atomic<bool> aborted{false};
  std::string abortWhy;  // under OpQueue::mu
  mutable std::mutex errMu;
  std::exception_ptr broken;           // the error every later op fails with (errMu)
  std::atomic<bool> brokenSet{false};  // broken is set
  std::atomic<bool> memberDown{false};  // another group of this rank failed us: raise broken
  // Global ranks learned dead after the group broke (errMu): another group of this rank saw
  // them die (a shrink's new group, say). railcc.failed_ranks() names them with broken's, so
  // that a retried shrink leaves out every rank that is gone, not only the first.
  std::vector<int> laterDead;
  // Set-up: an error that came from a peer's published init failure, and when we last looked.
  bool initFailSeen = false;
  Clock::time_point lastInitFailCheck{};
  size_t reportTurn = 0;  // checkPeersReported's place among the peers waited on (engine thread)
};

// watchdog.cpp (Watchdog): `mu` guards what the watchdog found and the caller reads.
struct Stragglers {
  mutable std::mutex mu;
  std::mutex checkMu;  // one checkStragglers() at a time
  std::vector<bool> lagFlagged;
  std::set<std::pair<int, bool>> linkFlagged;
  std::string msg;                   // pending StragglerError for the next op (RAILCC_STRAGGLER_ACTION=raise)
  std::atomic<bool> pending{false};  // msg is not empty
  std::vector<int> ranks;
  std::string peerProgressJson = "{}";  // what describePeerProgress concluded, for the dump
};

}  // namespace railcc::engine
