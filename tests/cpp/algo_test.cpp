// The algorithm rule (engine/algorithms/choose.h): what it picks, what RAILCC_ALGO changes,
// and every forced algorithm giving the same, exact results on real ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "common/error.h"
#include "engine/algorithms/choose.h"
#include "engine/algorithms/schedule.h"
#include "ranks.h"

using namespace railcc;
using namespace railcc::engine;

namespace {

AlgoPlace oneHost(int n) {
  AlgoPlace p;
  p.size = n;
  p.localRanks = n;
  p.shmRings = n > 2;
  p.shmRingSlices = n > 2;
  p.oneshotBytes = 65536;
  return p;
}

TEST(AlgoRule, SizeAndPlacementDecide) {
  AlgoPlace p = oneHost(4);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 8, p, {}, nullptr), Algo::kOneShot);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 65537, p, {}, nullptr), Algo::kShmRings);
  EXPECT_EQ(chooseAlgo(AlgoOp::kBroadcast, 65536, p, {}, nullptr), Algo::kChain);
  EXPECT_EQ(chooseAlgo(AlgoOp::kBroadcast, 65537, p, {}, nullptr), Algo::kShmRings);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllgather, 1 << 20, p, {}, nullptr), Algo::kShmRings);
  AlgoPlace two = oneHost(2);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 1 << 20, two, {}, nullptr), Algo::kPairwise);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllgather, 1 << 20, two, {}, nullptr), Algo::kDirect);
  AlgoPlace hosts;
  hosts.size = 8;
  hosts.localRanks = 4;
  hosts.hostsEven = true;
  hosts.oneshotBytes = 65536;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 1 << 20, hosts, {}, nullptr), Algo::kHier);
  EXPECT_EQ(chooseAlgo(AlgoOp::kReduceScatter, 1 << 20, hosts, {}, nullptr), Algo::kPairwise);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 8, hosts, {}, nullptr), Algo::kOneShot);
  // One rank per host: pairwise above the one-shot's limit; from 16 ranks the tree below it.
  AlgoPlace spread;
  spread.size = 15;
  spread.oneshotBytes = 65536;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 8, spread, {}, nullptr), Algo::kOneShot);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 65537, spread, {}, nullptr), Algo::kPairwise);
  EXPECT_EQ(chooseAlgo(AlgoOp::kReduceScatter, 65537, spread, {}, nullptr), Algo::kPairwise);
  spread.size = 16;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 8, spread, {}, nullptr), Algo::kTree);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 65536, spread, {}, nullptr), Algo::kTree);
  EXPECT_EQ(chooseAlgo(AlgoOp::kReduceScatter, 8, spread, {}, nullptr), Algo::kRing);
  EXPECT_NE(describeRule(spread, {}).find("all_reduce: tree"), std::string::npos) << describeRule(spread, {});
  hosts.size = 16;
  hosts.localRanks = 8;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 8, hosts, {}, nullptr), Algo::kTree);
  // The printable rule names each op and where it changes.
  std::string rule = describeRule(p, {});
  EXPECT_NE(rule.find("all_reduce: oneshot"), std::string::npos) << rule;
  EXPECT_NE(rule.find("from 65537 B rings"), std::string::npos) << rule;
  EXPECT_NE(rule.find("GPU buffers: staged"), std::string::npos) << rule;
}

