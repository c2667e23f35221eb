#include "engine/algorithms/choose.h"

#include <algorithm>
#include <sstream>

#include "common/error.h"

namespace railcc::engine {

const char* algoName(Algo a) {
  switch (a) {
    case Algo::kOneShot: return "oneshot";
    case Algo::kShmRings: return "rings";
    case Algo::kHier: return "hier";
    case Algo::kPairwise: return "pairwise";
    case Algo::kChain: return "chain";
    case Algo::kDirect: return "direct";
    case Algo::kRing: return "ring";
    case Algo::kTree: return "tree";
  }
  return "?";
}

namespace {

const char* opName(AlgoOp op) {
  switch (op) {
    case AlgoOp::kAllreduce: return "all_reduce";
    case AlgoOp::kReduceScatter: return "reduce_scatter";
    case AlgoOp::kBroadcast: return "broadcast";
    case AlgoOp::kAllgather: return "all_gather";
  }
  return "?";
}

// Whether `a` can run `op` of `bytes` here.
bool fits(Algo a, AlgoOp op, size_t bytes, const AlgoPlace& p) {
  bool reducing = op == AlgoOp::kAllreduce || op == AlgoOp::kReduceScatter;
  switch (a) {
    case Algo::kOneShot: return reducing && p.size > 1 && static_cast<int64_t>(bytes) <= p.oneshotBytes;
    case Algo::kShmRings: return p.shmRings && (!reducing || p.shmRingSlices);
    case Algo::kHier: return op != AlgoOp::kBroadcast && p.hostsEven;
    case Algo::kPairwise: return reducing;
    case Algo::kChain: return op == AlgoOp::kBroadcast;
    case Algo::kDirect: return op == AlgoOp::kAllgather;
    case Algo::kRing: return p.size > 1 && op != AlgoOp::kBroadcast;
    case Algo::kTree: return p.size > 1 && (op == AlgoOp::kAllreduce || op == AlgoOp::kBroadcast);
  }
  return false;
}

}  // namespace

std::vector<Algo> parseAlgos(const std::string& spec, std::string* ignored) {
  std::vector<Algo> out;
  std::istringstream is(spec);
  std::string name;
  while (std::getline(is, name, ',')) {
    name.erase(std::remove_if(name.begin(), name.end(), [](char c) { return c == ' '; }), name.end());
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
    if (name.empty()) continue;
    bool found = false;
    for (Algo a : {Algo::kOneShot, Algo::kShmRings, Algo::kHier, Algo::kPairwise, Algo::kChain, Algo::kDirect,
                   Algo::kRing, Algo::kTree})
      if (name == algoName(a)) {
        out.push_back(a);
        found = true;
      }
    if (name == "ring") out.push_back(Algo::kChain);  // NCCL's ring broadcasts along a pipelined ring
    if (found) continue;
    if (name.rfind("collnet", 0) == 0 || name.rfind("nvls", 0) == 0 || name == "pat") {
      if (ignored) *ignored += (ignored->empty() ? "" : ", ") + name;
    } else {
      RAILCC_THROW(kInvalidUsage, "RAILCC_ALGO/NCCL_ALGO='", spec, "': unknown algorithm '", name,
                   "'; railcc has oneshot, rings, hier, pairwise, ring, tree, chain and direct");
    }
  }
  return out;
}

Algo chooseAlgo(AlgoOp op, size_t bytes, const AlgoPlace& p, const std::vector<Algo>& prefer, const char** why) {
  for (Algo a : prefer)
    if (fits(a, op, bytes, p)) {
      if (why) *why = "RAILCC_ALGO";
      return a;
    }
  const bool acrossHosts = p.localRanks < p.size;
  auto pick = [&](Algo a, const char* w) {
    if (why) *why = w;
    return a;
  };
  switch (op) {
    case AlgoOp::kAllreduce:
    case AlgoOp::kReduceScatter:
      if (op == AlgoOp::kAllreduce && acrossHosts && p.size >= kTreeMinRanks && fits(Algo::kOneShot, op, bytes, p))
        return pick(Algo::kTree, "16 or more ranks across hosts, at most RAILCC_ONESHOT_BYTES");
      // A one-shot reduce-scatter would meet every peer: across hosts from 16 ranks the rails
      // (or the ring), whatever the size.
      if (op == AlgoOp::kReduceScatter && acrossHosts && p.size >= kRingMinRanks)
        return p.hostsEven ? pick(Algo::kHier, "16 or more ranks, hosts with equal rank counts: rings along rails")
                           : pick(Algo::kRing, "16 or more ranks across hosts: two peers per rank");
      if (fits(Algo::kOneShot, op, bytes, p) && !(p.sharedCores && fits(Algo::kShmRings, op, bytes, p)))
        return pick(Algo::kOneShot, "at most RAILCC_ONESHOT_BYTES");
      if (fits(Algo::kOneShot, op, bytes, p) && static_cast<int64_t>(bytes) <= kSharedCoresOneshotBytes)
        return pick(Algo::kOneShot, "ranks share cores: at most 16384 B");
      if (fits(Algo::kShmRings, op, bytes, p)) return pick(Algo::kShmRings, "every rank on this host");
      if (op == AlgoOp::kAllreduce && fits(Algo::kHier, op, bytes, p))
        return pick(Algo::kHier, "hosts with equal rank counts");
      if (acrossHosts && p.size >= kRingMinRanks)
        return pick(Algo::kRing, "16 or more ranks across hosts: two peers per rank");
      // Below kRingMinRanks not the ring (see there: a slow cable is named more reliably when
      // a rank's links are not paced alike). The pairwise all-reduce's all-gather half goes through the broadcast rings wherever
      // they cover the group (the reduce-scatter half already checked every fingerprint).
      return pick(Algo::kPairwise, op == AlgoOp::kAllreduce && p.shmRings
                                       ? "otherwise; its all-gather half through the broadcast rings"
                                       : "otherwise");
    case AlgoOp::kBroadcast:
    case AlgoOp::kAllgather:
      // Where ranks take turns on the cores, a chain waits for one rank to be scheduled per hop;
      // through the rings each rank waits for the root alone (2x faster at 8 B-32 KiB on 4 ranks
      // and 2 cores, docs/benchmarks.md).
      if (op == AlgoOp::kBroadcast && p.sharedCores && fits(Algo::kShmRings, op, bytes, p))
        return pick(Algo::kShmRings, "ranks share cores: every rank on this host, whatever the size");
      // Where ranks share cores the bytes copied decide: each rank reads every peer's block once,
      // straight from its owner (single copy), n(n-1) copies where the rings make n more (every
      // block written into its ring first) and wait on every writer's turn on a core. 4 ranks on
      // 2 cores, 256 KiB a rank: 303 us against 719 through the rings (docs/benchmarks.md).
      if (op == AlgoOp::kAllgather && p.sharedCores && p.cmaBytes > 0 &&
          bytes >= static_cast<size_t>(std::max<int64_t>(p.cmaBytes, 4096)) && fits(Algo::kShmRings, op, bytes, p))
        return pick(Algo::kDirect, "ranks share cores: each block read once from its owner (single copy)");
      if (fits(Algo::kShmRings, op, bytes, p) && static_cast<int64_t>(bytes) > p.oneshotBytes)
        return pick(Algo::kShmRings, "every rank on this host, above RAILCC_ONESHOT_BYTES");
      // The chain's latency is n - 1 hops; a tree's, twice its depth (tree.cpp).
      if (op == AlgoOp::kBroadcast && acrossHosts && p.size >= kTreeMinRanks &&
          static_cast<int64_t>(bytes) <= p.oneshotBytes)
        return pick(Algo::kTree, "16 or more ranks across hosts, at most RAILCC_ONESHOT_BYTES: a tree along rails");
      if (op == AlgoOp::kAllgather && acrossHosts && p.size >= kRingMinRanks)
        return p.hostsEven ? pick(Algo::kHier, "16 or more ranks, hosts with equal rank counts: rings along rails")
                           : pick(Algo::kRing, "16 or more ranks across hosts: two peers per rank");
      if (op == AlgoOp::kBroadcast)
        return pick(Algo::kChain, p.hostsEven ? "otherwise; along the root's rail, then through each host" : "otherwise");
      return pick(Algo::kDirect, "otherwise");
  }
  return Algo::kPairwise;
}

int64_t cmaBytesFor(int64_t configured, bool sharedCores) {
  if (configured >= 0) return configured;
  return sharedCores ? int64_t(64) << 10 : int64_t(16) << 10;
}

bool railRing(int railRanks, const std::vector<Algo>& prefer) {
  return railRanks >= kRingMinRanks || std::find(prefer.begin(), prefer.end(), Algo::kRing) != prefer.end();
}

const char* devicePathName(DevicePath d) { return d == DevicePath::kCudaIpc ? "cuda-ipc" : "staged"; }

DevicePath chooseDevicePath(const AlgoPlace& place, bool peersMapped, const char** why) {
  const char* w = "";
  DevicePath d = DevicePath::kStaged;
  if (!place.cudaIpc) w = "RAILCC_CUDA_IPC is off, or a peer is on another host";
  else if (!peersMapped) w = "a rank could not map its peers' GPU memory";
  else {
    d = DevicePath::kCudaIpc;
    w = "every rank on this host, GPU memory mapped across";
  }
  if (why) *why = w;
  return d;
}

std::string describeRule(const AlgoPlace& p, const std::vector<Algo>& prefer) {
  std::ostringstream os;
  os << p.size << " ranks, " << p.localRanks << " on this host";
  if (p.sharedCores) os << ", sharing cores";
  if (!prefer.empty()) {
    os << "; RAILCC_ALGO prefers";
    for (Algo a : prefer) os << " " << algoName(a);
  }
  // The sizes where the choice can change: zero, the one-shot limits and just above them.
  std::vector<size_t> edges = {0};
  for (int64_t limit : {p.oneshotBytes, p.sharedCores ? kSharedCoresOneshotBytes : int64_t(-1),
                        p.sharedCores && p.cmaBytes > 0 ? std::max<int64_t>(p.cmaBytes, 4096) - 1 : int64_t(-1)})
    if (limit >= 0) edges.insert(edges.end(), {static_cast<size_t>(limit), static_cast<size_t>(limit) + 1});
  std::sort(edges.begin(), edges.end());
  for (AlgoOp op : {AlgoOp::kAllreduce, AlgoOp::kReduceScatter, AlgoOp::kBroadcast, AlgoOp::kAllgather}) {
    os << "\n  " << opName(op) << ":";
    Algo last{};
    bool first = true;
    for (size_t b : edges) {
      const char* why = "";
      Algo a = chooseAlgo(op, b, p, prefer, &why);
      if (!first && a == last) continue;
      os << (first ? " " : "; ") << (first ? "" : "from ") << (first ? "" : std::to_string(b) + " B ") << algoName(a)
         << " (" << why << ")";
      last = a;
      first = false;
    }
  }
  if (p.hostsEven && p.localRanks > 1) {
    const int rail = p.size / p.localRanks;
    os << "\n  hier between hosts (" << rail << " ranks per rail): all_reduce "
       << (railRing(rail, prefer) ? "ring" : "pairwise") << " (ring from " << kRingMinRanks
       << " ranks per rail, or where RAILCC_ALGO lists ring); reduce_scatter and all_gather, where hier runs them, ring; "
       << "tree: " << (railTree(rail) ? "recursive doubling on this host, then a binary tree per rail"
                                        : "recursive doubling over all ranks")
       << " (along rails from " << kRingMinRanks << " ranks per rail)";
  }
  if (treeRanks(0, p) > 0)  // hosts of one rank each
    os << "\n  tree between hosts of one rank each: one binary tree over all ranks (from " << kRingMinRanks << " ranks)";
  if (p.localRanks > 1) {
    os << "\n  between ranks of this host, messages ";
    if (p.cmaBytes > 0)
      os << "of at least " << std::max<int64_t>(p.cmaBytes, 4096)
         << " B in all-gather and all-to-all steps in one copy (the receiver reads the sender's buffer: "
            "CMA, where the kernel allows it), the rest";
    os << " through the shared-memory FIFOs (two copies)";
  }
  const char* why = "";
  DevicePath d = chooseDevicePath(p, true, &why);
  os << "\n  GPU buffers: " << devicePathName(d) << " (" << why << ")";
  if (d == DevicePath::kCudaIpc) os << ", else staged";
  return os.str();
}

}  // namespace railcc::engine
