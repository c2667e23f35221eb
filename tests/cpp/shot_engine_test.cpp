// The one-kernel all-reduce (RAILCC_CUDA_SHOTS) through the real engine: ranks are threads
// with their own communicators over the real shm transport; the device is the fake runtime of
// fake_device.h (host memory, named so), whose "kernel" is the host build of cuda/shots.h, a
// thread per block. What this checks is the host's side: the pads at the pools' tails zeroed
// before peers map them, the table filled once, the per-block counts carried across ops and
// chunks, the settings agreed on, and a peer that stops calling ending the others' op with an
// error that names it. (The kernels themselves are compiled by nvcc in the same build and run
// on a lent GPU by scripts/gpu_check.sh.)
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "engine/allocator_segments.h"
#include "engine/communicator.h"
#include "engine/device.h"
#include "engine/device/heap.h"
#include "fake_device.h"
#include "ranks.h"
#include "transport/stats.h"

using namespace railcc;
using namespace railcc::engine;
using namespace railcc::engine::fake_device;
using testing_util::waitOk;

namespace {

const Placement kDev{0, nullptr, nullptr};

Config shotConfig() {
  Config cfg = Config::defaults();
  cfg.initTimeoutSec = 30;
  cfg.cudaIpc = true;
  cfg.cudaShots = true;
  cfg.cudaShotBlocks = 3;
  cfg.cudaIpcBytes = 4 * 65536;  // 256 KiB of scratch: large ops take several chunks
  cfg.cudaHeapBytes = 2 << 20;    // each rank's heap: 2 MiB
  cfg.buffSize = 64 * 1024;
  return cfg;
}

class ShotEngine : public testing::Test {
 protected:
  void SetUp() override { setDeviceApiForTesting(&kFake); }
  void TearDown() override { setDeviceApiForTesting(nullptr); }
};

template <typename T>
std::vector<T> inputOf(int rank, size_t count) {
  std::vector<T> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = static_cast<T>((i * 7 + static_cast<size_t>(rank) * 3) % 5 + 1);
  return v;
}

// Expected: the engine's host reduction applied in rank order (small integers: exact).
template <typename T>
void allreduceMatches(Communicator& c, DataType dt, ReduceOp op, double scale, size_t count) {
  const int n = c.size();
  std::vector<T> want = inputOf<T>(0, count);
  if (op == ReduceOp::kPremulSum) scaleCopy(want.data(), want.data(), count, dt, scale);
  for (int r = 1; r < n; ++r) {
    auto x = inputOf<T>(r, count);
    reduceInto(want.data(), x.data(), count, dt, op, scale);
  }
  if (op == ReduceOp::kAvg) divideBy(want.data(), count, dt, n);
  auto got = inputOf<T>(c.rank(), count);
  waitOk(c.allreduce(got.data(), count, dt, op, scale, Millis(0), kDev));
  for (size_t i = 0; i < count; ++i)
    ASSERT_EQ(got[i], want[i]) << dtypeName(dt) << " " << reduceOpName(op) << " count " << count << " i " << i;
}

uint64_t deviceStat(transport::Stat s) {
  return transport::statRow(transport::StatKind::kDevice).v[static_cast<size_t>(s)].load();
}

}  // namespace

// What railcc.stats() and railcc-bench --stats report: the CUDA IPC path meets on the host
// twice per chunk, the one-kernel path never (set-up aside, which exchanges handles once), and
// the IPC path with its steps ordered by the streams' signals never either: its two steps an
// op are signals.
TEST_F(ShotEngine, HostRoundsPerOpTwoThroughIpcNoneThroughShotsOrStreamSignals) {
  enum Path { kIpc, kShots, kSignals };
  for (Path path : {kIpc, kShots, kSignals}) {
    Config cfg = shotConfig();
    cfg.cudaShots = path == kShots;
    cfg.cudaIpcSignals = path == kSignals;
    uint64_t rounds = 0, kernels = 0, steps = 0;
    testing_util::runRanks(2, cfg, "rounds", [&](Communicator& c) {
      std::vector<float> v(1001, 1.0f);
      waitOk(c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(0), kDev));  // set-up
      waitOk(c.barrier());
      const uint64_t r0 = deviceStat(transport::Stat::kHostRounds), k0 = deviceStat(transport::Stat::kDeviceKernels),
                     s0 = deviceStat(transport::Stat::kDeviceSignalSteps);
      waitOk(c.barrier());
      for (int i = 0; i < 10; ++i) {
        std::fill(v.begin(), v.end(), static_cast<float>(i + c.rank()));
        waitOk(c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(0), kDev));
        for (float x : v) ASSERT_EQ(x, static_cast<float>(2 * i + 1)) << "path " << path;
      }
      waitOk(c.barrier());
      if (c.rank() == 0) {
        rounds = deviceStat(transport::Stat::kHostRounds) - r0;
        kernels = deviceStat(transport::Stat::kDeviceKernels) - k0;
        steps = deviceStat(transport::Stat::kDeviceSignalSteps) - s0;
      }
      waitOk(c.barrier());
    });
    // 2 ranks x 10 ops: one-shot IPC is 2 steps an op (in, done), host rounds or signals; the
    // kernel path one kernel and neither.
    EXPECT_EQ(rounds, path == kIpc ? 2u * 2 * 10 : 0u) << "path " << path;
    EXPECT_EQ(steps, path == kSignals ? 2u * 2 * 10 : 0u) << "path " << path;
    EXPECT_EQ(kernels, path == kShots ? 2u * 10 : 0u) << "path " << path;
  }
}

