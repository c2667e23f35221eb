// The CUDA caching allocator's trace hook (allocator_trace.h). The allocator's class is known
// only where torch's headers were built for CUDA and the CUDA toolkit's headers are at hand;
// elsewhere (a CPU build of torch) there is nothing to watch. The allocator object is found
// at run time (dlsym), so the module links no CUDA library of torch's and loads with either.
#include "allocator_trace.h"

#include <dlfcn.h>

#include <cstddef>
#include <exception>

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

static std::string attach() {
  // c10::cuda::CUDACachingAllocator::allocator, in libc10_cuda.so where torch was built for CUDA.
  void* sym = dlsym(RTLD_DEFAULT, "_ZN3c104cuda20CUDACachingAllocator9allocatorE");
  if (!sym) return "this torch has no CUDA caching allocator (libc10_cuda.so is not loaded)";
  auto* a = static_cast<std::atomic<alloc::CUDAAllocator*>*>(sym)->load();
  if (!a) return "torch's CUDA allocator is not set up";
  try {  // an allocator that keeps no trace (cudaMallocAsync's) refuses
    a->attachAllocatorTraceTracker([](const alloc::TraceEntry& te) {
      allocatorTraced(static_cast<int>(te.action_), static_cast<size_t>(te.addr_), te.size_);
    });
  } catch (const std::exception& e) {
    return std::string("torch's CUDA allocator takes no trace hook: ") + e.what();
  }
  return "";
}
#else
static std::string attach() { return "railcc was built without CUDA headers for torch's allocator"; }
#endif

const std::string& watchAllocatorSegments() {
  static const std::string why = attach();
  return why;
}

}  // namespace railcc
