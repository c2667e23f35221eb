// The device signals of csrc/cuda/signals.h, played by CPU threads: the same header, the same
// memory orders (release adds, acquire reads), on host memory. A thread stands for a rank of one
// GPU collective: data written before a signal is seen after the wait; counts wrap at 2^32
// without harm; a peer that never signals ends the wait at its deadline with {op, rank}
// recorded; the host's abort flag ends it at once. (No GPU runs here; the kernels built on this
// header compile with nvcc in the same build, and run on the lent GPU.)
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "cuda/signals.h"

using namespace railcc::cuda;

namespace {

uint64_t nowNs() { return signalNow(); }
constexpr uint64_t kSecond = 1000000000ull;

}  // namespace

TEST(Signals, CountsCompareModuloTwoToThe32) {
  EXPECT_TRUE(signalReached(5, 5));
  EXPECT_TRUE(signalReached(6, 5));
  EXPECT_FALSE(signalReached(4, 5));
  EXPECT_TRUE(signalReached(2, 0xfffffffeu));   // wrapped past the expected count
  EXPECT_FALSE(signalReached(0xfffffffeu, 2));  // not yet wrapped to it
  EXPECT_TRUE(signalReached(0x7fffffffu, 0));
}

// Five ranks exchange a value with every peer for many rounds, each writing into its peers'
// memory and then signalling; counts start just below 2^32, so they wrap during the test.
TEST(Signals, DataWrittenBeforeASignalIsSeenAfterTheWaitAcrossTheWrap) {
  constexpr int n = 5, rounds = 3000;
  constexpr uint32_t start = 0xffffffffu - 1000;
  std::vector<SignalPad> pads(n);
  for (SignalPad& p : pads) {
    std::memset(&p, 0, sizeof(p));
    for (uint32_t& c : p.count) c = start;
  }
  // inbox[r][parity][p]: what rank p wrote for rank r in a round of that parity. A peer is at
  // most one round ahead (it waits for this rank's signal of the round before), so two suffice.
  std::vector<std::vector<std::vector<uint64_t>>> inbox(n, std::vector<std::vector<uint64_t>>(2, std::vector<uint64_t>(n, 0)));
  SignalFailure failure{};
  std::atomic<int> wrong{0}, failed{0};
  std::vector<std::thread> ranks;
  for (int me = 0; me < n; ++me)
    ranks.emplace_back([&, me] {
      for (int k = 0; k < rounds; ++k) {
        for (int p = 0; p < n; ++p)
          if (p != me) {
            inbox[p][k % 2][me] = static_cast<uint64_t>(k) * 1000 + static_cast<uint64_t>(me);  // a plain store
            signalPeer(&pads[p], me);
          }
        const uint32_t expected = start + static_cast<uint32_t>(k + 1);
        for (int p = 0; p < n; ++p) {
          if (p == me) continue;
          if (signalWait(&pads[me], p, expected, nowNs() + 60 * kSecond, k, &failure) != kSignalled) {
            ++failed;
            return;
          }
          if (inbox[me][k % 2][p] != static_cast<uint64_t>(k) * 1000 + static_cast<uint64_t>(p)) ++wrong;
        }
      }
    });
  for (auto& t : ranks) t.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(failure.state, 0u);
  EXPECT_LT(pads[0].count[1], start);  // it wrapped
  EXPECT_EQ(pads[0].count[1], start + static_cast<uint32_t>(rounds));
}

// Rank 2 signals the first op and never the second: the others' waits end at their deadline
// and the first failure names the op and rank 2, with the count seen and the one expected.
TEST(Signals, APeerThatNeverSignalsEndsTheWaitAndIsRecorded) {
  constexpr int n = 3;
  std::vector<SignalPad> pads(n);
  for (SignalPad& p : pads) std::memset(&p, 0, sizeof(p));
  SignalFailure failure{};
  std::vector<SignalWait> second(n, kSignalled);
  std::vector<std::thread> ranks;
  for (int me = 0; me < n; ++me)
    ranks.emplace_back([&, me] {
      for (uint64_t seq = 7; seq < 9; ++seq) {
        if (me == 2 && seq == 8) return;  // stops calling
        for (int p = 0; p < n; ++p)
          if (p != me) signalPeer(&pads[p], me);
        for (int p = 0; p < n; ++p) {
          if (p == me) continue;
          const SignalWait w = signalWait(&pads[me], p, static_cast<uint32_t>(seq - 6), nowNs() + kSecond / 5, seq, &failure);
          if (seq == 8 && w != kSignalled) second[static_cast<size_t>(me)] = w;
        }
      }
    });
  for (auto& t : ranks) t.join();
  EXPECT_EQ(second[0], kTimedOut);
  EXPECT_EQ(second[1], kTimedOut);
  EXPECT_EQ(failure.state, static_cast<uint32_t>(kTimedOut));
  EXPECT_EQ(failure.peer, 2);
  EXPECT_EQ(failure.seq, 8u);
  EXPECT_EQ(failure.count, 1u);
  EXPECT_EQ(failure.expected, 2u);
}

// The host raises the pad's abort flag while a rank waits with a deadline far away: the wait
// ends, says so, and records it; a later failure does not overwrite the first.
TEST(Signals, TheHostsAbortFlagEndsAWaitAndTheFirstFailureStays) {
  SignalPad pad;
  std::memset(&pad, 0, sizeof(pad));
  SignalFailure failure{};
  SignalWait got = kSignalled;
  std::thread waiter([&] { got = signalWait(&pad, 1, 1, nowNs() + 3600 * kSecond, 42, &failure); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  __atomic_store_n(&pad.abort, 1u, __ATOMIC_RELAXED);
  waiter.join();
  EXPECT_EQ(got, kAborted);
  EXPECT_EQ(failure.state, static_cast<uint32_t>(kAborted));
  EXPECT_EQ(failure.peer, 1);
  EXPECT_EQ(failure.seq, 42u);
  recordFailure(&failure, kTimedOut, 3, 43, 0, 1);
  EXPECT_EQ(failure.peer, 1);
  EXPECT_EQ(failure.seq, 42u);
}
