#pragma once
// What the c10d glue tells the engine about torch's CUDA caching allocator, from the
// allocator's trace hook (csrc/allocator_trace.cpp): the segments (cudaMalloc'd blocks) it makes
// and frees. Only such a segment is ever registered for peers to read in place
// (engine/device/segments.h), because only its freeing is known in time for every peer to
// close it first. Thread-safe; segmentFreeing() blocks until peers closed it (bounded).

#include <cstddef>

namespace railcc::engine {

/// A segment of `bytes` at `base` was made (SEGMENT_ALLOC).
void segmentMade(char* base, size_t bytes);
/// The segment at `base` is about to be freed (SEGMENT_FREE): every group's peers close it
/// first. Called while the allocator holds its lock: it never calls back into torch.
void segmentFreeing(char* base);
/// Segments known now (tests and railcc.stats()).
size_t segmentsKnown();
/// How to find the segment holding p where the hook did not see it made (the allocator's own
/// lookup): true with its base and size, false for memory the allocator did not make.
using SegmentFinder = bool (*)(const void* p, char** base, size_t* bytes);
void setSegmentFinder(SegmentFinder f);

}  // namespace railcc::engine