// From 16 ranks across hosts every op but broadcast meets two peers per rank (small
// all-reduces: the tree's log2 n); hier's network stage becomes a ring from 16 hosts.
TEST(AlgoRule, AcrossHostsFrom16RanksTheRingBoundsThePeers) {
  AlgoPlace spread;
  spread.size = 16;
  spread.oneshotBytes = 65536;
  for (size_t b : {size_t(8), size_t(65537), size_t(1) << 28}) {
    EXPECT_EQ(chooseAlgo(AlgoOp::kReduceScatter, b, spread, {}, nullptr), Algo::kRing) << b;
    EXPECT_EQ(chooseAlgo(AlgoOp::kAllgather, b, spread, {}, nullptr), Algo::kRing) << b;
    // Small broadcasts by the tree (log2 n hops, not n - 1), large ones by the pipelined chain.
    EXPECT_EQ(chooseAlgo(AlgoOp::kBroadcast, b, spread, {}, nullptr), b <= 65536 ? Algo::kTree : Algo::kChain) << b;
  }
  spread.size = 15;
  EXPECT_EQ(chooseAlgo(AlgoOp::kBroadcast, 8, spread, {}, nullptr), Algo::kChain);
  spread.size = 16;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 65537, spread, {}, nullptr), Algo::kRing);
  spread.size = 15;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllgather, 1 << 20, spread, {}, nullptr), Algo::kDirect);
  AlgoPlace hosts;  // 4,096 ranks, 8 per host: hier, its 512-rank rails rings
  hosts.size = 4096;
  hosts.localRanks = 8;
  hosts.hostsEven = true;
  hosts.oneshotBytes = 65536;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 1 << 28, hosts, {}, nullptr), Algo::kHier);
  for (size_t b : {size_t(8), size_t(1) << 28}) {
    EXPECT_EQ(chooseAlgo(AlgoOp::kReduceScatter, b, hosts, {}, nullptr), Algo::kHier) << b;
    EXPECT_EQ(chooseAlgo(AlgoOp::kAllgather, b, hosts, {}, nullptr), Algo::kHier) << b;
  }
  EXPECT_TRUE(railRing(512, {}));
  EXPECT_TRUE(railRing(16, {}));
  EXPECT_FALSE(railRing(15, {}));
  EXPECT_TRUE(railRing(2, parseAlgos("hier,ring", nullptr)));
  std::string rule = describeRule(hosts, {});
  EXPECT_NE(rule.find("hier between hosts (512 ranks per rail): all_reduce ring"), std::string::npos) << rule;
  EXPECT_NE(rule.find("all_gather: hier"), std::string::npos) << rule;
}

TEST(AlgoRule, RanksSharingCoresReduceThroughTheRingsFrom16KiB) {
  AlgoPlace p = oneHost(4);
  p.sharedCores = true;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 16384, p, {}, nullptr), Algo::kOneShot);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 16385, p, {}, nullptr), Algo::kShmRings);
  EXPECT_EQ(chooseAlgo(AlgoOp::kReduceScatter, 65536, p, {}, nullptr), Algo::kShmRings);
  // Broadcast goes through the rings at every size: a chain would wait for one rank's turn on a
  // core per hop. All-gather copies no more in one step: unchanged.
  for (size_t b : {size_t(0), size_t(8), size_t(65536), size_t(65537)})
    EXPECT_EQ(chooseAlgo(AlgoOp::kBroadcast, b, p, {}, nullptr), Algo::kShmRings) << b;
  EXPECT_EQ(chooseAlgo(AlgoOp::kBroadcast, 8, p, parseAlgos("chain", nullptr), nullptr), Algo::kChain);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllgather, 65536, p, {}, nullptr), Algo::kDirect);
  // Above the one-shot limit all-gather reads each block from its owner (single copy) rather than
  // through the rings, as far as single copy reaches; below it, or with single copy off, the rings.
  p.cmaBytes = cmaBytesFor(-1, true);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllgather, 1 << 20, p, {}, nullptr), Algo::kDirect);
  p.cmaBytes = 1 << 21;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllgather, 1 << 20, p, {}, nullptr), Algo::kShmRings);
  EXPECT_NE(describeRule(p, {}).find("from 2097152 B direct (ranks share cores"), std::string::npos) << describeRule(p, {});
  p.cmaBytes = 0;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllgather, 1 << 20, p, {}, nullptr), Algo::kShmRings);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllgather, 1 << 20, p, parseAlgos("rings", nullptr), nullptr), Algo::kShmRings);
  // A smaller RAILCC_ONESHOT_BYTES still rules; RAILCC_ALGO=oneshot keeps it up to that value.
  p.oneshotBytes = 4096;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 8192, p, {}, nullptr), Algo::kShmRings);
  p.oneshotBytes = 65536;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 65536, p, parseAlgos("oneshot", nullptr), nullptr), Algo::kOneShot);
  // Without rings (two ranks, or rings too small for slices) the one-shot limit is as set.
  AlgoPlace two = oneHost(2);
  two.sharedCores = true;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 65536, two, {}, nullptr), Algo::kOneShot);
  p.shmRingSlices = false;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 65536, p, {}, nullptr), Algo::kOneShot);
  p.shmRingSlices = true;
  std::string rule = describeRule(p, {});
  EXPECT_NE(rule.find("sharing cores"), std::string::npos) << rule;
  EXPECT_NE(rule.find("from 16385 B rings"), std::string::npos) << rule;
  EXPECT_NE(rule.find("broadcast: rings (ranks share cores"), std::string::npos) << rule;
  // Ranks with cores of their own keep the chain for small broadcasts.
  p.sharedCores = false;
  EXPECT_EQ(chooseAlgo(AlgoOp::kBroadcast, 8, p, {}, nullptr), Algo::kChain);
}

