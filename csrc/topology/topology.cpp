#include "topology/topology.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <functional>

#include "common/error.h"
#include "topology/hwloc_lib.h"

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
  const hw::Lib* lib = nullptr;
  hw::Topo t = nullptr;
  ~Hw() {
    if (t) lib->topologyDestroy(t);
  }
};

std::string busIdOf(const hw::PciAttr& p) {
  char b[32];
  std::snprintf(b, sizeof(b), "%04x:%02x:%02x.%x", static_cast<unsigned>(p.domain), static_cast<unsigned>(p.bus),
                static_cast<unsigned>(p.dev), static_cast<unsigned>(p.func));
  return b;
}

// Every object below `o` (normal, memory, I/O and misc children), depth first, as hwloc
// numbers them.
void walk(hw::Obj* o, const std::function<void(hw::Obj*)>& f) {
  f(o);
  for (hw::Obj* c = o->firstChild; c; c = c->nextSibling) walk(c, f);
  for (hw::Obj* c = o->memoryFirstChild; c; c = c->nextSibling) walk(c, f);
  for (hw::Obj* c = o->ioFirstChild; c; c = c->nextSibling) walk(c, f);
  for (hw::Obj* c = o->miscFirstChild; c; c = c->nextSibling) walk(c, f);
}

const char* infoByName(const hw::Obj* o, const char* name) {
  for (unsigned i = 0; i < o->infosCount; ++i)
    if (o->infos[i].name && std::strcmp(o->infos[i].name, name) == 0) return o->infos[i].value;
  return nullptr;
}

PciDevice describe(const hw::Lib& lib, hw::Obj* o) {
  PciDevice d;
  d.busId = busIdOf(o->attr->pcidev);
  d.linkGBs = o->attr->pcidev.linkSpeed;
  // Up through the bridges: PCI-to-PCI ones make the chain; the host bridge names the root.
  for (hw::Obj* p = o->parent; p && p->type == hw::kObjBridge; p = p->parent) {
    const hw::BridgeAttr& b = p->attr->bridge;
    if (b.upstreamType == hw::kBridgePci) {
      d.chain.insert(d.chain.begin(), busIdOf(b.upstream.pci));
      continue;
    }
    char r[48];
    std::snprintf(r, sizeof(r), "%04x:[%02x-%02x]", static_cast<unsigned>(b.downstream.pci.domain),
                  static_cast<unsigned>(b.downstream.pci.secondaryBus),
                  static_cast<unsigned>(b.downstream.pci.subordinateBus));
    d.root = r;
    break;
  }
  // The first ancestor with a CPU set is the normal object the device hangs from.
  hw::Obj* normal = o->parent;
  while (normal && !normal->cpuset) normal = normal->parent;
  if (normal && normal->nodeset && lib.bitmapWeight(normal->nodeset) == 1) {
    // The node's logical number, not its OS number (they agree on Linux hosts).
    d.numa = lib.bitmapFirst(normal->nodeset);
  }
  return d;
}

