#pragma once
// The machine as railcc needs to see it: GPUs, NICs (RDMA devices and network interfaces),
// NUMA nodes and the PCI path between every GPU and every NIC, found with hwloc (loaded at run
// time, see hwloc_lib.h), read from an hwloc XML file, or, where hwloc cannot be loaded, read
// from sysfs. Depends on common only; the engine and `railcc topo` build on it.

#include <string>
#include <vector>

namespace railcc::topology {

/// How traffic between two PCI devices travels, nearest first, in NCCL's words.
enum class Path : int {
  kLOC,  // the same device
  kPIX,  // through at most one PCIe switch
  kPXB,  // through several PCIe switches, not the host bridge
  kPHB,  // through the host bridge of one CPU
  kSYS,  // across CPU sockets (or where is unknown)
};
const char* pathName(Path p);
/// "PIX", "pxb", "2" (NCCL_NET_GDR_LEVEL's numbers): the path; throws kInvalidUsage otherwise.
Path parsePath(const std::string& s);

struct PciDevice {
  std::string busId;               // "0000:17:00.0"
  int numa = -1;                   // NUMA node, -1 when the device is local to several or none
  double linkGBs = 0;              // PCIe link speed (GB/s) as hwloc reports it, 0 if unknown
  std::vector<std::string> chain;  // PCI bridges (bus ids) from the root port down to the device
  std::string root;                // its host bridge ("" when there is none)
};

struct Gpu {
  PciDevice pci;
  bool found = true;  // false: a bus id the CUDA runtime named but the topology lacks (VMs)
};

struct Nic {
  std::string name;                 // "mlx5_0" for an RDMA device, "eth0" for an interface
  bool rdma = false;                // an OpenFabrics device (verbs); else a network interface
  std::vector<std::string> netdevs; // the network interfaces of the same PCI function
  PciDevice pci;
};

struct Topology {
  std::string method;  // where it came from: "hwloc", "sysfs" or "file" (an hwloc XML file)
  std::string source;  // the same in words: "this machine (hwloc 2.8, libhwloc.so.15)",
                       // "this machine (sysfs; hwloc not loaded: <why>)" or "file <path>"
  std::string hostname;
  int numaNodes = 1;
  std::vector<Gpu> gpus;  // in the order asked for (CUDA's), else by bus id
  std::vector<Nic> nics;  // RDMA devices (with their interfaces), then other interfaces on PCI, by bus id
  std::string xml;        // the topology as hwloc XML (what RAILCC_TOPO_DUMP_FILE writes); "" from sysfs

  /// Path between GPU g and NIC n.
  Path path(size_t g, size_t n) const;
  /// The RDMA NICs when there are any, else the network interfaces with a PCI device.
  std::vector<size_t> railNics() const;
};

struct DiscoverOptions {
  std::string xmlFile;                // read this instead of the machine (RAILCC_TOPO_FILE)
  std::vector<std::string> gpuBusIds; // the GPUs, in CUDA's order; empty: every NVIDIA GPU found
  std::string hwlocLib;               // the hwloc to load; "": RAILCC_HWLOC_LIB, else libhwloc.so.15
  bool sysfs = false;                 // read sysfs even where hwloc loads (tests compare the two)
  std::string sysfsRoot;              // with sysfs: a tree in place of / (tests)
};

/// Loads the topology: from the XML file when one is named, else from hwloc, else (hwloc
/// cannot be loaded) from sysfs, the reason named in `source`. Throws Error(kInvalidUsage)
/// naming the file when an XML cannot be read (or hwloc, which reads it, cannot be loaded),
/// Error(kSystem) when hwloc fails on the machine.
Topology discover(const DiscoverOptions& opts);
/// discover(), shared by the processes of one machine and user that start within `maxAgeSec`
/// seconds of each other (shared.cpp): the first discovers and leaves the XML in `dir`
/// (railcc-topo-<uid>-<boot id>.xml) and the same in its compact form (.txt, read without
/// hwloc where `opts` names no GPUs), the rest load it. An XML file named in `opts`, sysfs,
/// `maxAgeSec` <= 0 or an empty `dir`: plain discover(). Throws as discover() does.
Topology discoverShared(const DiscoverOptions& opts, const std::string& dir, int64_t maxAgeSec);
/// The same, except that where another process is discovering it returns false at once rather
/// than wait for its file (nothing discovered or written; `out` is then not to be used); true
/// with `out` set otherwise.
bool discoverSharedNow(const DiscoverOptions& opts, const std::string& dir, int64_t maxAgeSec, Topology& out);
/// The topology as a few lines of text and back (compact.cpp): what discoverShared leaves for
/// the processes after the first, read without loading hwloc. encodeCompact returns "" for a
/// topology it cannot write faithfully; decodeCompact returns false on anything it does not
/// recognise (method, source and hostname are the caller's to set).
std::string encodeCompact(const Topology& t);
bool decodeCompact(const std::string& text, Topology& t);
/// Throws Error(kInvalidUsage) unless `path` is a readable regular file of a sane size for an
/// hwloc XML file (a device or FIFO named by RAILCC_TOPO_FILE would be read without end).
void checkTopologyFile(const std::string& path);

/// The machine from sysfs alone (under `opts.sysfsRoot`): PCI devices, their bridges, NUMA
/// nodes and link speeds, the same fields hwloc gives, without the XML. `why` says why hwloc
/// was not used (it goes into `source`).
Topology discoverSysfs(const DiscoverOptions& opts, const std::string& why);

/// topo.nics: the RDMA devices, then the other interfaces, each by bus id (both readers).
void sortNics(std::vector<Nic> rdma, std::vector<Nic> net, Topology& topo);

/// Path between two PCI devices (the rule behind Topology::path).
Path pathBetween(const PciDevice& a, const PciDevice& b);

/// "0000:17:00.0" from "00000000:17:00.0", "17:00.0" or upper case (CUDA writes 8 hex digits of
/// domain; sysfs and hwloc 4).
std::string normalizeBusId(const std::string& id);

}  // namespace railcc::topology
