// The verbs transport with rdma-core's header: the endpoint blob, and what needs an RDMA
// device, which skips without one: in CI it runs inside the Soft-RoCE VM
// (tests/vm/test_vm_verbs.py), over real rxe devices. The pure rules: verbs_rules_test.cpp.
#include <arpa/inet.h>
#include <dirent.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "collective_checks.h"
#include "common/error.h"
#include "ranks.h"
#include "transport/memory_owners.h"
#include "transport/stats.h"
#include "transport/verbs/verbs_connection.h"

using namespace railcc;
using namespace railcc::engine;
using namespace railcc::transport::verbs;

namespace {

// A peer's endpoint blob is read from the store, which any process that reaches it can write:
// hostile and truncated blobs are refused, never crash the reader.
TEST(VerbsBlob, AWellFormedBlobParses) {
  const std::string gid(32, 'a');
  Blob b;
  ASSERT_TRUE(parseBlob("verbs1;d,rxe0:1,7," + gid + ",3,1;c,2,1,0,0,17,99,140000000,55,4194304", &b));
  ASSERT_EQ(b.devs.size(), 1u);
  EXPECT_EQ(b.devs[0].dev, "rxe0:1");
  EXPECT_EQ(b.devs[0].lid, 7);
  EXPECT_EQ(b.devs[0].mtu, 3);
  EXPECT_TRUE(b.devs[0].roce);
  ASSERT_EQ(b.conns.size(), 1u);
  const QpInfo& q = b.conns.at({2, 1, 0});
  EXPECT_EQ(q.qpn, 17u);
  EXPECT_EQ(q.psn, 99u);
  EXPECT_EQ(q.ringAddr, 140000000u);
  EXPECT_EQ(q.rkey, 55u);
  EXPECT_EQ(q.ringBytes, 4194304u);
}

TEST(VerbsBlob, HostileBlobsAreRefused) {
  const std::string gid(32, 'a'), dev = ";d,rxe0:1,7," + gid + ",3,1";
  for (const std::string& s : std::vector<std::string>{std::string("verbs1;;c"), std::string("verbs1;c"), std::string("verbs1;d"),
        std::string(";;;"), std::string("verbs1;,,,"), std::string("verbs1;c,1,2,3,0,1,2,3,4,5"),  // no device
        "verbs1" + dev + ";c,1,0,0,1,1,2,3,4,5",                       // device 1 of 1
        "verbs1" + dev + ";c,-1,0,0,0,1,2,3,4,5",                      // a negative rank
        "verbs1" + dev + ";c,99999999999,0,0,0,1,2,3,4,5",             // a rank past int
        "verbs1" + dev + ";c,1,0,0,0,1,2,3,99999999999999999999999,5",  // an address past 64 bits
        "verbs1" + dev + ";c,1,0,0,0,1,2,3,4,0",                       // an empty ring
        "verbs1" + dev + ";c,1,0,0,0,zz,2,3,4,5", "verbs1" + dev + ";c,1,0,0,0, 1,2,3,4,5",
        "verbs1;d,rxe0:1,70000," + gid + ",3,1", "verbs1;d,rxe0:1,7,zz,3,1", "verbs1;d,rxe0:1,7," + gid + ",9,1",
        "verbs1;d,,7," + gid + ",3,1", std::string("verbs1;x,1")}) {
    Blob b;
    EXPECT_FALSE(parseBlob(s, &b)) << s;
  }
}

TEST(VerbsBlob, TruncatedAndMutatedBlobsNeverCrash) {
  const std::string gid(32, '0');
  std::string good = "verbs1;d,rxe0:1,7," + gid + ",3,1;d,rxe1:1,8," + gid + ",5,0";
  for (int r = 0; r < 4; ++r) good += ";c," + std::to_string(r) + ",1,0,1,17,99,140000000,55,4194304";
  int accepted = 0;
  for (size_t n = 0; n <= good.size(); ++n) {
    Blob b;
    accepted += parseBlob(good.substr(0, n), &b);
  }
  EXPECT_GT(accepted, 0);
  const std::string alphabet = "verbs1;,cd0123456789-:ax \n";
  uint64_t x = 88172645463325252ull;  // xorshift: the same inputs on every run
  auto next = [&] {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  };
  for (int i = 0; i < 20000; ++i) {
    std::string s = good;
    for (int k = 0, m = 1 + static_cast<int>(next() % 6); k < m; ++k) {
      size_t at = next() % s.size();
      switch (next() % 3) {
        case 0: s[at] = alphabet[next() % alphabet.size()]; break;
        case 1: s.erase(at, 1 + next() % 8); break;
        default: s.insert(at, 1, alphabet[next() % alphabet.size()]); break;
      }
      if (s.empty()) s = "v";
    }
    Blob b;
    if (parseBlob(s, &b))
      for (auto& [key, q] : b.conns) EXPECT_GT(q.ringBytes, 0u) << s;
  }
  for (int i = 0; i < 5000; ++i) {  // random field lists from scratch
    std::string s = "verbs1";
    for (int k = 0, m = static_cast<int>(next() % 40); k < m; ++k) s += alphabet[next() % alphabet.size()];
    Blob b;
    parseBlob(s, &b);
  }
}

// --- With a device (the Soft-RoCE VM) ---------------------------------------------------------

// The ports this process may use (none outside the VM: the tests below then skip).
std::vector<std::shared_ptr<Device>> devices(const Config& cfg) {
  std::string why;
  return openDevices(cfg, &why);
}

#define SKIP_WITHOUT_RDMA(devs) \
  if ((devs).empty()) GTEST_SKIP() << "no RDMA device here (the Soft-RoCE VM runs these)"

TEST(VerbsLoopback, WritesWithImmediateWrapTheRingBothWays) {
  Config cfg = Config::defaults();
  auto devs = devices(cfg);
  SKIP_WITHOUT_RDMA(devs);
  const size_t ring = 64 << 10;
  // Both ends on one device: rxe reaches its own address, not a second device's (no route).
  VerbsConnection a(devs[0], ring, cfg, "rank 1 (host b)"), b(devs[0], ring, cfg, "rank 0 (host a)");
  a.connectTo(b.local());
  b.connectTo(a.local());
  const size_t total = 3 * ring + 12345;
  std::vector<uint8_t> out(total), inA(total), inB(total);
  for (size_t i = 0; i < total; ++i) out[i] = static_cast<uint8_t>(i * 7 + i / 251);
  size_t sentA = 0, sentB = 0, gotA = 0, gotB = 0;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  size_t step = 1;
  while (gotA < total || gotB < total) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "stalled at " << gotA << "/" << gotB;
    step = step * 3 % 40000 + 1;  // pieces of every size, across the ring's end
    sentA += a.send(out.data() + sentA, std::min(step, total - sentA));
    sentB += b.send(out.data() + sentB, std::min(step + 5, total - sentB));
    gotB += b.recv(inB.data() + gotB, std::min(step * 2, total - gotB));
    gotA += a.recv(inA.data() + gotA, total - gotA);
  }
  EXPECT_EQ(inA, out);
  EXPECT_EQ(inB, out);
  EXPECT_EQ(a.describe().rfind("verbs ", 0), 0u) << a.describe();
}