// One-shot (up to RAILCC_ONESHOT_BYTES) and two-shot, one chunk and several, every kind of op.
TEST_F(ShotEngine, EveryOpOnOddWorldSizesAndCountsAcrossChunks) {
  const long before = gShotLaunches.load();
  for (int n : {2, 3}) {
    testing_util::runRanks(n, shotConfig(), "shots", [](Communicator& c) {
      for (size_t count : {size_t(0), size_t(1), size_t(1001), size_t(100003)}) {
        allreduceMatches<float>(c, DataType::kFloat32, ReduceOp::kSum, 1.0, count);
        allreduceMatches<float>(c, DataType::kFloat32, ReduceOp::kPremulSum, 0.5, count);
        allreduceMatches<double>(c, DataType::kFloat64, ReduceOp::kAvg, 1.0, count);
        allreduceMatches<int64_t>(c, DataType::kInt64, ReduceOp::kProduct, 1.0, count);
        allreduceMatches<int32_t>(c, DataType::kInt32, ReduceOp::kMax, 1.0, count);
        allreduceMatches<int8_t>(c, DataType::kInt8, ReduceOp::kMin, 1.0, count);
        allreduceMatches<uint8_t>(c, DataType::kUInt8, ReduceOp::kBxor, 1.0, count);
      }
    });
  }
  // Each rank, each dtype and op, each count but 0: the kernel ran, not the IPC copies.
  EXPECT_EQ(gShotLaunches.load() - before, (2 + 3) * 7 * 3);
}

// Many ops back to back, and a coalesced call (a kernel per tensor, a zero-size one skipped by
// every rank alike), then ops queued on the caller's stream (complete once queued).
TEST_F(ShotEngine, ManyOpsCoalescedAndQueued) {
  testing_util::runRanks(4, shotConfig(), "shots", [](Communicator& c) {
    const int n = c.size(), me = c.rank();
    for (int k = 0; k < 100; ++k) {
      std::vector<int32_t> v(37, me + k);
      waitOk(c.allreduce(v.data(), v.size(), DataType::kInt32, ReduceOp::kSum, 1.0, Millis(0), kDev));
      for (int32_t x : v) ASSERT_EQ(x, n * (n - 1) / 2 + n * k) << "op " << k;
    }
    std::vector<std::vector<float>> bufs = {std::vector<float>(5, 1.0f), {}, std::vector<float>(70001, 2.0f)};
    std::vector<void*> ptrs;
    std::vector<size_t> counts;
    for (auto& b : bufs) ptrs.push_back(b.data()), counts.push_back(b.size());
    waitOk(c.allreduceCoalesced(ptrs, counts, DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(0), kDev));
    for (float x : bufs[0]) ASSERT_EQ(x, static_cast<float>(n));
    for (float x : bufs[2]) ASSERT_EQ(x, 2.0f * n);

    void* mine = nullptr;  // the caller's stream; destroyed streams stay readable (teardown drains it)
    Fake::streamCreate(&mine);
    const Placement on{0, mine, nullptr, /*queued=*/true};
    std::vector<int64_t> q(50000, me + 1);
    waitOk(c.allreduce(q.data(), q.size(), DataType::kInt64, ReduceOp::kSum, 1.0, Millis(0), on));
    Fake::streamSynchronize(mine);  // the caller orders on its stream
    for (int64_t x : q) ASSERT_EQ(x, n * (n + 1) / 2);
    Fake::streamDestroy(mine);
  });
}

