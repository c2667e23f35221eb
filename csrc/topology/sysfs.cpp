// The topology from sysfs, for hosts where hwloc cannot be loaded: the same devices and PCI
// chains hwloc would give, from the kernel's device tree (/sys/devices/pciDDDD:BB/<port>/...,
// one path component per bridge) and each device's numa_node and link attributes.

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "topology/topology.h"

namespace railcc::topology {
namespace {

std::string readLine(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

std::vector<std::string> listDir(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') out.push_back(e->d_name);
    closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> split(const std::string& path) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < path.size()) {
    size_t slash = path.find('/', at);
    if (slash == std::string::npos) slash = path.size();
    if (slash > at) out.push_back(path.substr(at, slash - at));
    at = slash + 1;
  }
  return out;
}

bool isBusId(const std::string& s) {
  unsigned a, b, c, d;
  char tail;
  return s.size() == 12 && std::sscanf(s.c_str(), "%4x:%2x:%2x.%1x%c", &a, &b, &c, &d, &tail) == 4;
}

// The resolved path of a sysfs link as components ("sys", "devices", "pci0000:00", ...).
std::vector<std::string> resolved(const std::string& path) {
  char buf[PATH_MAX];
  if (!realpath(path.c_str(), buf)) return {};
  return split(buf);
}

// PCI function of a device whose resolved path is `parts`: the last bus id in it ("" if none).
std::string pciFunctionOf(const std::vector<std::string>& parts) {
  for (size_t i = parts.size(); i-- > 0;)
    if (isBusId(parts[i])) return parts[i];
  return "";
}

// GB/s of a link from "16.0 GT/s PCIe" and its width, as hwloc computes it.
double linkGBs(const std::string& speed, const std::string& width) {
  double gt = std::atof(speed.c_str()), lanes = std::atof(width.c_str());
  if (gt <= 0 || lanes <= 0) return 0;
  double encoding = gt <= 5.0 ? 8.0 / 10.0 : 128.0 / 130.0;  // PCIe 1-2: 8b/10b, 3 and later: 128b/130b
  return gt * lanes * encoding / 8.0;
}

struct Reader {
  std::string root;  // prefix of every path ("" for the machine)
  int numaNodes = 1;

  PciDevice describe(const std::string& busId) const {
    PciDevice d;
    d.busId = busId;
    const std::string dir = root + "/sys/bus/pci/devices/" + busId;
    std::vector<std::string> parts = resolved(dir);
    // .../devices/pci0000:00/0000:00:01.0/0000:01:00.0/<busId>: the host bridge, then bridges.
    size_t i = 0;
    while (i < parts.size() && parts[i].rfind("pci", 0) != 0) ++i;
    if (i < parts.size()) {
      d.root = parts[i];
      for (size_t j = i + 1; j < parts.size() && parts[j] != busId; ++j)
        if (isBusId(parts[j])) d.chain.push_back(parts[j]);
    }
    std::string numa = readLine(dir + "/numa_node");
    d.numa = numa.empty() ? -1 : std::atoi(numa.c_str());
    // hwloc hangs a device whose node is unknown from the machine: on one node, that node.
    if (d.numa < 0 && numaNodes == 1) d.numa = 0;
    d.linkGBs = linkGBs(readLine(dir + "/current_link_speed"), readLine(dir + "/current_link_width"));
    return d;
  }
};

}  // namespace

Topology discoverSysfs(const DiscoverOptions& opts, const std::string& why) {
  Reader rd;
  rd.root = opts.sysfsRoot;
  while (!rd.root.empty() && rd.root.back() == '/') rd.root.pop_back();
  Topology topo;
  topo.method = "sysfs";
  topo.source = "this machine (sysfs" + (rd.root.empty() ? std::string() : " under " + rd.root) + "; " + why + ")";
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) == 0) topo.hostname = host;
  int numa = 0;
  for (const std::string& n : listDir(rd.root + "/sys/devices/system/node"))
    if (n.size() > 4 && n.rfind("node", 0) == 0 && std::isdigit(static_cast<unsigned char>(n[4]))) ++numa;
  topo.numaNodes = rd.numaNodes = std::max(1, numa);

  const std::string pci = rd.root + "/sys/bus/pci/devices/";
  if (!opts.gpuBusIds.empty()) {
    for (const std::string& id : opts.gpuBusIds) {
      Gpu g;
      g.pci.busId = normalizeBusId(id);
      if (access((pci + g.pci.busId).c_str(), F_OK) == 0) g.pci = rd.describe(g.pci.busId);
      else g.found = false;
      topo.gpus.push_back(g);
    }
  } else {
    for (const std::string& id : listDir(pci)) {
      unsigned long vendor = std::strtoul(readLine(pci + id + "/vendor").c_str(), nullptr, 16);
      unsigned long cls = std::strtoul(readLine(pci + id + "/class").c_str(), nullptr, 16);
      if (vendor == 0x10de && (cls >> 16) == 0x03) topo.gpus.push_back({rd.describe(id), true});
    }
  }

  // Interfaces with a PCI function (virtio's sit one level below theirs, as hwloc finds them).
  std::vector<std::pair<std::string, std::string>> ifaces;  // (name, PCI function)
  for (const std::string& n : listDir(rd.root + "/sys/class/net")) {
    std::string fn = pciFunctionOf(resolved(rd.root + "/sys/class/net/" + n + "/device"));
    if (!fn.empty()) ifaces.push_back({n, fn});
  }
  std::vector<Nic> rdma, net;
  std::vector<std::string> rdmaFns;
  for (const std::string& n : listDir(rd.root + "/sys/class/infiniband")) {
    std::string fn = pciFunctionOf(resolved(rd.root + "/sys/class/infiniband/" + n + "/device"));
    if (fn.empty()) continue;  // software devices (rxe, siw) have no PCI function of their own
    Nic nic;
    nic.name = n;
    nic.rdma = true;
    nic.pci = rd.describe(fn);
    for (auto& [name, f] : ifaces)
      if (f == fn) nic.netdevs.push_back(name);
    rdma.push_back(nic);
    rdmaFns.push_back(fn);
  }
  for (auto& [name, fn] : ifaces) {
    if (std::find(rdmaFns.begin(), rdmaFns.end(), fn) != rdmaFns.end()) continue;  // listed with its RDMA device
    Nic nic;
    nic.name = name;
    nic.netdevs = {name};
    nic.pci = rd.describe(fn);
    net.push_back(nic);
  }
  sortNics(rdma, net, topo);
  return topo;
}

}  // namespace railcc::topology
