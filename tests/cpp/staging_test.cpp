// Collectives on "device" buffers without a GPU: the engine's pinned staging, and the CUDA
// IPC all-reduce (pools mapped by peers, interprocess events, zero-byte host rounds), on the
// fake device runtime of fake_device.h (host memory, named so).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "engine/communicator.h"
#include "engine/device.h"
#include "common/error.h"
#include "fake_device.h"
#include "ranks.h"

using namespace railcc;
using namespace railcc::engine;
using namespace railcc::engine::fake_device;

namespace {

struct Param {
  int size;
  bool shm;
  int64_t staging;  // RAILCC_CUDA_STAGING_BYTES: small ones cut many chunks
  bool ipc;         // RAILCC_CUDA_IPC (used when every rank shares memory, i.e. shm)
  bool signals = false;  // RAILCC_CUDA_IPC_SIGNALS: the IPC steps meet through the streams
};

std::string paramName(const testing::TestParamInfo<Param>& p) {
  return std::string(p.param.shm ? "shm" : "tcp") + "_n" + std::to_string(p.param.size) + "_stage" +
         std::to_string(p.param.staging) + (p.param.ipc ? "_ipc" : "") + (p.param.signals ? "_signals" : "");
}

void runRanks(const Param& p, const std::function<void(Communicator&)>& body) {
  Config cfg = Config::defaults();
  cfg.shmDisable = !p.shm;
  cfg.initTimeoutSec = 30;
  cfg.cudaStagingBytes = p.staging;
  cfg.cudaIpc = p.ipc;
  cfg.cudaIpcSignals = p.signals;
  cfg.cudaIpcBytes = 4 * 65536;  // the smallest chunks, so the tests cross several
  cfg.buffSize = 64 * 1024;
  testing_util::runRanks(p.size, cfg, "staging", body);
}

using testing_util::waitOk;

const Placement kDev{0, nullptr, nullptr};

class Staged : public testing::TestWithParam<Param> {
 protected:
  void SetUp() override { setDeviceApiForTesting(&kFake); }
  void TearDown() override { setDeviceApiForTesting(nullptr); }
};

TEST_P(Staged, AllreduceReduceBroadcast) {
  runRanks(GetParam(), [](Communicator& c) {
    int n = c.size(), me = c.rank();
    for (size_t count : {size_t(0), size_t(1), size_t(1001), size_t(40009)}) {
      std::vector<int64_t> v(count);
      for (size_t i = 0; i < count; ++i) v[i] = static_cast<int64_t>(i) * (me + 1);
      waitOk(c.allreduce(v.data(), count, DataType::kInt64, ReduceOp::kSum, 1.0, Millis(0), kDev));
      int64_t f = static_cast<int64_t>(n) * (n + 1) / 2;
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(v[i], static_cast<int64_t>(i) * f) << "count " << count << " i " << i;

      std::vector<float> a(count, static_cast<float>(me + 1));
      waitOk(c.allreduce(a.data(), count, DataType::kFloat32, ReduceOp::kAvg, 1.0, Millis(0), kDev));
      for (float x : a) ASSERT_FLOAT_EQ(x, (n + 1) / 2.0f);

      std::vector<int32_t> r(count, me + 1);
      int root = n - 1;
      waitOk(c.reduce(r.data(), count, DataType::kInt32, ReduceOp::kMax, root, 1.0, Millis(0), kDev));
      for (int32_t x : r) ASSERT_EQ(x, me == root ? n : me + 1);  // other ranks keep their input

      std::vector<int16_t> b(count, static_cast<int16_t>(me == root ? 7 : -1));
      waitOk(c.broadcast(b.data(), count, DataType::kInt16, root, Millis(0), kDev));
      for (int16_t x : b) ASSERT_EQ(x, 7);
    }
  });
}

// Every rank's input is a pattern of small integers, so every op is exact; the expected result
// comes from the engine's host reduction applied in rank order.
template <typename T>
std::vector<T> patternOf(int rank, size_t count, size_t mul, size_t rankMul, size_t mod) {
  std::vector<T> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = static_cast<T>((i * mul + static_cast<size_t>(rank) * rankMul) % mod + 1);
  return v;
}
template <typename T, typename Input>
std::vector<T> reducedInRankOrder(int n, const Input& input, size_t count, DataType dt, ReduceOp op, double scale) {
  std::vector<T> want = input(0);
  if (op == ReduceOp::kPremulSum) scaleCopy(want.data(), want.data(), count, dt, scale);
  for (int r = 1; r < n; ++r) {
    auto x = input(r);
    reduceInto(want.data(), x.data(), count, dt, op, scale);
  }
  if (op == ReduceOp::kAvg) divideBy(want.data(), count, dt, n);
  return want;
}

template <typename T>
void allreduceMatches(Communicator& c, DataType dt, ReduceOp op, double scale, size_t count) {
  int n = c.size(), me = c.rank();
  auto input = [&](int r) { return patternOf<T>(r, count, 7, 3, 5); };
  std::vector<T> want = reducedInRankOrder<T>(n, input, count, dt, op, scale);
  auto got = input(me);
  waitOk(c.allreduce(got.data(), count, dt, op, scale, Millis(0), kDev));
  for (size_t i = 0; i < count; ++i)
    ASSERT_EQ(got[i], want[i]) << dtypeName(dt) << " " << reduceOpName(op) << " count " << count << " i " << i;
}

TEST_P(Staged, AllreduceOpsAndDtypes) {
  runRanks(GetParam(), [](Communicator& c) {
    for (size_t count : {size_t(0), size_t(7), size_t(70001)}) {
      allreduceMatches<float>(c, DataType::kFloat32, ReduceOp::kPremulSum, 0.5, count);
      allreduceMatches<double>(c, DataType::kFloat64, ReduceOp::kAvg, 1.0, count);
      allreduceMatches<float>(c, DataType::kFloat32, ReduceOp::kProduct, 1.0, count);
      allreduceMatches<int32_t>(c, DataType::kInt32, ReduceOp::kMax, 1.0, count);
      allreduceMatches<int8_t>(c, DataType::kInt8, ReduceOp::kMin, 1.0, count);
      allreduceMatches<uint8_t>(c, DataType::kUInt8, ReduceOp::kBxor, 1.0, count);
    }
  });
}

TEST_P(Staged, AllgatherReduceScatterInPlaceToo) {
  runRanks(GetParam(), [](Communicator& c) {
    int n = c.size(), me = c.rank();
    const size_t count = 2999;
    std::vector<int32_t> in(count), out(count * static_cast<size_t>(n), -1);
    for (size_t i = 0; i < count; ++i) in[i] = static_cast<int32_t>(i) + 10000 * me;
    std::vector<void*> outs;
    for (int r = 0; r < n; ++r) outs.push_back(out.data() + count * static_cast<size_t>(r));
    waitOk(c.allgather(in.data(), count, DataType::kInt32, outs, Millis(0), kDev));
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(out[count * static_cast<size_t>(r) + i], static_cast<int32_t>(i) + 10000 * r);

    // In place: the input is this rank's slice of the output.
    std::fill(out.begin(), out.end(), -1);
    int32_t* mine = out.data() + count * static_cast<size_t>(me);
    for (size_t i = 0; i < count; ++i) mine[i] = static_cast<int32_t>(i) + 10000 * me;
    waitOk(c.allgather(mine, count, DataType::kInt32, outs, Millis(0), kDev));
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(out[count * static_cast<size_t>(r) + i], static_cast<int32_t>(i) + 10000 * r);

    // reduce_scatter: rank r's block of the result is sum over ranks of their block r.
    std::vector<double> full(count * static_cast<size_t>(n));
    for (size_t i = 0; i < full.size(); ++i) full[i] = static_cast<double>(i) + me;
    std::vector<const void*> ins;
    for (int r = 0; r < n; ++r) ins.push_back(full.data() + count * static_cast<size_t>(r));
    std::vector<double> rs(count, -1);
    waitOk(c.reduceScatter(ins, rs.data(), count, DataType::kFloat64, ReduceOp::kSum, 1.0, Millis(0), kDev));
    double rankSum = n * (n - 1) / 2.0;
    for (size_t i = 0; i < count; ++i)
      ASSERT_DOUBLE_EQ(rs[i], n * static_cast<double>(count * static_cast<size_t>(me) + i) + rankSum) << i;
  });
}

TEST_P(Staged, AlltoallUnevenGatherScatterCoalesced) {
  runRanks(GetParam(), [](Communicator& c) {
    int n = c.size(), me = c.rank();
    // 0 included; one pair far larger than the rest, so ranks must agree on the chunk count
    auto split = [n](int from, int to) {
      return static_cast<size_t>((from * 7 + to * 1301) % 3001) + (from == 0 && to == n - 1 ? 40000 : 0);
    };
    std::vector<std::vector<int32_t>> send(static_cast<size_t>(n)), recv(static_cast<size_t>(n));
    std::vector<const void*> ins;
    std::vector<void*> outs;
    std::vector<size_t> inC, outC;
    for (int p = 0; p < n; ++p) {
      send[static_cast<size_t>(p)].assign(split(me, p), me * 100 + p);
      recv[static_cast<size_t>(p)].assign(split(p, me), -1);
      ins.push_back(send[static_cast<size_t>(p)].data());
      inC.push_back(split(me, p));
      outs.push_back(recv[static_cast<size_t>(p)].data());
      outC.push_back(split(p, me));
    }
    waitOk(c.alltoall(ins, inC, outs, outC, DataType::kInt32, Millis(0), kDev));
    for (int p = 0; p < n; ++p)
      for (int32_t x : recv[static_cast<size_t>(p)]) ASSERT_EQ(x, p * 100 + me) << "from " << p;

    const size_t count = 1777;
    int root = n / 2;
    std::vector<uint8_t> g(count, static_cast<uint8_t>(me + 1)), all(count * static_cast<size_t>(n), 0);
    std::vector<void*> gouts;
    if (me == root)
      for (int r = 0; r < n; ++r) gouts.push_back(all.data() + count * static_cast<size_t>(r));
    waitOk(c.gather(g.data(), count, DataType::kUInt8, gouts, root, Millis(0), kDev));
    if (me == root)
      for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], i / count + 1);

    std::vector<const void*> sins;
    std::vector<uint8_t> src(count * static_cast<size_t>(n));
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i / count * 3 + 1);
    if (me == root)
      for (int r = 0; r < n; ++r) sins.push_back(src.data() + count * static_cast<size_t>(r));
    std::vector<uint8_t> got(count, 0);
    waitOk(c.scatter(sins, got.data(), count, DataType::kUInt8, root, Millis(0), kDev));
    for (uint8_t x : got) ASSERT_EQ(x, me * 3 + 1);

