#pragma once
// What ranks tell each other through the store at set-up, and how little each must read.
// (Also where this host's identity is made: hostIdentity, declared in communicator.h.)
//
// Every rank publishes its host record ("peer/<r>": host id, hostname, pid, pid namespace, CPU
// mask), but only ranks of the same host read it. What every rank needs of every other rank,
// its host, travels as a HostMap (its hosts, in rank order): run-length encoded (ranks of one
// host are usually contiguous), and combined in groups of 16 by whichever rank completes a
// group, never by a rank that waits for it. Each rank publishes its own part ("place/<r>") and
// adds one to its group's count ("gather/1/<g>", g = r / 16); the rank whose add completes the
// count reads the group's parts, merges them in rank order, publishes the merge
// ("place/1/<g>") and counts it into the next level's group in turn, and so on up to the level
// of one group, whose merge is the whole map ("hosts"). Every other rank only waits for that
// one key. No rank naps between asks for a part that is already there: a tree whose inner
// ranks wait for their children's parts left the whole machine idle for two of their naps at
// the end of the gather (~30 ms of 250 at 128 ranks on 2 cores, the longest nap growing with
// the group: c10d_store.cpp). Per rank that is a constant number of store operations (one add
// per level at most) and about one placement's bytes: 512 hosts of 8 ranks make a few KiB, not
// N records; 16 parts a group is one level up to 16 ranks, two up to 256, three up to 4,096.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "engine/store.h"
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
  /// The ranks of `parts`, one after the other (a host met again is reused).
  static HostMap concat(const std::vector<const HostMap*>& parts);
  int ranks() const;
  /// Host index of each rank, in rank order.
  std::vector<int> hostOfRank() const;
  /// Lines "h|id|name" and "r|host index|ranks"; decode() rejects what encode() cannot write,
  /// naming `who` (a store record written by something other than railcc), and a record of
  /// other than `ranks` ranks, before it expands or keeps more than that.
  std::string encode() const;
  static HostMap decode(const std::string& s, const std::string& who, int ranks);
};

/// The gather's groups (above): level 0 has one part per rank; a group of level l >= 1 merges
/// the parts [kGatherRadix * g, kGatherRadix * (g + 1)) of level l - 1 that exist, and the level
/// with one group is the last (its merge names every rank). A group of one rank has no levels.
constexpr int kGatherRadix = 16;
/// Parts at `level` for a group of `size` ranks: ceil(size / 16^level).
int gatherParts(int size, int level);
/// The last level (0 for a group of one rank).
int gatherLevels(int size);
/// Parts of level - 1 that group `group` of `level` merges: its first and how many.
std::pair<int, int> gatherMembers(int size, int level, int group);
/// The first and last rank that part `index` of `level` covers.
std::pair<int64_t, int64_t> gatherSpan(int size, int level, int index);
/// The store key of part `index` of `level`: "place/<r>" a rank's own, "place/<l>/<g>" a merge.
std::string gatherPartKey(int level, int index);
/// Publishes rank `rank`'s part `mine` and counts it in; while its count completes a group,
/// reads the group's other parts (within `timeout`), merges them in rank order, publishes the
/// merge and counts it in one level up. True once it merged the last level: `mine` is then the
/// whole map, published as "hosts". `who(level, index)` names a part in an error; `group`, the
/// process group.
bool combineHostMap(Store& store, int rank, int size, HostMap& mine, std::chrono::milliseconds timeout,
                    const std::string& group, const std::function<std::string(int, int)>& who);
/// For a wait for "hosts" that ran out: throws, naming the first part of the gather that is not
/// in the store, if any (the rank that completed its group died or stalled), else a count that
/// something other than the group's ranks changed.
void throwMissingPart(Store& store, int size, int64_t timeoutSec, const std::function<std::string(int, int)>& who);

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

/// A failure report's reason ("failed/<r>", after its "ranks=" line) that is itself a report
/// passed on ("rank 14 (host b, ...) failed: rank 13 (...) failed: <why>"), told once: the
/// innermost reason, its first line followed by the ranks that passed it on (at most 8 named),
/// so that a chain of 16 ranks does not make a first line of hundreds of characters.
std::string innermostReason(const std::string& reason);

/// Which transport reaches a peer: the first of `candidates` (name and set-up, in preference
/// order) that its endpoints offer and whose set-up can reach it by the offer. Returns its index,
/// with `rec` given the offer's channels and endpoint and `why` the set-up's reason; else -1,
/// with `tried` saying for each why not ("\n  name: ..."; `peer` names the peer there).
int firstReaching(const std::vector<std::pair<std::string, transport::Setup*>>& candidates, const Endpoints& offers,
                  const std::string& peer, transport::PeerRecord& rec, std::string& why, std::string& tried);

}  // namespace railcc::engine
