// Registered segments (engine/device/segments.h): the protocol between a segment's owner and
// its peers, with ranks as threads, boards in plain host memory and the fake device runtime of
// fake_device.h (named so: an IPC handle carries the pointer itself, and it counts what is
// opened and closed). What this checks: a segment is read in place only once every peer has
// mapped it, is closed by every peer before revoke() returns, can be offered again at the same
// address, and a peer that cannot map it, has left, or never answers leaves the owner correct.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "engine/allocator_segments.h"
#include "engine/device/segments.h"
#include "fake_device.h"

using namespace railcc;
using namespace railcc::engine;
using namespace railcc::engine::fake_device;
using std::chrono::milliseconds;

namespace {

// n ranks' boards and tables, and a registry per rank (watchers started unless told not).
struct Ranks {
  int n;
  std::vector<std::unique_ptr<SegmentBoard>> boards;
  std::vector<std::vector<char*>> tables;
  std::vector<std::shared_ptr<SegmentRegistry>> regs;

  explicit Ranks(int n_, milliseconds wait = milliseconds(5000), std::vector<bool> watch = {}) : n(n_) {
    for (int r = 0; r < n; ++r) {
      boards.push_back(std::make_unique<SegmentBoard>());
      tables.emplace_back(static_cast<size_t>(n) * cuda::kSegSlots, nullptr);
    }
    std::vector<SegmentBoard*> b;
    for (auto& x : boards) b.push_back(x.get());
    for (int r = 0; r < n; ++r) {
      regs.push_back(std::make_shared<SegmentRegistry>(kFake, r, b, tables[r].data(), -1, wait,
                                                       [](int q) { return "rank " + std::to_string(q); }));
      if (watch.empty() || watch[r]) regs.back()->startWatcher();
    }
  }
  ~Ranks() {
    // Everyone leaves together, as a group's ranks do: in parallel, each answering the others.
    std::vector<std::thread> ts;
    for (auto& r : regs) ts.emplace_back([r] { r->shutdown(); });
    for (auto& t : ts) t.join();
  }
  // Rank q's pointer to owner o's slot s.
  char* mapped(int q, int o, int s) { return tables[q][static_cast<size_t>(o) * cuda::kSegSlots + s]; }
};

// place() once every peer has answered (their watchers run on their own), within 5 s.
uint64_t placeWhenMapped(SegmentRegistry& r, const void* p, size_t bytes) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  uint64_t at = r.place(p, bytes);
  while (at == cuda::kInScratch && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(milliseconds(1));
    at = r.place(p, bytes);
  }
  return at;
}

}  // namespace

TEST(Segments, ReadInPlaceOnlyOnceEveryPeerMappedIt) {
  const int opened = gMemOpened, closed = gMemClosed;
  Ranks g(3);
  std::vector<char> seg(1 << 20);
  // Nothing offered: the scratch.
  EXPECT_EQ(g.regs[0]->place(seg.data() + 64, 128), cuda::kInScratch);
  ASSERT_TRUE(g.regs[0]->offer(seg.data(), seg.size()));
  EXPECT_FALSE(g.regs[0]->offer(seg.data(), seg.size())) << "offered twice";
  EXPECT_TRUE(g.regs[0]->offered(seg.data() + 100));
  const uint64_t at = placeWhenMapped(*g.regs[0], seg.data() + 64, 128);
  ASSERT_NE(at, cuda::kInScratch);
  const int slot = static_cast<int>((at >> cuda::kPlaceShift) - 1);
  EXPECT_EQ(at & cuda::kPlaceOffset, 64u);
  for (int q = 1; q < 3; ++q) {
    EXPECT_EQ(g.mapped(q, 0, slot), seg.data()) << "rank " << q;
    cuda::ShotPeers peers{};
    peers.segs = g.tables[q].data();
    EXPECT_EQ(cuda::shotPlace(&peers, 0, at), seg.data() + 64);  // where the kernel of rank q reads it
  }
  // Past the segment's end, or not inside it at all: the scratch.
  EXPECT_EQ(g.regs[0]->place(seg.data() + seg.size() - 8, 16), cuda::kInScratch);
  std::vector<char> other(64);
  EXPECT_EQ(g.regs[0]->place(other.data(), 8), cuda::kInScratch);
  // Revoked: every peer has closed it when revoke() returns.
  EXPECT_TRUE(g.regs[0]->revoke(seg.data()));
  for (int q = 1; q < 3; ++q) EXPECT_EQ(g.mapped(q, 0, slot), nullptr) << "rank " << q << " still maps it";
  EXPECT_EQ(g.regs[0]->place(seg.data() + 64, 128), cuda::kInScratch);
  EXPECT_EQ(gMemOpened - opened, gMemClosed - closed);
  // The same address again (the allocator reused it): offered and mapped anew.
  ASSERT_TRUE(g.regs[0]->offer(seg.data(), seg.size() / 2));
  EXPECT_NE(placeWhenMapped(*g.regs[0], seg.data(), 16), cuda::kInScratch);
  EXPECT_EQ(g.regs[0]->place(seg.data() + seg.size() / 2, 16), cuda::kInScratch) << "past the new, smaller segment";
}