bool isNvidiaGpu(const hw::Obj* o) {
  return o->attr->pcidev.vendorId == 0x10de && (o->attr->pcidev.classId >> 8) == 0x03;
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
  std::string libName = opts.hwlocLib;
  if (libName.empty())
    if (const char* e = std::getenv("RAILCC_HWLOC_LIB")) libName = e;
  std::string why;
  const hw::Lib* lib = opts.sysfs ? nullptr : hw::hwlocLib(libName, &why);
  if (!opts.xmlFile.empty()) {
    checkTopologyFile(opts.xmlFile);
    if (!lib) RAILCC_THROW(kInvalidUsage, "topology file ", opts.xmlFile, " needs hwloc to be read: ", why);
  } else if (!lib) {
    return discoverSysfs(opts, opts.sysfs ? "asked for" : "hwloc not loaded: " + why);
  }
  Topology topo;
  Hw hw;
  hw.lib = lib;
  if (lib->topologyInit(&hw.t) != 0) {
    hw.t = nullptr;
    RAILCC_THROW(kSystem, "hwloc_topology_init failed: ", std::strerror(errno));
  }
  lib->setIoTypesFilter(hw.t, hw::kTypeFilterKeepAll);
  if (!opts.xmlFile.empty()) {
    if (lib->setXml(hw.t, opts.xmlFile.c_str()) != 0)
      RAILCC_THROW(kInvalidUsage, "topology file ", opts.xmlFile, " is not hwloc XML: ", std::strerror(errno));
    topo.method = "file";
    topo.source = "file " + opts.xmlFile;
  } else {
    topo.method = "hwloc";
    topo.source = "this machine (hwloc " + lib->version() + ", " + lib->path + ")";
  }
  if (lib->topologyLoad(hw.t) != 0)
    throw Error(opts.xmlFile.empty() ? ErrorCode::kSystem : ErrorCode::kInvalidUsage,
                "hwloc could not load " + topo.source + ": " + std::strerror(errno));
  hw::Obj* root = lib->objByDepth(hw.t, 0, 0);
  if (!root) RAILCC_THROW(kSystem, "hwloc loaded ", topo.source, " without a root object");
  if (const char* h = infoByName(root, "HostName")) topo.hostname = h;
  std::vector<hw::Obj*> pcidevs, osdevs;
  int numa = 0;
  walk(root, [&](hw::Obj* o) {
    if (o->type == hw::kObjPciDevice) pcidevs.push_back(o);
    else if (o->type == hw::kObjOsDevice) osdevs.push_back(o);
    else if (o->type == hw::kObjNumaNode) ++numa;
  });
  topo.numaNodes = std::max(1, numa);

  if (!opts.gpuBusIds.empty()) {
    for (const std::string& id : opts.gpuBusIds) {
      Gpu g;
      g.pci.busId = normalizeBusId(id);
      auto it = std::find_if(pcidevs.begin(), pcidevs.end(),
                             [&](hw::Obj* o) { return busIdOf(o->attr->pcidev) == g.pci.busId; });
      if (it != pcidevs.end()) g.pci = describe(*lib, *it);
      else g.found = false;
      topo.gpus.push_back(g);
    }
  } else {
    for (hw::Obj* o : pcidevs)
      if (isNvidiaGpu(o)) topo.gpus.push_back({describe(*lib, o), true});
    std::sort(topo.gpus.begin(), topo.gpus.end(), [](const Gpu& a, const Gpu& b) { return a.pci.busId < b.pci.busId; });
  }

  // RDMA devices with the interfaces of their PCI function; then interfaces on their own.
  std::vector<Nic> rdma, net;
  for (hw::Obj* o : osdevs) {
    hw::Obj* pci = o->parent;
    if (!pci || pci->type != hw::kObjPciDevice || !o->name) continue;
    if (o->attr->osdev.type == hw::kOsDevOpenFabrics) {
      Nic n;
      n.name = o->name;
      n.rdma = true;
      n.pci = describe(*lib, pci);
      for (hw::Obj* s = pci->ioFirstChild; s; s = s->nextSibling)
        if (s->type == hw::kObjOsDevice && s->attr->osdev.type == hw::kOsDevNetwork && s->name)
          n.netdevs.push_back(s->name);
      rdma.push_back(n);
    } else if (o->attr->osdev.type == hw::kOsDevNetwork) {
      bool ofed = false;  // an RDMA device's interface is listed with it (Nic::netdevs)
      for (hw::Obj* s = pci->ioFirstChild; s; s = s->nextSibling)
        ofed = ofed || (s->type == hw::kObjOsDevice && s->attr->osdev.type == hw::kOsDevOpenFabrics);
      if (ofed) continue;
      Nic n;
      n.name = o->name;
      n.netdevs = {o->name};
      n.pci = describe(*lib, pci);
      net.push_back(n);
    }
  }
  sortNics(rdma, net, topo);

  char* buf = nullptr;
  int len = 0;
  if (lib->exportXmlBuffer(hw.t, &buf, &len, 0) == 0 && buf) {
    topo.xml.assign(buf, static_cast<size_t>(std::max(len - 1, 0)));  // len counts the final NUL
    lib->freeXmlBuffer(hw.t, buf);
  }
  return topo;
}

void sortNics(std::vector<Nic> rdma, std::vector<Nic> net, Topology& topo) {
  auto byBus = [](const Nic& a, const Nic& b) { return a.pci.busId != b.pci.busId ? a.pci.busId < b.pci.busId : a.name < b.name; };
  std::sort(rdma.begin(), rdma.end(), byBus);
  std::sort(net.begin(), net.end(), byBus);
  topo.nics = std::move(rdma);
  topo.nics.insert(topo.nics.end(), net.begin(), net.end());
}

}  // namespace railcc::topology