// The same through the IPC path whose steps are the streams' signals: the others' streams wait
// on rank 2's count, the op times out on the host, and the error names rank 2 (read from the
// pads rank 2 never wrote); teardown releases the streams' waits, so it does not hang.
TEST_F(ShotEngine, APeerThatStopsCallingIsNamedThroughStreamSignals) {
  Config cfg = shotConfig();
  cfg.cudaShots = false;
  cfg.cudaIpcSignals = true;
  std::atomic<int> failed{0};
  const auto t0 = std::chrono::steady_clock::now();
  // The buffers outlive the group: a failed op's copies still run once teardown releases the
  // waits (as a Work keeps its tensors until the GPU is done with them).
  std::vector<std::vector<float>> bufs(3, std::vector<float>(1000, 1.0f));
  testing_util::runRanks(3, cfg, "signals", [&](Communicator& c) {
    std::vector<float>& v = bufs[static_cast<size_t>(c.rank())];
    waitOk(c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(0), kDev));
    if (c.rank() == 2) {
      while (failed.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    auto req = c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(1500), kDev);
    auto e = testing_util::failureOf(req, Millis(60000));
    failed.fetch_add(1);
    ASSERT_TRUE(e) << "rank " << c.rank() << " did not fail with a railcc error";
    const std::string what = e->what();
    EXPECT_NE(what.find("rank 2"), std::string::npos) << what;
    EXPECT_NE(what.find("not signalled"), std::string::npos) << what;
  });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}

// Rank 2 stops calling after the first op: the others' kernels give up within the op's timeout,
// and their error names rank 2 (the device's failure record, read by the host).
TEST_F(ShotEngine, APeerThatStopsCallingIsNamed) {
  std::atomic<int> failed{0};
  testing_util::runRanks(3, shotConfig(), "shots", [&](Communicator& c) {
    std::vector<float> v(1000, 1.0f);
    waitOk(c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(0), kDev));
    if (c.rank() == 2) {
      while (failed.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto req = c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(1500), kDev);
    auto e = testing_util::failureOf(req, Millis(60000));
    failed.fetch_add(1);
    ASSERT_TRUE(e) << "rank " << c.rank() << " did not fail with a railcc error";
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
    const std::string what = e->what();
    EXPECT_NE(what.find("rank 2"), std::string::npos) << what;
  });
}

// The same on the caller's stream, where the call returns once the kernel is queued: the
// watchdog thread reads the device's failure record and fails the group naming rank 1, and
// the next call raises it.
TEST_F(ShotEngine, AQueuedOpWhosePeerStopsFailsTheGroupNamingIt) {
  std::atomic<int> failed{0};
  testing_util::runRanks(2, shotConfig(), "shots", [&](Communicator& c) {
    void* s = nullptr;
    Fake::streamCreate(&s);
    const Placement on{0, s, nullptr, /*queued=*/true};
    std::vector<float> v(1000, 1.0f);
    waitOk(c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(0), on));
    Fake::streamSynchronize(s);
    if (c.rank() == 1) {
      while (failed.load() < 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      Fake::streamDestroy(s);
      return;
    }
    waitOk(c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(1500), on));  // queued
    Fake::streamSynchronize(s);  // the "kernel" gives up at its deadline
    const auto t0 = std::chrono::steady_clock::now();
    while (!c.brokenError() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30))
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    failed.fetch_add(1);
    ASSERT_TRUE(c.brokenError()) << "the group did not fail";
    try {
      std::rethrow_exception(c.brokenError());
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("allreduce (seq "), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("one kernel on the GPU"), std::string::npos) << e.what();
      EXPECT_EQ(e.op, "allreduce");
    }
    auto next = c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(0), on);
    ASSERT_TRUE(next->wait(Millis(60000)));
    EXPECT_TRUE(next->error());
    Fake::streamDestroy(s);
  });
}