int openFds() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d)) ++n;
    closedir(d);
  }
  return n;
}

// Drives `done` until it holds, failing the test after 30 s.
template <typename F>
void until(F done, const char* what) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!done()) ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "stalled: " << what;
}

// One group's queue pairs on a device share one completion channel (CqHub): 64 peers (both ends
// of each pair in this process: 128 connections over 8 completion queues) add one file
// descriptor, not one per connection, and each pair's bytes and rendezvous reach its own end.
TEST(VerbsLoopback, SixtyFourPeersShareOneCompletionChannel) {
  Config cfg = Config::defaults();
  auto devs = devices(cfg);
  SKIP_WITHOUT_RDMA(devs);
  const int before = openFds();
  auto hub = std::make_shared<CqHub>(devs[0], VerbsConnection::completionsPerQp());
  std::vector<std::unique_ptr<VerbsConnection>> as, bs;
  for (int i = 0; i < 64; ++i) {
    as.push_back(std::make_unique<VerbsConnection>(devs[0], 16 << 10, cfg, "rank " + std::to_string(i), hub));
    bs.push_back(std::make_unique<VerbsConnection>(devs[0], 16 << 10, cfg, "rank 0", hub));
    as[i]->connectTo(bs[i]->local());
    bs[i]->connectTo(as[i]->local());
  }
  EXPECT_LE(openFds() - before, 1) << "file descriptors grew with the connections";
  EXPECT_EQ(as[0]->pollFd(), bs[63]->pollFd());
  for (int i = 0; i < 64; ++i) {
    uint32_t v = 1000 + static_cast<uint32_t>(i);
    until([&] { return as[i]->send(&v, 4) == 4; }, "send");
  }
  for (int i = 63; i >= 0; --i) {
    uint32_t got = 0;
    until([&] { return bs[i]->recv(&got, 4) == 4; }, "receive");
    EXPECT_EQ(got, 1000u + static_cast<uint32_t>(i));
  }
  // A rendezvous on one pair among them: b reads a's buffer, then acknowledges.
  std::vector<char> src(3 << 20), dst(3 << 20, 0);
  for (size_t k = 0; k < src.size(); ++k) src[k] = static_cast<char>(k * 13 + k / 4093);
  uint64_t key = 0;
  ASSERT_TRUE(as[17]->exposeForRead(src.data(), src.size(), &key));
  until([&] { return bs[17]->readRemote(dst.data(), reinterpret_cast<uint64_t>(src.data()), key, dst.size()); },
        "RDMA read");
  bs[17]->ackRemote();
  until([&] { return as[17]->remoteAcked() == 1; }, "acknowledgement");
  EXPECT_EQ(src, dst);
}

