// Topology discovery (hwloc) and rail assignment, against the XML machines in tests/data/topo
// (see make_topologies.py there) and against this machine.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <set>

#include "common/error.h"
#include "topology/rails.h"
#include "topology/topology.h"
#include "engine/rail_check.h"

using namespace railcc;
using namespace railcc::topology;

namespace {

std::string topoFile(const char* name) { return std::string(RAILCC_TEST_DATA) + "/topo/" + name; }

Topology load(const char* name, std::vector<std::string> gpus = {}) {
  DiscoverOptions o;
  o.xmlFile = topoFile(name);
  o.gpuBusIds = std::move(gpus);
  return discover(o);
}

std::vector<RankPlace> gpuRanks(int n) {
  std::vector<RankPlace> r(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) r[static_cast<size_t>(i)].gpu = i;
  return r;
}

TEST(Topology, DgxLikeBoxHasItsGpusNicsAndPaths) {
  Topology t = load("dgx_h100.xml");
  EXPECT_EQ(t.hostname, "dgx_h100");
  EXPECT_EQ(t.numaNodes, 2);
  ASSERT_EQ(t.gpus.size(), 8u);
  ASSERT_EQ(t.nics.size(), 8u);
  for (size_t n = 0; n < 8; ++n) {
    EXPECT_TRUE(t.nics[n].rdma);
    EXPECT_EQ(t.nics[n].name, "mlx5_" + std::to_string(n));
    ASSERT_EQ(t.nics[n].netdevs.size(), 1u);
    EXPECT_EQ(t.nics[n].netdevs[0], "ens" + std::to_string(n) + "np0");
    EXPECT_EQ(t.nics[n].pci.numa, static_cast<int>(n / 4));
  }
  // Switch k holds GPUs 2k, 2k+1 and NICs 2k, 2k+1; switches 0-1 on socket 0, 2-3 on socket 1.
  EXPECT_EQ(t.path(0, 0), Path::kPIX);
  EXPECT_EQ(t.path(1, 0), Path::kPIX);
  EXPECT_EQ(t.path(0, 2), Path::kPHB);  // the other switch of the same socket
  EXPECT_EQ(t.path(0, 4), Path::kSYS);
  EXPECT_EQ(t.path(7, 7), Path::kPIX);
  EXPECT_EQ(t.gpus[0].pci.chain.size(), 3u);  // root port, switch upstream, downstream port
  EXPECT_EQ(t.railNics().size(), 8u);
}

TEST(Topology, GpusSharingASwitchSpreadOverItsNics) {
  Topology t = load("dgx_h100.xml");
  auto a = assignRails(t, gpuRanks(8));
  ASSERT_EQ(a.size(), 8u);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(a[static_cast<size_t>(i)].nic, i) << a[static_cast<size_t>(i)].why;
    EXPECT_EQ(a[static_cast<size_t>(i)].rail, i);
    EXPECT_EQ(a[static_cast<size_t>(i)].path, Path::kPIX);
  }
  EXPECT_NE(a[3].why.find("mlx5_3 (rail 3, PIX)"), std::string::npos) << a[3].why;
  // Four ranks on GPUs 0, 2, 4, 6: each takes the first NIC of its own switch.
  std::vector<RankPlace> four{{0, -1}, {2, -1}, {4, -1}, {6, -1}};
  auto b = assignRails(t, four);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(b[i].nic, static_cast<int>(2 * i)) << b[i].why;
}

TEST(Topology, NicsOnOneSocketLeaveTheOtherSocketsGpusAcrossSockets) {
  Topology t = load("nics_on_socket1.xml");
  ASSERT_EQ(t.gpus.size(), 8u);
  ASSERT_EQ(t.nics.size(), 4u);
  for (size_t n = 0; n < 4; ++n) {
    EXPECT_EQ(t.nics[n].pci.numa, 1);
    for (size_t g = 0; g < 4; ++g) EXPECT_EQ(t.path(g, n), Path::kSYS);
  }
  EXPECT_EQ(t.path(4, 0), Path::kPIX);
  EXPECT_EQ(t.path(6, 2), Path::kPIX);
  EXPECT_EQ(t.path(4, 2), Path::kPHB);
  auto a = assignRails(t, gpuRanks(8));
  std::vector<int> uses(4, 0);
  for (auto& x : a) ++uses[static_cast<size_t>(x.nic)];
  EXPECT_EQ(uses, std::vector<int>({2, 2, 2, 2}));  // spread evenly, two ranks per NIC
  EXPECT_EQ(a[0].path, Path::kSYS);
  EXPECT_EQ(a[4].path, Path::kPIX);
  EXPECT_TRUE(a[4].nic == 0 || a[4].nic == 1) << a[4].why;
  EXPECT_TRUE(a[6].nic == 2 || a[6].nic == 3) << a[6].why;
}

