// The one-kernel all-reduces of csrc/cuda/shots.h, played by CPU threads on host memory: a
// thread per (rank, block) stands for a block of the kernel, a thread per rank for its stream
// (it refills the input, "launches" its blocks, waits for them and checks the output). The same
// header, the same signals and memory orders as the kernels nvcc builds from it; no GPU runs
// here. Every rank must end with its reference's bits (ranks reduced in rank order), on odd
// world sizes, odd and zero counts, every op, in and out of place, ops back to back with new
// inputs (a fast rank runs ahead into the next op), counts that wrap at 2^32, and a rank that
// stops coming or an abort: the waits end and the failure names the op and the rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "cuda/shots.h"

using namespace railcc;
using namespace railcc::cuda;

namespace {

constexpr uint64_t kSecond = 1000000000ull;

enum class Shot { kOne, kTwo };

// n ranks' buffers, scratch, pads, where records, epochs and table in one process (host memory
// stands for device memory). Each rank's input and output lie in one vector, its heap; ranks
// in `registered` tell their peers so (shotPublish, as the engine does), and the others go
// through their scratch.
template <typename T>
struct Group {
  int n;
  size_t count, chunk;
  bool inPlace;
  size_t span;  // elements of the input's (and the output's) room in the heap
  std::vector<std::vector<T>> heap, scratch;
  std::vector<std::unique_ptr<SignalPad[]>> pads;
  std::vector<std::unique_ptr<ShotWhere[]>> wheres;
  std::vector<std::vector<uint32_t>> epochs;
  ShotPeers table{};  // every rank maps the others at the same addresses here
  SignalFailure failure{};
  uint64_t registered = 0;  // bit r: rank r's buffers count as registered

  size_t shift = 0;  // the user's buffers start this many elements into their room

