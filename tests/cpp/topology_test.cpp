// Topology discovery (hwloc) and rail assignment, against the XML machines in tests/data/topo
// (see make_topologies.py there) and against this machine.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>

#include "common/error.h"
#include "topology/rails.h"
#include "topology/topology.h"
#include "engine/rail_check.h"
#include "engine/store.h"

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

// The compact form the processes after the first read instead of loading hwloc: everything
// railcc uses of a topology comes back, and nothing that is not one is taken for one.
TEST(Topology, CompactFormReadsBackTheSame) {
  for (const char* name : {"dgx_h100.xml", "nics_on_socket1.xml", "vm_flat.xml"}) {
    Topology t = load(name);
    const std::string text = encodeCompact(t);
    ASSERT_FALSE(text.empty()) << name;
    Topology u;
    ASSERT_TRUE(decodeCompact(text, u)) << name;
    EXPECT_EQ(u.numaNodes, t.numaNodes) << name;
    EXPECT_EQ(u.xml, t.xml) << name;
    ASSERT_EQ(u.gpus.size(), t.gpus.size()) << name;
    ASSERT_EQ(u.nics.size(), t.nics.size()) << name;
    for (size_t g = 0; g < t.gpus.size(); ++g) {
      EXPECT_EQ(u.gpus[g].found, t.gpus[g].found);
      EXPECT_EQ(u.gpus[g].pci.busId, t.gpus[g].pci.busId);
      EXPECT_EQ(u.gpus[g].pci.numa, t.gpus[g].pci.numa);
      EXPECT_EQ(u.gpus[g].pci.linkGBs, t.gpus[g].pci.linkGBs);
      EXPECT_EQ(u.gpus[g].pci.chain, t.gpus[g].pci.chain);
      EXPECT_EQ(u.gpus[g].pci.root, t.gpus[g].pci.root);
    }
    for (size_t n = 0; n < t.nics.size(); ++n) {
      EXPECT_EQ(u.nics[n].name, t.nics[n].name);
      EXPECT_EQ(u.nics[n].rdma, t.nics[n].rdma);
      EXPECT_EQ(u.nics[n].netdevs, t.nics[n].netdevs);
      EXPECT_EQ(u.nics[n].pci.busId, t.nics[n].pci.busId);
      EXPECT_EQ(u.nics[n].pci.chain, t.nics[n].pci.chain);
    }
    for (size_t g = 0; g < t.gpus.size(); ++g)
      for (size_t n = 0; n < t.nics.size(); ++n) EXPECT_EQ(u.path(g, n), t.path(g, n)) << name;
    EXPECT_EQ(u.railNics(), t.railNics()) << name;
    // Cut short, a field too many, another version, an XML longer than said: refused.
    Topology v;
    EXPECT_FALSE(decodeCompact(text.substr(0, text.size() / 2), v)) << name;
    EXPECT_FALSE(decodeCompact(text + "x", v)) << name;
    EXPECT_FALSE(decodeCompact("railcc-topology 2" + text.substr(text.find('\n')), v)) << name;
    std::string extra = text;
    extra.insert(extra.find("\nnuma ") + 1, "gpu 1 0000:01:00.0 0 16 - - surplus\n");
    EXPECT_FALSE(decodeCompact(extra, v)) << name;
  }
  Topology v;
  EXPECT_FALSE(decodeCompact("", v));
  EXPECT_FALSE(decodeCompact("<?xml version=\"1.0\"?>", v));
  // A name a line could not hold is not written at all.
  Topology odd = load("vm_flat.xml");
  ASSERT_FALSE(odd.nics.empty());
  odd.nics[0].name = "eth 0";
  EXPECT_EQ(encodeCompact(odd), "");
  odd.nics[0].name = "";
  EXPECT_EQ(encodeCompact(odd), "");
  odd.nics[0].name = "eth0";
  odd.nics[0].netdevs = {"eth0", ""};
  EXPECT_EQ(encodeCompact(odd), "");
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

// Rank 0 makes the check on its watchdog thread once the other hosts' endpoints exist: each
// step is one look that never waits (the watchdog paces them), and a check still missing a
// host's line at set-up's deadline is given up (said at INFO), never an error.
TEST(RailCheck, MadeLaterLooksWithoutWaitingAndGivesUpAtItsDeadline) {
  using namespace railcc::engine;
  using Ms = std::chrono::milliseconds;
  const auto now = [] { return std::chrono::steady_clock::now(); };
  const std::string two = "rails=2;0=eth0@10.77.0.0/24;1=eth1@10.78.0.0/24";
  MemoryStore store;
  RailCheckLater r;
  r.group = "g";
  r.lines = {"host=a;rank=0;nic=mlx5_0;rail=0;" + two};
  r.keys = {"ep/1", "ep/2"};
  r.giveUp = now() + std::chrono::seconds(60);
  auto t0 = now();
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(railCheckStep(store, r));  // nothing there yet
  EXPECT_LT(now() - t0, Ms(1000));  // looks, not waits (each a 60 s wait otherwise)
  store.set("ep/1", "socket 1 10.0.0.2:5000\nrails 0 host=b;rank=1;nic=mlx5_0;rail=0;" + two + "\n");
  EXPECT_FALSE(railCheckStep(store, r));  // one host's line still missing
  store.set("ep/2", "rails 0 host=c;rank=2;nic=mlx5_0;rail=0;" + two + "\n");
  EXPECT_TRUE(railCheckStep(store, r));
  ASSERT_EQ(r.lines.size(), 3u);
  EXPECT_EQ(checkRailLines(r.lines).hosts, 3);
  EXPECT_TRUE(checkRailLines(r.lines).problems.empty());

  RailCheckLater late;  // past its deadline: given up at the first miss
  late.group = "g";
  late.keys = {"ep/9"};
  late.giveUp = now();
  EXPECT_TRUE(railCheckStep(store, late));
  EXPECT_EQ(late.lines.size(), 0u);
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

namespace {

// Where discoverShared keeps a machine's share in `dir`, less the extension.
std::string shareBase(const std::string& dir) {
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(boot, id);
  return dir + "/railcc-topo-" + std::to_string(getuid()) + "-" + id;
}

// Without hwloc (the GPU images may lack it) the topology comes from sysfs, and says so.
// discoverShared: the second process of a machine reads the first one's compact file (the
// XML where GPUs are named, or the compact file is unusable); files that are neither, or
// too old, are discovered anew; 0 s shares nothing.
TEST(Topology, ProcessesOfOneMachineShareOneDiscovery) {
  char tmpl[] = "/tmp/railcc-topo-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  DiscoverOptions o;
  Topology first = discoverShared(o, dir, 60);
  if (first.method != "hwloc") {
    GTEST_SKIP() << "hwloc does not load here: " << first.source;
  }
  EXPECT_EQ(first.source.find("shared"), std::string::npos) << first.source;
  const std::string base = shareBase(dir);
  const std::string xmlPath = base + ".xml", compactPath = base + ".txt";
  struct stat st {};
  for (const std::string& path : {xmlPath, compactPath}) {
    ASSERT_EQ(stat(path.c_str(), &st), 0) << path;
    EXPECT_EQ(st.st_mode & 0777, 0600u) << path;
  }
  auto sameAsFirst = [&](const Topology& t) {
    EXPECT_EQ(t.method, "hwloc");
    EXPECT_EQ(t.numaNodes, first.numaNodes);
    ASSERT_EQ(t.nics.size(), first.nics.size());
    for (size_t i = 0; i < first.nics.size(); ++i) {
      EXPECT_EQ(t.nics[i].name, first.nics[i].name);
      EXPECT_EQ(t.nics[i].pci.busId, first.nics[i].pci.busId);
    }
    EXPECT_EQ(t.gpus.size(), first.gpus.size());
  };

  // The next process reads the compact file (no hwloc); one that names GPUs, the XML.
  Topology second = discoverShared(o, dir, 60);
  EXPECT_NE(second.source.find("shared through " + compactPath), std::string::npos) << second.source;
  sameAsFirst(second);
  EXPECT_EQ(second.xml, first.xml);  // what RAILCC_TOPO_DUMP_FILE writes
  DiscoverOptions named;
  named.gpuBusIds = {"0000:99:00.0"};
  Topology withGpus = discoverShared(named, dir, 60);
  EXPECT_NE(withGpus.source.find("shared through " + xmlPath), std::string::npos) << withGpus.source;
  ASSERT_EQ(withGpus.gpus.size(), 1u);
  EXPECT_FALSE(withGpus.gpus[0].found);

  {  // a compact file that does not parse: the XML instead
    std::ofstream junk(compactPath, std::ios::trunc);
    junk << "railcc-topology 1\nnuma x\n";
  }
  Topology third = discoverShared(o, dir, 60);
  EXPECT_NE(third.source.find("shared through " + xmlPath), std::string::npos) << third.source;
  sameAsFirst(third);
  {  // and neither usable: discovered anew, and both files replaced by ones that are
    std::ofstream junk(xmlPath, std::ios::trunc);
    junk << "not hwloc xml";
  }
  Topology fourth = discoverShared(o, dir, 60);
  EXPECT_EQ(fourth.source.find("shared"), std::string::npos) << fourth.source;
  EXPECT_NE(discoverShared(o, dir, 60).source.find("shared through " + compactPath), std::string::npos);

  // Older than the limit: discovered anew.
  timespec old[2] = {{time(nullptr) - 120, 0}, {time(nullptr) - 120, 0}};
  ASSERT_EQ(utimensat(AT_FDCWD, xmlPath.c_str(), old, 0), 0);
  ASSERT_EQ(utimensat(AT_FDCWD, compactPath.c_str(), old, 0), 0);
  EXPECT_EQ(discoverShared(o, dir, 60).source.find("shared"), std::string::npos);

  // 0 s: nothing shared, nothing written.
  std::remove(xmlPath.c_str());
  std::remove(compactPath.c_str());
  EXPECT_EQ(discoverShared(o, dir, 0).source.find("shared"), std::string::npos);
  EXPECT_NE(stat(xmlPath.c_str(), &st), 0);
  EXPECT_NE(stat(compactPath.c_str(), &st), 0);

  EXPECT_EQ(std::system(("rm -rf '" + dir + "'").c_str()), 0);
}

// discoverSharedNow (set-up's early read of the topology): while another process holds the
// machine's lock it is discovering, so the call returns false at once with nothing written, and
// later calls wait for nobody; once the lock is free it discovers (and shares) or reads the share.
TEST(Topology, AnEarlyReadLeavesTheDiscoveryToTheProcessAtIt) {
  char tmpl[] = "/tmp/railcc-topo-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string base = shareBase(dir);
  int held = ::open((base + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(held, 0);
  ASSERT_EQ(::flock(held, LOCK_EX | LOCK_NB), 0);  // "another process" (its own open file)
  DiscoverOptions o;
  Topology t;
  t.hostname = "untouched";
  EXPECT_FALSE(discoverSharedNow(o, dir, 60, t));
  EXPECT_EQ(t.hostname, "untouched");
  struct stat st {};
  EXPECT_NE(stat((base + ".txt").c_str(), &st), 0);
  ::flock(held, LOCK_UN);
  ::close(held);

  Topology first;
  ASSERT_TRUE(discoverSharedNow(o, dir, 60, first));
  if (first.method != "hwloc") {
    EXPECT_EQ(std::system(("rm -rf '" + dir + "'").c_str()), 0);
    GTEST_SKIP() << "hwloc does not load here: " << first.source;
  }
  EXPECT_EQ(first.source.find("shared"), std::string::npos) << first.source;
  Topology second;
  ASSERT_TRUE(discoverSharedNow(o, dir, 60, second));
  EXPECT_NE(second.source.find("shared through " + base + ".txt"), std::string::npos) << second.source;
  EXPECT_EQ(second.nics.size(), first.nics.size());
  EXPECT_EQ(std::system(("rm -rf '" + dir + "'").c_str()), 0);
}

TEST(Topology, SysfsGivesThisMachineAsHwlocDoes) {
  Topology viaHwloc = discover({});
  DiscoverOptions o;
  o.sysfs = true;
  Topology viaSysfs = discover(o);
  EXPECT_EQ(viaHwloc.method, "hwloc");
  EXPECT_EQ(viaSysfs.method, "sysfs");
  EXPECT_NE(viaSysfs.source.find("this machine (sysfs"), std::string::npos) << viaSysfs.source;
  EXPECT_TRUE(viaSysfs.xml.empty());
  EXPECT_EQ(viaSysfs.numaNodes, viaHwloc.numaNodes);
  EXPECT_EQ(viaSysfs.gpus.size(), viaHwloc.gpus.size());
  ASSERT_EQ(viaSysfs.nics.size(), viaHwloc.nics.size());
  for (size_t i = 0; i < viaHwloc.nics.size(); ++i) {
    const Nic &a = viaHwloc.nics[i], &b = viaSysfs.nics[i];
    EXPECT_EQ(b.name, a.name);
    EXPECT_EQ(b.rdma, a.rdma);
    EXPECT_EQ(b.netdevs, a.netdevs);
    EXPECT_EQ(b.pci.busId, a.pci.busId);
    EXPECT_EQ(b.pci.chain, a.pci.chain);
    EXPECT_EQ(b.pci.numa, a.pci.numa);
  }
}

TEST(Topology, HwlocThatCannotBeLoadedFallsBackToSysfsAndSaysWhy) {
  DiscoverOptions o;
  o.hwlocLib = "/nonexistent/libhwloc.so.15";
  Topology t = discover(o);
  EXPECT_EQ(t.method, "sysfs");
  EXPECT_NE(t.source.find("hwloc not loaded: cannot load /nonexistent/libhwloc.so.15"), std::string::npos) << t.source;
  // An XML file needs hwloc: a clear error rather than an empty machine.
  o.xmlFile = topoFile("dgx_h100.xml");
  try {
    discover(o);
    FAIL() << "an XML file was read without hwloc";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
    EXPECT_NE(std::string(e.what()).find("needs hwloc"), std::string::npos) << e.what();
  }
}

// A fake sysfs: one GPU and a ConnectX behind one PCIe switch on socket 0, a second GPU on
// socket 1, and a virtio interface on the root bus.
class FakeSysfs : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/railcc-sysfs-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root = tmpl;
  }
  void TearDown() override { EXPECT_EQ(std::system(("rm -rf " + root).c_str()), 0); }
  void mkdirs(const std::string& rel) {
    for (size_t j = rel.find('/');; j = rel.find('/', j + 1)) {
      mkdir((root + "/" + rel.substr(0, j)).c_str(), 0755);
      if (j == std::string::npos) break;
    }
  }
  void file(const std::string& rel, const std::string& text) { std::ofstream(root + "/" + rel) << text << "\n"; }
  void link(const std::string& rel, const std::string& target) {
    ASSERT_EQ(symlink((root + "/" + target).c_str(), (root + "/" + rel).c_str()), 0) << rel;
  }
  // A PCI function at `path` below sys/devices, listed in sys/bus/pci/devices.
  void pci(const std::string& path, const char* vendor, const char* cls, int numa, const char* speed = nullptr) {
    std::string dir = "sys/devices/" + path;
    mkdirs(dir);
    file(dir + "/vendor", vendor);
    file(dir + "/class", cls);
    file(dir + "/numa_node", std::to_string(numa));
    if (speed) file(dir + "/current_link_speed", speed), file(dir + "/current_link_width", "16");
    link("sys/bus/pci/devices/" + path.substr(path.rfind('/') + 1), dir);
  }
  std::string root;
};

TEST_F(FakeSysfs, GpusNicsAndPathsComeFromTheDeviceTree) {
  mkdirs("sys/bus/pci/devices");
  mkdirs("sys/class/net");
  mkdirs("sys/class/infiniband");
  mkdirs("sys/devices/system/node/node0");
  mkdirs("sys/devices/system/node/node1");
  const std::string sw = "pci0000:00/0000:00:01.0/0000:01:00.0";
  pci("pci0000:00/0000:00:01.0", "0x8086", "0x060400", 0);
  pci(sw, "0x10b5", "0x060400", 0);
  pci(sw + "/0000:02:00.0", "0x10b5", "0x060400", 0);
  pci(sw + "/0000:02:01.0", "0x10b5", "0x060400", 0);
  pci(sw + "/0000:02:00.0/0000:03:00.0", "0x10de", "0x030200", 0, "32.0 GT/s PCIe");
  pci(sw + "/0000:02:01.0/0000:04:00.0", "0x15b3", "0x020700", 0, "16.0 GT/s PCIe");
  pci("pci0000:80/0000:80:01.0/0000:81:00.0", "0x10de", "0x030200", 1);
  pci("pci0000:00/0000:00:03.0", "0x1af4", "0x020000", -1);
  mkdirs("sys/devices/pci0000:00/0000:00:03.0/virtio2/net/eth0");
  link("sys/class/net/eth0", "sys/devices/pci0000:00/0000:00:03.0/virtio2/net/eth0");
  link("sys/devices/pci0000:00/0000:00:03.0/virtio2/net/eth0/device", "sys/devices/pci0000:00/0000:00:03.0/virtio2");
  const std::string nic = "sys/devices/" + sw + "/0000:02:01.0/0000:04:00.0";
  mkdirs(nic + "/net/ib0");
  mkdirs(nic + "/infiniband/mlx5_0");
  link("sys/class/net/ib0", nic + "/net/ib0");
  link(nic + "/net/ib0/device", nic);
  link("sys/class/infiniband/mlx5_0", nic + "/infiniband/mlx5_0");
  link(nic + "/infiniband/mlx5_0/device", nic);
  mkdirs("sys/devices/virtual/net/lo");
  link("sys/class/net/lo", "sys/devices/virtual/net/lo");

  DiscoverOptions o;
  o.sysfs = true;
  o.sysfsRoot = root;
  Topology t = discover(o);
  EXPECT_EQ(t.method, "sysfs");
  EXPECT_NE(t.source.find(root), std::string::npos) << t.source;
  EXPECT_EQ(t.numaNodes, 2);
  ASSERT_EQ(t.gpus.size(), 2u);
  EXPECT_EQ(t.gpus[0].pci.busId, "0000:03:00.0");
  EXPECT_EQ(t.gpus[0].pci.chain, (std::vector<std::string>{"0000:00:01.0", "0000:01:00.0", "0000:02:00.0"}));
  EXPECT_EQ(t.gpus[0].pci.root, "pci0000:00");
  EXPECT_NEAR(t.gpus[0].pci.linkGBs, 63.0, 0.1);
  EXPECT_EQ(t.gpus[1].pci.numa, 1);
  ASSERT_EQ(t.nics.size(), 2u);
  EXPECT_EQ(t.nics[0].name, "mlx5_0");
  EXPECT_TRUE(t.nics[0].rdma);
  EXPECT_EQ(t.nics[0].netdevs, std::vector<std::string>{"ib0"});
  EXPECT_EQ(t.nics[1].name, "eth0");
  EXPECT_EQ(t.nics[1].pci.busId, "0000:00:03.0");
  EXPECT_EQ(t.nics[1].pci.numa, -1);  // two nodes and no numa_node: unknown, as hwloc says
  EXPECT_EQ(t.path(0, 0), Path::kPIX);
  EXPECT_EQ(t.path(1, 0), Path::kSYS);
  EXPECT_EQ(t.path(0, 1), Path::kPHB);
  // The runtime's bus ids, in its order; one the tree lacks is said to be missing.
  o.gpuBusIds = {"00000000:81:00.0", "0000:03:00.0", "0000:99:00.0"};
  t = discover(o);
  ASSERT_EQ(t.gpus.size(), 3u);
  EXPECT_EQ(t.gpus[0].pci.numa, 1);
  EXPECT_TRUE(t.gpus[1].found);
  EXPECT_FALSE(t.gpus[2].found);
  auto a = assignRails(t, gpuRanks(2));
  EXPECT_EQ(a[1].nic, 0);
}

}  // namespace
