#include "topology/topology.h"

#include <hwloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "common/error.h"

namespace railcc::topology {

const char* pathName(Path p) {
  switch (p) {
    case Path::kLOC: return "LOC";
    case Path::kPIX: return "PIX";
    case Path::kPXB: return "PXB";
    case Path::kPHB: return "PHB";
    case Path::kSYS: return "SYS";
  }
  return "?";
}

Path parsePath(const std::string& s) {
  std::string u;
  for (char c : s)
    if (!std::isspace(static_cast<unsigned char>(c))) u += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  // NCCL_NET_GDR_LEVEL's numbers: 0 LOC, 1 PIX, 2 PXB, 3 PHB, 4 and 5 SYS.
  static const char* kNumbers[] = {"LOC", "PIX", "PXB", "PHB", "SYS", "SYS"};
  if (u.size() == 1 && u[0] >= '0' && u[0] <= '5') u = kNumbers[u[0] - '0'];
  for (Path p : {Path::kLOC, Path::kPIX, Path::kPXB, Path::kPHB, Path::kSYS})
    if (u == pathName(p)) return p;
  RAILCC_THROW(kInvalidUsage, "path type '", s, "': expected one of LOC, PIX, PXB, PHB, SYS or 0..5");
}

std::string normalizeBusId(const std::string& id) {
  std::string s;
  for (char c : id) s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  unsigned dom = 0, bus = 0, dev = 0, fn = 0;
  if (std::sscanf(s.c_str(), "%x:%x:%x.%x", &dom, &bus, &dev, &fn) == 4) {
  } else if (std::sscanf(s.c_str(), "%x:%x.%x", &bus, &dev, &fn) == 3) {
    dom = 0;
  } else {
    return s;
  }
  char b[32];
  std::snprintf(b, sizeof(b), "%04x:%02x:%02x.%x", dom & 0xffff, bus, dev, fn);
  return b;
}

Path pathBetween(const PciDevice& a, const PciDevice& b) {
  if (a.busId == b.busId) return Path::kLOC;
  size_t common = 0;
  if (!a.root.empty() && a.root == b.root)
    while (common < a.chain.size() && common < b.chain.size() && a.chain[common] == b.chain[common]) ++common;
  if (common == 0) {
    // Different root ports: through the host bridge, and across sockets when the NUMA nodes differ.
    if (a.numa >= 0 && b.numa >= 0 && a.numa != b.numa) return Path::kSYS;
    if (a.numa < 0 && b.numa < 0 && a.root.empty() && b.root.empty()) return Path::kSYS;  // nothing known
    return Path::kPHB;
  }
  size_t below = std::max(a.chain.size(), b.chain.size()) - common;
  return below <= 1 ? Path::kPIX : Path::kPXB;
}

Path Topology::path(size_t g, size_t n) const {
  if (!gpus.at(g).found) return Path::kSYS;
  return pathBetween(gpus[g].pci, nics.at(n).pci);
}

std::vector<size_t> Topology::railNics() const {
  std::vector<size_t> rdma, net;
  for (size_t i = 0; i < nics.size(); ++i) (nics[i].rdma ? rdma : net).push_back(i);
  return rdma.empty() ? net : rdma;
}

namespace {

struct Hw {
  hwloc_topology_t t = nullptr;
  ~Hw() {
    if (t) hwloc_topology_destroy(t);
  }
};

std::string busIdOf(const hwloc_obj_attr_u::hwloc_pcidev_attr_s& p) {
  char b[32];
  std::snprintf(b, sizeof(b), "%04x:%02x:%02x.%x", static_cast<unsigned>(p.domain), static_cast<unsigned>(p.bus),
                static_cast<unsigned>(p.dev), static_cast<unsigned>(p.func));
  return b;
}

PciDevice describe(hwloc_topology_t t, hwloc_obj_t o) {
  PciDevice d;
  d.busId = busIdOf(o->attr->pcidev);
  d.linkGBs = o->attr->pcidev.linkspeed;
  // Up through the bridges: PCI-to-PCI ones make the chain; the host bridge names the root.
  for (hwloc_obj_t p = o->parent; p && p->type == HWLOC_OBJ_BRIDGE; p = p->parent) {
    if (p->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_PCI) {
      d.chain.insert(d.chain.begin(), busIdOf(p->attr->bridge.upstream.pci));
      continue;
    }
    char b[48];
    std::snprintf(b, sizeof(b), "%04x:[%02x-%02x]", static_cast<unsigned>(p->attr->bridge.downstream.pci.domain),
                  static_cast<unsigned>(p->attr->bridge.downstream.pci.secondary_bus),
                  static_cast<unsigned>(p->attr->bridge.downstream.pci.subordinate_bus));
    d.root = b;
    break;
  }
  hwloc_obj_t normal = hwloc_get_non_io_ancestor_obj(t, o);
  if (normal && normal->nodeset && hwloc_bitmap_weight(normal->nodeset) == 1) {
    // The node's logical number, not its OS number (they agree on Linux hosts).
    d.numa = hwloc_bitmap_first(normal->nodeset);
  }
  return d;
}

bool isNvidiaGpu(hwloc_obj_t o) {
  return o->attr->pcidev.vendor_id == 0x10de && (o->attr->pcidev.class_id >> 8) == 0x03;
}

}  // namespace

void checkTopologyFile(const std::string& path) {
  // A device or a FIFO would be read until memory runs out, or forever.
  constexpr off_t kMaxBytes = off_t(64) << 20;  // a 4,096-object machine's XML is a few MiB
  struct stat st {};
  if (stat(path.c_str(), &st) != 0)
    RAILCC_THROW(kInvalidUsage, "topology file ", path, " cannot be read: ", std::strerror(errno),
                 " (RAILCC_TOPO_FILE names an hwloc XML file, as lstopo --of xml writes)");
  if (!S_ISREG(st.st_mode))
    RAILCC_THROW(kInvalidUsage, "topology file ", path, " is not a regular file (a device, FIFO or directory); ",
                 "RAILCC_TOPO_FILE names an hwloc XML file, as lstopo --of xml writes");
  if (st.st_size > kMaxBytes)
    RAILCC_THROW(kInvalidUsage, "topology file ", path, " is ", st.st_size >> 20, " MiB, more than any hwloc XML of a ",
                 "machine (at most ", kMaxBytes >> 20, " MiB read)");
  if (access(path.c_str(), R_OK) != 0)
    RAILCC_THROW(kInvalidUsage, "topology file ", path, " cannot be read: ", std::strerror(errno));
}

Topology discover(const DiscoverOptions& opts) {
  Topology topo;
  Hw hw;
  if (hwloc_topology_init(&hw.t) != 0) RAILCC_THROW(kSystem, "hwloc_topology_init failed: ", std::strerror(errno));
  hwloc_topology_set_io_types_filter(hw.t, HWLOC_TYPE_FILTER_KEEP_ALL);
  if (!opts.xmlFile.empty()) {
    checkTopologyFile(opts.xmlFile);
    if (hwloc_topology_set_xml(hw.t, opts.xmlFile.c_str()) != 0)
      RAILCC_THROW(kInvalidUsage, "topology file ", opts.xmlFile, " is not hwloc XML: ", std::strerror(errno));
    topo.source = "file " + opts.xmlFile;
  } else {
    topo.source = std::string("this machine (hwloc ") + HWLOC_VERSION + ")";
  }
  if (hwloc_topology_load(hw.t) != 0)
    throw Error(opts.xmlFile.empty() ? ErrorCode::kSystem : ErrorCode::kInvalidUsage,
                "hwloc could not load " + topo.source + ": " + std::strerror(errno));
  hwloc_obj_t root = hwloc_get_root_obj(hw.t);
  if (const char* h = hwloc_obj_get_info_by_name(root, "HostName")) topo.hostname = h;
  topo.numaNodes = std::max(1, hwloc_get_nbobjs_by_type(hw.t, HWLOC_OBJ_NUMANODE));

  if (!opts.gpuBusIds.empty()) {
    for (const std::string& id : opts.gpuBusIds) {
      Gpu g;
      g.pci.busId = normalizeBusId(id);
      hwloc_obj_t o = hwloc_get_pcidev_by_busidstring(hw.t, g.pci.busId.c_str());
      if (o) g.pci = describe(hw.t, o);
      else g.found = false;
      topo.gpus.push_back(g);
    }
  } else {
    for (hwloc_obj_t o = hwloc_get_next_pcidev(hw.t, nullptr); o; o = hwloc_get_next_pcidev(hw.t, o))
      if (isNvidiaGpu(o)) topo.gpus.push_back({describe(hw.t, o), true});
  }

  // RDMA devices with the interfaces of their PCI function; then interfaces on their own.
  std::vector<Nic> rdma, net;
  for (hwloc_obj_t o = hwloc_get_next_osdev(hw.t, nullptr); o; o = hwloc_get_next_osdev(hw.t, o)) {
    hwloc_obj_t pci = o->parent;
    if (!pci || pci->type != HWLOC_OBJ_PCI_DEVICE || !o->name) continue;
    if (o->attr->osdev.type == HWLOC_OBJ_OSDEV_OPENFABRICS) {
      Nic n;
      n.name = o->name;
      n.rdma = true;
      n.pci = describe(hw.t, pci);
      for (hwloc_obj_t s = pci->io_first_child; s; s = s->next_sibling)
        if (s->type == HWLOC_OBJ_OS_DEVICE && s->attr->osdev.type == HWLOC_OBJ_OSDEV_NETWORK && s->name)
          n.netdevs.push_back(s->name);
      rdma.push_back(n);
    } else if (o->attr->osdev.type == HWLOC_OBJ_OSDEV_NETWORK) {
      bool ofed = false;  // an RDMA device's interface is listed with it (Nic::netdevs)
      for (hwloc_obj_t s = pci->io_first_child; s; s = s->next_sibling)
        ofed = ofed || (s->type == HWLOC_OBJ_OS_DEVICE && s->attr->osdev.type == HWLOC_OBJ_OSDEV_OPENFABRICS);
      if (ofed) continue;
      Nic n;
      n.name = o->name;
      n.netdevs = {o->name};
      n.pci = describe(hw.t, pci);
      net.push_back(n);
    }
  }
  auto byBus = [](const Nic& a, const Nic& b) { return a.pci.busId != b.pci.busId ? a.pci.busId < b.pci.busId : a.name < b.name; };
  std::sort(rdma.begin(), rdma.end(), byBus);
  std::sort(net.begin(), net.end(), byBus);
  topo.nics = rdma;
  topo.nics.insert(topo.nics.end(), net.begin(), net.end());

  char* buf = nullptr;
  int len = 0;
  if (hwloc_topology_export_xmlbuffer(hw.t, &buf, &len, 0) == 0 && buf) {
    topo.xml.assign(buf, static_cast<size_t>(std::max(len - 1, 0)));  // len counts the final NUL
    hwloc_free_xmlbuffer(hw.t, buf);
  }
  return topo;
}

}  // namespace railcc::topology
