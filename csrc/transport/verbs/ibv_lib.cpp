#include "transport/verbs/ibv_lib.h"

#include <dlfcn.h>

#include <memory>
#include <string>

#include "common/load_once.h"

namespace railcc::transport::verbs {
namespace {

template <typename F>
bool bind(void* h, const char* name, F& out, std::string* missing) {
  out = reinterpret_cast<F>(dlsym(h, name));
  if (out == nullptr && missing != nullptr) *missing += (missing->empty() ? "" : ", ") + std::string(name);
  return out != nullptr;
}

std::unique_ptr<IbvLib> load(const std::string& name, std::string* whyNot) {
  void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char* e = dlerror();
    *whyNot = "cannot load " + name + " (" + (e ? e : "unknown error") +
              "): install rdma-core (libibverbs1 and the provider of your NIC), or point RAILCC_IBVERBS_LIB at it";
    return nullptr;
  }
  auto lib = std::make_unique<IbvLib>();
  lib->path = name;
  std::string missing;
  bind(h, "ibv_get_device_list", lib->getDeviceList, &missing);
  bind(h, "ibv_free_device_list", lib->freeDeviceList, &missing);
  bind(h, "ibv_get_device_name", lib->getDeviceName, &missing);
  bind(h, "ibv_open_device", lib->openDevice, &missing);
  bind(h, "ibv_close_device", lib->closeDevice, &missing);
  bind(h, "ibv_query_port", lib->queryPort, &missing);
  bind(h, "ibv_query_gid", lib->queryGid, &missing);
  bind(h, "ibv_alloc_pd", lib->allocPd, &missing);
  bind(h, "ibv_dealloc_pd", lib->deallocPd, &missing);
  bind(h, "ibv_reg_mr", lib->regMr, &missing);
  bind(h, "ibv_dereg_mr", lib->deregMr, &missing);
  bind(h, "ibv_create_comp_channel", lib->createCompChannel, &missing);
  bind(h, "ibv_destroy_comp_channel", lib->destroyCompChannel, &missing);
  bind(h, "ibv_create_cq", lib->createCq, &missing);
  bind(h, "ibv_destroy_cq", lib->destroyCq, &missing);
  bind(h, "ibv_get_cq_event", lib->getCqEvent, &missing);
  bind(h, "ibv_ack_cq_events", lib->ackCqEvents, &missing);
  bind(h, "ibv_create_qp", lib->createQp, &missing);
  bind(h, "ibv_modify_qp", lib->modifyQp, &missing);
  bind(h, "ibv_destroy_qp", lib->destroyQp, &missing);
  bind(h, "ibv_get_async_event", lib->getAsyncEvent, &missing);
  bind(h, "ibv_ack_async_event", lib->ackAsyncEvent, &missing);
  bind(h, "ibv_wc_status_str", lib->wcStatusStr, &missing);
  bind(h, "ibv_event_type_str", lib->eventTypeStr, &missing);
  bind(h, "ibv_reg_dmabuf_mr", lib->regDmabufMr, nullptr);  // rdma-core 34 and later
  if (!missing.empty()) {
    *whyNot = name + " lacks " + missing + " (too old a libibverbs?)";
    dlclose(h);
    return nullptr;
  }
  return lib;  // the handle stays open for the life of the process
}

}  // namespace

const IbvLib* ibvLib(const std::string& override, std::string* whyNot) {
  return loadOnce<IbvLib>(override.empty() ? "libibverbs.so.1" : override, &load, whyNot);
}

}  // namespace railcc::transport::verbs