// RAILCC_CUDA_SHOTS and RAILCC_CUDA_SHOT_BLOCKS decide what every rank's GPU does: ranks that
// disagree all fail at the first CUDA op, naming the setting.
TEST_F(ShotEngine, SettingsThatDifferFailOnEveryRank) {
  for (int which : {0, 1}) {
    testing_util::runRanks(
        3, shotConfig(), "shots",
        [which](Communicator& c) {
          std::vector<int32_t> v(100, 1);
          auto req = c.allreduce(v.data(), v.size(), DataType::kInt32, ReduceOp::kSum, 1.0, Millis(0), kDev);
          auto e = testing_util::failureOf(req, Millis(60000));
          ASSERT_TRUE(e) << "rank " << c.rank() << " did not fail with a railcc error";
          EXPECT_EQ(e->code(), ErrorCode::kMismatch) << e->what();
          EXPECT_NE(std::string(e->what()).find(which == 0 ? "RAILCC_CUDA_SHOTS=0" : "RAILCC_CUDA_SHOT_BLOCKS=5"),
                    std::string::npos)
              << e->what();
        },
        [which](int rank, Config& c) {
          if (rank != 1) return;
          if (which == 0) c.cudaShots = false;
          else c.cudaShotBlocks = 5;
        });
  }
}

// All-gather and reduce-scatter of one tensor of n blocks (the *_tensor calls), in place too,
// and broadcast from every root, through the kernels; blocks that are separate tensors take
// the IPC copies instead.
TEST_F(ShotEngine, AllgatherReduceScatterAndBroadcast) {
  const long before = gShotLaunches.load();
  testing_util::runRanks(3, shotConfig(), "shots", [](Communicator& c) {
    const int n = c.size(), me = c.rank();
    const size_t nn = static_cast<size_t>(n);
    for (size_t count : {size_t(0), size_t(5), size_t(70001)}) {
      std::vector<int32_t> mine(count), all(count * nn, -1);
      for (size_t i = 0; i < count; ++i) mine[i] = static_cast<int32_t>(i * 3) + me;
      std::vector<void*> outs;
      for (size_t r = 0; r < nn; ++r) outs.push_back(all.data() + r * count);
      waitOk(c.allgather(mine.data(), count, DataType::kInt32, outs, Millis(0), kDev));
      for (size_t i = 0; i < all.size(); ++i)
        ASSERT_EQ(all[i], static_cast<int32_t>((i % count) * 3 + i / count)) << "all-gather count " << count << " i " << i;
      // in place: the input is this rank's block of the output
      std::vector<int32_t> inplace(count * nn, -1);
      for (size_t i = 0; i < count; ++i) inplace[static_cast<size_t>(me) * count + i] = static_cast<int32_t>(i * 3) + me;
      std::vector<void*> outs2;
      for (size_t r = 0; r < nn; ++r) outs2.push_back(inplace.data() + r * count);
      waitOk(c.allgather(outs2[static_cast<size_t>(me)], count, DataType::kInt32, outs2, Millis(0), kDev));
      ASSERT_EQ(inplace, all);

      std::vector<double> full(count * nn);
      for (size_t i = 0; i < full.size(); ++i) full[i] = static_cast<double>(i % 7 + static_cast<size_t>(me));
      std::vector<const void*> ins;
      for (size_t r = 0; r < nn; ++r) ins.push_back(full.data() + r * count);
      std::vector<double> got(count, -1);
      waitOk(c.reduceScatter(ins, got.data(), count, DataType::kFloat64, ReduceOp::kAvg, 1.0, Millis(0), kDev));
      for (size_t i = 0; i < count; ++i) {
        const size_t at = static_cast<size_t>(me) * count + i;
        ASSERT_EQ(got[i], static_cast<double>(at % 7) + (n - 1) / 2.0) << "reduce-scatter count " << count << " i " << i;
      }

      for (int root = 0; root < n; ++root) {
        std::vector<int16_t> b(count);
        for (size_t i = 0; i < count; ++i) b[i] = static_cast<int16_t>(me == root ? i % 1000 + static_cast<size_t>(root) : 0);
        waitOk(c.broadcast(b.data(), count, DataType::kInt16, root, Millis(0), kDev));
        for (size_t i = 0; i < count; ++i)
          ASSERT_EQ(b[i], static_cast<int16_t>(i % 1000 + static_cast<size_t>(root))) << "broadcast root " << root << " i " << i;
      }
      // separate tensors: the IPC copies, no kernel
      std::vector<std::vector<int32_t>> apart(nn, std::vector<int32_t>(count + 1, -1));
      std::vector<void*> outs3;
      for (auto& v : apart) outs3.push_back(v.data());
      waitOk(c.allgather(mine.data(), count, DataType::kInt32, outs3, Millis(0), kDev));
      for (size_t r = 0; r < nn; ++r)
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(apart[r][i], static_cast<int32_t>(i * 3 + r));

      // all-to-all of equal blocks in one tensor (a kernel), out of place and in place, then
      // with splits that differ (the IPC copies)
      for (bool inPlace : {false, true}) {
        std::vector<int64_t> src(count * nn), dst(count * nn, -1);
        for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<int64_t>(me) * 1000000 + static_cast<int64_t>(i);
        int64_t* out = inPlace ? src.data() : dst.data();
        std::vector<const void*> aIns;
        std::vector<void*> aOuts;
        for (size_t r = 0; r < nn; ++r) aIns.push_back(src.data() + r * count), aOuts.push_back(out + r * count);
        std::vector<size_t> counts(nn, count);
        waitOk(c.alltoall(aIns, counts, aOuts, counts, DataType::kInt64, Millis(0), kDev));
        for (size_t i = 0; i < count * nn; ++i)
          ASSERT_EQ(out[i], static_cast<int64_t>(i / count) * 1000000 + static_cast<int64_t>(static_cast<size_t>(me) * count + i % count))
              << "all-to-all count " << count << " in place " << inPlace << " i " << i;
      }
      std::vector<size_t> sendCounts(nn), recvCounts(nn);
      for (size_t r = 0; r < nn; ++r) sendCounts[r] = count / 2 + r, recvCounts[r] = count / 2 + static_cast<size_t>(me);
      std::vector<std::vector<int32_t>> sendBufs(nn), recvBufs(nn);
      std::vector<const void*> sIns;
      std::vector<void*> rOuts;
      for (size_t r = 0; r < nn; ++r) {
        sendBufs[r].assign(sendCounts[r], static_cast<int32_t>(me * 10 + static_cast<int>(r)));
        recvBufs[r].assign(recvCounts[r], -1);
        sIns.push_back(sendBufs[r].data());
        rOuts.push_back(recvBufs[r].data());
      }
      waitOk(c.alltoall(sIns, sendCounts, rOuts, recvCounts, DataType::kInt32, Millis(0), kDev));
      for (size_t r = 0; r < nn; ++r)
        for (int32_t x : recvBufs[r]) ASSERT_EQ(x, static_cast<int32_t>(r * 10 + static_cast<size_t>(me)));
    }
  });
  // Per rank and count but 0: 2 all-gathers, a reduce-scatter, 3 broadcasts and 2 all-to-alls
  // as kernels; the all-gather into separate tensors (each one longer than a block: never one
  // tensor) and the all-to-all of differing splits none.
  EXPECT_EQ(gShotLaunches.load() - before, 3 * 2 * (3 + 3 + 2));
}