TEST(Topology, FlatVmBusIsThroughTheHostBridge) {
  Topology t = load("vm_flat.xml");
  ASSERT_EQ(t.gpus.size(), 2u);
  ASSERT_EQ(t.nics.size(), 2u);  // two RDMA devices, each with its interface
  EXPECT_TRUE(t.nics[0].rdma);
  EXPECT_EQ(t.nics[1].netdevs, std::vector<std::string>({"eth2"}));
  EXPECT_EQ(t.railNics(), std::vector<size_t>({0, 1}));
  EXPECT_TRUE(t.gpus[0].pci.chain.empty());
  EXPECT_EQ(t.path(0, 0), Path::kPHB);
  auto a = assignRails(t, gpuRanks(2));
  EXPECT_EQ(a[0].nic, 0);
  EXPECT_EQ(a[1].nic, 1);
}

TEST(Topology, GpusNamedByTheRuntimeAndMissingFromTheTopologyAreSaidSo) {
  // CUDA writes the domain with 8 digits and upper case; hwloc has 4 and lower case.
  Topology t = load("dgx_h100.xml", {"00000000:35:00.0", "0000:99:00.0"});
  ASSERT_EQ(t.gpus.size(), 2u);
  EXPECT_TRUE(t.gpus[0].found);
  EXPECT_EQ(t.gpus[0].pci.busId, "0000:35:00.0");
  EXPECT_FALSE(t.gpus[1].found);
  EXPECT_EQ(t.path(1, 0), Path::kSYS);
  EXPECT_EQ(normalizeBusId("35:00.0"), "0000:35:00.0");
  EXPECT_EQ(normalizeBusId("0000:AB:00.1"), "0000:ab:00.1");
}

TEST(Topology, RanksWithoutGpusGoByNumaNode) {
  Topology t = load("dgx_h100.xml");
  std::vector<RankPlace> r{{-1, 1}, {-1, 1}, {-1, 0}};
  auto a = assignRails(t, r);
  EXPECT_EQ(a[0].nic, 4) << a[0].why;
  EXPECT_EQ(a[1].nic, 5) << a[1].why;
  EXPECT_EQ(a[2].nic, 0) << a[2].why;
  EXPECT_EQ(a[0].path, Path::kPHB);
  EXPECT_NE(a[0].why.find("NUMA node 1"), std::string::npos) << a[0].why;
}

TEST(Topology, DumpedXmlReadsBackTheSame) {
  Topology t = load("nics_on_socket1.xml");
  ASSERT_FALSE(t.xml.empty());
  std::string path = ::testing::TempDir() + "railcc-topo-dump.xml";
  std::ofstream(path) << t.xml;
  DiscoverOptions o;
  o.xmlFile = path;
  Topology u = discover(o);
  ASSERT_EQ(u.gpus.size(), t.gpus.size());
  ASSERT_EQ(u.nics.size(), t.nics.size());
  for (size_t g = 0; g < t.gpus.size(); ++g)
    for (size_t n = 0; n < t.nics.size(); ++n) EXPECT_EQ(u.path(g, n), t.path(g, n));
  std::remove(path.c_str());
}

TEST(Topology, BadFilesAndPathNamesAreClearErrors) {
  DiscoverOptions o;
  o.xmlFile = "/nonexistent/railcc-topo.xml";
  try {
    discover(o);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/railcc-topo.xml"), std::string::npos) << e.what();
  }
  std::string junk = ::testing::TempDir() + "railcc-topo-junk.xml";
  std::ofstream(junk) << "not xml at all";
  o.xmlFile = junk;
  EXPECT_THROW(discover(o), Error);
  std::remove(junk.c_str());
  EXPECT_EQ(parsePath("pxb"), Path::kPXB);
  EXPECT_EQ(parsePath("3"), Path::kPHB);
  EXPECT_EQ(parsePath("5"), Path::kSYS);
  EXPECT_THROW(parsePath("NVL"), Error);
}