TEST(AlgoRule, SingleCopyStartsLowerWhereRanksShareCores) {
  // RAILCC_CMA_BYTES=-1 (the default) resolves by placement; a value set is kept, 0 included.
  EXPECT_EQ(cmaBytesFor(-1, false), 16 << 10);
  EXPECT_EQ(cmaBytesFor(-1, true), 64 << 10);
  EXPECT_EQ(cmaBytesFor(0, true), 0);
  EXPECT_EQ(cmaBytesFor(4096, false), 4096);
  EXPECT_EQ(cmaBytesFor(int64_t(1) << 30, true), int64_t(1) << 30);
  AlgoPlace p = oneHost(4);
  p.sharedCores = true;
  p.cmaBytes = cmaBytesFor(-1, true);
  std::string rule = describeRule(p, {});
  EXPECT_NE(rule.find("of at least 65536 B in all-gather and all-to-all steps in one copy"), std::string::npos) << rule;
}

TEST(AlgoRule, GpuBuffersGoThroughCudaIpcOnlyWhereEveryRankMappedItsPeers) {
  AlgoPlace p = oneHost(4);
  const char* why = "";
  EXPECT_EQ(chooseDevicePath(p, true, &why), DevicePath::kStaged);  // RAILCC_CUDA_IPC off
  p.cudaIpc = true;
  EXPECT_EQ(chooseDevicePath(p, false, &why), DevicePath::kStaged);
  EXPECT_NE(std::string(why).find("could not map"), std::string::npos) << why;
  EXPECT_EQ(chooseDevicePath(p, true, &why), DevicePath::kCudaIpc);
  EXPECT_NE(describeRule(p, {}).find("GPU buffers: cuda-ipc"), std::string::npos);
}

TEST(AlgoRule, PreferencesApplyWhereTheyFitAndNcclNamesMap) {
  AlgoPlace p = oneHost(4);
  std::string ignored;
  auto pref = parseAlgos("Ring, Tree, collnet_direct", &ignored);
  EXPECT_EQ(ignored, "collnet_direct");
  const char* why = "";
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 8, p, pref, &why), Algo::kRing);
  EXPECT_STREQ(why, "RAILCC_ALGO");
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllgather, 8, p, pref, nullptr), Algo::kRing);
  EXPECT_EQ(chooseAlgo(AlgoOp::kBroadcast, 1 << 20, p, pref, nullptr), Algo::kChain);
  EXPECT_EQ(chooseAlgo(AlgoOp::kReduceScatter, 1 << 20, p, pref, nullptr), Algo::kRing);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 8, p, parseAlgos("tree", nullptr), nullptr), Algo::kTree);
  // The tree runs no reduce-scatter: the rule decides.
  EXPECT_EQ(chooseAlgo(AlgoOp::kReduceScatter, 1 << 20, p, parseAlgos("tree", nullptr), nullptr), Algo::kShmRings);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllgather, 8, p, parseAlgos("tree", nullptr), nullptr), Algo::kDirect);
  // Preferred but unable to run here: the rule decides.
  auto hier = parseAlgos("hier", nullptr);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 1 << 20, p, hier, nullptr), Algo::kShmRings);
  try {
    parseAlgos("ring,butterfly", nullptr);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("butterfly"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("pairwise"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("tree"), std::string::npos);
  }
}