// Buffers carved from the ranks' heaps (allocate_tensor's CUDA path), which every peer mapped
// at set-up: the kernels read them in place (the in-place count says so) and every kind of op
// still gets its reference's result, mixed with buffers outside the heap in the same group;
// a buffer given back is carved again; one larger than the heap is refused (torch allocates it).
TEST_F(ShotEngine, HeapBuffersAreReadInPlace) {
  for (int n : {2, 3}) {
    uint64_t inPlace = 0, kernels = 0;
    testing_util::runRanks(n, shotConfig(), "heap", [&](Communicator& c) {
      const int me = c.rank();
      const size_t count = 70001;  // two-shot, several chunks of the 256 KiB scratch
      EXPECT_TRUE(c.offersShared());
      EXPECT_EQ(c.allocateShared(0, size_t(3) << 20), nullptr);  // larger than the heap
      std::shared_ptr<void> a = c.allocateShared(0, count * sizeof(float));
      std::shared_ptr<void> g = c.allocateShared(0, n * 1001 * sizeof(int32_t));
      ASSERT_TRUE(a && g);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(a.get()) % 512, 0u);
      waitOk(c.barrier());
      const uint64_t i0 = deviceStat(transport::Stat::kDeviceInPlace), k0 = deviceStat(transport::Stat::kDeviceKernels);
      waitOk(c.barrier());
      // All-reduce in place in the heap (two-shot), rank 1's buffer outside it.
      std::vector<float> outside(count);
      float* v = me == 1 ? outside.data() : static_cast<float*>(a.get());
      for (size_t i = 0; i < count; ++i) v[i] = static_cast<float>((i + static_cast<size_t>(me)) % 7);
      waitOk(c.allreduce(v, count, DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(0), kDev));
      for (size_t i = 0; i < count; ++i) {
        float want = 0;
        for (int r = 0; r < n; ++r) want += static_cast<float>((i + static_cast<size_t>(r)) % 7);
        ASSERT_EQ(v[i], want) << "i " << i;
      }
      // All-gather into the heap with my block as the input (FSDP2's way), then reduce-scatter
      // out of it into a buffer outside, then broadcast from the heap.
      int32_t* gb = static_cast<int32_t*>(g.get());
      std::vector<void*> outs;
      for (int r = 0; r < n; ++r) outs.push_back(gb + static_cast<size_t>(r) * 1001);
      for (size_t i = 0; i < 1001; ++i) gb[static_cast<size_t>(me) * 1001 + i] = me * 10000 + static_cast<int32_t>(i);
      waitOk(c.allgather(outs[static_cast<size_t>(me)], 1001, DataType::kInt32, outs, Millis(0), kDev));
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < 1001; ++i) ASSERT_EQ(gb[static_cast<size_t>(r) * 1001 + i], r * 10000 + static_cast<int32_t>(i));
      std::vector<int32_t> red(1001);
      std::vector<const void*> ins(outs.begin(), outs.end());
      waitOk(c.reduceScatter(ins, red.data(), 1001, DataType::kInt32, ReduceOp::kSum, 1.0, Millis(0), kDev));
      for (size_t i = 0; i < 1001; ++i) ASSERT_EQ(red[i], n * (me * 10000 + static_cast<int32_t>(i)));
      if (me == 1)
        for (size_t i = 0; i < 1001; ++i) gb[i] = 77777 + static_cast<int32_t>(i);
      waitOk(c.broadcast(gb, 1001, DataType::kInt32, 1, Millis(0), kDev));
      for (size_t i = 0; i < 1001; ++i) ASSERT_EQ(gb[i], 77777 + static_cast<int32_t>(i));
      waitOk(c.barrier());
      if (me == 0) {
        inPlace = deviceStat(transport::Stat::kDeviceInPlace) - i0;
        kernels = deviceStat(transport::Stat::kDeviceKernels) - k0;
      }
      waitOk(c.barrier());
      // Given back and carved again at the same place (the lowest free range).
      void* was = a.get();
      a.reset();
      std::shared_ptr<void> again = c.allocateShared(0, 100);
      EXPECT_EQ(again.get(), was);
    });
    // Each rank's 4 ops were kernels, and published its input in place but rank 1's all-reduce.
    EXPECT_EQ(kernels, 4u * static_cast<uint64_t>(n)) << "n " << n;
    EXPECT_EQ(inPlace, 4u * static_cast<uint64_t>(n) - 1u) << "n " << n;
  }
}

