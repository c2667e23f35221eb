#include "engine/simulate.h"

#include <algorithm>
#include <deque>

#include "common/error.h"
#include "engine/algorithms/choose.h"
#include "engine/algorithms/schedule.h"
#include "engine/records.h"

namespace railcc::engine {

namespace {

// Ranks start, start + stride, ...: a host's ranks, a rail, or the whole job.
struct Group {
  int start = 0, stride = 1, m = 1;
  int at(int j) const { return start + j * stride; }
  int pos(int r) const { return (r - start) / stride; }
};

// The bytes of block j when `count` elements of `es` bytes are cut into m blocks (as the
// engine's Blocks does: the first count % m blocks one element larger).
uint64_t blockBytes(size_t count, int m, int j, size_t es) {
  const size_t base = count / static_cast<size_t>(m), rem = count % static_cast<size_t>(m);
  return (base + (static_cast<size_t>(j) < rem ? 1 : 0)) * es;
}

enum class Kind { kRingReduce, kRingGather, kPairReduce, kPairGather, kPairSeparate, kPairBlocks, kAll, kDoubling, kTree, kChain,
                  kBcastTree, kRailChain };

// One stage of a rank's schedule: `count` elements over `g` (kAll, kPairSeparate, kChain,
// kPairBlocks: `count` is a byte count per message; kPairBlocks sends `per` of them a step).
struct Phase {
  Kind kind;
  Group g;
  size_t count;
  int steps;
  int per = 1;
};

struct Step {
  std::vector<std::pair<int, uint64_t>> sends;
  std::vector<int> recvs;
  void clear() {
    sends.clear();
    recvs.clear();
  }
};

class Planner {
 public:
  Planner(const SimJob& job, size_t es, bool railRing, bool railTree)
      : job_(job), es_(es), railRing_(railRing), railTree_(railTree) {}

  // The phases of rank r for one op of the chosen algorithm.
  std::vector<Phase> plan(Algo a, const std::string& op, size_t bytes, int r) const {
    const int n = job_.size, L = job_.perHost;
    const Group all{0, 1, n}, host{r / L * L, 1, L}, rail{r % L, L, n / L};
    const size_t count = bytes / es_;
    std::vector<Phase> ph;
    if (op == "all_reduce") {
      switch (a) {
        case Algo::kOneShot: ph.push_back({Kind::kAll, all, bytes, 1}); break;
        case Algo::kTree:  // along rails from 16 hosts: within the host, then a binary tree per rail
          if (railTree_) {
            ph.push_back({Kind::kDoubling, host, bytes, 0});
            ph.push_back({Kind::kTree, rail, bytes, 0});
          } else {
            ph.push_back({Kind::kDoubling, all, bytes, 0});
          }
          break;
        case Algo::kRing:
          ph.push_back({Kind::kRingReduce, all, count, n - 1});
          ph.push_back({Kind::kRingGather, all, count, n - 1});
          break;
        case Algo::kPairwise:
          ph.push_back({Kind::kPairReduce, all, count, n - 1});
          ph.push_back({Kind::kPairGather, all, count, n - 1});
          break;
        case Algo::kHier: {
          const size_t piece = blockBytes(count, L, host.pos(r), 1);
          ph.push_back({Kind::kPairReduce, host, count, L - 1});
          if (railRing_) {
            ph.push_back({Kind::kRingReduce, rail, piece, rail.m - 1});
            ph.push_back({Kind::kRingGather, rail, piece, rail.m - 1});
          } else {
            ph.push_back({Kind::kPairReduce, rail, piece, rail.m - 1});
            ph.push_back({Kind::kPairGather, rail, piece, rail.m - 1});
          }
          ph.push_back({Kind::kPairGather, host, count, L - 1});
          break;
        }
        default: unsupported(a, op);
      }
    } else if (op == "reduce_scatter") {
      if (a == Algo::kHier) {  // the host's terms for each rank of the rail, then the rail's ring
        ph.push_back({Kind::kPairBlocks, host, bytes, L - 1, rail.m});
        ph.push_back({Kind::kRingReduce, rail, count * static_cast<size_t>(rail.m), rail.m - 1});
      } else if (a == Algo::kOneShot) ph.push_back({Kind::kAll, all, bytes, 1});
      else if (a == Algo::kPairwise) ph.push_back({Kind::kPairSeparate, all, bytes, n - 1});
      else if (a == Algo::kRing) ph.push_back({Kind::kRingReduce, all, count * static_cast<size_t>(n), n - 1});
      else unsupported(a, op);
    } else if (op == "all_gather") {
      if (a == Algo::kHier) {  // the rail's ring, then the rail's blocks to each rank of the host
        ph.push_back({Kind::kRingGather, rail, count * static_cast<size_t>(rail.m), rail.m - 1});
        ph.push_back({Kind::kPairBlocks, host, bytes, L - 1, rail.m});
      } else if (a == Algo::kDirect) ph.push_back({Kind::kAll, all, bytes, 1});
      else if (a == Algo::kRing) ph.push_back({Kind::kRingGather, all, count * static_cast<size_t>(n), n - 1});
      else unsupported(a, op);
    } else if (op == "broadcast") {  // from rank 0
      if (a == Algo::kTree) ph.push_back({Kind::kBcastTree, all, bytes, 0});
      else if (a == Algo::kChain && railLinks()) ph.push_back({Kind::kRailChain, all, bytes, 0});
      else if (a == Algo::kChain) ph.push_back({Kind::kChain, all, bytes, r == 0 ? 1 : 2});
      else unsupported(a, op);
    }
    return ph;
  }