  Group(int n_, size_t count_, bool inPlace_, size_t chunk_ = 0, uint32_t firstEpoch = 0, size_t shift_ = 0)
      : n(n_), count(count_), chunk(chunk_ ? chunk_ : count_ + 1), inPlace(inPlace_), span(count_ + 1 + shift_),
        heap(n_, std::vector<T>(2 * span)), scratch(n_, std::vector<T>(chunk)), shift(shift_) {
    for (int r = 0; r < n; ++r) {
      pads.emplace_back(new SignalPad[kMaxShotBlocks]);
      std::memset(pads.back().get(), 0, sizeof(SignalPad) * kMaxShotBlocks);
      for (int b = 0; b < kMaxShotBlocks; ++b)
        for (uint32_t& c : pads.back()[b].count) c = 2u * firstEpoch;
      wheres.emplace_back(new ShotWhere[kMaxShotBlocks]);
      epochs.emplace_back(kMaxShotBlocks, firstEpoch);
      table.scratch[r] = scratch[r].data();
      table.pads[r] = pads[r].get();
      table.where[r] = wheres[r].get();
      table.heap[r] = reinterpret_cast<char*>(heap[r].data());
    }
  }
  T* input(int r) { return heap[r].data() + shift; }
  T* result(int r) { return (inPlace ? heap[r].data() : heap[r].data() + span) + shift; }
  ShotArgs args(int r, ReduceOp op, uint64_t seq, uint64_t timeoutNs, ShotKind k) {
    ShotArgs a{&table, input(r), result(r), r, n, 0, count, chunk, epochs[r].data(), timeoutNs, seq, &failure, nullptr, 0.5, op};
    if (registered >> r & 1)
      shotPublish(k, r, table.heap[r], 2 * span * sizeof(T), a.input, count * sizeof(T), a.output, count * sizeof(T),
                  &a.inHeap, &a.outHeap);
    return a;
  }
};

template <typename T>
T inputValue(int r, int k, size_t i) {
  if constexpr (std::is_floating_point_v<T>) {
    if (i % 97 == 5 && r == 1) return std::nan("");  // NaN propagates through every op
    return static_cast<T>(0.1 * static_cast<double>((i * 7 + static_cast<size_t>(r) * 13 + static_cast<size_t>(k)) % 23) - 1.0);
  } else {
    return static_cast<T>((i * 7 + static_cast<size_t>(r) * 13 + static_cast<size_t>(k) * 3) % 11 + (r == 2 ? 64 : 1));
  }
}

// The reference: ranks folded in rank order, independent of shots.h's code.
template <typename T>
T reference(ReduceOp op, int n, int k, size_t i) {
  auto bothNan = [](T a, T b) {
    if constexpr (std::is_floating_point_v<T>) return std::isnan(a) ? a : b;
    else return b;
  };
  T acc = inputValue<T>(0, k, i);
  for (int r = 1; r < n; ++r) {
    T v = inputValue<T>(r, k, i);
    bool nan = false;
    if constexpr (std::is_floating_point_v<T>) nan = std::isnan(acc) || std::isnan(v);
    switch (op) {
      case ReduceOp::kSum: case ReduceOp::kAvg: case ReduceOp::kPremulSum: acc = static_cast<T>(acc + v); break;
      case ReduceOp::kProduct: acc = static_cast<T>(acc * v); break;
      case ReduceOp::kMin: acc = nan ? bothNan(acc, v) : (v < acc ? v : acc); break;
      case ReduceOp::kMax: acc = nan ? bothNan(acc, v) : (acc < v ? v : acc); break;
      default:
        if constexpr (std::is_integral_v<T>) {
          if (op == ReduceOp::kBand) acc = static_cast<T>(acc & v);
          if (op == ReduceOp::kBor) acc = static_cast<T>(acc | v);
          if (op == ReduceOp::kBxor) acc = static_cast<T>(acc ^ v);
        }
    }
  }
  if (op == ReduceOp::kAvg) acc = static_cast<T>(static_cast<double>(acc) / n);
  if (op == ReduceOp::kPremulSum) acc = static_cast<T>(static_cast<double>(acc) * 0.5);
  return acc;
}

template <typename T>
bool sameBits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <typename T>
using BlockFn = std::function<bool(const ShotArgs&, int, int, const ShotThreads&, uint64_t)>;

template <typename T>
BlockFn<T> blockFor(Shot shot, ReduceOp op) {
  auto pick = [&](auto opTag) -> BlockFn<T> {
    using O = decltype(opTag);
    if (shot == Shot::kOne) return oneShotBlock<T, O>;
    return twoShotBlock<T, O>;
  };
  switch (op) {
    case ReduceOp::kSum: case ReduceOp::kAvg: case ReduceOp::kPremulSum: return pick(ShotSum{});
    case ReduceOp::kProduct: return pick(ShotProd{});
    case ReduceOp::kMin: return pick(ShotMin{});
    case ReduceOp::kMax: return pick(ShotMax{});
    default: break;
  }
  if constexpr (std::is_integral_v<T>) {
    if (op == ReduceOp::kBand) return pick(ShotBand{});
    if (op == ReduceOp::kBor) return pick(ShotBor{});
    return pick(ShotBxor{});
  }
  return nullptr;
}

// Runs `ops` all-reduces on every rank, each rank on its own thread, its blocks on theirs.
// `stopAfter[r]`: rank r launches only that many ops. Returns how many (rank, op) outputs were
// wrong; `failedOps` counts the ops in which some block's wait failed.
template <typename T>
int run(Group<T>& g, Shot shot, ReduceOp op, int blocks, int ops, std::vector<int> stopAfter = {},
        uint64_t timeoutNs = 60 * kSecond, int* failedOps = nullptr) {
  std::atomic<int> wrong{0}, failed{0};
  BlockFn<T> fn = blockFor<T>(shot, op);
  std::vector<std::thread> ranks;
  for (int r = 0; r < g.n; ++r)
    ranks.emplace_back([&, r] {
      const int mine = stopAfter.empty() ? ops : stopAfter[static_cast<size_t>(r)];
      for (int k = 0; k < mine; ++k) {
        for (size_t i = 0; i < g.count; ++i) g.input(r)[i] = inputValue<T>(r, k, i);
        ShotArgs a = g.args(r, op, static_cast<uint64_t>(k), timeoutNs,
                            shot == Shot::kOne ? ShotKind::kAllReduceOne : ShotKind::kAllReduceTwo);
        std::atomic<bool> ok{true};
        std::vector<std::thread> bs;
        for (int b = 0; b < blocks; ++b)
          bs.emplace_back([&, b] {
            if (!fn(a, b, blocks, ShotThreads{0, 1}, signalNow() + timeoutNs)) ok = false;
          });
        for (auto& t : bs) t.join();
        if (!ok) {
          ++failed;
          return;  // a failed op leaves the output incomplete; the rank stops as the watchdog would have it
        }
        const T* res = g.result(r);
        for (size_t i = 0; i < g.count; ++i)
          if (!sameBits(res[i], reference<T>(op, g.n, k, i))) {
            ++wrong;
            break;
          }
        if (!sameBits(res[g.count], T{})) ++wrong;  // nothing written past the end
      }
    });
  for (auto& t : ranks) t.join();
  if (failedOps) *failedOps = failed.load();
  else EXPECT_EQ(failed.load(), 0);
  return wrong.load();
}

const ReduceOp kFloatOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kPremulSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax};
const ReduceOp kIntOps[] = {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor};

}  // namespace

