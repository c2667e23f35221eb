#pragma once
// hwloc, loaded at run time. One build of railcc runs on hosts with and without hwloc (and
// builds without its headers): nothing links the library, the few entry points topology.cpp
// uses are looked up with dlsym, and the few types it reads are declared here, for the ABI of
// hwloc 2.x (libhwloc.so.15; checked with hwloc_get_api_version() at load time). Where hwloc's
// own header is present, tests/cpp/hwloc_abi_test.cpp checks these declarations against it.
// The helpers hwloc.h defines inline (tree walks, info lookups) are written in topology.cpp.

#include <cstdint>
#include <string>

namespace railcc::topology::hw {

// Object types (hwloc_obj_type_t): only those railcc tells apart.
enum ObjType : int {
  kObjNumaNode = 13,
  kObjBridge = 14,
  kObjPciDevice = 15,
  kObjOsDevice = 16,
};
enum BridgeType : int { kBridgeHost = 0, kBridgePci = 1 };
enum OsDevType : int { kOsDevBlock = 0, kOsDevGpu = 1, kOsDevNetwork = 2, kOsDevOpenFabrics = 3 };
constexpr int kTypeFilterKeepAll = 0;  // hwloc_type_filter_e

struct PciAttr {  // struct hwloc_pcidev_attr_s (16-bit PCI domains: hwloc's default build)
  unsigned short domain;
  unsigned char bus, dev, func;
  unsigned short classId;
  unsigned short vendorId, deviceId, subvendorId, subdeviceId;
  unsigned char revision;
  float linkSpeed;  // GB/s
};

struct BridgeAttr {  // struct hwloc_bridge_attr_s
  union {
    PciAttr pci;
  } upstream;
  int upstreamType;  // BridgeType
  union {
    struct {
      unsigned short domain;
      unsigned char secondaryBus, subordinateBus;
    } pci;
  } downstream;
  int downstreamType;
  unsigned depth;
};

struct OsDevAttr {  // struct hwloc_osdev_attr_s
  int type;         // OsDevType
};

// union hwloc_obj_attr_u: every member starts at its beginning; railcc reads these three.
union Attr {
  PciAttr pcidev;
  BridgeAttr bridge;
  OsDevAttr osdev;
};

struct Info {  // struct hwloc_info_s
  char* name;
  char* value;
};

struct Obj {  // struct hwloc_obj
  int type;   // ObjType
  char* subtype;
  unsigned osIndex;
  char* name;
  uint64_t totalMemory;
  Attr* attr;
  int depth;
  unsigned logicalIndex;
  Obj* nextCousin;
  Obj* prevCousin;
  Obj* parent;
  unsigned siblingRank;
  Obj* nextSibling;
  Obj* prevSibling;
  unsigned arity;
  Obj** children;
  Obj* firstChild;
  Obj* lastChild;
  int symmetricSubtree;
  unsigned memoryArity;
  Obj* memoryFirstChild;
  unsigned ioArity;
  Obj* ioFirstChild;
  unsigned miscArity;
  Obj* miscFirstChild;
  void* cpuset;
  void* completeCpuset;
  void* nodeset;
  void* completeNodeset;
  Info* infos;
  unsigned infosCount;
  void* userdata;
  uint64_t gpIndex;
};

using Topo = void*;  // hwloc_topology_t

/// The entry points railcc uses, all present in every hwloc 2.x.
struct Lib {
  std::string path;     // what was loaded, for messages
  unsigned apiVersion;  // hwloc_get_api_version(): 0x00020800 for hwloc 2.8
  int (*topologyInit)(Topo*) = nullptr;
  void (*topologyDestroy)(Topo) = nullptr;
  int (*setIoTypesFilter)(Topo, int) = nullptr;
  int (*setXml)(Topo, const char*) = nullptr;
  int (*topologyLoad)(Topo) = nullptr;
  Obj* (*objByDepth)(Topo, int depth, unsigned idx) = nullptr;
  int (*bitmapWeight)(const void*) = nullptr;
  int (*bitmapFirst)(const void*) = nullptr;
  int (*exportXmlBuffer)(Topo, char** buf, int* len, unsigned long flags) = nullptr;
  void (*freeXmlBuffer)(Topo, char* buf) = nullptr;

  /// "2.8" from apiVersion.
  std::string version() const;
};

/// hwloc, loaded once per process: `override` (RAILCC_HWLOC_LIB) when set, else
/// libhwloc.so.15. Returns nullptr with `whyNot` set when it cannot be loaded, lacks an entry
/// point or is not hwloc 2.x. Thread-safe; a failed load is retried on the next call.
const Lib* hwlocLib(const std::string& override, std::string* whyNot);

}  // namespace railcc::topology::hw