// The broadcast tree's links, for hosts of 1 to 9 ranks, 1 to 40 hosts and every root: each
// rank but the root has one parent that lists it as a child, every rank is reached from the
// root, only the root's local index crosses hosts (H - 1 messages over the network), a rank
// has at most 4 children, and the depth is at most that of the two binary trees together.
TEST(BcastTree, ReachesEveryRankOnceWithOneNetworkHopPerHost) {
  for (int L = 1; L <= 9; ++L)
    for (int H = 1; H <= 40; H += (H < 12 ? 1 : 7))
      for (int root = 0; root < H * L; root += (H * L > 24 ? 5 : 1)) {
        const int n = H * L, hr = root / L, lr = root % L;
        std::vector<schedule::BcastLinks> links;
        for (int i = 0; i < n; ++i) links.push_back(schedule::bcastTree(H, L, hr, lr, i / L, i % L));
        std::vector<int> depth(static_cast<size_t>(n), -1);
        depth[static_cast<size_t>(root)] = 0;
        std::vector<int> todo{root};
        int network = 0, deepest = 0;
        while (!todo.empty()) {
          const int i = todo.back();
          todo.pop_back();
          const auto& b = links[static_cast<size_t>(i)];
          ASSERT_LE(b.nkids, 4);
          for (int k = 0; k < b.nkids; ++k) {
            const int c = b.kids[k];
            ASSERT_TRUE(c >= 0 && c < n) << "H " << H << " L " << L << " root " << root;
            ASSERT_EQ(links[static_cast<size_t>(c)].parent, i) << "H " << H << " L " << L << " root " << root << " kid " << c;
            ASSERT_EQ(depth[static_cast<size_t>(c)], -1) << "reached twice: " << c;
            depth[static_cast<size_t>(c)] = depth[static_cast<size_t>(i)] + 1;
            deepest = std::max(deepest, depth[static_cast<size_t>(c)]);
            if (c / L != i / L) {
              ++network;
              ASSERT_EQ(c % L, lr);
              ASSERT_EQ(i % L, lr);
            }
            todo.push_back(c);
          }
        }
        for (int i = 0; i < n; ++i) {
          ASSERT_GE(depth[static_cast<size_t>(i)], 0) << "H " << H << " L " << L << " root " << root << ": " << i << " never reached";
          ASSERT_EQ(links[static_cast<size_t>(i)].parent < 0, i == root);
        }
        ASSERT_EQ(network, H - 1);
        auto levels = [](int m) {
          int d = 0;
          while ((1 << (d + 1)) - 1 < m) ++d;
          return d;
        };
        ASSERT_LE(deepest, levels(H) + levels(L)) << "H " << H << " L " << L;
      }
}

class Forced : public testing::TestWithParam<const char*> {};

