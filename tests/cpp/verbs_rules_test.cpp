// The verbs transport's pure rules (verbs_rules.h: RAILCC_IB_HCA, the GID choice, the
// GPUDirect decision, the memory a connection pins), on faked inputs. Built on every host,
// with or without rdma-core's header, like the rules themselves.
#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "transport/verbs/verbs_rules.h"

using namespace railcc;
using namespace railcc::transport::verbs;

namespace {

TEST(VerbsRules, HcaSpecsFollowNcclSyntax) {
  auto f = parseHcaSpec("mlx5_0:1,mlx5_1");
  EXPECT_TRUE(hcaMatches(f, "mlx5_0", 1));
  EXPECT_FALSE(hcaMatches(f, "mlx5_0", 2));
  EXPECT_TRUE(hcaMatches(f, "mlx5_1", 2));
  EXPECT_TRUE(hcaMatches(f, "mlx5_10", 1));  // a prefix
  EXPECT_FALSE(hcaMatches(f, "mlx5_2", 1));
  auto ex = parseHcaSpec("^mlx5_2");
  EXPECT_TRUE(hcaMatches(ex, "mlx5_0", 1));
  EXPECT_FALSE(hcaMatches(ex, "mlx5_2", 1));
  auto exact = parseHcaSpec("=mlx5_1");
  EXPECT_TRUE(hcaMatches(exact, "mlx5_1", 1));
  EXPECT_FALSE(hcaMatches(exact, "mlx5_10", 1));
  EXPECT_TRUE(hcaMatches(parseHcaSpec(""), "rxe0", 1));
}

GidEntry gid(int index, const char* text, int version, const char* netdev = "eth0") {
  GidEntry e;
  e.index = index;
  inet_pton(AF_INET6, text, e.raw);
  e.roceVersion = version;
  e.netdev = netdev;
  return e;
}

// A RoCE port as rxe and mlx5 show it: link-local v1/v2 first, then the IPv4-mapped ones.
std::vector<GidEntry> roceTable() {
  return {gid(0, "fe80::1", 1), gid(1, "fe80::1", 2), gid(2, "::ffff:10.1.0.5", 1), gid(3, "::ffff:10.1.0.5", 2),
          gid(4, "::ffff:192.168.7.5", 2, "eth1"), gid(5, "2001:db8::5", 2)};
}

TEST(VerbsRules, GidPickIsRoceV2Ipv4NotLinkLocal) {
  Config cfg = Config::defaults();
  std::string why;
  EXPECT_EQ(pickGid(roceTable(), cfg, "dev:1", &why), 3) << why;
  cfg.ibAddrRange = "192.168.0.0/16";
  EXPECT_EQ(pickGid(roceTable(), cfg, "dev:1", &why), 4) << why;
  cfg.ibAddrRange = "";
  cfg.ibRoceVersion = 1;
  EXPECT_EQ(pickGid(roceTable(), cfg, "dev:1", &why), 2) << why;
  cfg.ibRoceVersion = 2;
  cfg.ibAddrFamily = "AF_INET6";
  EXPECT_EQ(pickGid(roceTable(), cfg, "dev:1", &why), 5) << why;
}

TEST(VerbsRules, AForcedGidIndexWinsAndAMissingOneNamesTheRightOne) {
  Config cfg = Config::defaults();
  std::string why;
  cfg.ibGidIndex = 1;
  EXPECT_EQ(pickGid(roceTable(), cfg, "dev:1", &why), 1);
  EXPECT_NE(why.find("link-local"), std::string::npos) << why;
  EXPECT_NE(why.find("index 3 would"), std::string::npos) << why;
  cfg.ibGidIndex = 9;
  EXPECT_EQ(pickGid(roceTable(), cfg, "rxe0 port 1", &why), -1);
  EXPECT_NE(why.find("rxe0 port 1 has no GID at index 9"), std::string::npos) << why;
  EXPECT_NE(why.find("set it to 3"), std::string::npos) << why;
  cfg.ibGidIndex = -1;
  std::vector<GidEntry> onlyLinkLocal = {gid(0, "fe80::1", 2)};
  EXPECT_EQ(pickGid(onlyLinkLocal, cfg, "rxe0 port 1", &why), -1);
  EXPECT_NE(why.find("ip addr add"), std::string::npos) << why;
}

TEST(VerbsRules, GpuDirectDecisionFollowsPathLevelAndCapabilities) {
  GdrFacts f{"GPU 0", "mlx5_0", "PIX", "PXB", true, true};
  EXPECT_EQ(decideGdr(f).mode, GdrMode::kDmabuf);
  EXPECT_EQ(decideGdr(f).line, "GPUDirect RDMA enabled for GPU 0 <-> mlx5_0 (dma-buf, path PIX)");
  f.dmabuf = false;
  EXPECT_EQ(decideGdr(f).mode, GdrMode::kPeermem);
  f.peermem = false;
  EXPECT_EQ(decideGdr(f).mode, GdrMode::kStaged);
  EXPECT_EQ(decideGdr(f).line,
            "GPUDirect RDMA disabled for GPU 0 <-> mlx5_0: nvidia_peermem not loaded and dma-buf unsupported: staging "
            "through host memory");
  GdrFacts far{"GPU 3", "mlx5_1", "SYS", "PXB", true, true};
  EXPECT_EQ(decideGdr(far).mode, GdrMode::kStaged);
  EXPECT_NE(decideGdr(far).line.find("path is SYS, beyond"), std::string::npos);
  far.level = "SYS";
  EXPECT_EQ(decideGdr(far).mode, GdrMode::kDmabuf);
  far.level = "5";  // NCCL's old numbers
  EXPECT_EQ(decideGdr(far).mode, GdrMode::kDmabuf);
  far.level = "1";
  EXPECT_EQ(decideGdr(far).mode, GdrMode::kStaged);
  GdrFacts unknown{"GPU 0", "mlx5_0", "", "PXB", true, true};
  EXPECT_NE(decideGdr(unknown).line.find("unknown"), std::string::npos);
  EXPECT_FALSE(decideGdr(unknown).withinLevel);
  far.level = "SYS";
  f.peermem = f.dmabuf = false;
  EXPECT_TRUE(decideGdr(far).withinLevel);
  EXPECT_TRUE(decideGdr(f).withinLevel);  // in reach, staged for want of peermem and dma-buf
}

TEST(VerbsRules, RingAndPinnedBytesFollowBuffsizeUpTo512MiB) {
  EXPECT_EQ(ringBytes(4 << 20), size_t(4) << 20);
  EXPECT_EQ(ringBytes(int64_t(1) << 29), size_t(1) << 29);
  EXPECT_EQ(ringBytes(int64_t(64) << 30), size_t(1) << 29);
  EXPECT_EQ(connectionPinnedBytes(4 << 20), size_t(8) << 20);
  EXPECT_EQ(connectionPinnedBytes(int64_t(1) << 30), size_t(1) << 30);
}

}  // namespace
