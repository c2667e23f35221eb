#pragma once
// Which algorithm runs a collective: one rule, in one place, that can be printed.
//
// The inputs are what every rank of a group knows alike (the op, its size in bytes, how the
// ranks sit on hosts, the configuration), so every rank picks the same algorithm without
// talking. RAILCC_ALGO (or NCCL_ALGO) lists algorithms to prefer: for each op the first one
// listed that can run it here wins; otherwise the rule decides.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace railcc::engine {

enum class Algo : uint8_t {
  kOneShot,   // every rank sends its block to every peer and reduces in rank order: one step
  kShmRings,  // the shared-memory broadcast rings, "rings" (all ranks on one host, three or more)
  kHier,      // per host, then per rail across hosts (then per host again): all-reduce,
              // reduce-scatter, all-gather
  kPairwise,  // reduce-scatter then all-gather by pairwise exchanges (NCCL's "ring" family)
  kChain,     // pipelined chain from the root (broadcast)
  kDirect,    // every peer at once, nothing reduced (all-gather)
  kRing,      // around a ring of all ranks, host by host: two peers per rank (all-reduce,
              // reduce-scatter, all-gather)
  kTree,      // recursive doubling: log2(n) + 2 steps, whole buffers (small all-reduces); for
              // broadcast, a binary tree along the root's rail, then within each host
};

const char* algoName(Algo a);

/// Where ranks share cores and the broadcast rings cover the group, the rule takes the one-shot
/// reduction only up to this many bytes (or RAILCC_ONESHOT_BYTES if smaller): each rank of it
/// copies its whole buffer n-1 times where the rings copy about twice, and from 32 KiB on a
/// 4-rank all-reduce on 2 cores was about twice as fast through the rings.
constexpr int64_t kSharedCoresOneshotBytes = 16384;
/// RAILCC_CMA_BYTES=-1 (its default): single copy between ranks of a host from 1 MiB, or from
/// 64 KiB where the host's ranks share cores. There the FIFO's second copy needs the sender
/// scheduled again, and a read through the kernel needs only the receiver: 4 ranks on 2 CPUs,
/// all-to-all of 256 KiB 182 -> 94 us and of 1 MiB 435 -> 207 us (thresholds of 4 and 16 KiB
/// were no better); with a CPU per rank, 64 KiB made 2-rank all-to-alls slower (25 -> 37 us).
int64_t cmaBytesFor(int64_t configured, bool sharedCores);

/// Across hosts, an all-reduce small enough for the one-shot runs by recursive doubling (tree)
/// from this many ranks: every rank of the one-shot sends its buffer to each of n-1 peers. On
/// ranks of fake hosts on one machine (tools/scale_harness.py, docs/history/), 8 bytes:
/// tree 0.98x the one-shot's time at 4 ranks, 0.82x at 8, 0.70x at 16 and 0.55x at 32. Those
/// ranks share 2 cores, so the count of messages weighs more than on a real network, where the
/// one-shot's single step may win at 8: the switch is at 16, where the gain was clear.
constexpr int kTreeMinRanks = 16;

/// Across hosts, from this many ranks taking part in a network stage (the whole group, or the
/// ranks of one rail under `hier`), large reductions and every all-gather run around a ring:
/// two peers per rank whatever the job's size, where the pairwise schedule meets n-1 peers
/// (each a lazy connection, with its buffers) and the direct all-gather sends n-1 messages at
/// once. On ranks of fake hosts on one machine, 1 MiB all-reduce: ring 0.93x pairwise's time
/// at 4 ranks, 0.83x at 8, 0.75x at 16, 0.44x at 32 (docs/history/). Below 16 pairwise
/// stays: with one send link and one receive link per rank a ring paces every link to the
/// slowest, so the watchdog's comparison of a rank's links names a slow cable less often.
constexpr int kRingMinRanks = 16;

enum class AlgoOp : uint8_t { kAllreduce, kReduceScatter, kBroadcast, kAllgather };