    // Coalesced: sizes 0, 1, odd and one larger than a chunk.
    std::vector<std::vector<float>> ts;
    for (size_t sz : {size_t(0), size_t(1), size_t(333), size_t(20011)}) ts.emplace_back(sz, static_cast<float>(me));
    std::vector<void*> bufs;
    std::vector<size_t> counts;
    for (auto& t : ts) bufs.push_back(t.data()), counts.push_back(t.size());
    waitOk(c.allreduceCoalesced(bufs, counts, DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(0), kDev));
    for (auto& t : ts)
      for (float x : t) ASSERT_FLOAT_EQ(x, n * (n - 1) / 2.0f);
  });
}

// Rooted ops and many-buffer all-reduce, with counts that cross several chunks (with CUDA IPC
// the root reads its peers' pools, or they read its pool). Expected results come from the
// engine's host reduction in rank order, so every op must match exactly.
template <typename T>
void reduceMatches(Communicator& c, DataType dt, ReduceOp op, double scale, size_t count, int root) {
  int n = c.size(), me = c.rank();
  auto input = [&](int r) { return patternOf<T>(r, count, 5, 7, 6); };
  std::vector<T> want = reducedInRankOrder<T>(n, input, count, dt, op, scale);
  auto got = input(me);
  waitOk(c.reduce(got.data(), count, dt, op, root, scale, Millis(0), kDev));
  auto mine = input(me);
  for (size_t i = 0; i < count; ++i)
    ASSERT_EQ(got[i], me == root ? want[i] : mine[i])
        << dtypeName(dt) << " " << reduceOpName(op) << " root " << root << " count " << count << " i " << i;
}

