#pragma once
// What ranks tell each other through the store at set-up, and how little each must read.
// (Also where this host's identity is made: hostIdentity, declared in communicator.h.)
//
// Every rank publishes its host record ("peer/<r>": host id, hostname, pid, pid namespace, CPU
// mask), but only ranks of the same host read it. What every rank needs of every other rank,
// its host, travels as a HostMap (its hosts, in rank order): run-length encoded (ranks of one host are usually
// contiguous), gathered up a tree of ranks of radix 16 (rank r merges the placements of its
// children r + m * 16^l, m = 1..15, below r + the largest power of 16 dividing r, each covering
// the ranks that follow it) and published by rank 0 for all. Per rank that is a constant number
// of store operations and about one placement's bytes: 512 hosts of 8 ranks make a few KiB, not
// N records. The tree is wide because every level is a wait on the store, and a wait ends one
// ask after its keys appear, and the asks of a long wait are far apart (c10d_store.cpp): 128
// ranks on 2 cores spent a median 130 ms in the seven levels of a binary tree, 35 ms at 64 ranks
// in six; radix 16 is two levels up to 256 ranks and three up to 4,096.

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "transport/transport.h"

namespace railcc::engine {

/// The hosts of a run of consecutive ranks.
struct HostMap {
  struct Host {
    std::string id, name;  // host identity (ranks sharing memory have the same) and hostname
  };
  std::vector<Host> hosts;                 // in order of their first rank
  std::vector<std::pair<int, int>> runs;   // (index in hosts, consecutive ranks on it)

  static HostMap one(const std::string& id, const std::string& name);
  /// Appends `o`'s ranks after this one's (hosts already here are reused).
  void append(const HostMap& o);
  int ranks() const;
  /// Host index of each rank, in rank order.
  std::vector<int> hostOfRank() const;
  /// Lines "h|id|name" and "r|host index|ranks"; decode() rejects what encode() cannot write,
  /// naming `who` (a store record written by something other than railcc).
  std::string encode() const;
  static HostMap decode(const std::string& s, const std::string& who);
};

/// The ranks whose placements rank `rank` merges (the radix-16 tree over `size` ranks, rooted
/// at 0), in the order their ranks follow.
std::vector<int> gatherChildren(int rank, int size);

/// This process's pid namespace ("pid:[4026531836]"): pids mean something only within one.
std::string pidNamespace();
/// The CPUs this process may run on, as hex digits (CPU 0 in the lowest bit of the last digit).
std::string affinityHex();

/// Whether one host's ranks outnumber the CPUs in the union of their affinities (`masks`: each
/// rank's CPU mask as hex digits, CPU 0 in the lowest bit of the last digit).
bool ranksOutnumberCpus(const std::vector<std::string>& masks);

/// A peer's host record "hostId|hostname|pid|pid namespace|cpu mask", split and checked.
std::vector<std::string> parsePeerRecord(const std::string& v, const std::string& who);

/// A peer's published endpoints: one line per transport, "name channels blob" -> {channels, blob}.
using Endpoints = std::map<std::string, std::pair<int, std::string>>;
Endpoints parseEndpoints(const std::string& v, const std::string& who);

/// Which transport reaches a peer: the first of `candidates` (name and set-up, in preference
/// order) that its endpoints offer and whose set-up can reach it by the offer. Returns its index,
/// with `rec` given the offer's channels and endpoint and `why` the set-up's reason; else -1,
/// with `tried` saying for each why not ("\n  name: ..."; `peer` names the peer there).
int firstReaching(const std::vector<std::pair<std::string, transport::Setup*>>& candidates, const Endpoints& offers,
                  const std::string& peer, transport::PeerRecord& rec, std::string& why, std::string& tried);

}  // namespace railcc::engine