// Buffers in segments of torch's caching allocator (which its trace hook told of: here the
// test tells the engine as the hook would): the first op on one goes through the scratch and
// offers the segment; once every peer has mapped it, peers read it in place. Its free (the
// hook's SEGMENT_FREE) returns only after every peer closed it; after that the buffer goes
// through the scratch again until the allocator tells of a segment there anew.
TEST_F(ShotEngine, AllocatorSegmentsAreReadInPlaceOnceEveryPeerMappedThem) {
  const int opened = gMemOpened, closed = gMemClosed;
  for (int n : {2, 3}) {
    testing_util::runRanks(n, shotConfig(), "segments", [&](Communicator& c) {
      const int me = c.rank();
      const size_t count = 70001;  // two-shot, several chunks of the scratch
      std::vector<float> seg(count + 64);
      float* v = seg.data() + 64;  // the tensor, 64 elements into its segment
      char* base = reinterpret_cast<char*>(seg.data());
      segmentMade(base, seg.size() * sizeof(float));
      int round = 0;
      // One all-reduce, checked; returns how many ranks' inputs were read in place.
      auto op = [&] {
        ++round;
        waitOk(c.barrier());
        const uint64_t s0 = deviceStat(transport::Stat::kDeviceInPlace);
        waitOk(c.barrier());
        for (size_t i = 0; i < count; ++i) v[i] = static_cast<float>((i + static_cast<size_t>(me + round)) % 7);
        waitOk(c.allreduce(v, count, DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(0), kDev));
        for (size_t i = 0; i < count; ++i) {
          float want = 0;
          for (int r = 0; r < n; ++r) want += static_cast<float>((i + static_cast<size_t>(r + round)) % 7);
          EXPECT_EQ(v[i], want) << "i " << i << " round " << round;
          if (v[i] != want) break;
        }
        waitOk(c.barrier());
        const uint64_t d = deviceStat(transport::Stat::kDeviceInPlace) - s0;
        waitOk(c.barrier());
        return d;
      };
      auto untilInPlace = [&] {
        for (int i = 0; i < 200; ++i)
          if (op() == static_cast<uint64_t>(n)) return true;
        return false;
      };
      EXPECT_EQ(op(), 0u) << "the first op on a segment goes through the scratch";
      ASSERT_TRUE(untilInPlace()) << "never read in place";
      EXPECT_EQ(op(), static_cast<uint64_t>(n)) << "in place from then on";
      segmentFreeing(base);  // every peer closed it when this returns
      EXPECT_EQ(op(), 0u) << "a freed segment is not read in place";
      segmentMade(base, seg.size() * sizeof(float));  // the allocator made one there again
      ASSERT_TRUE(untilInPlace());
      segmentFreeing(base);
    });
  }
  EXPECT_EQ(gMemOpened - opened, gMemClosed - closed) << "every mapping was closed";
}

