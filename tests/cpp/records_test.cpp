// What set-up reads of the store (engine/records.h): the host map combined in groups of ranks,
// malformed records refused by name, and a real set-up of ranks on several hosts that reads no
// endpoint of another host's rank until a collective needs the pair.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "common/strings.h"
#include "engine/communicator.h"
#include "engine/records.h"
#include "engine/store.h"

using namespace railcc;
using namespace railcc::engine;

namespace {

// Every rank's host map combined in groups as set-up combines it, played in one process.
HostMap gather(const std::vector<int>& hostOf) {
  const int n = static_cast<int>(hostOf.size());
  std::vector<HostMap> part;
  for (int h : hostOf) part.push_back(HostMap::one("id" + std::to_string(h), "host" + std::to_string(h)));
  for (int level = 1; level <= gatherLevels(n); ++level) {
    std::vector<HostMap> next(static_cast<size_t>(gatherParts(n, level)));
    for (int g = 0; g < static_cast<int>(next.size()); ++g) {
      const auto [first, count] = gatherMembers(n, level, g);
      std::vector<HostMap> decoded;
      for (int i = first; i < first + count; ++i) decoded.push_back(HostMap::decode(part[static_cast<size_t>(i)].encode(), "test", part[static_cast<size_t>(i)].ranks()));
      std::vector<const HostMap*> members;
      for (const HostMap& m : decoded) members.push_back(&m);
      next[static_cast<size_t>(g)] = HostMap::concat(members);
    }
    part = std::move(next);
  }
  return part.front();
}

}  // namespace

TEST(HostMap, CombinedInGroupsItNamesEveryRanksHost) {
  std::mt19937 rng(7);
  std::vector<int> sizes;
  for (int n = 1; n <= 70; ++n) sizes.push_back(n);
  for (int n : {255, 256, 257, 273, 1000, 4097}) sizes.push_back(n);  // a third level, a fourth
  for (int n : sizes) {
    std::vector<int> contiguous, interleaved, random;
    for (int r = 0; r < n; ++r) {
      contiguous.push_back(r / 8);
      interleaved.push_back(r % 3);
      random.push_back(static_cast<int>(rng() % 5));
    }
    for (const auto& hostOf : {contiguous, interleaved, random}) {
      HostMap m = gather(hostOf);
      ASSERT_EQ(m.ranks(), n);
      std::vector<int> got = m.hostOfRank();
      for (int r = 0; r < n; ++r)
        ASSERT_EQ(m.hosts[static_cast<size_t>(got[static_cast<size_t>(r)])].id, "id" + std::to_string(hostOf[static_cast<size_t>(r)]))
            << "rank " << r << " of " << n;
    }
    // Every part of a level is merged by exactly one group of the next, in order; one group last.
    for (int level = 1; level <= gatherLevels(n); ++level) {
      int next = 0;
      for (int g = 0; g < gatherParts(n, level); ++g) {
        const auto [first, count] = gatherMembers(n, level, g);
        ASSERT_EQ(first, next) << "level " << level << " group " << g << " of " << n;
        ASSERT_GE(count, 1);
        ASSERT_LE(count, kGatherRadix);
        next += count;
      }
      ASSERT_EQ(next, gatherParts(n, level - 1)) << "level " << level << " of " << n;
    }
    ASSERT_EQ(gatherParts(n, gatherLevels(n)), 1) << n;
  }
}