TEST(Segments, EveryRankOwnsAndMapsAtOnce) {
  const int opened = gMemOpened, closed = gMemClosed;
  {
    Ranks g(4);
    std::vector<std::vector<char>> segs(4, std::vector<char>(4096));
    std::vector<std::thread> ts;
    for (int r = 0; r < 4; ++r)
      ts.emplace_back([&, r] {
        for (int round = 0; round < 20; ++round) {
          ASSERT_TRUE(g.regs[r]->offer(segs[r].data(), segs[r].size()));
          ASSERT_NE(placeWhenMapped(*g.regs[r], segs[r].data(), 4096), cuda::kInScratch);
          ASSERT_TRUE(g.regs[r]->revoke(segs[r].data()));
        }
      });
    for (auto& t : ts) t.join();
    for (int q = 0; q < 4; ++q) EXPECT_EQ(g.regs[q]->mappedCount(), 0u);
  }
  EXPECT_EQ(gMemOpened - opened, gMemClosed - closed);
}

TEST(Segments, APeerThatCannotMapItKeepsItInTheScratch) {
  Ranks g(3);
  std::vector<char> seg(4096);
  gRefuseOpen = seg.data();
  ASSERT_TRUE(g.regs[1]->offer(seg.data(), seg.size()));
  // Rank 0 maps it, rank 2 cannot: never published.
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_EQ(g.regs[1]->place(seg.data(), 64), cuda::kInScratch);
  gRefuseOpen = nullptr;
  EXPECT_TRUE(g.regs[1]->revoke(seg.data()));
  EXPECT_EQ(g.regs[0]->mappedCount(), 0u);
}

TEST(Segments, APeerThatNeverAnswersIsWaitedForBoundedAndItsSlotIsNotReused) {
  Ranks g(2, milliseconds(200), {true, false});  // rank 1 watches nothing: it never answers
  std::vector<char> seg(4096);
  ASSERT_TRUE(g.regs[0]->offer(seg.data(), seg.size()));
  g.regs[1]->catchUp();  // it mapped it once, then went silent
  ASSERT_NE(placeWhenMapped(*g.regs[0], seg.data(), 64), cuda::kInScratch);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(g.regs[0]->revoke(seg.data()));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, milliseconds(150));
  // Its slot stays taken: another segment gets another slot.
  std::vector<char> next(4096);
  ASSERT_TRUE(g.regs[0]->offer(next.data(), next.size()));
  g.regs[1]->catchUp();
  const uint64_t at = g.regs[0]->place(next.data(), 64);
  ASSERT_NE(at, cuda::kInScratch);
  EXPECT_EQ(g.mapped(1, 0, static_cast<int>((at >> cuda::kPlaceShift) - 1)), next.data());
  // A peer that was silent once is not waited for again: the allocator is not held up by it
  // at every free.
  const auto t1 = std::chrono::steady_clock::now();
  EXPECT_TRUE(g.regs[0]->revoke(next.data()));
  EXPECT_LT(std::chrono::steady_clock::now() - t1, milliseconds(150));
  g.regs[1]->catchUp();
}