// Without RAILCC_CUDA_SHOTS there is no heap: allocate_tensor's CUDA tensors come from torch.
TEST_F(ShotEngine, NoHeapWithoutShots) {
  Config cfg = shotConfig();
  cfg.cudaShots = false;
  testing_util::runRanks(2, cfg, "heap", [](Communicator& c) {
    EXPECT_FALSE(c.offersShared());
    EXPECT_EQ(c.allocateShared(0, 4096), nullptr);
  });
}

// The heap's carving, alone: buffers start on its 512-byte grain (counted from the region's
// first boundary), the lowest free range that fits is taken, neighbours merge when given back
// so a buffer as large as the heap fits again, and what take() never gave is refused.
TEST(DeviceHeapCarving, FirstFitAlignedAndMerging) {
  std::vector<char> mem(10 * 512 + 100);
  char* base = mem.data() + 3;  // off the grain, as a fake region may be
  bool released = false;
  {
    DeviceHeap h(base, mem.size() - 3, 0, [&](char*) { released = true; });
    char* a = h.take(1);
    char* b = h.take(513);
    char* c = h.take(512);
    ASSERT_TRUE(a && b && c);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 512, 0u);
    EXPECT_EQ(b, a + 512);
    EXPECT_EQ(c, b + 1024);
    EXPECT_EQ(h.used(), 4u * 512);
    EXPECT_EQ(h.take(0), nullptr);
    EXPECT_EQ(h.take(100 * 512), nullptr);
    EXPECT_FALSE(h.give(a + 1));    // not a buffer's start
    EXPECT_FALSE(h.give(nullptr));  // not in the heap
    EXPECT_TRUE(h.give(b));
    EXPECT_FALSE(h.give(b));        // twice
    EXPECT_EQ(h.take(512), b);      // the lowest range that fits
    EXPECT_TRUE(h.give(a));
    EXPECT_TRUE(h.give(b));
    EXPECT_TRUE(h.give(c));
    EXPECT_EQ(h.used(), 0u);
    char* all = h.take(9 * 512);    // everything merged back into one range
    EXPECT_EQ(all, a);
    EXPECT_TRUE(h.give(all));
  }
  EXPECT_TRUE(released);
  bool kept = true;
  {
    DeviceHeap h(base, mem.size() - 3, 0, [&](char*) { kept = false; });
    h.keep();  // peers may still map it
  }
  EXPECT_TRUE(kept);
}