TEST(Shots, PartsOfAChunkCoverEveryElementOnceAndKeepTheirOwners) {
  for (size_t chunk : {size_t{16}, size_t{1000}, size_t{65536}})
    for (size_t len : {size_t{0}, size_t{1}, chunk / 3, chunk - 1, chunk})
      for (int slices : {1, 2, 3})
        for (int blocks : {1, 3}) {
          std::vector<int> owner(chunk, -1), seen(len, 0);
          for (int r = 0; r < slices; ++r)
            for (int b = 0; b < blocks; ++b) {
              size_t s, e, fs, fe;
              shotPart(chunk, len, r, slices, b, blocks, &s, &e);
              shotPart(chunk, chunk, r, slices, b, blocks, &fs, &fe);
              for (size_t i = s; i < e; ++i) ++seen[i];
              for (size_t i = fs; i < fe; ++i) owner[i] = r * blocks + b;
              for (size_t i = s; i < e; ++i) EXPECT_EQ(owner[i], r * blocks + b);  // the full chunk's owner
            }
          for (size_t i = 0; i < len; ++i) ASSERT_EQ(seen[i], 1) << chunk << " " << len << " " << i;
        }
}

TEST(Shots, RangesCoverEveryElementOnceAndStartOnSixteen) {
  for (size_t count : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{1000}, size_t{4099}})
    for (int blocks : {1, 2, 3, 7, kMaxShotBlocks}) {
      size_t next = 0;
      for (int b = 0; b < blocks; ++b) {
        size_t s, e;
        shotRange(count, b, blocks, &s, &e);
        EXPECT_LE(s, e);
        if (s < e) {
          EXPECT_EQ(s, next) << count << " " << blocks << " " << b;
          EXPECT_EQ(s % 16, 0u);
          next = e;
        }
      }
      EXPECT_EQ(next, count) << count << " " << blocks;
    }
}

TEST(Shots, OneShotEveryFloatOpMatchesTheRankOrderReferenceBitForBit) {
  for (int n : {1, 2, 3, 5})
    for (ReduceOp op : kFloatOps)
      for (bool inPlace : {false, true})
        for (size_t chunk : {size_t{0}, size_t{100}}) {
          Group<float> g(n, 1013, inPlace, chunk);
          EXPECT_EQ(run(g, Shot::kOne, op, 3, 4), 0)
              << "n=" << n << " op=" << reduceOpName(op) << " inPlace=" << inPlace << " chunk=" << chunk;
        }
}

TEST(Shots, TwoShotEveryFloatOpMatchesTheRankOrderReferenceBitForBit) {
  for (int n : {1, 2, 3, 5})
    for (ReduceOp op : kFloatOps)
      for (bool inPlace : {false, true})
        for (size_t chunk : {size_t{0}, size_t{100}}) {
          Group<double> g(n, 1013, inPlace, chunk);
          EXPECT_EQ(run(g, Shot::kTwo, op, 3, 4), 0)
              << "n=" << n << " op=" << reduceOpName(op) << " inPlace=" << inPlace << " chunk=" << chunk;
        }
}

TEST(Shots, IntegerOpsAndOddCounts) {
  for (Shot shot : {Shot::kOne, Shot::kTwo})
    for (ReduceOp op : kIntOps)
      for (size_t count : {size_t{0}, size_t{1}, size_t{17}, size_t{333}}) {
        Group<int64_t> g(3, count, shot == Shot::kTwo);
        EXPECT_EQ(run(g, shot, op, 2, 3), 0) << reduceOpName(op) << " count=" << count;
        Group<uint8_t> u(4, count, false);
        EXPECT_EQ(run(u, shot, op, 5, 2), 0) << reduceOpName(op) << " count=" << count;
      }
}