struct AlgoPlace {
  int size = 1;
  int localRanks = 1;
  bool shmRings = false;     // the shared-memory broadcast rings cover the group
  bool shmRingSlices = false;  // and are large enough for the reducing ring algorithms
  bool hostsEven = false;    // two or more hosts with the same number (two or more) of ranks
  bool hostsOfOne = false;   // two or more hosts, each with one rank of the group
  int64_t oneshotBytes = 0;  // RAILCC_ONESHOT_BYTES
  // Some host has more ranks of the group than CPUs they may run on (from every rank's CPU
  // affinity, which all ranks exchange at set-up). There every byte a rank copies is taken
  // from a core another rank waits for, so the total copied decides, not the steps.
  bool sharedCores = false;
  bool cudaIpc = false;      // RAILCC_CUDA_IPC on, two or more ranks, every one on this host
  int64_t cmaBytes = 0;      // RAILCC_CMA_BYTES: single copy between ranks of a host from here
};

/// How an op on GPU buffers runs: the collective on the GPUs through CUDA IPC, in place, or
/// the host algorithm chosen above on copies staged through pinned host memory.
enum class DevicePath : uint8_t { kCudaIpc, kStaged };
const char* devicePathName(DevicePath d);

/// `peersMapped`: every rank of the group mapped every peer's IPC pool and events on this
/// device (known only at the group's first device op; all ranks learn the same answer).
DevicePath chooseDevicePath(const AlgoPlace& place, bool peersMapped, const char** why);

/// Parses RAILCC_ALGO / NCCL_ALGO: comma-separated names, case-insensitive. NCCL's "ring" and
/// "tree" are railcc's (ring also takes the chain broadcast, a pipelined ring from the root);
/// NCCL algorithms railcc lacks (collnet*, nvls*, pat) are skipped and named in `ignored`.
/// Anything else throws kInvalidUsage listing the valid names.
std::vector<Algo> parseAlgos(const std::string& spec, std::string* ignored);

/// The algorithm for one op of `bytes` bytes; `why` says which rule (or preference) chose it.
Algo chooseAlgo(AlgoOp op, size_t bytes, const AlgoPlace& place, const std::vector<Algo>& prefer, const char** why);

/// Whether `hier`'s stage between hosts (the ranks of one rail, `railRanks` of them) runs
/// around a ring instead of pairwise: from kRingMinRanks, or wherever RAILCC_ALGO lists ring.
bool railRing(int railRanks, const std::vector<Algo>& prefer);
/// Whether the small all-reduce (kTree) goes along rails, a binary tree over each rail after
/// recursive doubling within the host (3 network peers per rank instead of log2 of the hosts):
/// from kRingMinRanks hosts of equal rank counts.
inline bool railTree(int railRanks) { return railRanks >= kRingMinRanks; }
/// The ranks of the small all-reduce's binary tree between hosts (tree.cpp), or 0 for
/// recursive doubling over all ranks: a rail's (`railRanks`, 0 without rails) where railTree
/// says so, and every rank where each host runs one (recursive doubling would meet log2 n
/// network peers: 12 at 4,096 hosts; the tree 3, at about twice its steps).
inline int treeRanks(int railRanks, const AlgoPlace& p) {
  if (railTree(railRanks)) return railRanks;
  return p.hostsOfOne && railTree(p.size) ? p.size : 0;
}

/// The barrier is a one-byte all-reduce (its peers are the small all-reduce's) from
/// kTreeMinRanks ranks across hosts, where a dissemination would meet 2 log2 n network peers;
/// below, a dissemination over all ranks (a few peers, and a stray message of an op the ranks
/// disagreed on is read, and named, by the barrier that follows it).
inline bool barrierByAllreduce(const AlgoPlace& p) { return p.localRanks < p.size && p.size >= kTreeMinRanks; }

/// The rule as it applies to this group, one line per op: logged by rank 0 at INFO (COLL).
std::string describeRule(const AlgoPlace& place, const std::vector<Algo>& prefer);

}  // namespace railcc::engine
