#include "engine/simulate.h"

#include <algorithm>
#include <deque>

#include "common/error.h"
#include "engine/algorithms/choose.h"
#include "engine/algorithms/plan.h"
#include "engine/algorithms/table.h"
#include "engine/choice_settings.h"
#include "engine/records.h"

namespace railcc::engine {

namespace {

// The simulation's ranks are host by host, `L` to a host: every order of plan.h is arithmetic.
class SimLayout : public Layout {
 public:
  SimLayout(int r, int L) : r_(r), L_(L) {}
  int at(Order o, int j) const override {
    if (o == Order::kHost) return r_ / L_ * L_ + j;
    if (o == Order::kRail) return r_ % L_ + j * L_;
    return j;
  }
  int me(Order o) const override { return o == Order::kHost ? r_ % L_ : o == Order::kRail ? r_ / L_ : r_; }
  int rootIndex() const override { return 0; }

 private:
  int r_, L_;
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
  place.shmRings = L == n && n > 2;
  place.shmRingSlices = place.shmRings;
  place.hostsEven = L > 1 && L < n;
  place.hostsOfOne = L == 1 && n > 1;
  place.oneshotBytes = job.oneshotBytes;
  const std::vector<Algo> prefer = job.algo.empty() ? std::vector<Algo>{} : parseAlgos(job.algo, nullptr);
  const Algo a = chooseAlgo(aop, bytes, place, prefer, nullptr);
  PlanShape shape;
  shape.size = n;
  shape.hostRanks = L;
  shape.railRanks = n / L;
  shape.railWidth = place.hostsEven ? L : 1;
  shape.es = elemSize;
  shape.hostsEven = place.hostsEven;
  shape.hostsOfOne = place.hostsOfOne;
  shape.railRing = railRing(n / L, prefer);
  shape.treeRanks = treeRanks(place.hostsEven ? n / L : 0, place);
  SimResult res;
  res.algo = algoName(a);
  if (n == 1) {
    if (perRank) res.sent.resize(1);
    return res;
  }
  const AlgoRow& row = algoRow(a);
  if (!row.simulated)
    RAILCC_THROW(kInvalidUsage, "railcc sim: ", op, " by ", algoName(a),
                 " is not simulated (the shared-memory rings of a one-host group are not modelled)");
  res.algo += row.describe(shape, aop);
  if (perRank) res.sent.resize(static_cast<size_t>(n));

  struct Cursor {
    std::vector<Phase> phases;
    size_t phase = 0;
    int k = 0, kEnd = 0;
    int64_t t = 0;
    bool posted = false;
  };
  std::vector<SimLayout> layouts;
  layouts.reserve(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) layouts.emplace_back(r, L);
  auto stepsAt = [&](const Cursor& c, int r) { return stepsOf(c.phases[c.phase], shape, layouts[static_cast<size_t>(r)]); };
  std::vector<Cursor> cur(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    Cursor& c = cur[static_cast<size_t>(r)];
    c.phases = row.plan(shape, layouts[static_cast<size_t>(r)], aop, bytes);
    while (c.phase < c.phases.size() && (c.kEnd = stepsAt(c, r)) == 0) ++c.phase;
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
        stepOf(c.phases[c.phase], shape, layouts[static_cast<size_t>(r)], c.k, st);
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
          while (c.phase < c.phases.size() && (c.kEnd = stepsAt(c, r)) == 0) ++c.phase;
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
  // this host's records and endpoints, the secret and rank 0's algorithm settings beside it
  const uint64_t local = static_cast<uint64_t>(L - 1) * (recordBytes + endpointBytes) + 64 +
                         choiceSettingsRecord(Config::defaults()).size();
  for (int k = 0; k <= levels; ++k) {  // the rank that completes a group at levels 1..k
    uint64_t bytes = local;
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