TEST(HostMap, StaysSmallWhereHostsHoldConsecutiveRanks) {
  std::vector<int> hostOf;
  for (int r = 0; r < 4096; ++r) hostOf.push_back(r / 8);
  HostMap m = gather(hostOf);
  EXPECT_EQ(m.hosts.size(), 512u);
  EXPECT_EQ(m.runs.size(), 512u);
  EXPECT_LT(m.encode().size(), 24u * 1024);  // ids and names of ~10 characters; not 4,096 records
  // Three levels of groups of 16 at 4,096 ranks: a rank merges at most 15 parts at each.
  EXPECT_EQ(gatherLevels(1), 0);
  EXPECT_EQ(gatherLevels(2), 1);
  EXPECT_EQ(gatherLevels(16), 1);
  EXPECT_EQ(gatherLevels(17), 2);
  EXPECT_EQ(gatherLevels(256), 2);
  EXPECT_EQ(gatherLevels(257), 3);
  EXPECT_EQ(gatherLevels(4096), 3);
  EXPECT_EQ(gatherLevels(4097), 4);
  EXPECT_EQ(gatherMembers(40, 1, 2), (std::pair<int, int>{32, 8}));
  EXPECT_EQ(gatherMembers(40, 2, 0), (std::pair<int, int>{0, 3}));
  EXPECT_EQ(gatherMembers(4096, 3, 0), (std::pair<int, int>{0, 16}));
  EXPECT_EQ(gatherMembers(4097, 4, 0), (std::pair<int, int>{0, 2}));
  EXPECT_EQ(gatherMembers(4097, 3, 1), (std::pair<int, int>{16, 1}));
}

namespace {

std::string partOf(int level, int index) { return "part " + std::to_string(level) + "/" + std::to_string(index); }

}  // namespace

// Ranks as threads on one store, in a shuffled order of arrival: exactly one merges the last
// level, and every rank ends with the same map naming every rank's host.
TEST(HostMap, CombinedByWhicheverRankCompletesEachGroup) {
  for (int n : {2, 3, 16, 17, 40, 300}) {
    MemoryStore store;
    std::vector<int> order(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) order[static_cast<size_t>(r)] = r;
    std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(n)));
    std::vector<std::string> got(static_cast<size_t>(n));
    std::vector<int> wholeHere(static_cast<size_t>(n), 0);
    std::vector<std::string> errors(static_cast<size_t>(n));
    std::vector<std::thread> ts;
    for (int r : order)
      ts.emplace_back([&, r] {
        try {
          HostMap m = HostMap::one("id" + std::to_string(r / 3), "host" + std::to_string(r / 3));
          if (combineHostMap(store, r, n, m, Millis(30000), "g", partOf)) {
            wholeHere[static_cast<size_t>(r)] = 1;
            got[static_cast<size_t>(r)] = m.encode();
          } else {
            got[static_cast<size_t>(r)] = store.get("hosts", Millis(30000));
          }
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(r)] = e.what();
        }
      });
    for (auto& t : ts) t.join();
    for (int r = 0; r < n; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r << " of " << n;
    EXPECT_EQ(std::count(wholeHere.begin(), wholeHere.end(), 1), 1) << n;
    const HostMap whole = HostMap::decode(got.front(), "test", n);
    ASSERT_EQ(whole.ranks(), n);
    const std::vector<int> hostOf = whole.hostOfRank();
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(got[static_cast<size_t>(r)], got.front()) << "rank " << r << " of " << n;
      EXPECT_EQ(whole.hosts[static_cast<size_t>(hostOf[static_cast<size_t>(r)])].id, "id" + std::to_string(r / 3));
    }
  }
}

