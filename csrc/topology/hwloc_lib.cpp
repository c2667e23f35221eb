#include "topology/hwloc_lib.h"

#include <dlfcn.h>

#include <memory>
#include <string>

#include "common/load_once.h"

namespace railcc::topology::hw {
namespace {

template <typename F>
void bind(void* h, const char* name, F& out, std::string& missing) {
  out = reinterpret_cast<F>(dlsym(h, name));
  if (out == nullptr) missing += (missing.empty() ? "" : ", ") + std::string(name);
}

std::unique_ptr<Lib> load(const std::string& name, std::string* whyNot) {
  void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char* e = dlerror();
    *whyNot = "cannot load " + name + " (" + (e ? e : "unknown error") +
              "): install hwloc 2.x (libhwloc15), or point RAILCC_HWLOC_LIB at it";
    return nullptr;
  }
  auto lib = std::make_unique<Lib>();
  lib->path = name;
  std::string missing;
  unsigned (*apiVersion)() = nullptr;
  bind(h, "hwloc_get_api_version", apiVersion, missing);
  bind(h, "hwloc_topology_init", lib->topologyInit, missing);
  bind(h, "hwloc_topology_destroy", lib->topologyDestroy, missing);
  bind(h, "hwloc_topology_set_io_types_filter", lib->setIoTypesFilter, missing);
  bind(h, "hwloc_topology_set_xml", lib->setXml, missing);
  bind(h, "hwloc_topology_load", lib->topologyLoad, missing);
  bind(h, "hwloc_get_obj_by_depth", lib->objByDepth, missing);
  bind(h, "hwloc_bitmap_weight", lib->bitmapWeight, missing);
  bind(h, "hwloc_bitmap_first", lib->bitmapFirst, missing);
  bind(h, "hwloc_topology_export_xmlbuffer", lib->exportXmlBuffer, missing);
  bind(h, "hwloc_free_xmlbuffer", lib->freeXmlBuffer, missing);
  if (!missing.empty()) {
    *whyNot = name + " lacks " + missing + " (not hwloc 2.x?)";
    dlclose(h);
    return nullptr;
  }
  lib->apiVersion = apiVersion();
  // The declarations in hwloc_lib.h follow the ABI of hwloc 2.x; 1.x and a future 3.x differ.
  if ((lib->apiVersion >> 16) != 2) {
    *whyNot = name + " is hwloc API " + lib->version() + ", railcc reads hwloc 2.x only";
    dlclose(h);
    return nullptr;
  }
  return lib;  // the handle stays open for the life of the process
}

}  // namespace

std::string Lib::version() const {
  return std::to_string(apiVersion >> 16) + "." + std::to_string((apiVersion >> 8) & 0xff);
}

const Lib* hwlocLib(const std::string& override, std::string* whyNot) {
  return loadOnce<Lib>(override.empty() ? "libhwloc.so.15" : override, &load, whyNot);
}

}  // namespace railcc::topology::hw