// A buffer whose owner went (its storage freed) and whose address now holds other memory is
// registered afresh: the peer reads the new bytes, never the old pages through a cached key.
TEST(VerbsLoopback, MemoryFreedAndMappedAgainAtTheSameAddressIsReadFresh) {
  Config cfg = Config::defaults();
  auto devs = devices(cfg);
  SKIP_WITHOUT_RDMA(devs);
  VerbsConnection a(devs[0], 64 << 10, cfg, "rank 1 (host b)"), b(devs[0], 64 << 10, cfg, "rank 0 (host a)");
  a.connectTo(b.local());
  b.connectTo(a.local());
  struct Owner : transport::MemoryOwner {
    std::atomic<bool> live{true};
    bool alive() const override { return live; }
  };
  transport::wantMemoryOwners(4096);
  const size_t n = 1 << 20;
  std::vector<char> dst(n);
  auto* p = static_cast<char*>(mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(p, MAP_FAILED);
  auto send = [&](char fill) {
    const uint64_t acked = a.remoteAcked();
    uint64_t key = 0;
    ASSERT_TRUE(a.exposeForRead(p, n, &key));
    until([&] { return b.readRemote(dst.data(), reinterpret_cast<uint64_t>(p), key, n); }, "RDMA read");
    b.ackRemote();
    until([&] { return a.remoteAcked() == acked + 1; }, "acknowledgement");
    EXPECT_EQ(dst, std::vector<char>(n, fill));
  };
  for (int round = 0; round < 3; ++round) {
    auto owner = std::make_shared<Owner>();
    transport::noteMemoryOwner(p, n, owner);
    const char fill = static_cast<char>('a' + round);
    std::memset(p, fill, n);
    auto& hits = transport::statRow(transport::StatKind::kVerbs).v[static_cast<size_t>(transport::Stat::kRegCacheHits)];
    send(fill);
    const uint64_t before = hits.load();
    send(fill);  // the second finds the first's registration (a read of freed pages would show the old fill)
    EXPECT_EQ(hits.load(), before + 1) << "round " << round;
    // Freed: the owner says so, and the address gets new pages.
    owner->live = false;
    ASSERT_EQ(munmap(p, n), 0);
    ASSERT_EQ(mmap(p, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0), p);
  }
  munmap(p, n);
}

TEST(VerbsLoopback, AGonePeerFailsTheConnectionNamingRetryExceeded) {
  Config cfg = Config::defaults();
  cfg.ibTimeout = 8;  // ~1 ms a try
  cfg.ibRetryCnt = 1;
  auto devs = devices(cfg);
  SKIP_WITHOUT_RDMA(devs);
  VerbsConnection a(devs[0], 64 << 10, cfg, "rank 1 (host b)");
  {
    VerbsConnection b(devs[0], 64 << 10, cfg, "rank 0 (host a)");
    a.connectTo(b.local());
    b.connectTo(a.local());
  }  // b's queue pair is gone: nothing answers a's writes
  std::string err;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  try {
    while (std::chrono::steady_clock::now() < deadline) {
      uint8_t x[100] = {0};
      a.send(x, sizeof(x));
      a.checkAlive();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPeerFailure);
    err = e.what();
  }
  EXPECT_NE(err.find("rank 1 (host b)"), std::string::npos) << err;
  EXPECT_NE(err.find("status 12"), std::string::npos) << err;
  EXPECT_NE(err.find("process died or its host is unreachable"), std::string::npos) << err;
}

// Every rank its own "host", RAILCC_NET=verbs: every byte between ranks crosses a queue pair.
void runOverVerbs(int n, int qps, const std::function<void(Communicator&)>& body) {
  Config cfg = Config::defaults();
  cfg.net = "verbs";
  cfg.initTimeoutSec = 120;
  cfg.channelMinBytes = 4096;
  cfg.ibQpsPerConn = qps;
  cfg.buffSize = 256 << 10;
  testing_util::runRanks(n, cfg, "verbs", body, [](int r, Config& c) { c.hostId = "verbs-host-" + std::to_string(r); });
}

class Verbs : public testing::TestWithParam<std::pair<int, int>> {};

TEST_P(Verbs, EveryCollectiveIsBitExact) {
  auto devs = devices(Config::defaults());
  SKIP_WITHOUT_RDMA(devs);
  auto [n, qps] = GetParam();
  size_t channels = devs.size() * static_cast<size_t>(qps);
  runOverVerbs(n, qps, [n, channels](Communicator& c) {
    // Queue pairs are made at first use: before any op the link names no queue pair yet.
    EXPECT_NE(c.transportTo((c.rank() + 1) % n).find("at first use"), std::string::npos);
    testing_util::everyCollectiveIsBitExact(c, n, "verbs ");
    std::string desc = c.transportTo((c.rank() + 1) % n);
    EXPECT_EQ(desc.rfind("verbs ", 0), 0u) << desc;
    EXPECT_EQ(static_cast<size_t>(std::count(desc.begin(), desc.end(), ',')) + 1, channels) << desc;
  });
}

INSTANTIATE_TEST_SUITE_P(RanksAndQps, Verbs, testing::Values(std::make_pair(2, 1), std::make_pair(3, 2)),
                         [](const testing::TestParamInfo<std::pair<int, int>>& p) {
                           return "n" + std::to_string(p.param.first) + "_qps" + std::to_string(p.param.second);
                         });

TEST(VerbsInit, AGidIndexThePortLacksIsAClearInitError) {
  Config probe = Config::defaults();
  auto devs = devices(probe);
  SKIP_WITHOUT_RDMA(devs);
  if (!devs[0]->roce()) GTEST_SKIP() << "an InfiniBand port: GID indices are a RoCE matter";
  devs.clear();
  Config cfg = Config::defaults();
  cfg.net = "verbs";
  cfg.ibGidIndex = 37;
  cfg.initTimeoutSec = 10;
  std::vector<std::string> errs = testing_util::initErrors(2, cfg);
  for (auto& e : errs) {
    EXPECT_NE(e.find("has no GID at index 37"), std::string::npos) << e;
    EXPECT_NE(e.find("set it to 1"), std::string::npos) << e;
  }
}

}  // namespace

