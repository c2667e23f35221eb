// The flight recorder's bytes per peer: what an op moved, summed per peer whatever order the
// transfers came in, for ops that meet two peers and for ops that meet every rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "engine/telemetry.h"

using railcc::engine::Telemetry;

namespace {

// The `"bytes_sent": {...}` (or recv) object the recorder should print for `m`.
std::string expected(const char* key, const std::map<int, uint64_t>& m) {
  std::string s = std::string("\"") + key + "\": {";
  bool first = true;
  for (auto& [p, b] : m) {
    if (b == 0) continue;
    s += (first ? "\"" : ", \"") + std::to_string(p) + "\": " + std::to_string(b);
    first = false;
  }
  return s + "}";
}

}  // namespace

TEST(FlightRecorder, BytesPerPeerSumOverStepsForTwoPeersAndForEveryRank) {
  const int n = 4096;
  Telemetry t(/*rank=*/0, n, /*ringSize=*/4, /*window=*/4);

  // A ring: the same two neighbours step after step, sends and receives apart.
  uint64_t ring = t.opQueued(1, "allreduce", "float32", "SUM", -1, 1);
  std::map<int, uint64_t> ringSent, ringRecv;
  for (int step = 0; step < 2 * (n - 1); ++step) {
    t.opBytes(ring, {{1, 100u + step, 0}, {n - 1, 0, 7}});
    ringSent[1] += 100u + step;
    ringRecv[n - 1] += 7;
  }
  // All-to-all: every peer, twice each, in a shuffled order, one call at a time.
  uint64_t a2a = t.opQueued(0, "alltoall", "float32", "", -1, 1);
  std::vector<int> order;
  for (int round = 0; round < 2; ++round)
    for (int p = 1; p < n; ++p) order.push_back(p);
  std::shuffle(order.begin(), order.end(), std::mt19937(7));
  std::map<int, uint64_t> a2aSent, a2aRecv;
  for (int p : order) {
    t.opBytes(a2a, p, static_cast<uint64_t>(p), static_cast<uint64_t>(3 * p));
    a2aSent[p] += static_cast<uint64_t>(p);
    a2aRecv[p] += static_cast<uint64_t>(3 * p);
  }
  t.opBytes(a2a, n, 1, 1);   // not a rank of the group: ignored
  t.opBytes(a2a, -1, 1, 1);  // likewise

  const std::string json = t.opsJson();
  EXPECT_NE(json.find(expected("bytes_sent", ringSent) + ", " + expected("bytes_recv", ringRecv)), std::string::npos)
      << json.substr(0, 600);
  EXPECT_NE(json.find(expected("bytes_sent", a2aSent) + ", " + expected("bytes_recv", a2aRecv)), std::string::npos);
  EXPECT_EQ(json.find("\"4096\""), std::string::npos);

  // Slots are reused: an op after the ring wrapped holds only its own bytes.
  for (int i = 0; i < 4; ++i) t.opQueued(2 + static_cast<uint64_t>(i), "barrier", "uint8", "MAX", -1, 1);
  uint64_t last = t.opQueued(6, "allreduce", "float32", "SUM", -1, 1);
  t.opBytes(last, 5, 11, 12);
  const std::string after = t.opsJson();
  EXPECT_NE(after.find("\"bytes_sent\": {\"5\": 11}, \"bytes_recv\": {\"5\": 12}"), std::string::npos) << after;
  EXPECT_EQ(after.find("alltoall"), std::string::npos);
}