  // Step k of phase p for rank r.
  void step(const Phase& p, int r, int k, Step& out) const {
    out.clear();
    const Group& g = p.g;
    const int m = g.m, i = g.pos(r);
    switch (p.kind) {
      case Kind::kRingReduce: {
        const auto s = schedule::ringReduceStep(m, i, k);
        out.sends.push_back({g.at(schedule::mod(i + 1, m)), blockBytes(p.count, m, s.send, es_)});
        out.recvs.push_back(g.at(schedule::mod(i - 1, m)));
        break;
      }
      case Kind::kRingGather: {
        const auto s = schedule::ringGatherStep(m, i, k);
        out.sends.push_back({g.at(schedule::mod(i + 1, m)), blockBytes(p.count, m, s.send, es_)});
        out.recvs.push_back(g.at(schedule::mod(i - 1, m)));
        break;
      }
      case Kind::kPairReduce:
      case Kind::kPairGather:
      case Kind::kPairSeparate: {
        const auto s = schedule::pairwiseStep(m, i, k + 1);
        const uint64_t b = p.kind == Kind::kPairSeparate ? p.count
                           : blockBytes(p.count, m, p.kind == Kind::kPairReduce ? s.to : i, es_);
        out.sends.push_back({g.at(s.to), b});
        out.recvs.push_back(g.at(s.from));
        break;
      }
      case Kind::kPairBlocks: {
        const auto s = schedule::pairwiseStep(m, i, k + 1);
        for (int j = 0; j < p.per; ++j) out.sends.push_back({g.at(s.to), p.count});
        for (int j = 0; j < p.per; ++j) out.recvs.push_back(g.at(s.from));
        break;
      }
      case Kind::kAll:
        for (int j = 0; j < m; ++j)
          if (j != i) {
            out.sends.push_back({g.at(j), p.count});
            out.recvs.push_back(g.at(j));
          }
        break;
      case Kind::kDoubling: {
        const schedule::Doubling d = schedule::doubling(m, i);
        const bool fold = d.foldPeer >= 0;
        if (fold && (k == 0 || k == schedule::doublingSteps(d) - 1)) {
          const bool send = (k == 0) == d.hands;  // hands on first, takes the result back last
          if (send) out.sends.push_back({g.at(d.foldPeer), p.count});
          else out.recvs.push_back(g.at(d.foldPeer));
        } else {
          const int partner = schedule::doublingPartner(d, 1 << (k - (fold ? 1 : 0)));
          out.sends.push_back({g.at(partner), p.count});
          out.recvs.push_back(g.at(partner));
        }
        break;
      }
      case Kind::kTree: {  // children in, up, back down, out to the children
        const schedule::TreeLinks t = schedule::binaryTree(m, i);
        const int j = k - (t.nkids > 0 ? 1 : 0);
        if (j < 0)
          for (int c = 0; c < t.nkids; ++c) out.recvs.push_back(g.at(t.kids[c]));
        else if (t.parent >= 0 && j == 0) out.sends.push_back({g.at(t.parent), p.count});
        else if (t.parent >= 0 && j == 1) out.recvs.push_back(g.at(t.parent));
        else
          for (int c = 0; c < t.nkids; ++c) out.sends.push_back({g.at(t.kids[c]), p.count});
        break;
      }
      case Kind::kBcastTree: {  // from the parent; to the children, their acknowledgements back; up
        const schedule::BcastLinks b = bcastLinks(r);
        const int j = k - (b.parent >= 0 ? 1 : 0);
        if (j < 0) {
          out.recvs.push_back(b.parent);
        } else if (j == 0 && b.nkids > 0) {
          for (int c = 0; c < b.nkids; ++c) out.sends.push_back({b.kids[c], p.count});
          for (int c = 0; c < b.nkids; ++c) out.recvs.push_back(b.kids[c]);
        } else {
          out.sends.push_back({b.parent, 0});
        }
        break;
      }
      case Kind::kRailChain: {  // from the rail or host before; on, with the acknowledgements; up the rail
        const schedule::ChainLinks c = chainLinks(r);
        const int j = k - (c.from >= 0 ? 1 : 0);
        if (j < 0) {
          out.recvs.push_back(c.from);
        } else if (j == 0 && (c.nto > 0 || c.nacks > 0 || c.tailAck >= 0)) {
          for (int t = 0; t < c.nto; ++t) out.sends.push_back({c.to[t], p.count});
          for (int t = 0; t < c.nacks; ++t) out.recvs.push_back(c.acksFrom[t]);
          if (c.tailAck >= 0) out.sends.push_back({c.tailAck, 0});
        } else {
          out.sends.push_back({c.ackTo, 0});
        }
        break;
      }
      case Kind::kChain:  // from position 0: receive, then forward; the tail tells the root
        if (i == 0) {
          if (m > 1) out.sends.push_back({g.at(1), p.count});
          if (m > 1) out.recvs.push_back(g.at(m - 1));
        } else if (k == 0) {
          out.recvs.push_back(g.at(i - 1));
        } else {
          out.sends.push_back({g.at(i == m - 1 ? 0 : i + 1), i == m - 1 ? 0 : p.count});
        }
        break;
    }
  }