// A count left by another job on the same prefix is an error naming the key, not a hang; after a
// wait for the whole ran out, the part that never came is named.
TEST(HostMap, AStaleCountAndAMissingMergeAreNamed) {
  MemoryStore stale;
  stale.add("gather/1/0", 2);
  HostMap m = HostMap::one("a", "a");
  try {
    combineHostMap(stale, 1, 2, m, Millis(1000), "g", partOf);
    FAIL() << "a count of 3 for a group of 2 was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("store key 'gather/1/0' counts 3"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("same store prefix"), std::string::npos) << e.what();
  }
  MemoryStore store;
  for (int r = 0; r < 20; ++r) store.set(gatherPartKey(0, r), HostMap::one("a", "a").encode());
  store.set(gatherPartKey(1, 1), HostMap::one("a", "a").encode());  // ranks 16-19 merged; 0-15 never
  try {
    throwMissingPart(store, 20, 7, partOf);
    FAIL() << "no part named";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(e.what()).find("part 1/0 never reached the store within RAILCC_INIT_TIMEOUT=7 s"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("'place/1/0'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(gatherSpan(20, 1, 1), (std::pair<int64_t, int64_t>{16, 19}));
  EXPECT_EQ(gatherSpan(4096, 2, 3), (std::pair<int64_t, int64_t>{768, 1023}));
}

TEST(HostMap, MalformedRecordsAreRefusedNamingTheRank) {
  for (const char* bad : {"", "junk", "h|a|b\nr|1|1\n", "h|a|b\nr|0|0\n", "x|a|b\n", "h||b\nr|0|1\n", "h|a|b\n",
                          "h|a|\nr|0|1\n", "h|a|b|c\nr|0|1\n", "h|a|b\nr|0|\n", "h|a|b\nr|0|1|\n", "hh|a|b\nr|0|1\n"}) {
    try {
      HostMap::decode(bad, "rank 5", 1);
      FAIL() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 5"), std::string::npos) << e.what();
    }
  }
}

// A record naming more ranks than the part covers is refused before anything grows with its
// counts: 24 runs of 2^24 ranks once took a rank to 1.8 GB.
TEST(HostMap, ARecordOfMoreRanksThanItCoversIsRefusedBeforeItGrows) {
  std::string huge = "h|a|b\n";
  for (int i = 0; i < 200; ++i) huge += "r|0|16777216\n";
  for (const auto& [record, ranks, words] : std::vector<std::tuple<std::string, int, std::string>>{
           {huge, 16, "more than the 16 ranks it covers"},
           {"h|a|b\nr|0|3\n", 2, "more than the 2 ranks it covers"},
           {"h|a|b\nr|0|1\n", 2, "names 1 ranks where it covers 2"},
           {"h|a|b\nh|c|d\nh|e|f\nr|0|1\n", 2, "names 3 hosts for 2 ranks"},
           {"h|a\xff|b\nr|0|1\n", 1, "not printable text"},
           {"h|a|b\x01\nr|0|1\n", 1, "not printable text"}}) {
    try {
      HostMap::decode(record, "rank 7", ranks);
      FAIL() << "accepted '" << record.substr(0, 40) << "'";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("rank 7"), std::string::npos) << what;
      EXPECT_NE(what.find(words), std::string::npos) << what;
      EXPECT_TRUE(printableText(what.substr(0, what.find('\n')))) << what;
    }
  }
  EXPECT_EQ(HostMap::decode("h|a|b\nh|c|d\nr|0|2\nr|1|3\n", "x", 5).ranks(), 5);
}

namespace {

// The ranks' shared store, counting what each rank reads.
class CountingStore : public Store {
 public:
  CountingStore(Store& base, std::map<std::string, int>& reads, std::mutex& mu) : base_(base), reads_(reads), mu_(mu) {}
  void set(const std::string& k, const std::string& v) override { base_.set(k, v); }
  std::string get(const std::string& k, Millis t) override { return getAll({k}, t).front(); }
  int64_t add(const std::string& k, int64_t d) override { return base_.add(k, d); }
  std::vector<std::string> getAll(const std::vector<std::string>& keys, Millis t) override {
    auto out = base_.getAll(keys, t);
    std::lock_guard<std::mutex> g(mu_);
    for (const auto& k : keys) ++reads_[k];
    return out;
  }

 private:
  Store& base_;
  std::map<std::string, int>& reads_;
  std::mutex& mu_;
};

}  // namespace

// The ranks an INFO line names (peers left to their first use) as spans, a few for a job laid
// out in blocks however large.
TEST(Strings, RankSpansFoldRunsOfConsecutiveRanks) {
  EXPECT_EQ(rankSpans({}), "");
  EXPECT_EQ(rankSpans({7}), "7");
  EXPECT_EQ(rankSpans({1, 2, 3, 5, 7, 8}), "1-3, 5, 7-8");
  std::vector<int> others;
  for (int r = 0; r < 4096; ++r)
    if (r / 8 != 3) others.push_back(r);  // every rank but those of host 3
  EXPECT_EQ(rankSpans(others), "0-23, 32-4095");
}

TEST(SetUp, ReadsThisHostsRecordsAndAnotherHostsEndpointOnlyAtFirstUse) {
  // 12 ranks on 4 hosts of 3 (threads, each with RAILCC_HOST_ID; shared memory within a host,
  // TCP connected at first use between hosts).
  const int n = 12, perHost = 3;
  MemoryStore store;
  std::mutex mu;
  std::vector<std::map<std::string, int>> initReads(n), opReads(n);
  std::vector<std::string> errors(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        std::map<std::string, int> reads;
        CountingStore counting(store, reads, mu);
        CommOptions o;
        o.rank = r;
        o.size = n;
        o.name = "records";
        o.timeout = Millis(60000);
        o.config = Config::defaults();
        o.config.hostId = "host" + std::to_string(r / perHost);
        o.config.initTimeoutSec = 60;
        Communicator c(counting, o);
        {
          std::lock_guard<std::mutex> g(mu);
          initReads[static_cast<size_t>(r)] = reads;
        }
        std::vector<float> v(1000, static_cast<float>(r + 1));
        auto req = c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
        if (!req->wait(Millis(60000))) throw std::runtime_error("all_reduce did not finish");
        if (req->error()) std::rethrow_exception(req->error());
        for (float x : v)
          if (x != n * (n + 1) / 2) throw std::runtime_error("wrong sum " + std::to_string(x));
        std::lock_guard<std::mutex> g(mu);
        opReads[static_cast<size_t>(r)] = reads;
        c.shutdown();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < n; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  for (int r = 0; r < n; ++r) {
    for (const auto& [key, times] : initReads[static_cast<size_t>(r)]) {
      auto slash = key.rfind('/');
      int of = slash == std::string::npos ? -1 : std::atoi(key.c_str() + slash + 1);
      bool sameHost = of >= 0 && of / perHost == r / perHost;
      if (key.find("peer/") != std::string::npos)
        EXPECT_TRUE(sameHost) << "rank " << r << " read " << key << " at init";
      // Rank 0 reads one endpoint per other host for its rail check, and only where rails exist.
      if (key.find("ep/") != std::string::npos && r != 0)
        EXPECT_TRUE(sameHost) << "rank " << r << " read " << key << " at init";
    }
    // The secret, the whole host map, the other parts of a group this rank completed (any rank
    // may: the last of the 12 to count itself in reads the 11 others), this host's records and
    // endpoints (no ready marks: a shared-memory name goes when the watchdog sees every peer has
    // mapped it); rank 0 also a rail line per other host where rails were found.
    size_t most = 2u + (n - 1) + 2u * (perHost - 1) + (r == 0 ? n / perHost - 1 : 0);
    std::string keys;
    for (const auto& kv : initReads[static_cast<size_t>(r)]) keys += " " + kv.first;
    EXPECT_LE(initReads[static_cast<size_t>(r)].size(), most) << "rank " << r << " read" << keys;
    int remoteEps = 0;
    for (const auto& [key, times] : opReads[static_cast<size_t>(r)]) {
      auto at = key.find("ep/");
      if (at != std::string::npos && std::atoi(key.c_str() + at + 3) / perHost != r / perHost) ++remoteEps;
    }
    EXPECT_GT(remoteEps, 0) << "rank " << r << " met another host without reading its endpoint";
  }
}

// A failure passed down a chain of ranks is told once, with the ranks it came through.
TEST(FailureReport, AChainOfPassedOnFailuresIsToldOnce) {
  EXPECT_EQ(innermostReason("rank 3 (host a, pid 7) is gone: EOF"), "rank 3 (host a, pid 7) is gone: EOF");
  EXPECT_EQ(innermostReason("collective mismatch: x"), "collective mismatch: x");
  std::string chain = "rank 0 (host h0, shm) is gone: closed\nhint";
  for (int r = 1; r < 15; ++r) chain = "rank " + std::to_string(r) + " (host h" + std::to_string(r) + ", shm) failed: " + chain;
  const std::string told = innermostReason(chain);
  EXPECT_EQ(told.rfind("rank 0 (host h0, shm) is gone: closed (passed on by ranks 14, 13, 12, 11, 10, 9, 8, 7 and 6 more)", 0), 0u)
      << told;
  EXPECT_NE(told.find("\nhint"), std::string::npos) << told;
  EXPECT_LT(told.find('\n'), 120u) << told;
  EXPECT_EQ(innermostReason("rank 2 (group rank 1) (host b, tcp) failed: slow"), "slow (passed on by rank 2)");
}