TEST(Topology, ThisMachineLoads) {
  // No GPU and no RDMA device here: the topology still has NUMA nodes and, where the network
  // interfaces sit on PCI, those interfaces.
  Topology t = discover({});
  EXPECT_GE(t.numaNodes, 1);
  EXPECT_NE(t.source.find("this machine"), std::string::npos);
  for (const Nic& n : t.nics) EXPECT_FALSE(n.name.empty());
  auto a = assignRails(t, {RankPlace{}});
  ASSERT_EQ(a.size(), 1u);
  EXPECT_FALSE(a[0].why.empty());
}

}  // namespace

// ---------------------------------------------------------------- rank 0's check of the rails

TEST(RailCheck, HostsThatAgreeAreSaidToAndDisagreementsNameTheHosts) {
  using railcc::engine::checkRailLines;
  auto line = [](const std::string& host, int rank, const std::string& rails) {
    return "host=" + host + ";rank=" + std::to_string(rank) + ";nic=mlx5_0;rail=0;" + rails;
  };
  std::string two = "rails=2;0=eth0@10.77.0.0/24;1=eth1@10.78.0.0/24";
  auto ok = checkRailLines({line("a", 0, two), line("a", 1, two), line("b", 2, two), line("b", 3, two)});
  EXPECT_EQ(ok.hosts, 2);
  EXPECT_EQ(ok.rails, 2);
  EXPECT_TRUE(ok.problems.empty());
  EXPECT_EQ(ok.agreed, "rail 0 10.77.0.0/24, rail 1 10.78.0.0/24");

  auto fewer = checkRailLines({line("a", 0, two), line("b", 1, "rails=1;0=eth0@10.77.0.0/24")});
  ASSERT_EQ(fewer.problems.size(), 1u);
  EXPECT_NE(fewer.problems[0].find("1 on b; 2 on a"), std::string::npos) << fewer.problems[0];

  auto subnet = checkRailLines({line("a", 0, two), line("b", 1, "rails=2;0=eth0@10.77.0.0/24;1=ib1@10.99.0.0/24"),
                                line("c", 2, "rails=2;0=eth0@10.77.0.0/24;1=-")});
  ASSERT_EQ(subnet.problems.size(), 1u);
  const std::string& p = subnet.problems[0];
  EXPECT_NE(p.find("rail 1 is not one network"), std::string::npos) << p;
  EXPECT_NE(p.find("10.78.0.0/24 on a (eth1)"), std::string::npos) << p;
  EXPECT_NE(p.find("10.99.0.0/24 on b (ib1)"), std::string::npos) << p;
  EXPECT_NE(p.find("no IPv4 address on c (-)"), std::string::npos) << p;

  EXPECT_EQ(checkRailLines({line("a", 0, two)}).hosts, 1);  // one host: nothing to compare
  EXPECT_TRUE(checkRailLines({"junk", ""}).problems.empty());
}

// Rail lines come from other ranks' store records: a count no host can have is reported, not
// allocated for (rails=2000000000 once cost 20 s of CPU and then std::bad_alloc).
TEST(RailCheck, AHostileRailCountIsReportedNotAllocated) {
  using railcc::engine::checkRailLines;
  std::string two = "host=a;rank=0;nic=mlx5_0;rail=0;rails=2;0=eth0@10.77.0.0/24;1=eth1@10.78.0.0/24";
  for (const char* bad : {"2000000000", "99999999999999999999999", "-3", "zz", ""}) {
    auto c = checkRailLines({two, std::string("host=b;rank=1;nic=x;rail=0;rails=") + bad});
    ASSERT_EQ(c.problems.size(), 1u) << bad;
    EXPECT_NE(c.problems[0].find("host b published rails="), std::string::npos) << c.problems[0];
    EXPECT_EQ(c.hosts, 1) << bad;  // b is left out
  }
}
