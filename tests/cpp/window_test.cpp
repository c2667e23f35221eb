// One-sided windows (transport/window.h) with every rank a thread over one in-memory store:
// puts land where they were aimed and before the signal that follows them, on one host
// (the target reads the writer's memory through the kernel) and across fake hosts (TCP);
// misuse and a gone peer are refused by name.

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "engine/store.h"
#include "transport/window.h"

namespace railcc::transport {
namespace {

using Millis = std::chrono::milliseconds;

Directory over(engine::Store& s, const std::string& prefix) {
  Directory d;
  d.set = [&s, prefix](const std::string& k, const std::string& v) { s.set(prefix + k, v); };
  d.get = [&s, prefix](const std::string& k, Millis t) { return s.get(prefix + k, t); };
  d.add = [&s, prefix](const std::string& k, int64_t x) { return s.add(prefix + k, x); };
  return d;
}

std::vector<WindowPeer> peersOn(int n, bool oneHost) {
  std::vector<WindowPeer> peers;
  for (int r = 0; r < n; ++r)
    peers.push_back({oneHost ? "host" : "host" + std::to_string(r), "h" + std::to_string(r), "pid:[1]"});
  return peers;
}

// Runs body(rank, endpoint) on n threads; a failure on any rank names it.
void onRanks(int n, bool oneHost, const std::function<void(int, WindowEndpoint&)>& body) {
  static int windows = 0;
  engine::MemoryStore store;
  const std::string prefix = "w" + std::to_string(windows++) + "/";
  std::vector<std::unique_ptr<WindowEndpoint>> eps;
  for (int r = 0; r < n; ++r)
    eps.push_back(std::make_unique<WindowEndpoint>(over(store, prefix), r, peersOn(n, oneHost), "window t", Millis(20000)));
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r, *eps[static_cast<size_t>(r)]);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

template <typename F>
void expectRefused(F&& f, ErrorCode code, const std::string& said) {
  try {
    f();
    ADD_FAILURE() << "accepted; expected '" << said << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(said), std::string::npos) << e.what();
  }
}

class WindowPaths : public ::testing::TestWithParam<bool> {};

TEST_P(WindowPaths, EveryRankPutsIntoEveryWindowBeforeItsSignal) {
  const bool oneHost = GetParam();
  const int n = 3;
  const size_t block = 5;                      // odd
  const size_t big = (3u << 20) / sizeof(int);  // 3 MiB: more than a socket buffer
  onRanks(n, oneHost, [&](int rank, WindowEndpoint& w) {
    for (int round = 0; round < 2; ++round) {  // a second registration, as after deregister
      std::vector<int> region(n * (block + big), -1);
      w.registerRegion(region.data(), region.size() * sizeof(int), sizeof(int), "Int");
      std::vector<int> mine(block + big);
      for (size_t i = 0; i < mine.size(); ++i) mine[i] = rank * 1000000 + round * 100000 + static_cast<int>(i);
      for (int dst = 0; dst < n; ++dst) {
        w.put(mine.data(), block * sizeof(int), "Int", dst, rank * block, Millis(20000));
        w.put(mine.data() + block, big * sizeof(int), "Int", dst, n * block + rank * big, Millis(20000));
        w.signal(dst, Millis(20000));
      }
      for (int src = 0; src < n; ++src) w.waitSignal(src, Millis(20000));
      for (int src = 0; src < n; ++src) {
        for (size_t i = 0; i < block; ++i)
          ASSERT_EQ(region[src * block + i], src * 1000000 + round * 100000 + static_cast<int>(i)) << src << " " << i;
        for (size_t i = 0; i < big; i += 4099)
          ASSERT_EQ(region[n * block + src * big + i], src * 1000000 + round * 100000 + static_cast<int>(block + i));
      }
      const int peer = (rank + 1) % n;
      EXPECT_EQ(w.pathTo(peer), oneHost ? "process_vm_readv" : "socket");
      EXPECT_EQ(w.pathTo(rank), "memcpy");
      w.deregister(Millis(20000));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(OneHostAndFakeHosts, WindowPaths, ::testing::Values(true, false));

TEST(Window, MisuseIsRefusedByName) {
  // Both ranks see their 200 ms wait time out before either signals: a rank held up past the
  // other's signal would take it for the one it was told not to expect.
  std::atomic<int> timedOut{0};
  onRanks(2, true, [&](int rank, WindowEndpoint& w) {
    float x[4] = {1, 2, 3, 4};
    expectRefused([&] { w.put(x, sizeof(x), "Float", 1 - rank, 0, Millis(5000)); }, ErrorCode::kInvalidUsage,
                  "before tensor_register");
    std::vector<float> region(10);
    w.registerRegion(region.data(), region.size() * sizeof(float), sizeof(float), "Float");
    expectRefused([&] { w.registerRegion(region.data(), 4, 4, "Float"); }, ErrorCode::kInvalidUsage,
                  "registered already");
    const int peer = 1 - rank;
    expectRefused([&] { w.put(x, sizeof(x), "Double", peer, 0, Millis(5000)); }, ErrorCode::kInvalidUsage,
                  "put of Double into rank");
    expectRefused([&] { w.put(x, sizeof(x), "Float", peer, 7, Millis(5000)); }, ErrorCode::kInvalidUsage,
                  "4 elements at offset 7");
    expectRefused([&] { w.put(x, sizeof(x), "Float", 5, 0, Millis(5000)); }, ErrorCode::kInvalidUsage, "names rank 5");
    expectRefused([&] { w.waitSignal(peer, Millis(200)); }, ErrorCode::kTimeout, "no signal came in 200 ms");
    timedOut.fetch_add(1);
    for (int i = 0; i < 20000 && timedOut.load() < 2; ++i) std::this_thread::sleep_for(Millis(1));
    w.put(x, sizeof(x), "Float", peer, 6, Millis(5000));  // the last four fit
    w.signal(peer, Millis(5000));
    w.waitSignal(peer, Millis(5000));
    EXPECT_EQ(region[9], 4.0f);
    w.deregister(Millis(5000));
    expectRefused([&] { w.deregister(Millis(5000)); }, ErrorCode::kInvalidUsage, "no tensor registered");
  });
}

TEST(Window, AGonePeerIsNamed) {
  engine::MemoryStore store;
  auto a = std::make_unique<WindowEndpoint>(over(store, "g/"), 0, peersOn(2, false), "window g", Millis(5000));
  auto b = std::make_unique<WindowEndpoint>(over(store, "g/"), 1, peersOn(2, false), "window g", Millis(5000));
  std::vector<double> ra(4), rb(4);
  std::thread t([&] { b->registerRegion(rb.data(), sizeof(double) * 4, sizeof(double), "Double"); });
  a->registerRegion(ra.data(), sizeof(double) * 4, sizeof(double), "Double");
  t.join();
  double v[2] = {1.5, 2.5};
  a->put(v, sizeof(v), "Double", 1, 2, Millis(5000));
  EXPECT_EQ(rb[3], 2.5);
  b.reset();  // rank 1's window (its process, as far as rank 0 can tell) is gone
  expectRefused([&] { a->put(v, sizeof(v), "Double", 1, 0, Millis(5000)); }, ErrorCode::kPeerFailure, "rank 1 (host h1)");
  expectRefused([&] { a->deregister(Millis(300)); }, ErrorCode::kTimeout, "1 of 2 ranks had called it");
}

}  // namespace
}  // namespace railcc::transport