TEST_P(Staged, RootedOpsAndManyBuffersAcrossChunks) {
  runRanks(GetParam(), [](Communicator& c) {
    int n = c.size(), me = c.rank();
    for (int root : {0, n - 1}) {
      for (size_t count : {size_t(0), size_t(3), size_t(70001)}) {
        reduceMatches<int64_t>(c, DataType::kInt64, ReduceOp::kSum, 1.0, count, root);
        reduceMatches<float>(c, DataType::kFloat32, ReduceOp::kPremulSum, 0.25, count, root);
        reduceMatches<double>(c, DataType::kFloat64, ReduceOp::kAvg, 1.0, count, root);
        reduceMatches<int8_t>(c, DataType::kInt8, ReduceOp::kMin, 1.0, count, root);
      }
      const size_t count = 100003;  // int32: several chunks, and pieces that do not divide them
      std::vector<int32_t> g(count), all(count * static_cast<size_t>(n), -1);
      for (size_t i = 0; i < count; ++i) g[i] = static_cast<int32_t>(i) * 3 + me;
      std::vector<void*> gouts;
      if (me == root)
        for (int r = 0; r < n; ++r) gouts.push_back(all.data() + count * static_cast<size_t>(r));
      waitOk(c.gather(g.data(), count, DataType::kInt32, gouts, root, Millis(0), kDev));
      if (me == root)
        for (size_t i = 0; i < all.size(); ++i)
          ASSERT_EQ(all[i], static_cast<int32_t>(i % count) * 3 + static_cast<int32_t>(i / count)) << "gather " << i;

      std::vector<int32_t> src(count * static_cast<size_t>(n));
      for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<int32_t>(i) ^ 0x5a5a;
      std::vector<const void*> sins;
      if (me == root)
        for (int r = 0; r < n; ++r) sins.push_back(src.data() + count * static_cast<size_t>(r));
      std::vector<int32_t> got(count, -1);
      waitOk(c.scatter(sins, got.data(), count, DataType::kInt32, root, Millis(0), kDev));
      for (size_t i = 0; i < count; ++i)
        ASSERT_EQ(got[i], static_cast<int32_t>(count * static_cast<size_t>(me) + i) ^ 0x5a5a) << "scatter " << i;
    }

    // Many buffers of odd sizes: pieces of one buffer land in several ranks' slices and chunks;
    // the first few together are small enough for the one-shot path.
    std::vector<std::vector<int32_t>> ts;
    for (size_t sz : {size_t(0), size_t(5), size_t(1000), size_t(3), size_t(2000)}) {
      ts.emplace_back(sz);
      for (size_t i = 0; i < sz; ++i) ts.back()[i] = static_cast<int32_t>(sz * 7 + i) * (me + 1);
    }
    {
      std::vector<void*> small;
      std::vector<size_t> smallCounts;
      for (auto& t : ts) small.push_back(t.data()), smallCounts.push_back(t.size());
      waitOk(c.allreduceCoalesced(small, smallCounts, DataType::kInt32, ReduceOp::kSum, 1.0, Millis(0), kDev));
      for (auto& t : ts)
        for (size_t i = 0; i < t.size(); ++i)
          ASSERT_EQ(t[i], static_cast<int32_t>(t.size() * 7 + i) * (n * (n + 1) / 2)) << "small coalesced " << i;
      ts.clear();
    }
    for (size_t i = 0; i < 60; ++i) ts.emplace_back((i * 2749) % 9001 + (i == 7 ? 50000 : 0) - (i % 9 == 0 ? (i * 2749) % 9001 : 0));
    std::vector<void*> bufs;
    std::vector<size_t> counts;
    for (size_t t = 0; t < ts.size(); ++t) {
      for (size_t i = 0; i < ts[t].size(); ++i) ts[t][i] = static_cast<int32_t>(t * 100000 + i) * (me + 1);
      bufs.push_back(ts[t].data());
      counts.push_back(ts[t].size());
    }
    waitOk(c.allreduceCoalesced(bufs, counts, DataType::kInt32, ReduceOp::kSum, 1.0, Millis(0), kDev));
    int32_t f = n * (n + 1) / 2;
    for (size_t t = 0; t < ts.size(); ++t)
      for (size_t i = 0; i < ts[t].size(); ++i)
        ASSERT_EQ(ts[t][i], static_cast<int32_t>(t * 100000 + i) * f) << "buffer " << t << " i " << i;
  });
}

