#pragma once
// One-kernel collectives through peers' memory: all-reduce one-shot (every rank reads every
// rank's data and reduces all of it) and two-shot (every rank reduces a slice and writes it to
// every rank), all-gather, reduce-scatter, broadcast and all-to-all of equal blocks (ShotKind). Written once for both
// sides, as signals.h is: nvcc compiles it into the kernels
// (shot_kernels.cu), with a block of threads per worker, and the host compiler into
// tests/cpp/shots_test.cpp, where a CPU thread plays each (rank, block) on host memory.
//
// The layout
// * Every rank has a scratch buffer and kMaxShotBlocks signal pads in memory its peers map,
//   made and exchanged once per group. A table (ShotPeers, in device memory, filled once and
//   never per op) holds every rank's scratch and pads as mapped in this process; a captured CUDA
//   graph keeps the table's address.
// * A rank's data reaches its peers through its scratch (the kernel copies the input in, peers
//   read it; two-shot peers write their reduced slices into it) or, where it lies in the rank's
//   heap (memory registered once: every peer mapped it at set-up), in place: the rank says
//   which in its where record (ShotWhere, an offset into its heap), written by the kernel and
//   read by peers after the first barrier. So no rank learns its peers' buffers from the host:
//   there is no host exchange per op, whatever the caller passes, and registered buffers cost
//   no copy into scratch.
// * The data goes through the scratch in chunks (as many elements as the scratch holds), one
//   after another within the one kernel. Elements of a chunk are split into per-block ranges the
//   same way on every rank, so block b of one rank only ever needs block b of its peers, and
//   each block signals and waits on its own pad b.
// * Each block keeps its own count of chunks done in this rank's memory (`epochs[b]`), read at
//   the start and advanced with every chunk: the expected signal counts come from the device,
//   not from a kernel argument, so a replayed graph waits for the right counts.
//
// A chunk is two barriers per block (shotChunks): `in` (my data is where I said) and `out` (I
// have finished reading your data and, for two-shot, writing my slice into your output). After
// `out` a rank may refill its scratch. Signals per chunk per (block, peer): 2.
//
// Reduction order is rank 0, 1, ..., n-1 on every rank, accumulated in Accum<T> (float for the
// half types, which the .cu adds) and rounded once: every rank gets the same bits.
// AVG divides the sum by n; PREMUL_SUM multiplies the sum by `scale` (c10d's factor, the same
// on every rank).

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/types.h"
#include "cuda/reduce_ops.h"
#include "cuda/signals.h"

