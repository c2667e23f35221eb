#pragma once
// libibverbs, loaded at run time. One build of railcc runs on hosts with and without
// rdma-core: nothing links the library, the entry points are looked up with dlsym. The data
// path (ibv_post_send, ibv_post_recv, ibv_poll_cq, ibv_req_notify_cq) is inline in verbs.h
// and calls through the device context, so it needs no symbol.

#include <infiniband/verbs.h>

#include <string>

namespace railcc::transport::verbs {

/// The entry points railcc uses. Optional ones (newer rdma-core) may be null.
struct IbvLib {
  std::string path;  // what was loaded, for logs
  ibv_device** (*getDeviceList)(int*) = nullptr;
  void (*freeDeviceList)(ibv_device**) = nullptr;
  const char* (*getDeviceName)(ibv_device*) = nullptr;
  ibv_context* (*openDevice)(ibv_device*) = nullptr;
  int (*closeDevice)(ibv_context*) = nullptr;
  int (*queryPort)(ibv_context*, uint8_t, ibv_port_attr*) = nullptr;
  int (*queryGid)(ibv_context*, uint8_t, int, ibv_gid*) = nullptr;
  ibv_pd* (*allocPd)(ibv_context*) = nullptr;
  int (*deallocPd)(ibv_pd*) = nullptr;
  ibv_mr* (*regMr)(ibv_pd*, void*, size_t, int) = nullptr;
  ibv_mr* (*regDmabufMr)(ibv_pd*, uint64_t, size_t, uint64_t, int, int) = nullptr;  // optional (IBVERBS_1.12)
  int (*deregMr)(ibv_mr*) = nullptr;
  ibv_comp_channel* (*createCompChannel)(ibv_context*) = nullptr;
  int (*destroyCompChannel)(ibv_comp_channel*) = nullptr;
  ibv_cq* (*createCq)(ibv_context*, int, void*, ibv_comp_channel*, int) = nullptr;
  int (*destroyCq)(ibv_cq*) = nullptr;
  int (*getCqEvent)(ibv_comp_channel*, ibv_cq**, void**) = nullptr;
  void (*ackCqEvents)(ibv_cq*, unsigned int) = nullptr;
  ibv_qp* (*createQp)(ibv_pd*, ibv_qp_init_attr*) = nullptr;
  int (*modifyQp)(ibv_qp*, ibv_qp_attr*, int) = nullptr;
  int (*destroyQp)(ibv_qp*) = nullptr;
  int (*getAsyncEvent)(ibv_context*, ibv_async_event*) = nullptr;
  void (*ackAsyncEvent)(ibv_async_event*) = nullptr;
  const char* (*wcStatusStr)(ibv_wc_status) = nullptr;
  const char* (*eventTypeStr)(ibv_event_type) = nullptr;
};

/// The library, loaded once per process: `override` (RAILCC_IBVERBS_LIB) when set, else
/// libibverbs.so.1. Returns nullptr with `whyNot` set when it cannot be loaded or lacks a
/// required entry point. Thread-safe; a failed load is retried on the next call.
const IbvLib* ibvLib(const std::string& override, std::string* whyNot);

}  // namespace railcc::transport::verbs
