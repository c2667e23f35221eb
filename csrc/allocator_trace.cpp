// The CUDA caching allocator's trace hook (allocator_trace.h). The allocator's class is known
// only where torch's headers were built for CUDA and the CUDA toolkit's headers are at hand;
// elsewhere (a CPU build of torch) there is nothing to watch. The allocator object is found
// at run time (dlsym), so the module links no CUDA library of torch's and loads with either.
#include "allocator_trace.h"

#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>

#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>) && __has_include(<cuda_runtime_api.h>)
#define RAILCC_ALLOCATOR_HOOK 1
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "engine/allocator_segments.h"

namespace railcc {

namespace {
// TraceEntry's actions, as allocatorTraced() takes them (checked against the header below).
constexpr int kSegmentAlloc = 3, kSegmentFree = 4;
}  // namespace

void allocatorTraced(int action, size_t addr, size_t size) {
  // Called with the allocator's lock held: nothing here calls into torch.
  if (action == kSegmentAlloc) engine::segmentMade(reinterpret_cast<char*>(addr), size);
  if (action == kSegmentFree) engine::segmentFreeing(reinterpret_cast<char*>(addr));
}

#ifdef RAILCC_ALLOCATOR_HOOK
namespace alloc = c10::cuda::CUDACachingAllocator;
static_assert(static_cast<int>(alloc::TraceEntry::SEGMENT_ALLOC) == kSegmentAlloc, "TraceEntry changed");
static_assert(static_cast<int>(alloc::TraceEntry::SEGMENT_FREE) == kSegmentFree, "TraceEntry changed");

static alloc::CUDAAllocator* allocatorNow() {
  // c10::cuda::CUDACachingAllocator::allocator, in libc10_cuda.so where torch was built for CUDA.
  static void* const sym = dlsym(RTLD_DEFAULT, "_ZN3c104cuda20CUDACachingAllocator9allocatorE");
  return sym ? static_cast<std::atomic<alloc::CUDAAllocator*>*>(sym)->load() : nullptr;
}

// The segment holding p as the allocator knows it (also one made before the hook was attached,
// whose free the hook still reports). Never throws: memory it did not make, or a block of
// expandable segments (which CUDA IPC handles do not cover), is "none".
static bool baseOf(const void* p, char** base, size_t* bytes) {
  // The allocator answers memory it does not know (or expandable segments, a setting of the
  // whole process) by throwing, which costs a stack trace: after the first such answer the
  // lookup is not asked again, so no op pays it (segments the hook saw made are still known).
  static std::atomic<bool> refused{false};
  alloc::CUDAAllocator* a = allocatorNow();
  if (!a || refused.load(std::memory_order_relaxed)) return false;
  try {
    size_t size = 0;
    void* b = a->getBaseAllocation(const_cast<void*>(p), &size);
    if (!b || size == 0) return false;
    *base = static_cast<char*>(b);
    *bytes = size;
    return true;
  } catch (...) {
    refused.store(true, std::memory_order_relaxed);
    return false;
  }
}

static std::string attach() {
  if (!dlsym(RTLD_DEFAULT, "_ZN3c104cuda20CUDACachingAllocator9allocatorE"))
    return "this torch has no CUDA caching allocator (libc10_cuda.so is not loaded)";
  alloc::CUDAAllocator* a = allocatorNow();
  // The hook goes to the device allocators that exist: before CUDA's first use there are none.
  if (!a || !a->initialized()) return "torch's CUDA allocator is not set up yet (no CUDA tensor so far)";
  try {  // an allocator that keeps no trace (cudaMallocAsync's) refuses
    a->attachAllocatorTraceTracker([](const alloc::TraceEntry& te) {
      allocatorTraced(static_cast<int>(te.action_), static_cast<size_t>(te.addr_), te.size_);
    });
  } catch (const std::exception& e) {
    return std::string("torch's CUDA allocator takes no trace hook: ") + e.what();
  }
  engine::setSegmentFinder(baseOf);
  return "";
}
#else
static std::string attach() { return "railcc was built without CUDA headers for torch's allocator"; }
#endif

std::string watchAllocatorSegments() {
  static std::atomic<bool> attached{false};
  if (attached.load(std::memory_order_acquire)) return "";
  static std::mutex mu;
  std::lock_guard<std::mutex> g(mu);
  if (attached.load()) return "";
  std::string why = attach();  // tried again at the next call until it holds
  if (why.empty()) attached.store(true, std::memory_order_release);
  return why;
}

}  // namespace railcc