// More blocks than a rank's slice has ranges, many chunks an op and many ops back to back:
// ranks run ahead of each other into the next chunk and op, and the per-block counts keep them
// apart.
TEST(Shots, ManyOpsBackToBackWithMoreBlocksThanWork) {
  Group<float> one(3, 40, false);
  EXPECT_EQ(run(one, Shot::kOne, ReduceOp::kSum, 4, 200), 0);
  Group<float> two(5, 70, true, 33);  // 3 chunks an op, the last one short
  EXPECT_EQ(run(two, Shot::kTwo, ReduceOp::kSum, 4, 100), 0);
  EXPECT_EQ(one.epochs[0][0], 200u);
  EXPECT_EQ(two.epochs[4][3], 300u);
}

// User buffers off the 16-byte grain (the scratch is on it): the element-by-element path, with
// the same bits as the vector one.
TEST(Shots, BuffersOffTheVectorGrain) {
  for (Shot shot : {Shot::kOne, Shot::kTwo})
    for (size_t shift : {size_t{1}, size_t{3}}) {
      Group<float> g(3, 1013, false, 128, 0, shift);
      EXPECT_EQ(run(g, shot, ReduceOp::kSum, 3, 3), 0) << "shift " << shift;
      Group<int16_t> h(2, 515, true, 64, 0, shift);
      EXPECT_EQ(run(h, shot, ReduceOp::kMax, 2, 3), 0) << "shift " << shift;
    }
}

TEST(Shots, CountsWrapPastTwoToThe32) {
  const uint32_t start = 0x7ffffff0u;  // 2 * epoch wraps within the run
  Group<int32_t> g(3, 100, false, 30, start);  // 4 chunks an op
  EXPECT_EQ(run(g, Shot::kTwo, ReduceOp::kSum, 2, 10), 0);
  EXPECT_EQ(g.epochs[1][1], start + 40);
  EXPECT_LT(g.pads[0][0].count[1], 2u * start);  // wrapped
}

// Rank 2 runs op 0 and never op 1: the others' waits end at their deadline, and the first
// failure names op 1 and rank 2.
TEST(Shots, ARankThatStopsComingEndsTheOthersWaitsAndIsNamed) {
  for (Shot shot : {Shot::kOne, Shot::kTwo}) {
    Group<float> g(4, 256, false);
    int failedOps = 0;
    const auto t0 = signalNow();
    run(g, shot, ReduceOp::kSum, 2, 3, {3, 3, 1, 3}, kSecond / 5, &failedOps);
    EXPECT_LT(signalNow() - t0, 30 * kSecond);
    EXPECT_EQ(failedOps, 3);  // ranks 0, 1 and 3 each stop at op 1
    EXPECT_EQ(g.failure.state, static_cast<uint32_t>(kTimedOut));
    EXPECT_EQ(g.failure.peer, 2);
    EXPECT_EQ(g.failure.seq, 1u);
  }
}

// The host raises the abort flag on every pad of rank 0 while rank 1 never comes: rank 0's
// blocks leave at once, long before their 60 s deadline.
TEST(Shots, AnAbortEndsTheWaitsAtOnce) {
  Group<float> g(2, 64, false);
  std::thread host([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    for (int b = 0; b < kMaxShotBlocks; ++b) __atomic_store_n(&g.pads[0][b].abort, 1u, __ATOMIC_RELAXED);
  });
  int failedOps = 0;
  const auto t0 = signalNow();
  run(g, Shot::kOne, ReduceOp::kSum, 3, 1, {1, 0}, 60 * kSecond, &failedOps);
  host.join();
  EXPECT_LT(signalNow() - t0, 20 * kSecond);
  EXPECT_EQ(failedOps, 1);
  EXPECT_EQ(g.failure.state, static_cast<uint32_t>(kAborted));
  EXPECT_EQ(g.failure.peer, 1);
}
// A short last chunk: its parts are cut as the full chunks' are, so no block of a peer writes
// scratch that a block of this rank is still copying out of the chunk before (found so).
TEST(Shots, AShortLastChunkKeepsEveryElementsOwner) {
  for (bool inPlace : {true, false}) {
    Group<float> two(2, 100003, inPlace, 65536);
    EXPECT_EQ(run(two, Shot::kTwo, ReduceOp::kSum, 3, 3), 0) << "inPlace " << inPlace;
    Group<float> one(3, 100003, inPlace, 65536);
    EXPECT_EQ(run(one, Shot::kOne, ReduceOp::kSum, 3, 3), 0) << "inPlace " << inPlace;
  }
}

