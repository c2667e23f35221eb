#include "tensor_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include "backend.h"
#include "transport/memory_owners.h"

namespace railcc {
namespace {

// A registration pins the pages it was made on: if the memory were freed and the address handed
// out again, a cached registration would read or write the old pages. No weak reference or
// pointer comparison can tell that from the same memory, so the allocation itself is watched.
using transport::FreedFlag;

// Never destroyed: tensors may be freed during the process's exit, after static destructors.
std::mutex& watchedMu = *new std::mutex;
auto& watched = *new std::unordered_map<void*, std::shared_ptr<FreedFlag>>;  // by the allocation's context
c10::DeleterFnPtr cpuDeleter = nullptr;                                     // the CPU allocator's

void watchedDelete(void* ctx) {
  {
    std::lock_guard<std::mutex> g(watchedMu);
    auto it = watched.find(ctx);
    if (it != watched.end()) {
      it->second->freed.store(true, std::memory_order_release);
      watched.erase(it);
    }
  }
  cpuDeleter(ctx);
}

std::shared_ptr<const transport::MemoryOwner> ownerOfStorage(const c10::Storage& s) {
  static const c10::DeleterFnPtr cpu = [] {
    c10::Allocator* a = c10::GetCPUAllocator();
    cpuDeleter = a ? a->raw_deleter() : nullptr;
    return cpuDeleter;
  }();
  if (cpu == nullptr) return nullptr;
  at::DataPtr& dp = s.unsafeGetStorageImpl()->_mutable_data_ptr_no_checks();
  std::lock_guard<std::mutex> g(watchedMu);
  if (dp.get_deleter() == &watchedDelete) {
    auto it = watched.find(dp.get_context());
    return it == watched.end() ? nullptr : it->second;
  }
  if (dp.get_context() == nullptr || !dp.compare_exchange_deleter(cpu, &watchedDelete)) return nullptr;
  auto flag = std::make_shared<FreedFlag>();
  watched[dp.get_context()] = flag;
  return flag;
}

// The communication allocator's blocks: mapped whole pages, noted at birth, marked at death.
struct Block {
  void* base;
  size_t bytes;
  std::shared_ptr<FreedFlag> owner;
};

void freeBlock(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  b->owner->freed.store(true, std::memory_order_release);
  munmap(b->base, b->bytes);
  delete b;
}

}  // namespace

void noteTensorOwners(const std::vector<at::Tensor>& tensors) {
  const size_t minBytes = transport::memoryOwnersMinBytes();
  if (minBytes == ~size_t(0)) return;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.has_storage() || !t.device().is_cpu()) continue;
    const c10::Storage& s = t.storage();
    if (s.nbytes() < minBytes || s.data() == nullptr) continue;
    // The communication allocator's own blocks were noted when they were made.
    if (s.data_ptr().get_deleter() == &freeBlock) continue;
    if (auto owner = ownerOfStorage(s)) transport::noteMemoryOwner(s.data(), s.nbytes(), std::move(owner));
  }
}

c10::DataPtr CommunicationAllocator::allocate(size_t n) {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t bytes = std::max<size_t>((n + page - 1) / page * page, page);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "railcc: cannot map ", bytes, " bytes for a communication tensor");
  auto* b = new Block{p, bytes, std::make_shared<FreedFlag>()};
  transport::noteMemoryOwner(p, bytes, b->owner);
  return {p, b, &freeBlock, c10::Device(c10::DeviceType::CPU)};
}

void CommunicationAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  default_copy_data(dest, src, count);
}

std::shared_ptr<c10::Allocator> communicationAllocator() {
  static const auto a = std::make_shared<CommunicationAllocator>();
  return a;
}

// ---------------------------------------------------------------------------------------
// The backend's communication tensors (backend.h)

std::shared_ptr<c10::Allocator> ProcessGroupRailcc::getMemAllocator() { return communicationAllocator(); }

bool ProcessGroupRailcc::supportsTensorAlloc(c10::DeviceIndex deviceIdx) {
  return deviceIdx < 0 || comm().offersShared();
}

at::Tensor ProcessGroupRailcc::allocateTensor(long size, at::TensorOptions options) {
  if (size < 0) C10_THROW_ERROR(ValueError, "railcc: allocate_tensor: size " + std::to_string(size) + " is negative");
  if (options.device().is_cuda()) {  // the group's heap, else torch's own allocator
    const size_t bytes = static_cast<size_t>(size) * options.dtype().itemsize();
    std::shared_ptr<void> held = comm().allocateShared(options.device().index(), bytes);
    if (!held) return at::empty({size}, options);
    void* p = held.get();
    return at::from_blob(p, {size}, [held](void*) mutable { held.reset(); }, options);
  }
  if (options.device().type() != c10::DeviceType::CPU)
    C10_THROW_ERROR(ValueError, "railcc: allocate_tensor: railcc allocates communication tensors in host or CUDA "
                                "memory; got " + options.device().str());
  return at::detail::empty_generic({size}, communicationAllocator().get(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(options.dtype()), std::nullopt);
}

}  // namespace railcc