TEST_P(Forced, EveryAlgorithmGivesTheSameExactResults) {
  Config cfg = Config::defaults();
  cfg.algo = GetParam();
  cfg.initTimeoutSec = 30;
  testing_util::runRanks(3, cfg, "algo", [](Communicator& c) {
    const int n = c.size(), r = c.rank();
    for (size_t count : {size_t(0), size_t(5), size_t(100003)}) {
      std::vector<int32_t> a(count);
      for (size_t i = 0; i < count; ++i) a[i] = static_cast<int32_t>(i % 1000) * (r + 1);
      testing_util::waitOk(c.allreduce(a.data(), count, DataType::kInt32, ReduceOp::kSum));
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(a[i], static_cast<int32_t>(i % 1000) * n * (n + 1) / 2);
      std::vector<int32_t> b(count, r == 1 ? 7 : 0);
      testing_util::waitOk(c.broadcast(b.data(), count, DataType::kInt32, 1));
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(b[i], 7);
      std::vector<std::vector<int32_t>> outs(3, std::vector<int32_t>(count));
      std::vector<void*> po{outs[0].data(), outs[1].data(), outs[2].data()};
      std::vector<int32_t> mine(count, r + 10);
      testing_util::waitOk(c.allgather(mine.data(), count, DataType::kInt32, po));
      for (int q = 0; q < n; ++q)
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(outs[static_cast<size_t>(q)][i], q + 10);
      std::vector<const void*> ins{mine.data(), mine.data(), mine.data()};
      std::vector<int32_t> out(count);
      testing_util::waitOk(c.reduceScatter(ins, out.data(), count, DataType::kInt32, ReduceOp::kSum));
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(out[i], 10 + 11 + 12);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Algos, Forced, testing::Values("", "oneshot", "rings", "pairwise", "chain", "direct", "ring", "tree"),
                         [](const testing::TestParamInfo<const char*>& p) {
                           return std::string(*p.param ? p.param : "rule");
                         });

// The ring and the tree at sizes where their schedules differ (powers of two or not, one rank
// per ring position or several per host), with the ranks' hosts interleaved so the ring's
// host-by-host order is not the rank order: exact results for every reduction, and the same
// bits on every rank for sums of values no float holds exactly.
class RingTree : public testing::TestWithParam<std::tuple<const char*, int>> {};

TEST_P(RingTree, ExactAndAlikeOnEveryRank) {
  const auto [algo, n] = GetParam();
  Config cfg = Config::defaults();
  cfg.algo = algo;
  cfg.initTimeoutSec = 30;
  cfg.cmaBytes = 4096;  // the host stages' all-gather messages of 4 KiB and up in one copy
  const std::vector<size_t> counts{0, 1, static_cast<size_t>(n - 1), 7, 100003};
  std::vector<std::vector<std::vector<float>>> got(counts.size(), std::vector<std::vector<float>>(static_cast<size_t>(n)));
  testing_util::runRanks(
      n, cfg, std::string("ringtree-") + algo,
      [&](Communicator& c) {
        const int r = c.rank();
        for (size_t k = 0; k < counts.size(); ++k) {
          const size_t count = counts[k];
          for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProduct}) {
            std::vector<int32_t> a(count);
            for (size_t i = 0; i < count; ++i) a[i] = static_cast<int32_t>((i + static_cast<size_t>(r)) % 5) - 1;
            testing_util::waitOk(c.allreduce(a.data(), count, DataType::kInt32, op));
            for (size_t i = 0; i < count; ++i) {
              int32_t want = op == ReduceOp::kProduct ? 1 : op == ReduceOp::kSum ? 0 : static_cast<int32_t>((i % 5)) - 1;
              for (int q = 0; q < n; ++q) {
                int32_t v = static_cast<int32_t>((i + static_cast<size_t>(q)) % 5) - 1;
                if (op == ReduceOp::kSum) want += v;
                else if (op == ReduceOp::kProduct) want *= v;
                else if (op == ReduceOp::kMax) want = std::max(want, v);
                else want = std::min(want, v);
              }
              ASSERT_EQ(a[i], want) << "op " << static_cast<int>(op) << " count " << count << " element " << i;
            }
          }
          std::vector<double> pm(count, 2.0 * (r + 1));
          testing_util::waitOk(c.allreduce(pm.data(), count, DataType::kFloat64, ReduceOp::kPremulSum, 0.5));
          for (double v : pm) ASSERT_EQ(v, n * (n + 1) / 2.0);
          std::vector<double> av(count, 4.0 * (r + 1));
          testing_util::waitOk(c.allreduce(av.data(), count, DataType::kFloat64, ReduceOp::kAvg));
          for (double v : av) ASSERT_DOUBLE_EQ(v, 2.0 * (n + 1));
          std::vector<float> f(count);
          for (size_t i = 0; i < count; ++i) f[i] = 0.1f * static_cast<float>(r + 1) + 1e-3f * static_cast<float>(i % 97);
          testing_util::waitOk(c.allreduce(f.data(), count, DataType::kFloat32, ReduceOp::kSum));
          got[k][static_cast<size_t>(r)] = f;
          std::vector<std::vector<int32_t>> outs(static_cast<size_t>(n), std::vector<int32_t>(count));
          std::vector<void*> po;
          for (auto& o : outs) po.push_back(o.data());
          std::vector<int32_t> mine(count, r + 10);
          testing_util::waitOk(c.allgather(mine.data(), count, DataType::kInt32, po));
          for (int q = 0; q < n; ++q)
            for (size_t i = 0; i < count; ++i) ASSERT_EQ(outs[static_cast<size_t>(q)][i], q + 10) << "all_gather from " << q;
          // Reduce-scatter of separate inputs: block q of rank p holds p - 2q + i % 3.
          std::vector<std::vector<int32_t>> rin(static_cast<size_t>(n), std::vector<int32_t>(count));
          std::vector<const void*> pin;
          for (int q = 0; q < n; ++q) {
            for (size_t i = 0; i < count; ++i) rin[static_cast<size_t>(q)][i] = r - 2 * q + static_cast<int32_t>(i % 3);
            pin.push_back(rin[static_cast<size_t>(q)].data());
          }
          for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
            std::vector<int32_t> rout(count, -99);
            testing_util::waitOk(c.reduceScatter(pin, rout.data(), count, DataType::kInt32, op));
            for (size_t i = 0; i < count; ++i) {
              const int32_t base = -2 * r + static_cast<int32_t>(i % 3);
              const int32_t want = op == ReduceOp::kSum ? n * base + n * (n - 1) / 2 : op == ReduceOp::kMax ? base + n - 1 : base;
              ASSERT_EQ(rout[i], want) << "reduce_scatter op " << static_cast<int>(op) << " count " << count << " element " << i;
            }
            for (size_t i = 0; i < count; ++i) ASSERT_EQ(rin[static_cast<size_t>(r)][i], -r + static_cast<int32_t>(i % 3)) << "input changed";
          }
          std::vector<std::vector<double>> din(static_cast<size_t>(n), std::vector<double>(count, 2.0 * (r + 1)));
          std::vector<const void*> pdin;
          for (auto& d : din) pdin.push_back(d.data());
          std::vector<double> dout(count);
          testing_util::waitOk(c.reduceScatter(pdin, dout.data(), count, DataType::kFloat64, ReduceOp::kPremulSum, 0.5));
          for (double v : dout) ASSERT_EQ(v, n * (n + 1) / 2.0);
          testing_util::waitOk(c.reduceScatter(pdin, dout.data(), count, DataType::kFloat64, ReduceOp::kAvg));
          for (double v : dout) ASSERT_DOUBLE_EQ(v, n + 1.0);
        }
        // A broadcast from every root (the tree's rotation; its rails where hosts are even).
        for (int root = 0; root < n; ++root)
          for (size_t count : {size_t(0), size_t(3), size_t(100003)}) {
            std::vector<int32_t> b(count, r == root ? 0 : -1);
            if (r == root)
              for (size_t i = 0; i < count; ++i) b[i] = static_cast<int32_t>(i % 1009) + 7 * root;
            testing_util::waitOk(c.broadcast(b.data(), count, DataType::kInt32, root));
            for (size_t i = 0; i < count; ++i)
              ASSERT_EQ(b[i], static_cast<int32_t>(i % 1009) + 7 * root) << "broadcast from " << root << " element " << i;
          }
        // Above the 1 MiB the tree keeps for its copy, twice: the copy is let go and made again.
        for (int round = 0; round < 2; ++round) {
          std::vector<int32_t> big(300001, r + round);
          testing_util::waitOk(c.allreduce(big.data(), big.size(), DataType::kInt32, ReduceOp::kSum));
          for (int32_t v : big) ASSERT_EQ(v, n * (n - 1) / 2 + n * round);
        }
      },
      [](int r, Config& c) { c.hostId = "h" + std::to_string(r % 2); });
  for (size_t k = 0; k < counts.size(); ++k)
    for (int r = 1; r < n; ++r)
      EXPECT_TRUE(got[k][static_cast<size_t>(r)] == got[k][0]) << "rank " << r << " ended with other bits than rank 0, "
                                                               << counts[k] << " floats";
}

INSTANTIATE_TEST_SUITE_P(Algos, RingTree,
                         testing::Combine(testing::Values("ring", "tree", "hier,ring"), testing::Values(2, 3, 5, 6, 8)),
                         [](const testing::TestParamInfo<std::tuple<const char*, int>>& p) {
                           std::string name = std::string(std::get<0>(p.param)) + std::to_string(std::get<1>(p.param));
                           std::replace(name.begin(), name.end(), ',', '_');
                           return name;
                         });

}  // namespace
