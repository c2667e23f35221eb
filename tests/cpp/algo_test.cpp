// The algorithm rule (engine/algorithms/choose.h): what it picks, what RAILCC_ALGO changes,
// and every forced algorithm giving the same, exact results on real ranks.
#include <gtest/gtest.h>

#include "common/error.h"
#include "engine/algorithms/choose.h"
#include "ranks.h"

using namespace railcc;
using namespace railcc::engine;

namespace {

AlgoPlace oneHost(int n) {
  AlgoPlace p;
  p.size = n;
  p.localRanks = n;
  p.rings = n > 2;
  p.ringSlices = n > 2;
  p.oneshotBytes = 65536;
  return p;
}

TEST(AlgoRule, SizeAndPlacementDecide) {
  AlgoPlace p = oneHost(4);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 8, p, {}, nullptr), Algo::kOneShot);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 65537, p, {}, nullptr), Algo::kRings);
  EXPECT_EQ(chooseAlgo(AlgoOp::kBroadcast, 65536, p, {}, nullptr), Algo::kChain);
  EXPECT_EQ(chooseAlgo(AlgoOp::kBroadcast, 65537, p, {}, nullptr), Algo::kRings);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllgather, 1 << 20, p, {}, nullptr), Algo::kRings);
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
  // The printable rule names each op and where it changes.
  std::string rule = describeRule(p, {});
  EXPECT_NE(rule.find("all_reduce: oneshot"), std::string::npos) << rule;
  EXPECT_NE(rule.find("from 65537 B rings"), std::string::npos) << rule;
  EXPECT_NE(rule.find("GPU buffers: staged"), std::string::npos) << rule;
}

TEST(AlgoRule, RanksSharingCoresReduceThroughTheRingsFrom16KiB) {
  AlgoPlace p = oneHost(4);
  p.sharedCores = true;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 16384, p, {}, nullptr), Algo::kOneShot);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 16385, p, {}, nullptr), Algo::kRings);
  EXPECT_EQ(chooseAlgo(AlgoOp::kReduceScatter, 65536, p, {}, nullptr), Algo::kRings);
  // Broadcast and all-gather copy no more in one step: unchanged.
  EXPECT_EQ(chooseAlgo(AlgoOp::kBroadcast, 65536, p, {}, nullptr), Algo::kChain);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllgather, 65536, p, {}, nullptr), Algo::kDirect);
  // A smaller RAILCC_ONESHOT_BYTES still rules; RAILCC_ALGO=oneshot keeps it up to that value.
  p.oneshotBytes = 4096;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 8192, p, {}, nullptr), Algo::kRings);
  p.oneshotBytes = 65536;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 65536, p, parseAlgos("oneshot", nullptr), nullptr), Algo::kOneShot);
  // Without rings (two ranks, or rings too small for slices) the one-shot limit is as set.
  AlgoPlace two = oneHost(2);
  two.sharedCores = true;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 65536, two, {}, nullptr), Algo::kOneShot);
  p.ringSlices = false;
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 65536, p, {}, nullptr), Algo::kOneShot);
  p.ringSlices = true;
  std::string rule = describeRule(p, {});
  EXPECT_NE(rule.find("sharing cores"), std::string::npos) << rule;
  EXPECT_NE(rule.find("from 16385 B rings"), std::string::npos) << rule;
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
  auto pref = parseAlgos("Ring, Tree", &ignored);
  EXPECT_EQ(ignored, "tree");
  const char* why = "";
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 8, p, pref, &why), Algo::kPairwise);
  EXPECT_STREQ(why, "RAILCC_ALGO");
  EXPECT_EQ(chooseAlgo(AlgoOp::kBroadcast, 1 << 20, p, pref, nullptr), Algo::kChain);
  // Preferred but unable to run here: the rule decides.
  auto hier = parseAlgos("hier", nullptr);
  EXPECT_EQ(chooseAlgo(AlgoOp::kAllreduce, 1 << 20, p, hier, nullptr), Algo::kRings);
  try {
    parseAlgos("ring,butterfly", nullptr);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("butterfly"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("pairwise"), std::string::npos);
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

INSTANTIATE_TEST_SUITE_P(Algos, Forced, testing::Values("", "oneshot", "rings", "pairwise", "chain", "direct", "ring"),
                         [](const testing::TestParamInfo<const char*>& p) {
                           return std::string(*p.param ? p.param : "rule");
                         });

}  // namespace
