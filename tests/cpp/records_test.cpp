// What set-up reads of the store (engine/records.h): the host map gathered up a tree of ranks,
// malformed records refused by name, and a real set-up of ranks on several hosts that reads no
// endpoint of another host's rank until a collective needs the pair.
#include <gtest/gtest.h>

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

// Every rank's host map merged up the tree as set-up does, played in one process.
HostMap gather(const std::vector<int>& hostOf) {
  const int n = static_cast<int>(hostOf.size());
  std::vector<HostMap> part(static_cast<size_t>(n));
  // Children have higher ranks: merge from the last rank down.
  for (int r = n - 1; r >= 0; --r) {
    const int h = hostOf[static_cast<size_t>(r)];
    HostMap m = HostMap::one("id" + std::to_string(h), "host" + std::to_string(h));
    for (int c : gatherChildren(r, n)) m.append(HostMap::decode(part[static_cast<size_t>(c)].encode(), "test"));
    part[static_cast<size_t>(r)] = m;
  }
  return part[0];
}

}  // namespace

TEST(HostMap, GatheredUpTheTreeItNamesEveryRanksHost) {
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
    // Every rank but 0 is gathered by exactly one parent.
    std::vector<int> parents(static_cast<size_t>(n), 0);
    for (int r = 0; r < n; ++r)
      for (int c : gatherChildren(r, n)) ++parents[static_cast<size_t>(c)];
    for (int r = 1; r < n; ++r) ASSERT_EQ(parents[static_cast<size_t>(r)], 1) << "rank " << r << " of " << n;
  }
}

TEST(HostMap, StaysSmallWhereHostsHoldConsecutiveRanks) {
  std::vector<int> hostOf;
  for (int r = 0; r < 4096; ++r) hostOf.push_back(r / 8);
  HostMap m = gather(hostOf);
  EXPECT_EQ(m.hosts.size(), 512u);
  EXPECT_EQ(m.runs.size(), 512u);
  EXPECT_LT(m.encode().size(), 24u * 1024);  // ids and names of ~10 characters; not 4,096 records
  // Rank 0 merges 15 children on each of the three levels of 4,096 ranks; a rank's children
  // never hold more than the whole.
  EXPECT_EQ(gatherChildren(0, 4096).size(), 45u);
  EXPECT_EQ(gatherChildren(1, 4096).size(), 0u);
  EXPECT_EQ(gatherChildren(8, 4096).size(), 0u);
  EXPECT_EQ(gatherChildren(32, 40), (std::vector<int>{33, 34, 35, 36, 37, 38, 39}));
  EXPECT_EQ(gatherChildren(256, 4096).size(), 30u);  // 257..271, then 272, 288, ..., 496
  EXPECT_EQ(gatherChildren(256, 4096).back(), 496);
}

TEST(HostMap, MalformedRecordsAreRefusedNamingTheRank) {
  for (const char* bad : {"", "junk", "h|a|b\nr|1|1\n", "h|a|b\nr|0|0\n", "x|a|b\n", "h||b\nr|0|1\n", "h|a|b\n",
                          "h|a|\nr|0|1\n", "h|a|b|c\nr|0|1\n", "h|a|b\nr|0|\n", "h|a|b\nr|0|1|\n", "hh|a|b\nr|0|1\n"}) {
    try {
      HostMap::decode(bad, "rank 5");
      FAIL() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 5"), std::string::npos) << e.what();
    }
  }
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
    // The secret, rank 0's host map, a rank's children's (all 11 others for rank 0 here, none for
    // the rest), this host's records and endpoints (no ready marks: a shared-memory name goes
    // when the watchdog sees every peer has mapped it); rank 0 also a rail line per other host
    // where rails were found.
    size_t most = 2u + gatherChildren(r, n).size() + 2u * (perHost - 1) + (r == 0 ? n / perHost - 1 : 0);
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