// As the glue calls them: on the caller's stream, completing once queued. Five ops run back
// to back, each reading what the one before wrote, and nothing waits for the "GPU" until the
// end: with CUDA IPC none of them does, so the fake runs all their copies and kernels only at
// the final synchronize, and only the events order them (pools reused across ops included).
// The ops alternate between two streams, and only the last one's stream is synchronized: each
// op's stream must wait for the one before, or the other stream's ops would never run.
TEST_P(Staged, OpsQueuedOnTheCallersStream) {
  const Param p = GetParam();
  std::vector<std::unique_ptr<FakeStream>> streams;
  for (int r = 0; r < 2 * p.size; ++r) streams.push_back(std::make_unique<FakeStream>());
  runRanks(p, [&](Communicator& c) {
    int n = c.size(), me = c.rank(), root = n - 1;
    void* s = streams[static_cast<size_t>(2 * me)].get();
    void* s2 = streams[static_cast<size_t>(2 * me + 1)].get();
    const Placement on{0, s, nullptr, /*queued=*/true}, on2{0, s2, nullptr, /*queued=*/true};
    const size_t count = 70001;
    std::vector<int32_t> a(count), all(count * static_cast<size_t>(n), -1), rs(count, -1), b(count);
    for (size_t i = 0; i < count; ++i) a[i] = static_cast<int32_t>(i) + me;
    for (size_t i = 0; i < count; ++i) b[i] = me == root ? static_cast<int32_t>(i) * 3 : -1;
    std::vector<void*> outs;
    std::vector<const void*> ins;
    for (int r = 0; r < n; ++r) {
      outs.push_back(all.data() + count * static_cast<size_t>(r));
      ins.push_back(all.data() + count * static_cast<size_t>(r));
    }
    waitOk(c.allreduce(a.data(), count, DataType::kInt32, ReduceOp::kSum, 1.0, Millis(0), on));
    waitOk(c.allgather(a.data(), count, DataType::kInt32, outs, Millis(0), on2));
    waitOk(c.reduceScatter(ins, rs.data(), count, DataType::kInt32, ReduceOp::kSum, 1.0, Millis(0), on));
    waitOk(c.broadcast(b.data(), count, DataType::kInt32, root, Millis(0), on2));
    waitOk(c.allreduce(a.data(), count, DataType::kInt32, ReduceOp::kSum, 1.0, Millis(0), on));
    Fake::streamSynchronize(s);
    const int32_t base = n * (n - 1) / 2;
    for (size_t i = 0; i < count; ++i) {
      int32_t once = n * static_cast<int32_t>(i) + base;  // after the first all-reduce
      ASSERT_EQ(all[count * static_cast<size_t>(me) + i], once) << "all_gather " << i;
      ASSERT_EQ(rs[i], n * once) << "reduce_scatter " << i;
      ASSERT_EQ(b[i], static_cast<int32_t>(i) * 3) << "broadcast " << i;
      ASSERT_EQ(a[i], n * once) << "second all_reduce " << i;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Chunks, Staged,
                         testing::Values(Param{1, true, 4096, false}, Param{2, true, 4096, false},
                                         Param{3, true, 4096, false}, Param{4, true, 65536, false},
                                         Param{3, false, 4096, false}, Param{2, true, 33554432, false},
                                         Param{2, true, 4096, true}, Param{3, true, 4096, true},
                                         Param{4, true, 65536, true}, Param{3, false, 4096, true},
                                         Param{2, true, 4096, true, true}, Param{3, true, 4096, true, true},
                                         Param{4, true, 65536, true, true}),
                         paramName);

// GPUs that cannot reach each other's memory: every rank votes against CUDA IPC, and the
// group falls back to staging (after closing the peers' mappings and one more round).
struct FakeNoP2P : Fake {
  static int pointerDevice(const void*, int* d) { return *d = 1, 0; }  // peers' pools look remote
  static int canAccessPeer(int, int, int* can) { return *can = 0, 0; }
};
const cuda::DeviceApi kFakeNoP2P = [] {
  cuda::DeviceApi a = kFake;
  a.pointerDevice = FakeNoP2P::pointerDevice;
  a.canAccessPeer = FakeNoP2P::canAccessPeer;
  return a;
}();

TEST(StagedErrors, NoPeerAccessFallsBackToStaging) {
  setDeviceApiForTesting(&kFakeNoP2P);
  runRanks({3, true, 4096, true}, [](Communicator& c) {
    for (int round = 0; round < 2; ++round) {  // the second op must not try IPC again
      std::vector<int64_t> v(20011, c.rank() + 1);
      waitOk(c.allreduce(v.data(), v.size(), DataType::kInt64, ReduceOp::kSum, 1.0, Millis(0), kDev));
      for (int64_t x : v) ASSERT_EQ(x, 6);
    }
  });
  setDeviceApiForTesting(nullptr);
}

// The chunk size and the one-shot threshold decide how many host rounds an IPC op takes, which
// zero-byte rounds cannot check: ranks that disagree must all fail, naming the setting.
TEST(StagedErrors, IpcSettingsThatDifferFailOnEveryRank) {
  setDeviceApiForTesting(&kFake);
  Config cfg = Config::defaults();
  cfg.initTimeoutSec = 30;
  cfg.cudaIpc = true;
  cfg.cudaIpcBytes = 4 * 65536;
  cfg.buffSize = 64 * 1024;
  // RAILCC_ONESHOT_BYTES, also part of this vote, is compared earlier, at init (bootstrap.cpp;
  // test_hardening.py's test_algorithm_settings_that_differ_between_ranks_fail_init_by_name).
  testing_util::runRanks(
      3, cfg, "staging",
      [](Communicator& c) {
        std::vector<int32_t> v(1000, 1);
        auto req = c.allreduce(v.data(), v.size(), DataType::kInt32, ReduceOp::kSum, 1.0, Millis(0), kDev);
        auto e = testing_util::failureOf(req, Millis(60000));
        ASSERT_TRUE(e) << "rank " << c.rank() << " did not fail with a railcc error";
        EXPECT_EQ(e->code(), ErrorCode::kMismatch) << e->what();
        EXPECT_NE(std::string(e->what()).find("RAILCC_CUDA_IPC_BYTES"), std::string::npos) << e->what();
      },
      [](int rank, Config& c) {
        if (rank == 2) c.cudaIpcBytes = 8 * 65536;
      });
  setDeviceApiForTesting(nullptr);
}

TEST(StagedErrors, MissingPluginIsAClearDeviceError) {
  setDeviceApiForTesting(nullptr);
  setenv("RAILCC_CUDA_PLUGIN", "/nonexistent/librailcc_cuda.so", 1);
  std::string why;
  // The loader remembers its first answer per process; only check the message when this
  // test is the first to load it.
  if (!deviceApiAvailable(&why)) EXPECT_NE(why.find("CUDA plugin"), std::string::npos) << why;
  unsetenv("RAILCC_CUDA_PLUGIN");
}

// A kernel that never finishes on the caller's stream, before an op that completes once its
// GPU work is queued (CUDA IPC on the caller's stream): the call returns, and after the op's
// timeout the watchdog thread, which sleeps between checks instead of polling the GPU, fails
// the group naming the op and the stream; the next call on the group raises that error.
TEST(StagedErrors, GpuWorkThatNeverFinishesIsTimedOutByTheWatchdog) {
  setDeviceApiForTesting(&kFake);
  gHung = true;
  std::vector<std::unique_ptr<FakeStream>> streams;
  std::vector<std::unique_ptr<FakeEvent>> ready;
  for (int r = 0; r < 2; ++r) {
    streams.push_back(std::make_unique<FakeStream>());  // the caller's
    streams.push_back(std::make_unique<FakeStream>());  // the group's
    ready.push_back(std::make_unique<FakeEvent>());
  }
  std::atomic<int> checked{0};
  runRanks({2, true, 4096, true}, [&](Communicator& c) {
    const size_t me = static_cast<size_t>(c.rank());
    void* caller = streams[2 * me].get();
    void* s = streams[2 * me + 1].get();
    Fake::hangAsync(caller);
    Fake::eventRecord(ready[me].get(), caller);
    const Placement on{0, s, ready[me].get(), /*queued=*/true};
    std::vector<float> v(1000, 1.0f);
    waitOk(c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(300), on));
    const long before = gQueries.load();
    const auto t0 = std::chrono::steady_clock::now();
    while (!c.brokenError() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30))
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const long polls = gQueries.load() - before;
    ASSERT_TRUE(c.brokenError()) << "rank " << me << ": the group did not fail";
    // Waiting costs a query per watchdog wake-up (about one a second), not a spinning core.
    EXPECT_LT(polls, 50) << "the GPU was polled " << polls << " times while the op hung";
    char stream[32];
    std::snprintf(stream, sizeof(stream), "%p", s);
    try {
      std::rethrow_exception(c.brokenError());
    } catch (const Error& e) {
      std::string what = e.what();
      if (e.code() == ErrorCode::kPeerFailure) {  // the peer's watchdog was first, and told us
        EXPECT_NE(what.find("did not finish on the GPU"), std::string::npos) << what;
      } else {
        EXPECT_EQ(e.code(), ErrorCode::kTimeout) << what;
        EXPECT_NE(what.find("allreduce (seq "), std::string::npos) << what;
        EXPECT_NE(what.find("did not finish on the GPU within 300 ms"), std::string::npos) << what;
        EXPECT_NE(what.find(std::string("stream ") + stream), std::string::npos) << what;
        EXPECT_EQ(e.op, "allreduce");
      }
    }
    // The next call raises at once, on host buffers too.
    std::vector<float> h(10, 1.0f);
    auto next = c.allreduce(h.data(), h.size(), DataType::kFloat32, ReduceOp::kSum);
    ASSERT_TRUE(next->wait(Millis(60000)));
    EXPECT_TRUE(next->error());
    // The "kernel" ends once both ranks have looked, so teardown does not wait for it.
    checked.fetch_add(1);
    while (checked.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    gHung = false;
    // What the hung stream still holds reads `v`: let it run before `v` goes (a real GPU would
    // have run it on its own by now).
    Fake::streamSynchronize(caller);
    Fake::streamSynchronize(s);
  });
  setDeviceApiForTesting(nullptr);
}

}  // namespace