// All-gather, reduce-scatter and broadcast: every rank's buffers laid out as the engine passes
// them (one tensor of n blocks), checked against a reference built here; chunks cut short,
// in place too, ops back to back on the same pads and counts.
namespace {

struct Layout {
  ShotKind kind;
  int n;
  size_t count;  // per block (all-gather, reduce-scatter) or of the buffer (broadcast)
  size_t chunk;
  int root;
  bool inPlace;
  uint64_t registered = 0;  // bit r: rank r's buffers lie in its heap and it says so
};

int64_t valueOf(int r, int k, size_t i) { return static_cast<int64_t>((i * 5 + static_cast<size_t>(r) * 11 + static_cast<size_t>(k)) % 97); }

// Runs `ops` ops of l.kind on int64 with SUM; returns the (rank, op) results that were wrong.
int runLayout(const Layout& l, int blocks, int ops, bool* scratchUntouched = nullptr) {
  const size_t n = static_cast<size_t>(l.n);
  const bool a2a = l.kind == ShotKind::kAllToAll;
  const size_t inLen = l.kind == ShotKind::kReduceScatter || a2a ? n * l.count : l.count;
  const size_t outLen = l.kind == ShotKind::kAllGather || a2a ? n * l.count : l.count;
  // A rank's heap: its input's room, then its output's (with one element past each end).
  std::vector<std::vector<int64_t>> heap(n, std::vector<int64_t>(inLen + 1 + outLen + 1, -7));
  std::vector<std::vector<int64_t>> scratch(n, std::vector<int64_t>(l.chunk, -9));
  std::vector<std::unique_ptr<SignalPad[]>> pads;
  std::vector<std::unique_ptr<ShotWhere[]>> wheres;
  std::vector<std::vector<uint32_t>> epochs(n, std::vector<uint32_t>(kMaxShotBlocks, 0));
  ShotPeers table{};
  SignalFailure failure{};
  for (size_t r = 0; r < n; ++r) {
    pads.emplace_back(new SignalPad[kMaxShotBlocks]);
    std::memset(pads.back().get(), 0, sizeof(SignalPad) * kMaxShotBlocks);
    wheres.emplace_back(new ShotWhere[kMaxShotBlocks]);
    table.scratch[r] = scratch[r].data();
    table.pads[r] = pads[r].get();
    table.where[r] = wheres[r].get();
    table.heap[r] = reinterpret_cast<char*>(heap[r].data());
  }
  auto outRoom = [&](size_t r) { return heap[r].data() + inLen + 1; };
  // In place: all-gather's input is this rank's block of the output; reduce-scatter's output is
  // this rank's block of the input; broadcast's and all-to-all's buffer is both.
  auto inPtr = [&](size_t r) -> int64_t* {
    if (l.inPlace && l.kind == ShotKind::kAllGather) return outRoom(r) + r * l.count;
    if (l.inPlace && (l.kind == ShotKind::kBroadcast || a2a)) return outRoom(r);
    return heap[r].data();
  };
  auto outPtr = [&](size_t r) -> int64_t* {
    if (l.inPlace && l.kind == ShotKind::kReduceScatter) return heap[r].data() + r * l.count;
    return outRoom(r);
  };
  std::atomic<int> wrong{0};
  std::vector<std::thread> ranks;
  for (size_t r = 0; r < n; ++r)
    ranks.emplace_back([&, r] {
      for (int k = 0; k < ops; ++k) {
        const size_t fill = inLen;
        for (size_t i = 0; i < fill; ++i) inPtr(r)[i] = valueOf(static_cast<int>(r), k, i);
        if (l.kind == ShotKind::kBroadcast && !l.inPlace)
          for (size_t i = 0; i < l.count; ++i) outRoom(r)[i] = -1;
        ShotArgs a{&table, inPtr(r), outPtr(r), static_cast<int>(r), l.n, l.root, l.count, l.chunk, epochs[r].data(),
                   60 * kSecond, static_cast<uint64_t>(k), &failure, nullptr, 1.0, ReduceOp::kSum};
        if (l.registered >> r & 1)
          shotPublish(l.kind, static_cast<int>(r), table.heap[r], heap[r].size() * sizeof(int64_t), a.input,
                      inLen * sizeof(int64_t), a.output, outLen * sizeof(int64_t), &a.inHeap, &a.outHeap);
        EXPECT_TRUE(shotArgsValid(a, l.kind, blocks));
        std::vector<std::thread> bs;
        for (int b = 0; b < blocks; ++b)
          bs.emplace_back([&, b] { shotBlock<int64_t, ShotSum>(l.kind, a, b, blocks, ShotThreads{0, 1}, signalNow() + 60 * kSecond); });
        for (auto& t : bs) t.join();
        const int64_t* res = outPtr(r);
        bool ok = true;
        for (size_t i = 0; i < outLen && ok; ++i) {
          int64_t want = 0;
          if (l.kind == ShotKind::kAllGather) want = valueOf(static_cast<int>(i / l.count), k, i % l.count);
          if (l.kind == ShotKind::kBroadcast) want = r == static_cast<size_t>(l.root) && !l.inPlace ? -1 : valueOf(l.root, k, i);
          if (l.kind == ShotKind::kReduceScatter)
            for (size_t q = 0; q < n; ++q) want += valueOf(static_cast<int>(q), k, r * l.count + i);
          if (a2a) want = valueOf(static_cast<int>(i / l.count), k, r * l.count + i % l.count);
          ok = res[i] == want;
        }
        if (!l.inPlace && outRoom(r)[outLen] != -7) ok = false;  // nothing past the end
        if (!ok) ++wrong;
      }
    });
  for (auto& t : ranks) t.join();
  EXPECT_EQ(failure.state, 0u);
  if (scratchUntouched) {
    *scratchUntouched = true;
    for (auto& sc : scratch)
      for (int64_t v : sc) *scratchUntouched = *scratchUntouched && v == -9;
  }
  return wrong.load();
}

}  // namespace

