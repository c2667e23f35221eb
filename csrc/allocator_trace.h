#pragma once
// torch's CUDA caching allocator, watched through its trace hook: the segments it makes and
// frees are told to the engine (engine/allocator_segments.h), so that one-kernel ops may
// register a segment for peers to read in place and have every peer close it before it is
// freed. A glue file of its own, the only one that includes a c10/cuda header.

#include <string>

namespace railcc {

/// Attaches the hook once per process: "" once attached, else why not yet (torch's CUDA not
/// used so far: tried again at the next call) or not at all (a CPU build of torch, or railcc
/// built without CUDA's headers). Cheap once attached: called at every CUDA call of a group
/// with one-kernel ops.
std::string watchAllocatorSegments();

/// The hook's body, apart from the allocator's types: `action` is TraceEntry's (SEGMENT_ALLOC,
/// SEGMENT_FREE; others are ignored). Tests call it as the allocator would.
void allocatorTraced(int action, size_t addr, size_t size);

}  // namespace railcc