// CUDA graphs on the fake device: an all-reduce (one-shot and two-shot across chunks), a
// broadcast and an all-gather captured once after a warm-up, then the graph replayed 100 times
// with new inputs each time: every replay gives the reference's result, nothing CUDA forbids
// during a capture was called, and no host round or further launch happens per replay.
TEST_F(ShotEngine, CapturedOpsReplayWithNewInputs) {
  gCaptureViolations = 0;
  for (int n : {2, 3}) {
    testing_util::runRanks(n, shotConfig(), "graph", [](Communicator& c) {
      const int me = c.rank(), nr = c.size();
      void* s = nullptr;
      Fake::streamCreate(&s);
      const Placement on{0, s, nullptr, /*queued=*/true};
      std::vector<float> small(37), large(100003), bc(1001);
      std::vector<int32_t> gathered(static_cast<size_t>(nr) * 500);
      waitOk(c.allreduce(small.data(), small.size(), DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(0), on));  // warm-up
      Fake::streamSynchronize(s);
      FakeGraph graph;
      Fake::beginCapture(s, &graph);
      const long launches0 = gShotLaunches.load();
      waitOk(c.allreduce(small.data(), small.size(), DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(0), on));
      waitOk(c.allreduce(large.data(), large.size(), DataType::kFloat32, ReduceOp::kMax, 1.0, Millis(0), on));
      waitOk(c.broadcast(bc.data(), bc.size(), DataType::kFloat32, nr - 1, Millis(0), on));
      std::vector<void*> outs;
      for (int r = 0; r < nr; ++r) outs.push_back(gathered.data() + static_cast<size_t>(r) * 500);
      waitOk(c.allgather(outs[static_cast<size_t>(me)], 500, DataType::kInt32, outs, Millis(0), on));
      Fake::endCapture(s);
      EXPECT_GE(gShotLaunches.load() - launches0, 4);
      waitOk(c.barrier());
      const uint64_t rounds0 = deviceStat(transport::Stat::kHostRounds);
      for (int k = 0; k < 100; ++k) {
        for (size_t i = 0; i < small.size(); ++i) small[i] = static_cast<float>(me + k + static_cast<int>(i));
        for (size_t i = 0; i < large.size(); ++i) large[i] = static_cast<float>((static_cast<size_t>(me) * 7 + i + static_cast<size_t>(k)) % 1000);
        for (size_t i = 0; i < bc.size(); ++i) bc[i] = me == nr - 1 ? static_cast<float>(k * 3 + static_cast<int>(i)) : -1.0f;
        for (size_t i = 0; i < 500; ++i) gathered[static_cast<size_t>(me) * 500 + i] = me * 1000 + k + static_cast<int32_t>(i);
        Fake::replay(graph, s);
        Fake::streamSynchronize(s);
        for (size_t i = 0; i < small.size(); ++i)
          ASSERT_EQ(small[i], static_cast<float>(nr * (k + static_cast<int>(i)) + nr * (nr - 1) / 2)) << "replay " << k;
        for (size_t i = 0; i < large.size(); i += 997) {
          float want = 0;
          for (int r = 0; r < nr; ++r) want = std::max(want, static_cast<float>((static_cast<size_t>(r) * 7 + i + static_cast<size_t>(k)) % 1000));
          ASSERT_EQ(large[i], want) << "replay " << k << " i " << i;
        }
        for (size_t i = 0; i < bc.size(); ++i) ASSERT_EQ(bc[i], static_cast<float>(k * 3 + static_cast<int>(i))) << "replay " << k;
        for (int r = 0; r < nr; ++r)
          for (size_t i = 0; i < 500; i += 7)
            ASSERT_EQ(gathered[static_cast<size_t>(r) * 500 + i], r * 1000 + k + static_cast<int32_t>(i)) << "replay " << k;
      }
      EXPECT_EQ(deviceStat(transport::Stat::kHostRounds), rounds0);  // the host took no part
      waitOk(c.barrier());
      Fake::streamDestroy(s);
    });
  }
  EXPECT_EQ(gCaptureViolations.load(), 0);
}

// What a graph cannot replay is refused by name on every rank: an op that meets the peers on
// the host per chunk (all-gather into separate tensors), and a group's first CUDA op (its
// set-up) inside the capture.
TEST_F(ShotEngine, WhatAGraphCannotReplayIsRefused) {
  for (bool warm : {true, false}) {
    std::atomic<int> refused{0};
    testing_util::runRanks(2, shotConfig(), "graph", [&](Communicator& c) {
      void* s = nullptr;
      Fake::streamCreate(&s);
      const Placement on{0, s, nullptr, /*queued=*/true};
      std::vector<float> v(100, 1.0f);
      std::vector<std::vector<float>> parts(2, std::vector<float>(100));
      if (warm) {
        waitOk(c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(0), on));
        Fake::streamSynchronize(s);
      }
      FakeGraph graph;
      Fake::beginCapture(s, &graph);
      RequestPtr req = warm ? c.allgather(v.data(), 100, DataType::kFloat32, {parts[0].data(), parts[1].data()}, Millis(0), on)
                            : c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, 1.0, Millis(0), on);
      auto e = testing_util::failureOf(req, Millis(60000));
      Fake::endCapture(s);
      ASSERT_TRUE(e);
      const std::string what = e->what();
      EXPECT_NE(what.find("cannot be captured into a CUDA graph"), std::string::npos) << what;
      EXPECT_NE(what.find(warm ? "meets the peers on the host" : "outside the capture"), std::string::npos) << what;
      refused.fetch_add(1);
      Fake::streamDestroy(s);
    });
    EXPECT_EQ(refused.load(), 2) << "warm " << warm;
  }
}
