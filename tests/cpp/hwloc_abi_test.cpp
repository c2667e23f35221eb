// csrc/topology/hwloc_lib.h declares the hwloc 2.x types railcc reads, so that the build needs
// no hwloc header. Where the header is installed, this file checks those declarations against
// it, field by field: a mistake there fails the build of the tests, not a run on a GPU host.

#include <hwloc.h>

#include <cstddef>

#include <gtest/gtest.h>

#include "topology/hwloc_lib.h"

namespace hw = railcc::topology::hw;

static_assert(HWLOC_API_VERSION >= 0x00020000 && HWLOC_API_VERSION < 0x00030000, "hwloc_lib.h describes hwloc 2.x");

#define SAME_VALUE(ours, theirs) static_assert(static_cast<int>(ours) == static_cast<int>(theirs), #theirs)
SAME_VALUE(hw::kObjNumaNode, HWLOC_OBJ_NUMANODE);
SAME_VALUE(hw::kObjBridge, HWLOC_OBJ_BRIDGE);
SAME_VALUE(hw::kObjPciDevice, HWLOC_OBJ_PCI_DEVICE);
SAME_VALUE(hw::kObjOsDevice, HWLOC_OBJ_OS_DEVICE);
SAME_VALUE(hw::kBridgeHost, HWLOC_OBJ_BRIDGE_HOST);
SAME_VALUE(hw::kBridgePci, HWLOC_OBJ_BRIDGE_PCI);
SAME_VALUE(hw::kOsDevNetwork, HWLOC_OBJ_OSDEV_NETWORK);
SAME_VALUE(hw::kOsDevOpenFabrics, HWLOC_OBJ_OSDEV_OPENFABRICS);
SAME_VALUE(hw::kTypeFilterKeepAll, HWLOC_TYPE_FILTER_KEEP_ALL);
#undef SAME_VALUE
static_assert(sizeof(int) == sizeof(hwloc_obj_type_t) && sizeof(int) == sizeof(hwloc_obj_osdev_type_t) &&
                  sizeof(int) == sizeof(hwloc_obj_bridge_type_t),
              "enums are ints");

#define SAME(ours, theirs, f1, f2) static_assert(offsetof(ours, f1) == offsetof(theirs, f2), #f1)
using Pci = hwloc_obj_attr_u::hwloc_pcidev_attr_s;
using Bridge = hwloc_obj_attr_u::hwloc_bridge_attr_s;
static_assert(sizeof(hw::PciAttr) == sizeof(Pci), "pcidev size");
SAME(hw::PciAttr, Pci, domain, domain);
SAME(hw::PciAttr, Pci, bus, bus);
SAME(hw::PciAttr, Pci, dev, dev);
SAME(hw::PciAttr, Pci, func, func);
SAME(hw::PciAttr, Pci, classId, class_id);
SAME(hw::PciAttr, Pci, vendorId, vendor_id);
SAME(hw::PciAttr, Pci, revision, revision);
SAME(hw::PciAttr, Pci, linkSpeed, linkspeed);
static_assert(sizeof(((hw::PciAttr*)nullptr)->domain) == sizeof(((Pci*)nullptr)->domain), "PCI domain width");
static_assert(sizeof(hw::BridgeAttr) == sizeof(Bridge), "bridge size");
SAME(hw::BridgeAttr, Bridge, upstream.pci.bus, upstream.pci.bus);
SAME(hw::BridgeAttr, Bridge, upstreamType, upstream_type);
SAME(hw::BridgeAttr, Bridge, downstream.pci.domain, downstream.pci.domain);
SAME(hw::BridgeAttr, Bridge, downstream.pci.secondaryBus, downstream.pci.secondary_bus);
SAME(hw::BridgeAttr, Bridge, downstream.pci.subordinateBus, downstream.pci.subordinate_bus);
SAME(hw::BridgeAttr, Bridge, downstreamType, downstream_type);
SAME(hw::BridgeAttr, Bridge, depth, depth);
SAME(hw::OsDevAttr, hwloc_obj_attr_u::hwloc_osdev_attr_s, type, type);
SAME(hw::Info, hwloc_info_s, name, name);
SAME(hw::Info, hwloc_info_s, value, value);
static_assert(sizeof(hw::Info) == sizeof(hwloc_info_s), "info size");

static_assert(sizeof(hw::Obj) == sizeof(hwloc_obj), "object size");
SAME(hw::Obj, hwloc_obj, type, type);
SAME(hw::Obj, hwloc_obj, subtype, subtype);
SAME(hw::Obj, hwloc_obj, osIndex, os_index);
SAME(hw::Obj, hwloc_obj, name, name);
SAME(hw::Obj, hwloc_obj, totalMemory, total_memory);
SAME(hw::Obj, hwloc_obj, attr, attr);
SAME(hw::Obj, hwloc_obj, depth, depth);
SAME(hw::Obj, hwloc_obj, logicalIndex, logical_index);
SAME(hw::Obj, hwloc_obj, nextCousin, next_cousin);
SAME(hw::Obj, hwloc_obj, prevCousin, prev_cousin);
SAME(hw::Obj, hwloc_obj, parent, parent);
SAME(hw::Obj, hwloc_obj, siblingRank, sibling_rank);
SAME(hw::Obj, hwloc_obj, nextSibling, next_sibling);
SAME(hw::Obj, hwloc_obj, prevSibling, prev_sibling);
SAME(hw::Obj, hwloc_obj, arity, arity);
SAME(hw::Obj, hwloc_obj, children, children);
SAME(hw::Obj, hwloc_obj, firstChild, first_child);
SAME(hw::Obj, hwloc_obj, lastChild, last_child);
SAME(hw::Obj, hwloc_obj, symmetricSubtree, symmetric_subtree);
SAME(hw::Obj, hwloc_obj, memoryArity, memory_arity);
SAME(hw::Obj, hwloc_obj, memoryFirstChild, memory_first_child);
SAME(hw::Obj, hwloc_obj, ioArity, io_arity);
SAME(hw::Obj, hwloc_obj, ioFirstChild, io_first_child);
SAME(hw::Obj, hwloc_obj, miscArity, misc_arity);
SAME(hw::Obj, hwloc_obj, miscFirstChild, misc_first_child);
SAME(hw::Obj, hwloc_obj, cpuset, cpuset);
SAME(hw::Obj, hwloc_obj, completeCpuset, complete_cpuset);
SAME(hw::Obj, hwloc_obj, nodeset, nodeset);
SAME(hw::Obj, hwloc_obj, completeNodeset, complete_nodeset);
SAME(hw::Obj, hwloc_obj, infos, infos);
SAME(hw::Obj, hwloc_obj, infosCount, infos_count);
SAME(hw::Obj, hwloc_obj, userdata, userdata);
SAME(hw::Obj, hwloc_obj, gpIndex, gp_index);
#undef SAME

TEST(HwlocAbi, DeclarationsMatchTheInstalledHeader) {
  // The checks above ran at compile time; at run time the loaded library must be the series
  // the header describes.
  std::string why;
  const hw::Lib* lib = hw::hwlocLib("", &why);
  ASSERT_NE(lib, nullptr) << why;
  EXPECT_EQ(lib->apiVersion >> 16, static_cast<unsigned>(HWLOC_API_VERSION >> 16));
}