// Takes an interface down under a live connection: only where RAILCC_VM_TEST=1 says this is
// the throw-away Soft-RoCE VM (tests/vm), never on a real host.
TEST(VerbsLoopback, APortGoingDownIsALinkErrorNamingTheNicWithinTwoSeconds) {
  const char* vm = getenv("RAILCC_VM_TEST");
  if (vm == nullptr || std::string(vm) != "1") GTEST_SKIP() << "takes a link down: runs only in the Soft-RoCE VM";
  Config cfg = Config::defaults();
  auto devs = devices(cfg);
  SKIP_WITHOUT_RDMA(devs);
  std::shared_ptr<Device> dev;
  for (auto& d : devs)
    if (!d->netdev().empty()) dev = d;
  if (!dev) GTEST_SKIP() << "no RoCE port with an interface";
  VerbsConnection a(dev, 64 << 10, cfg, "rank 1 (host b)"), b(dev, 64 << 10, cfg, "rank 0 (host a)");
  a.connectTo(b.local());
  b.connectTo(a.local());
  ASSERT_EQ(system(("ip link set " + dev->netdev() + " down").c_str()), 0);
  auto t0 = std::chrono::steady_clock::now();
  std::string err;
  try {
    while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) {
      a.checkAlive();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPeerFailure);
    err = e.what();
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(system(("ip link set " + dev->netdev() + " up").c_str()), 0);
  EXPECT_NE(err.find("link error: " + dev->name() + " port 1 went down"), std::string::npos) << err;
  EXPECT_LT(secs, 2.0) << err;
  printf("port down reported after %.2f s: %s\n", secs, err.c_str());
}