namespace railcc::cuda {

constexpr int kMaxShotBlocks = 64;

/// Where a rank's input and output of the current op lie, as it tells its peers: a record per
/// block in its own memory, written before the block's first signal of the op. A place is its
/// registered memory (mapped by every peer once) and a byte offset into it: the top 16 bits
/// say which memory (0: the rank's heap; s + 1: its registered segment s, a block of torch's
/// caching allocator, engine/device/segments.h), the low 48 bits the offset. kInScratch: the
/// data goes through the rank's scratch.
constexpr uint64_t kInScratch = ~uint64_t(0);
constexpr int kSegSlots = 64;        // registered segments per rank and group
constexpr int kPlaceShift = 48;
constexpr uint64_t kPlaceOffset = (uint64_t(1) << kPlaceShift) - 1;
struct ShotWhere {
  uint64_t in;   // the input's first element
  uint64_t out;  // the output's (two-shot: where peers write their reduced slices)
};

/// The place of `offset` bytes into registered segment `slot` (ShotWhere).
RAILCC_HD uint64_t shotSegmentPlace(int slot, uint64_t offset) {
  return (static_cast<uint64_t>(slot + 1) << kPlaceShift) | offset;
}

/// What a shot kernel reads to reach its peers, in device memory (one per group).
struct ShotPeers {
  void* scratch[kMaxSignalPeers];     // rank r's scratch, as mapped here
  SignalPad* pads[kMaxSignalPeers];   // rank r's kMaxShotBlocks pads, as mapped here
  ShotWhere* where[kMaxSignalPeers];  // rank r's kMaxShotBlocks where records, as mapped here
  char* heap[kMaxSignalPeers];        // rank r's heap as mapped here (null: it has none)
  // Rank r's registered segment s as mapped here, at [r * kSegSlots + s]: host memory the
  // device reads (pinned), filled by this process's host as peers register segments, and read
  // only for a place a peer published after this process said it had mapped it. Null: none.
  char* const* segs;
};

/// The address, as mapped here, of rank r's place `where` (not kInScratch).
RAILCC_HD char* shotPlace(const ShotPeers* p, int r, uint64_t where) {
  const uint64_t mem = where >> kPlaceShift;
  if (mem == 0) return p->heap[r] + where;
  // Written by this process's host before it acked the place's owner, who published it only
  // then: read at system scope, after the barrier that made the place known.
  return loadPointer(p->segs + static_cast<size_t>(r) * kSegSlots + (mem - 1)) + (where & kPlaceOffset);
}

/// The collectives a shot kernel runs.
enum class ShotKind : uint8_t {
  kAllReduceOne,   // one-shot all-reduce
  kAllReduceTwo,   // two-shot all-reduce
  kAllGather,      // output: n * count elements, rank r's input at r * count
  kReduceScatter,  // input: n * count elements, rank r reduces the block at r * count
  kBroadcast,      // root's input to every other rank's output (the root's output untouched)
  kAllToAll,       // input and output: n * count elements; block r of my input goes to rank r
};

/// One collective.
struct ShotArgs {
  const ShotPeers* peers;
  const void* input;       // this rank's (only this rank touches it)
  void* output;            // this rank's; may be the input (all-reduce, broadcast)
  int me;
  int n;
  int root;                // broadcast
  size_t count;            // elements: the all-reduce's and broadcast's, each rank's block otherwise
  size_t chunk;            // elements the scratch holds: every rank passes the same
  uint32_t* epochs;        // this rank's per-block chunk counts (kMaxShotBlocks), in its own memory
  uint64_t timeoutNs;      // each wait's bound
  uint64_t seq;            // the host's op number, recorded with a failure
  SignalFailure* failure;  // host-mapped: the first failure
  const uint32_t* abort;   // host-mapped, may be null: the host sets it and every wait gives up
  double scale;            // PREMUL_SUM's factor
  ReduceOp op;
  // Where peers find this rank's input and output (ShotWhere): decided by the host, which knows
  // whether they lie in its heap and whether reading them in place is safe for the kind.
  uint64_t inHeap = kInScratch;
  uint64_t outHeap = kInScratch;
};

/// [begin, end) of `count` elements that block b of `blocks` owns. Ranges start on multiples of
/// 16 elements, so that a block's stores never share a 64-byte line with another block's.
RAILCC_HD void shotRange(size_t count, int b, int blocks, size_t* begin, size_t* end) {
  const size_t unit = 16;
  const size_t units = (count + unit - 1) / unit;
  const size_t per = (units + static_cast<size_t>(blocks) - 1) / static_cast<size_t>(blocks);
  size_t s = per * unit * static_cast<size_t>(b), e = s + per * unit;
  if (s > count) s = count;
  if (e > count) e = count;
  *begin = s;
  *end = e;
}

/// Block b's part of the `len` elements of a chunk, for one-shot (`slices` 1, `r` 0) or of slice
/// r of `slices` for two-shot. Parts are cut from the full chunk (`chunk` elements) and then
/// clipped to `len`, so an element of the scratch has the same owner in every chunk of an op:
/// a short last chunk must not hand a block scratch that another block of the same rank may
/// still be copying out of (blocks of one rank do not wait for each other).
RAILCC_HD void shotPart(size_t chunk, size_t len, int r, int slices, int b, int blocks, size_t* begin, size_t* end) {
  size_t ss, se, s, e;
  shotRange(chunk, r, slices, &ss, &se);
  shotRange(se - ss, b, blocks, &s, &e);
  s += ss;
  e += ss;
  *begin = s < len ? s : len;
  *end = e < len ? e : len;
}

/// Every rank's input (and two-shot's output) as one block reads them in its current chunk:
/// filled by the block's first threads after the `in` barrier (thread p asks rank p's where
/// record), read by all. On the device it lies in the block's shared memory, so the peers'
/// records are read once a block, not once a thread; on the host each block thread has its own.
template <typename T>
struct ShotTable {
  const T* src[kMaxSignalPeers];
  T* dst[kMaxSignalPeers];
};

/// How a block's threads work together: the device's block (syncthreads), or one host thread.
/// `shared`: the block's ShotTable in shared memory (device only).
struct ShotThreads {
  int tid;
  int count;
  void* shared = nullptr;
#if defined(__CUDA_ARCH__)
  __device__ bool anyAfterSync(bool v) const { return __syncthreads_or(v) != 0; }
  __device__ void sync() const { __syncthreads(); }
#else
  bool anyAfterSync(bool v) const { return v; }
  void sync() const {}
#endif
};

/// Block b's barrier number `k` (1 = in, 2 = out) of its chunk number `epoch`: signal every
/// peer's pad b, then wait until each has signalled this rank's pad b 2*epoch + k times. False
/// when a wait failed (recorded in args.failure); every thread of the block gets the same answer.
RAILCC_HD bool shotBarrier(const ShotArgs& a, int b, uint32_t epoch, uint32_t k, uint64_t deadline, const ShotThreads& t) {
  t.sync();  // this block's earlier writes come before its signal (release is cumulative)
  for (int p = t.tid; p < a.n; p += t.count)
    if (p != a.me) signalPeer(&a.peers->pads[p][b], a.me);
  bool failed = false;
  const uint32_t expected = 2u * epoch + k;
  for (int p = t.tid; p < a.n; p += t.count)
    if (p != a.me && signalWait(&a.peers->pads[a.me][b], p, expected, deadline, a.seq, a.failure, a.abort) != kSignalled)
      failed = true;
  return !t.anyAfterSync(failed);
}

template <typename T>
RAILCC_HD T shotFinish(typename Accum<T>::type acc, const ShotArgs& a) {
  using A = typename Accum<T>::type;
  if (a.op == ReduceOp::kAvg) acc = static_cast<A>(static_cast<double>(acc) / a.n);
  if (a.op == ReduceOp::kPremulSum) acc = static_cast<A>(static_cast<double>(acc) * a.scale);
  return Accum<T>::out(acc);
}

/// 16 bytes of elements, moved with one vector load or store where both sides are aligned.
template <typename T>
struct alignas(16) ShotPack {
  T v[16 / sizeof(T)];
};

RAILCC_HD bool shotAligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T>
RAILCC_HD void shotCopy(T* dst, const T* src, size_t s, size_t e, const ShotThreads& t) {
  constexpr size_t kLanes = 16 / sizeof(T);
  size_t i0 = s;
  if (shotAligned(dst + s) && shotAligned(src + s)) {
    const size_t packs = (e - s) / kLanes;
    auto* d = reinterpret_cast<ShotPack<T>*>(dst + s);
    const auto* q = reinterpret_cast<const ShotPack<T>*>(src + s);
    for (size_t k = static_cast<size_t>(t.tid); k < packs; k += static_cast<size_t>(t.count)) d[k] = q[k];
    i0 = s + packs * kLanes;
  }
  for (size_t i = i0 + static_cast<size_t>(t.tid); i < e; i += static_cast<size_t>(t.count)) dst[i] = src[i];
}

/// For i in [s, e): src[0][i], ..., src[n-1][i] reduced in rank order, stored at dst[0][i], ...,
/// dst[ndst-1][i] (one-shot and reduce-scatter: my output; two-shot: every rank's).
template <typename T, typename Op>
RAILCC_HD void shotReduce(const ShotArgs& a, const T* const* src, T* const* dst, int ndst, size_t s, size_t e,
                          const ShotThreads& t) {
  using W = Accum<T>;
  // 16 bytes a load where every side is aligned (the scratch always is, parts start on 16
  // elements); the same arithmetic in the same order, lane by lane.
  constexpr size_t kLanes = 16 / sizeof(T);
  size_t i0 = s;
  bool aligned = true;
  for (int r = 0; r < a.n && aligned; ++r) aligned = shotAligned(src[r] + s);
  for (int r = 0; r < ndst && aligned; ++r) aligned = shotAligned(dst[r] + s);
  if (aligned) {
    const size_t packs = (e - s) / kLanes;
    for (size_t k = static_cast<size_t>(t.tid); k < packs; k += static_cast<size_t>(t.count)) {
      const size_t i = s + k * kLanes;
      ShotPack<T> x = *reinterpret_cast<const ShotPack<T>*>(src[0] + i);
      typename W::type acc[kLanes];
      for (size_t j = 0; j < kLanes; ++j) acc[j] = W::in(x.v[j]);
      for (int r = 1; r < a.n; ++r) {
        x = *reinterpret_cast<const ShotPack<T>*>(src[r] + i);
        for (size_t j = 0; j < kLanes; ++j) acc[j] = Op::apply(acc[j], W::in(x.v[j]));
      }
      for (size_t j = 0; j < kLanes; ++j) x.v[j] = shotFinish<T>(acc[j], a);
      for (int r = 0; r < ndst; ++r) *reinterpret_cast<ShotPack<T>*>(dst[r] + i) = x;
    }
    i0 = s + packs * kLanes;
  }
  for (size_t i = i0 + static_cast<size_t>(t.tid); i < e; i += static_cast<size_t>(t.count)) {
    typename W::type acc = W::in(src[0][i]);
    for (int r = 1; r < a.n; ++r) acc = Op::apply(acc, W::in(src[r][i]));
    const T v = shotFinish<T>(acc, a);
    for (int r = 0; r < ndst; ++r) dst[r][i] = v;
  }
}

/// Rank r's input as this rank reads it in block b's current chunk: in r's heap, where r said it
/// is (its where record), `heapAt` elements past the input's start; else in r's scratch,
/// `scratchAt` elements in. Read after the chunk's `in` barrier, which publishes the record.
template <typename T>
RAILCC_HD const T* shotInput(const ShotArgs& a, int b, int r, size_t scratchAt, size_t heapAt) {
  const uint64_t off = a.peers->where[r][b].in;
  if (off == kInScratch) return static_cast<const T*>(a.peers->scratch[r]) + scratchAt;
  return reinterpret_cast<const T*>(shotPlace(a.peers, r, off)) + heapAt;
}

/// Rank r's output the same way (two-shot writes its reduced slice into every rank's).
template <typename T>
RAILCC_HD T* shotOutput(const ShotArgs& a, int b, int r, size_t heapAt) {
  const uint64_t off = a.peers->where[r][b].out;
  if (off == kInScratch) return static_cast<T*>(a.peers->scratch[r]);
  return reinterpret_cast<T*>(shotPlace(a.peers, r, off)) + heapAt;
}

/// `tb`, a ShotTable<T>& for block functions: the block's shared one on the device, a local on
/// the host.
#if defined(__CUDA_ARCH__)
#define RAILCC_SHOT_TABLE(T, tb) ShotTable<T>& tb = *static_cast<ShotTable<T>*>(t.shared)
#else
#define RAILCC_SHOT_TABLE(T, tb) \
  ShotTable<T> tb##Own;          \
  ShotTable<T>& tb = tb##Own
#endif

/// The skeleton of every kind, block b's side: publish where this rank's input and output lie,
/// then for each chunk of `per` elements of `total`: stage(c0, len) (my data into my scratch),
/// barrier `in`, use(c0, len) (read, and for two-shot write, peers' memory), barrier `out`,
/// done(c0, len) (out of my scratch), and the block's count moves on. False when a peer did not
/// come (recorded in args.failure; the output is then incomplete).
template <typename Stage, typename Use, typename Done>
RAILCC_HD bool shotChunks(const ShotArgs& a, int b, size_t total, size_t per, const ShotThreads& t, uint64_t deadline,
                          Stage&& stage, Use&& use, Done&& done) {
  // Peers read the record only between this op's barriers, and the previous op's last `out`
  // barrier said that each had finished with the previous record.
  if (t.tid == 0) a.peers->where[a.me][b] = ShotWhere{a.inHeap, a.outHeap};
  for (size_t c0 = 0; c0 < total; c0 += per) {
    const size_t len = total - c0 < per ? total - c0 : per;
    const uint32_t epoch = a.epochs[b];
    stage(c0, len);
    if (!shotBarrier(a, b, epoch, 1, deadline, t)) return false;
    use(c0, len);
    if (!shotBarrier(a, b, epoch, 2, deadline, t)) return false;
    done(c0, len);
    if (t.tid == 0) a.epochs[b] = epoch + 1;
    t.sync();
  }
  return true;
}

/// Stage: sets [s, e), block b's part of this chunk (`len` elements of `per`), and copies that
/// part of my input, elements [c0 + s, c0 + e), into my scratch, unless peers read it in my heap
/// (or `copy` is false: a broadcast's non-root). `eachBlock` (reduce-scatter, all-to-all): that
/// part of each of my n blocks of `a.count`, block r at r * per of the scratch.
template <typename T>
RAILCC_HD void shotStage(const ShotArgs& a, int b, int blocks, size_t per, size_t c0, size_t len, bool eachBlock,
                         bool copy, size_t* s, size_t* e, const ShotThreads& t) {
  shotPart(per, len, 0, 1, b, blocks, s, e);
  if (!copy || a.inHeap != kInScratch) return;
  const T* in = static_cast<const T*>(a.input);
  T* mine = static_cast<T*>(a.peers->scratch[a.me]);
  const int n = eachBlock ? a.n : 1;
  for (int r = 0; r < n; ++r)
    shotCopy(mine + static_cast<size_t>(r) * per, in + static_cast<size_t>(r) * a.count + c0, *s, *e, t);
}

/// Every rank's input, as shotInput() finds it, into the block's table; then the block syncs.
template <typename T>
RAILCC_HD void shotInputs(const ShotArgs& a, int b, size_t scratchAt, size_t heapAt, ShotTable<T>& tb,
                          const ShotThreads& t) {
  for (int r = t.tid; r < a.n; r += t.count) tb.src[r] = shotInput<T>(a, b, r, scratchAt, heapAt);
  t.sync();
}

/// One-shot all-reduce: my part of the chunk into my scratch (unless peers read my heap); in;
/// that part of every rank's input reduced into my output; out.
template <typename T, typename Op>
RAILCC_HD bool oneShotBlock(const ShotArgs& a, int b, int blocks, const ShotThreads& t, uint64_t deadline) {
  T* out = static_cast<T*>(a.output);
  size_t s = 0, e = 0;
  RAILCC_SHOT_TABLE(T, tb);
  return shotChunks(
      a, b, a.count, a.chunk, t, deadline,
      [&](size_t c0, size_t len) { shotStage<T>(a, b, blocks, a.chunk, c0, len, false, true, &s, &e, t); },
      [&](size_t c0, size_t) {
        shotInputs<T>(a, b, 0, c0, tb, t);
        T* dst = out + c0;
        shotReduce<T, Op>(a, tb.src, &dst, 1, s, e, t);
      },
      [](size_t, size_t) {});
}

/// Two-shot all-reduce: my part of every slice of the chunk into my scratch (unless in my
/// heap); in; my part of my slice reduced from every rank's input and written into every rank's
/// output (its heap, or its scratch); out; my output's slices out of my scratch (unless in my
/// heap, where peers wrote them).
template <typename T, typename Op>
RAILCC_HD bool twoShotBlock(const ShotArgs& a, int b, int blocks, const ShotThreads& t, uint64_t deadline) {
  const T* in = static_cast<const T*>(a.input);
  T* out = static_cast<T*>(a.output);
  T* mine = static_cast<T*>(a.peers->scratch[a.me]);
  RAILCC_SHOT_TABLE(T, tb);
  return shotChunks(
      a, b, a.count, a.chunk, t, deadline,
      [&](size_t c0, size_t len) {
        if (a.inHeap != kInScratch) return;
        for (int r = 0; r < a.n; ++r) {  // block b's part of every slice: what peers' block b reads
          size_t s, e;
          shotPart(a.chunk, len, r, a.n, b, blocks, &s, &e);
          shotCopy(mine, in + c0, s, e, t);
        }
      },
      [&](size_t c0, size_t len) {
        size_t s, e;
        shotPart(a.chunk, len, a.me, a.n, b, blocks, &s, &e);
        for (int r = t.tid; r < a.n; r += t.count) {
          tb.src[r] = shotInput<T>(a, b, r, 0, c0);
          tb.dst[r] = shotOutput<T>(a, b, r, c0);
        }
        t.sync();
        shotReduce<T, Op>(a, tb.src, tb.dst, a.n, s, e, t);
      },
      [&](size_t c0, size_t len) {
        if (a.outHeap != kInScratch) return;
        for (int r = 0; r < a.n; ++r) {  // every slice's part b is in my scratch now
          size_t s, e;
          shotPart(a.chunk, len, r, a.n, b, blocks, &s, &e);
          shotCopy(out + c0, mine, s, e, t);
        }
      });
}

/// All-gather: my part of the chunk into my scratch (unless in my heap); in; that part of every
/// rank's input into its place in my output (mine too, unless it is there already); out.
template <typename T>
RAILCC_HD bool allGatherBlock(const ShotArgs& a, int b, int blocks, const ShotThreads& t, uint64_t deadline) {
  T* out = static_cast<T*>(a.output);
  size_t s = 0, e = 0;
  RAILCC_SHOT_TABLE(T, tb);
  return shotChunks(
      a, b, a.count, a.chunk, t, deadline,
      [&](size_t c0, size_t len) { shotStage<T>(a, b, blocks, a.chunk, c0, len, false, true, &s, &e, t); },
      [&](size_t c0, size_t) {
        shotInputs<T>(a, b, 0, c0, tb, t);
        for (int r = 0; r < a.n; ++r) {
          T* dst = out + static_cast<size_t>(r) * a.count + c0;
          if (dst != tb.src[r]) shotCopy(dst, tb.src[r], s, e, t);
        }
      },
      [](size_t, size_t) {});
}

/// Broadcast: the root's part of the chunk into its scratch (unless in its heap); in; every
/// other rank copies that part of the root's input into its output; out.
template <typename T>
RAILCC_HD bool broadcastBlock(const ShotArgs& a, int b, int blocks, const ShotThreads& t, uint64_t deadline) {
  T* out = static_cast<T*>(a.output);
  size_t s = 0, e = 0;
  return shotChunks(
      a, b, a.count, a.chunk, t, deadline,
      [&](size_t c0, size_t len) { shotStage<T>(a, b, blocks, a.chunk, c0, len, false, a.me == a.root, &s, &e, t); },
      [&](size_t c0, size_t) {
        if (a.me != a.root) shotCopy(out + c0, shotInput<T>(a, b, a.root, 0, c0), s, e, t);
      },
      [](size_t, size_t) {});
}

/// Elements of each rank's block that one chunk of a reduce-scatter carries: the scratch holds
/// that many of every block, in rank order (a multiple of 16, at least 16; 0 if it cannot).
RAILCC_HD size_t shotScatterChunk(size_t chunk, int n) {
  const size_t per = chunk / static_cast<size_t>(n) / 16 * 16;
  return per;
}

/// Reduce-scatter: my part of this chunk of every rank's block into my scratch, block r at
/// r * per (unless in my heap); in; my part of my block reduced from every rank's input into my
/// output; out.
template <typename T, typename Op>
RAILCC_HD bool reduceScatterBlock(const ShotArgs& a, int b, int blocks, const ShotThreads& t, uint64_t deadline) {
  T* out = static_cast<T*>(a.output);
  const size_t per = shotScatterChunk(a.chunk, a.n);
  if (per == 0) return false;  // refused at launch
  const size_t me = static_cast<size_t>(a.me);
  size_t s = 0, e = 0;
  RAILCC_SHOT_TABLE(T, tb);
  return shotChunks(
      a, b, a.count, per, t, deadline,
      [&](size_t c0, size_t len) { shotStage<T>(a, b, blocks, per, c0, len, true, true, &s, &e, t); },
      [&](size_t c0, size_t) {
        shotInputs<T>(a, b, me * per, me * a.count + c0, tb, t);
        T* dst = out + c0;
        shotReduce<T, Op>(a, tb.src, &dst, 1, s, e, t);
      },
      [](size_t, size_t) {});
}

/// All-to-all of equal blocks: my part of this chunk of every block of my input into my scratch,
/// block r at r * per (unless in my heap); in; my part of block `me` of every rank's input into
/// block r of my output; out. Laid out as reduce-scatter's input, moved instead of reduced.
template <typename T>
RAILCC_HD bool allToAllBlock(const ShotArgs& a, int b, int blocks, const ShotThreads& t, uint64_t deadline) {
  T* out = static_cast<T*>(a.output);
  const size_t per = shotScatterChunk(a.chunk, a.n);
  if (per == 0) return false;  // refused at launch
  const size_t me = static_cast<size_t>(a.me);
  size_t s = 0, e = 0;
  RAILCC_SHOT_TABLE(T, tb);
  return shotChunks(
      a, b, a.count, per, t, deadline,
      [&](size_t c0, size_t len) { shotStage<T>(a, b, blocks, per, c0, len, true, true, &s, &e, t); },
      [&](size_t c0, size_t) {
        shotInputs<T>(a, b, me * per, me * a.count + c0, tb, t);
        for (int r = 0; r < a.n; ++r) shotCopy(out + static_cast<size_t>(r) * a.count + c0, tb.src[r], s, e, t);
      },
      [](size_t, size_t) {});
}

/// Whether a launch of kind `k` with `blocks` blocks can run `a` (the launchers refuse it
/// otherwise, before any rank waits on it).
RAILCC_HD bool shotArgsValid(const ShotArgs& a, ShotKind k, int blocks) {
  if (a.n < 1 || a.n > kMaxSignalPeers || a.me < 0 || a.me >= a.n || blocks < 1 || blocks > kMaxShotBlocks ||
      a.peers == nullptr || a.epochs == nullptr || a.chunk == 0)
    return false;
  if (k == ShotKind::kBroadcast && (a.root < 0 || a.root >= a.n)) return false;
  if ((k == ShotKind::kReduceScatter || k == ShotKind::kAllToAll) && shotScatterChunk(a.chunk, a.n) == 0) return false;
  return true;
}

/// Block b of kind `k`: the reducing kinds with (T, Op); all-gather and broadcast move T as bits.
template <typename T, typename Op>
RAILCC_HD bool shotBlock(ShotKind k, const ShotArgs& a, int b, int blocks, const ShotThreads& t, uint64_t deadline) {
  switch (k) {
    case ShotKind::kAllReduceOne: return oneShotBlock<T, Op>(a, b, blocks, t, deadline);
    case ShotKind::kAllReduceTwo: return twoShotBlock<T, Op>(a, b, blocks, t, deadline);
    case ShotKind::kReduceScatter: return reduceScatterBlock<T, Op>(a, b, blocks, t, deadline);
    case ShotKind::kAllGather: return allGatherBlock<T>(a, b, blocks, t, deadline);
    case ShotKind::kBroadcast: return broadcastBlock<T>(a, b, blocks, t, deadline);
    case ShotKind::kAllToAll: return allToAllBlock<T>(a, b, blocks, t, deadline);
  }
  return false;
}

/// What a rank publishes for an op of kind `k` (ShotArgs::inHeap, outHeap): the places of its
/// input and output where `place(p, bytes)` finds them wholly in registered memory (else it
/// returns kInScratch) and peers may touch them in place; else kInScratch. In place means peers
/// read my input while I write my output, so the input is published only where the two are
/// apart or alias the way the kind expects (my block of the all-gather's output, the
/// reduce-scatter's output my block of its input, the two-shot's and broadcast's output the
/// input itself), and never for an in-place one-shot, whose every rank would be writing what
/// the others still read. The output matters to two-shot alone, whose peers write into it.
/// Host code (the engine, the tests).
template <typename Place>
void shotPublishAt(ShotKind k, int me, const void* in, size_t inBytes, const void* out, size_t outBytes, Place&& place,
                   uint64_t* pubIn, uint64_t* pubOut) {
  const char* i = static_cast<const char*>(in);
  const char* o = static_cast<const char*>(out);
  const size_t m = static_cast<size_t>(me);
  const bool apart = inBytes == 0 || outBytes == 0 || i + inBytes <= o || o + outBytes <= i;
  bool alias = false;
  switch (k) {
    case ShotKind::kAllReduceOne: break;
    case ShotKind::kAllReduceTwo: case ShotKind::kBroadcast: alias = i == o; break;
    case ShotKind::kAllGather: alias = i == o + m * inBytes; break;
    case ShotKind::kReduceScatter: alias = o == i + m * outBytes; break;
    case ShotKind::kAllToAll: break;  // my block r is written while rank r reads it
  }
  *pubIn = apart || alias ? place(in, inBytes) : kInScratch;
  *pubOut = k == ShotKind::kAllReduceTwo && (apart || alias) ? place(out, outBytes) : kInScratch;
}

/// The offset of [p, p + bytes) in [base, base + size), or kInScratch where it is not wholly
/// inside (or there is no base).
inline uint64_t shotOffsetIn(const char* base, size_t size, const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  if (base == nullptr || c == nullptr || c < base || bytes > size || static_cast<size_t>(c - base) > size - bytes)
    return kInScratch;
  return static_cast<uint64_t>(c - base);
}

/// shotPublishAt() with the heap [heap, heap + heapBytes) as the only registered memory.
inline void shotPublish(ShotKind k, int me, const char* heap, size_t heapBytes, const void* in, size_t inBytes,
                        const void* out, size_t outBytes, uint64_t* pubIn, uint64_t* pubOut) {
  shotPublishAt(k, me, in, inBytes, out, outBytes,
                [&](const void* p, size_t bytes) { return shotOffsetIn(heap, heapBytes, p, bytes); }, pubIn, pubOut);
}

/// Bytes of an element of t (common/types.h's dtypeSize lives in the engine, which the CUDA
/// plugin does not link).
inline size_t shotElementBytes(DataType t) {
  switch (t) {
    case DataType::kFloat64: case DataType::kInt64: return 8;
    case DataType::kFloat32: case DataType::kInt32: return 4;
    case DataType::kFloat16: case DataType::kBFloat16: case DataType::kInt16: return 2;
    case DataType::kInt8: case DataType::kUInt8: case DataType::kBool: return 1;
  }
  return 0;
}

/// Whether shots reduce (op, t): what railcc reduces anywhere, bools through the bitwise ops.
inline bool shotSupported(DataType t, ReduceOp op) {
  const bool fl = t == DataType::kFloat32 || t == DataType::kFloat64 || t == DataType::kFloat16 || t == DataType::kBFloat16;
  switch (op) {
    case ReduceOp::kAvg: case ReduceOp::kPremulSum: return fl;
    case ReduceOp::kBand: case ReduceOp::kBor: case ReduceOp::kBxor: return !fl;
    default: return true;
  }
}

/// Calls f.template run<T, Op>() for a reducing kind `k` on (t, op), with `Half` and
/// `BFloat16` the caller's types for the 16-bit floats (void where it has none: then those
/// return `invalid`, as does a pair that shotSupported() refuses). All-gather and broadcast only
/// move elements: f.template move<U>() with U the unsigned type of t's size. Host code: the
/// kernels' launcher and the fake runtime of the tests.
template <typename Half, typename BFloat16, typename F>
int shotDispatch(ShotKind k, DataType t, ReduceOp op, F&& f, int invalid) {
  if (k == ShotKind::kAllGather || k == ShotKind::kBroadcast || k == ShotKind::kAllToAll) {
    switch (shotElementBytes(t)) {
      case 1: return f.template move<uint8_t>();
      case 2: return f.template move<uint16_t>();
      case 4: return f.template move<uint32_t>();
      case 8: return f.template move<uint64_t>();
      default: return invalid;
    }
  }
  if (!shotSupported(t, op)) return invalid;
  auto arith = [&](auto opTag) -> int {
    using O = decltype(opTag);
    switch (t) {
      case DataType::kFloat32: return f.template run<float, O>();
      case DataType::kFloat64: return f.template run<double, O>();
      case DataType::kFloat16:
        if constexpr (std::is_void_v<Half>) return invalid;
        else return f.template run<Half, O>();
      case DataType::kBFloat16:
        if constexpr (std::is_void_v<BFloat16>) return invalid;
        else return f.template run<BFloat16, O>();
      case DataType::kInt8: return f.template run<int8_t, O>();
      case DataType::kUInt8: case DataType::kBool: return f.template run<uint8_t, O>();
      case DataType::kInt16: return f.template run<int16_t, O>();
      case DataType::kInt32: return f.template run<int32_t, O>();
      case DataType::kInt64: return f.template run<int64_t, O>();
    }
    return invalid;
  };
  auto bits = [&](auto opTag) -> int {
    using O = decltype(opTag);
    switch (t) {
      case DataType::kInt8: return f.template run<int8_t, O>();
      case DataType::kUInt8: case DataType::kBool: return f.template run<uint8_t, O>();
      case DataType::kInt16: return f.template run<int16_t, O>();
      case DataType::kInt32: return f.template run<int32_t, O>();
      case DataType::kInt64: return f.template run<int64_t, O>();
      default: return invalid;
    }
  };
  if (t == DataType::kBool) {  // 0 or 1: the logical ops are the bitwise ones
    switch (op) {
      case ReduceOp::kSum: case ReduceOp::kMax: case ReduceOp::kBor: return bits(ShotBor{});
      case ReduceOp::kProduct: case ReduceOp::kMin: case ReduceOp::kBand: return bits(ShotBand{});
      case ReduceOp::kBxor: return bits(ShotBxor{});
      default: return invalid;
    }
  }
  switch (op) {
    case ReduceOp::kSum: case ReduceOp::kAvg: case ReduceOp::kPremulSum: return arith(ShotSum{});
    case ReduceOp::kProduct: return arith(ShotProd{});
    case ReduceOp::kMin: return arith(ShotMin{});
    case ReduceOp::kMax: return arith(ShotMax{});
    case ReduceOp::kBand: return bits(ShotBand{});
    case ReduceOp::kBor: return bits(ShotBor{});
    case ReduceOp::kBxor: return bits(ShotBxor{});
  }
  return invalid;
}

#undef RAILCC_SHOT_TABLE

}  // namespace railcc::cuda