TEST(Shots, AllGatherReduceScatterAndBroadcastAcrossShortChunks) {
  for (ShotKind kind : {ShotKind::kAllGather, ShotKind::kReduceScatter, ShotKind::kBroadcast, ShotKind::kAllToAll})
    for (int n : {1, 2, 3, 5})
      for (size_t count : {size_t{0}, size_t{1}, size_t{333}, size_t{1000}})
        for (bool inPlace : {false, true}) {
          Layout l{kind, n, count, 160, n - 1, inPlace};
          EXPECT_EQ(runLayout(l, 3, 5), 0) << "kind " << static_cast<int>(kind) << " n " << n << " count " << count
                                           << " inPlace " << inPlace;
        }
}

TEST(Shots, LaunchesThatCannotRunAreRefused) {
  ShotPeers table{};
  uint32_t epochs[kMaxShotBlocks] = {};
  ShotArgs a{&table, nullptr, nullptr, 0, 4, 0, 10, 64, epochs, kSecond, 0, nullptr, nullptr, 1.0, ReduceOp::kSum};
  EXPECT_TRUE(shotArgsValid(a, ShotKind::kAllReduceOne, 1));
  EXPECT_FALSE(shotArgsValid(a, ShotKind::kAllReduceOne, 0));
  EXPECT_FALSE(shotArgsValid(a, ShotKind::kAllReduceOne, kMaxShotBlocks + 1));
  a.root = 4;
  EXPECT_FALSE(shotArgsValid(a, ShotKind::kBroadcast, 1));  // no rank 4 in a group of 4
  a.root = 0;
  a.chunk = 60;  // fewer than 16 of each of the 4 blocks
  EXPECT_FALSE(shotArgsValid(a, ShotKind::kReduceScatter, 1));
  a.epochs = nullptr;
  EXPECT_FALSE(shotArgsValid(a, ShotKind::kAllGather, 1));
}