  int stepsOf(const Phase& p, int r) const {
    if (p.kind == Kind::kBcastTree) return schedule::bcastSteps(bcastLinks(r));
    if (p.kind == Kind::kRailChain) return schedule::railChainSteps(chainLinks(r));
    if (p.kind == Kind::kTree) return schedule::treeSteps(schedule::binaryTree(p.g.m, p.g.pos(r)));
    if (p.kind != Kind::kDoubling) return p.steps;
    return schedule::doublingSteps(schedule::doubling(p.g.m, p.g.pos(r)));
  }

 private:
  // Rank r's links in the broadcast tree from rank 0: along rails where hosts hold two or more
  // ranks each (the sim's ranks are host by host, as the engine's ringOrder()).
  schedule::BcastLinks bcastLinks(int r) const {
    const int L = job_.perHost > 1 && job_.perHost < job_.size ? job_.perHost : 1;
    return schedule::bcastTree(job_.size / L, L, 0, 0, r / L, r % L);
  }
  // The large broadcast from rank 0 along rails, where hosts hold two or more ranks each.
  bool railLinks() const { return job_.perHost > 1 && job_.perHost < job_.size; }
  schedule::ChainLinks chainLinks(int r) const {
    const int L = job_.perHost;
    return schedule::railChain(job_.size / L, L, 0, 0, r / L, r % L);
  }
  [[noreturn]] static void unsupported(Algo a, const std::string& op) {
    RAILCC_THROW(kInvalidUsage, "railcc sim: ", op, " by ", algoName(a),
                 " is not simulated (the shared-memory rings of a one-host group are not modelled)");
  }
  const SimJob& job_;
  size_t es_;
  bool railRing_;  // hier's all-reduce runs its rails as rings
  bool railTree_;  // the small all-reduce runs a binary tree along each rail
};

}  // namespace

SimResult simulateOp(const SimJob& job, const std::string& op, size_t bytes, size_t elemSize, bool perRank) {
  const int n = job.size, L = job.perHost;
  if (n < 1 || L < 1 || n % L != 0)
    RAILCC_THROW(kInvalidUsage, "railcc sim: ", n, " ranks at ", L, " per host: the ranks must fill whole hosts");
  if (elemSize == 0 || bytes % elemSize != 0)
    RAILCC_THROW(kInvalidUsage, "railcc sim: ", bytes, " bytes is not a whole number of ", elemSize, "-byte elements");
  AlgoOp aop;
  if (op == "all_reduce") aop = AlgoOp::kAllreduce;
  else if (op == "reduce_scatter") aop = AlgoOp::kReduceScatter;
  else if (op == "all_gather") aop = AlgoOp::kAllgather;
  else if (op == "broadcast") aop = AlgoOp::kBroadcast;
  else RAILCC_THROW(kInvalidUsage, "railcc sim: unknown op '", op, "' (all_reduce, reduce_scatter, all_gather, broadcast)");
  AlgoPlace place;
  place.size = n;
  place.localRanks = L;
  place.rings = L == n && n > 2;
  place.ringSlices = place.rings;
  place.hostsEven = L > 1 && L < n;
  place.hostsOfOne = L == 1 && n > 1;
  place.oneshotBytes = job.oneshotBytes;
  const std::vector<Algo> prefer = job.algo.empty() ? std::vector<Algo>{} : parseAlgos(job.algo, nullptr);
  const Algo a = n == 1 ? Algo::kPairwise : chooseAlgo(aop, bytes, place, prefer, nullptr);
  const bool rails = railRing(n / L, prefer), treeRails = treeRanks(place.hostsEven ? n / L : 0, place) > 0;
  SimResult res;
  res.algo = algoName(a);
  if (a == Algo::kHier) res.algo += aop != AlgoOp::kAllreduce || rails ? " (rails: ring)" : " (rails: pairwise)";
  if (a == Algo::kTree && (aop == AlgoOp::kBroadcast ? place.hostsEven : treeRails))
    res.algo += place.hostsOfOne ? " (binary tree)" : " (rails: binary tree)";
  if (a == Algo::kChain && place.hostsEven) res.algo += " (rails)";
  if (perRank) res.sent.resize(static_cast<size_t>(n));
  if (n == 1) return res;

  Planner planner(job, elemSize, rails, treeRails);
  struct Cursor {
    std::vector<Phase> phases;
    size_t phase = 0;
    int k = 0, kEnd = 0;
    int64_t t = 0;
    bool posted = false;
  };
  std::vector<Cursor> cur(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    Cursor& c = cur[static_cast<size_t>(r)];
    c.phases = planner.plan(a, op, bytes, r);
    while (c.phase < c.phases.size() && (c.kEnd = planner.stepsOf(c.phases[c.phase], r)) == 0) ++c.phase;
  }
  // inbox[r]: per sender, the start times of the steps whose messages r has not taken yet.
  std::vector<std::vector<std::pair<int, std::deque<int64_t>>>> inbox(static_cast<size_t>(n));
  auto queue = [&inbox](int to, int from) -> std::deque<int64_t>& {
    auto& box = inbox[static_cast<size_t>(to)];
    for (auto& [src, q] : box)
      if (src == from) return q;
    box.emplace_back(from, std::deque<int64_t>());
    return box.back().second;
  };
  std::vector<std::vector<int>> peers(static_cast<size_t>(n));
  std::vector<uint64_t> msgs(static_cast<size_t>(n)), sentB(static_cast<size_t>(n)), netB(static_cast<size_t>(n));
  Step st;
  std::vector<int> need;
  int left = n;
  for (int r = 0; r < n; ++r)
    if (cur[static_cast<size_t>(r)].phase >= cur[static_cast<size_t>(r)].phases.size()) --left;
  while (left > 0) {
    bool moved = false;
    for (int r = 0; r < n; ++r) {
      Cursor& c = cur[static_cast<size_t>(r)];
      while (c.phase < c.phases.size()) {
        planner.step(c.phases[c.phase], r, c.k, st);
        if (!c.posted) {
          for (auto& [to, b] : st.sends) {
            queue(to, r).push_back(c.t);
            peers[static_cast<size_t>(r)].push_back(to);
            ++msgs[static_cast<size_t>(r)];
            sentB[static_cast<size_t>(r)] += b;
            if (to / L != r / L) netB[static_cast<size_t>(r)] += b;
            if (perRank && b) {
              auto& v = res.sent[static_cast<size_t>(r)];
              auto it = std::find_if(v.begin(), v.end(), [to = to](const auto& e) { return e.first == to; });
              if (it == v.end()) v.push_back({to, b});
              else it->second += b;
            }
          }
          c.posted = true;
        }
        bool ready = true;
        need.assign(st.recvs.begin(), st.recvs.end());  // k receives from a peer need k messages
        std::sort(need.begin(), need.end());
        for (size_t x = 0; x < need.size() && ready;) {
          size_t y = x;
          while (y < need.size() && need[y] == need[x]) ++y;
          ready = queue(r, need[x]).size() >= y - x;
          x = y;
        }
        if (!ready) break;
        int64_t t = c.t;
        for (int from : st.recvs) {
          auto& q = queue(r, from);
          t = std::max(t, q.front());
          q.pop_front();
          peers[static_cast<size_t>(r)].push_back(from);
        }
        c.t = t + 1;
        c.posted = false;
        moved = true;
        if (++c.k == c.kEnd) {
          c.k = 0;
          ++c.phase;
          while (c.phase < c.phases.size() && (c.kEnd = planner.stepsOf(c.phases[c.phase], r)) == 0) ++c.phase;
          if (c.phase >= c.phases.size()) --left;
        }
      }
    }
    if (!moved) RAILCC_THROW(kInternal, "railcc sim: the ", res.algo, " schedule of ", op, " at ", n, " ranks deadlocks");
  }
  for (int r = 0; r < n; ++r) {
    auto& p = peers[static_cast<size_t>(r)];
    std::sort(p.begin(), p.end());
    p.erase(std::unique(p.begin(), p.end()), p.end());
    const int local = static_cast<int>(std::count_if(p.begin(), p.end(), [&](int q) { return q / L == r / L; }));
    res.localPeers = std::max(res.localPeers, local);
    res.netPeers = std::max(res.netPeers, static_cast<int>(p.size()) - local);
    res.messages = std::max(res.messages, msgs[static_cast<size_t>(r)]);
    res.bytesSent = std::max(res.bytesSent, sentB[static_cast<size_t>(r)]);
    res.netBytesSent = std::max(res.netBytesSent, netB[static_cast<size_t>(r)]);
    res.steps = std::max(res.steps, static_cast<int>(cur[static_cast<size_t>(r)].t));
    if (perRank) std::sort(res.sent[static_cast<size_t>(r)].begin(), res.sent[static_cast<size_t>(r)].end());
  }
  return res;
}

SimSetup simulateSetup(const SimJob& job, int idBytes, int nameBytes, uint64_t recordBytes, uint64_t endpointBytes) {
  const int n = job.size, L = job.perHost;
  if (n < 1 || L < 1 || n % L != 0)
    RAILCC_THROW(kInvalidUsage, "railcc sim: ", n, " ranks at ", L, " per host: the ranks must fill whole hosts");
  auto padded = [](char c, int h, int width) {
    std::string s = std::string(1, c) + std::to_string(h);
    return s.size() < static_cast<size_t>(width) ? s + std::string(static_cast<size_t>(width) - s.size(), 'x') : s;
  };
  // The parts of every level of the gather, merged as set-up merges them (records.h); a group's
  // merger reads the other parts of its group (the most: all but the smallest, its own). The
  // most a rank reads: the rank that completes a group at every level up to k (the most any
  // group's merger reads at each), and the whole map after, unless k is the last level (it
  // wrote the whole).
  const int levels = gatherLevels(n);
  std::vector<HostMap> part(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) part[static_cast<size_t>(r)] = HostMap::one(padded('h', r / L, idBytes), padded('n', r / L, nameBytes));
  std::vector<uint64_t> groupBytes(static_cast<size_t>(levels) + 1, 0);  // at level l: the most a merger reads
  std::vector<int> groupKeys(static_cast<size_t>(levels) + 1, 0);
  for (int level = 1; level <= levels; ++level) {
    std::vector<HostMap> next(static_cast<size_t>(gatherParts(n, level)));
    for (int g = 0; g < static_cast<int>(next.size()); ++g) {
      const auto [first, count] = gatherMembers(n, level, g);
      uint64_t bytes = 0, smallest = UINT64_MAX;
      std::vector<const HostMap*> members;
      for (int i = first; i < first + count; ++i) {
        const uint64_t b = part[static_cast<size_t>(i)].encode().size();
        bytes += b;
        smallest = std::min(smallest, b);
        members.push_back(&part[static_cast<size_t>(i)]);
      }
      next[static_cast<size_t>(g)] = HostMap::concat(members);
      groupBytes[static_cast<size_t>(level)] = std::max(groupBytes[static_cast<size_t>(level)], bytes - smallest);
      groupKeys[static_cast<size_t>(level)] = std::max(groupKeys[static_cast<size_t>(level)], count - 1);
    }
    part = std::move(next);
  }
  const uint64_t whole = part.front().encode().size();
  SimSetup out;
  const uint64_t local = static_cast<uint64_t>(L - 1) * (recordBytes + endpointBytes);
  for (int k = 0; k <= levels; ++k) {  // the rank that completes a group at levels 1..k
    uint64_t bytes = local + 64;  // this host's records and endpoints, the secret
    int keys = 1 + 2 * (L - 1), reads = 1 + (L > 1 ? 2 : 0);
    for (int level = 1; level <= k; ++level) {
      bytes += groupBytes[static_cast<size_t>(level)];
      keys += groupKeys[static_cast<size_t>(level)];
      reads += groupKeys[static_cast<size_t>(level)] > 0 ? 1 : 0;
    }
    if (k < levels) {  // the whole, read
      bytes += whole;
      keys += 1;
      reads += 1;
    }
    if (n == 1) bytes = keys = reads = 0;
    out.keys = std::max(out.keys, keys);
    out.bytes = std::max(out.bytes, bytes);
    out.reads = std::max(out.reads, reads);
  }
  // Its host record, part, endpoints and first progress record; per level a count and, where it
  // completes the group, the merge.
  out.writes = n == 1 ? 0 : 4 + 2 * levels;
  return out;
}

}  // namespace railcc::engine
