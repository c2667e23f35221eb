#pragma once
// Registrations of user memory with one RDMA device, for messages passed by address
// (rendezvous: the peer reads the sender's buffer, the receiver's NIC writes the destination).
// A range is registered once and kept while its owner (transport/memory_owners.h: the tensor's
// allocation, watched by the glue) says it has not been freed; memory with no owner is registered
// for one message and deregistered after. The cache keeps at most RAILCC_IB_MR_CACHE_BYTES,
// evicting the least recently used registration nobody is using, and drops every registration
// whose owner has gone (its pages were freed: the address may now be someone else's).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/memory_owners.h"
#include "transport/verbs/ibv_lib.h"

namespace railcc::transport::verbs {

class MrCache {
 public:
  /// A registration in use: give it back with release().
  struct Lease {
    ibv_mr* mr = nullptr;
    bool cached = false;
  };

  MrCache(const IbvLib* ibv, ibv_pd* pd, std::string dev, size_t capBytes);
  ~MrCache();
  MrCache(const MrCache&) = delete;
  MrCache& operator=(const MrCache&) = delete;

  /// A registration covering [p, p + n) that the NIC may read remotely and write locally. An
  /// empty lease when the registration is refused (said once, with the locked-memory limit):
  /// the caller then copies. Thread-safe.
  Lease acquire(const void* p, size_t n);
  void release(Lease& l);
  size_t cachedBytes() const;

 private:
  struct Entry {
    uintptr_t begin, end;
    ibv_mr* mr;
    std::shared_ptr<const MemoryOwner> owner;
    int uses;
    uint64_t lastUse;
  };
  ibv_mr* reg(uintptr_t begin, uintptr_t end);
  void dropAt(size_t i);
  void trim(size_t need);

  const IbvLib* ibv_;
  ibv_pd* pd_;
  std::string dev_;
  const size_t cap_;
  mutable std::mutex mu_;
  std::vector<Entry> entries_;
  size_t bytes_ = 0;
  uint64_t clock_ = 0;
  bool saidRefused_ = false;
};

}  // namespace railcc::transport::verbs