TEST(Segments, AFreeWaitsForTheKernelsStillQueuedOnTheSegment) {
  // The allocator frees a segment once its blocks' last uses are queued, not run: revoke()
  // waits for the last kernel that read it before any peer closes it.
  Ranks g(2);
  std::vector<char> seg(4096);
  ASSERT_TRUE(g.regs[0]->offer(seg.data(), seg.size()));
  const uint64_t at = placeWhenMapped(*g.regs[0], seg.data(), 64);
  ASSERT_NE(at, cuda::kInScratch);
  void* stream = nullptr;
  ASSERT_EQ(Fake::streamCreate(&stream), 0);
  gHung = true;
  Fake::hangAsync(stream);  // the kernel that reads it, still running
  g.regs[0]->used(at, stream);
  std::atomic<bool> done{false};
  std::thread freeing([&] {
    g.regs[0]->revoke(seg.data());
    done = true;
  });
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_FALSE(done.load()) << "revoked while a kernel that reads the segment had not run";
  EXPECT_EQ(g.mapped(1, 0, static_cast<int>((at >> cuda::kPlaceShift) - 1)), seg.data());
  gHung = false;
  freeing.join();
  EXPECT_EQ(g.mapped(1, 0, static_cast<int>((at >> cuda::kPlaceShift) - 1)), nullptr);
  Fake::streamDestroy(stream);
}

TEST(Segments, APeerThatLeftCountsAsClosed) {
  Ranks g(2, milliseconds(30000));
  std::vector<char> seg(4096);
  ASSERT_TRUE(g.regs[0]->offer(seg.data(), seg.size()));
  ASSERT_NE(placeWhenMapped(*g.regs[0], seg.data(), 64), cuda::kInScratch);
  g.regs[1]->shutdown();  // closes what it mapped, says it is gone
  EXPECT_EQ(g.regs[1]->mappedCount(), 0u);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(g.regs[0]->revoke(seg.data()));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(5000));
}

TEST(Segments, TheAllocatorsFreeRevokesInEveryGroup) {
  // Two groups over the same two ranks; the allocator's hook tells of a segment, both groups
  // register it, and its free is answered by both before segmentFreeing() returns.
  Ranks a(2), b(2);
  for (auto& r : a.regs) enlistSegments(r);
  for (auto& r : b.regs) enlistSegments(r);
  std::vector<char> seg(8192);
  segmentMade(seg.data(), seg.size());
  char* base = nullptr;
  size_t bytes = 0;
  ASSERT_TRUE(findSegment(seg.data() + 100, &base, &bytes));
  EXPECT_EQ(base, seg.data());
  EXPECT_EQ(bytes, seg.size());
  EXPECT_FALSE(findSegment(seg.data() + seg.size(), &base, &bytes));
  ASSERT_TRUE(a.regs[0]->offer(base, bytes));
  ASSERT_TRUE(b.regs[0]->offer(base, bytes));
  ASSERT_NE(placeWhenMapped(*a.regs[0], seg.data(), 64), cuda::kInScratch);
  ASSERT_NE(placeWhenMapped(*b.regs[0], seg.data(), 64), cuda::kInScratch);
  const size_t known = segmentsKnown();
  segmentFreeing(seg.data());
  EXPECT_EQ(segmentsKnown(), known - 1);
  EXPECT_FALSE(findSegment(seg.data(), &base, &bytes));
  EXPECT_EQ(a.regs[1]->mappedCount(), 0u);
  EXPECT_EQ(b.regs[1]->mappedCount(), 0u);
  EXPECT_EQ(a.regs[0]->place(seg.data(), 64), cuda::kInScratch);
}