// Registered buffers (in the rank's heap, which every peer maps once): peers read them, and
// two-shot writes into them, in place. Every rank registered, so nothing goes through the
// scratch (it keeps the bytes it was filled with), or only some, where the two ways meet in
// one op; in place and not, short chunks.
TEST(Shots, RegisteredBuffersAreUsedInPlaceAndMeetUnregisteredOnes) {
  for (ShotKind kind : {ShotKind::kAllGather, ShotKind::kReduceScatter, ShotKind::kBroadcast, ShotKind::kAllToAll})
    for (int n : {1, 2, 3, 5})
      for (bool inPlace : {false, true})
        for (uint64_t reg : {~uint64_t(0), uint64_t(0x5)}) {
          Layout l{kind, n, 333, 160, n / 2, inPlace, reg};
          bool untouched = false;
          EXPECT_EQ(runLayout(l, 3, 4, &untouched), 0)
              << "kind " << static_cast<int>(kind) << " n " << n << " inPlace " << inPlace << " reg " << reg;
          const bool allReg = reg == ~uint64_t(0);
          // (An in-place all-to-all goes through the scratch: peers read what it overwrites.)
          if (allReg && !(kind == ShotKind::kAllToAll && inPlace)) EXPECT_TRUE(untouched) << "kind " << static_cast<int>(kind) << " n " << n << " inPlace " << inPlace;
        }
  for (Shot shot : {Shot::kOne, Shot::kTwo})
    for (int n : {2, 3, 5})
      for (bool inPlace : {false, true})
        for (uint64_t reg : {~uint64_t(0), uint64_t(0x5)})
          for (size_t shift : {size_t{0}, size_t{1}}) {
            Group<float> g(n, 1013, inPlace, 100, 0, shift);
            g.registered = reg;
            for (auto& sc : g.scratch) std::fill(sc.begin(), sc.end(), -3.0f);
            EXPECT_EQ(run(g, shot, ReduceOp::kSum, 3, 4), 0)
                << "two " << (shot == Shot::kTwo) << " n " << n << " inPlace " << inPlace << " reg " << reg << " shift " << shift;
            // An in-place one-shot goes through the scratch (its output is its input); else
            // with every rank registered no scratch is touched.
            if (reg == ~uint64_t(0) && !(shot == Shot::kOne && inPlace)) {
              bool untouched = true;
              for (auto& sc : g.scratch)
                for (float v : sc) untouched = untouched && v == -3.0f;
              EXPECT_TRUE(untouched) << "two " << (shot == Shot::kTwo) << " n " << n << " inPlace " << inPlace;
            }
          }
}

TEST(Shots, WhatARankPublishesKeepsPeersOffWhatItWrites) {
  char heap[1024];
  uint64_t in = 0, out = 0;
  // Apart, both inside: both published (the output only for two-shot).
  shotPublish(ShotKind::kAllReduceTwo, 0, heap, sizeof(heap), heap, 100, heap + 512, 100, &in, &out);
  EXPECT_EQ(in, 0u);
  EXPECT_EQ(out, 512u);
  shotPublish(ShotKind::kAllReduceOne, 0, heap, sizeof(heap), heap, 100, heap + 512, 100, &in, &out);
  EXPECT_EQ(in, 0u);
  EXPECT_EQ(out, kInScratch);
  // In place: two-shot yes, one-shot no.
  shotPublish(ShotKind::kAllReduceTwo, 0, heap, sizeof(heap), heap + 64, 100, heap + 64, 100, &in, &out);
  EXPECT_EQ(in, 64u);
  EXPECT_EQ(out, 64u);
  shotPublish(ShotKind::kAllReduceOne, 0, heap, sizeof(heap), heap + 64, 100, heap + 64, 100, &in, &out);
  EXPECT_EQ(in, kInScratch);
  // All-gather: the input as my block of the output, yes; overlapping it any other way, no.
  shotPublish(ShotKind::kAllGather, 2, heap, sizeof(heap), heap + 200, 100, heap, 400, &in, &out);
  EXPECT_EQ(in, 200u);
  shotPublish(ShotKind::kAllGather, 1, heap, sizeof(heap), heap + 200, 100, heap, 400, &in, &out);
  EXPECT_EQ(in, kInScratch);
  // Reduce-scatter: the output as my block of the input.
  shotPublish(ShotKind::kReduceScatter, 3, heap, sizeof(heap), heap, 400, heap + 300, 100, &in, &out);
  EXPECT_EQ(in, 0u);
  shotPublish(ShotKind::kReduceScatter, 1, heap, sizeof(heap), heap, 400, heap + 300, 100, &in, &out);
  EXPECT_EQ(in, kInScratch);
  // Outside the heap, or running past its end, or no heap: scratch.
  char other[64];
  shotPublish(ShotKind::kAllReduceTwo, 0, heap, sizeof(heap), other, 64, heap + 1000, 100, &in, &out);
  EXPECT_EQ(in, kInScratch);
  EXPECT_EQ(out, kInScratch);
  shotPublish(ShotKind::kBroadcast, 0, nullptr, 0, heap, 64, heap, 64, &in, &out);
  EXPECT_EQ(in, kInScratch);
}
