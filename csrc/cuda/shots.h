#pragma once
// One-kernel collectives through peers' memory: all-reduce one-shot (every rank reads every
// rank's data and reduces all of it) and two-shot (every rank reduces a slice and writes it to
// every rank), all-gather, reduce-scatter and broadcast (ShotKind). Written once for both
// sides, as signals.h is: nvcc compiles it into the kernels
// (shot_kernels.cu), with a block of threads per worker, and the host compiler into
// tests/cpp/shots_test.cpp, where a CPU thread plays each (rank, block) on host memory.
//
// The layout
// * Every rank has a scratch buffer and kMaxShotBlocks signal pads in memory its peers map,
//   made and exchanged once per group. A table (ShotPeers, in device memory, filled once and
//   never per op) holds every rank's scratch and pads as mapped in this process; a captured CUDA
//   graph keeps the table's address.
// * The user's input and output are only ever touched by their own rank: the kernel copies the
//   input into its scratch, and peers read (and two-shot writes) scratch only. So no rank needs
//   to learn its peers' buffers: there is no host exchange per op, whatever the caller passes.
//   (Buffers registered once, read in place, would save the copies.)
// * The data goes through the scratch in chunks (as many elements as the scratch holds), one
//   after another within the one kernel. Elements of a chunk are split into per-block ranges the
//   same way on every rank, so block b of one rank only ever needs block b of its peers, and
//   each block signals and waits on its own pad b.
// * Each block keeps its own count of chunks done in this rank's memory (`epochs[b]`), read at
//   the start and advanced with every chunk: the expected signal counts come from the device,
//   not from a kernel argument, so a replayed graph waits for the right counts.
//
// A chunk is two barriers per block: `in` (my scratch holds my data) and `out` (I have finished
// reading your scratch and, for two-shot, writing my slice into it). After `out` a rank may
// refill its scratch. Signals per chunk per (block, peer): 2.
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

/// What a shot kernel reads to reach its peers, in device memory (one per group).
struct ShotPeers {
  void* scratch[kMaxSignalPeers];    // rank r's scratch, as mapped here
  SignalPad* pads[kMaxSignalPeers];  // rank r's kMaxShotBlocks pads, as mapped here
};

/// The collectives a shot kernel runs.
enum class ShotKind : uint8_t {
  kAllReduceOne,   // one-shot all-reduce
  kAllReduceTwo,   // two-shot all-reduce
  kAllGather,      // output: n * count elements, rank r's input at r * count
  kReduceScatter,  // input: n * count elements, rank r reduces the block at r * count
  kBroadcast,      // root's input to every other rank's output (the root's output untouched)
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

/// How a block's threads work together: the device's block (syncthreads), or one host thread.
struct ShotThreads {
  int tid;
  int count;
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

/// For i in [s, e) of a chunk: every rank's scratch[at + i] reduced in rank order, stored at
/// `dst[i]` (kEveryRank false) or in every rank's scratch at the same place (true).
template <typename T, typename Op, bool kEveryRank>
RAILCC_HD void shotReduce(const ShotArgs& a, size_t at, size_t s, size_t e, T* dst, const ShotThreads& t) {
  using W = Accum<T>;
  const ShotPeers& p = *a.peers;
  // 16 bytes a load where every side is aligned (the scratch always is, parts start on 16
  // elements); the same arithmetic in the same order, lane by lane.
  constexpr size_t kLanes = 16 / sizeof(T);
  size_t i0 = s;
  bool aligned = shotAligned(static_cast<const T*>(p.scratch[0]) + at + s) && (kEveryRank || shotAligned(dst + s));
  for (int r = 1; r < a.n && aligned; ++r) aligned = shotAligned(static_cast<const T*>(p.scratch[r]) + at + s);
  if (aligned) {
    const size_t packs = (e - s) / kLanes;
    for (size_t k = static_cast<size_t>(t.tid); k < packs; k += static_cast<size_t>(t.count)) {
      const size_t i = s + k * kLanes;
      ShotPack<T> x = *reinterpret_cast<const ShotPack<T>*>(static_cast<const T*>(p.scratch[0]) + at + i);
      typename W::type acc[kLanes];
      for (size_t j = 0; j < kLanes; ++j) acc[j] = W::in(x.v[j]);
      for (int r = 1; r < a.n; ++r) {
        x = *reinterpret_cast<const ShotPack<T>*>(static_cast<const T*>(p.scratch[r]) + at + i);
        for (size_t j = 0; j < kLanes; ++j) acc[j] = Op::apply(acc[j], W::in(x.v[j]));
      }
      for (size_t j = 0; j < kLanes; ++j) x.v[j] = shotFinish<T>(acc[j], a);
      if (kEveryRank) {
        for (int r = 0; r < a.n; ++r) *reinterpret_cast<ShotPack<T>*>(static_cast<T*>(p.scratch[r]) + at + i) = x;
      } else {
        *reinterpret_cast<ShotPack<T>*>(dst + i) = x;
      }
    }
    i0 = s + packs * kLanes;
  }
  for (size_t i = i0 + static_cast<size_t>(t.tid); i < e; i += static_cast<size_t>(t.count)) {
    typename W::type acc = W::in(static_cast<const T*>(p.scratch[0])[at + i]);
    for (int r = 1; r < a.n; ++r) acc = Op::apply(acc, W::in(static_cast<const T*>(p.scratch[r])[at + i]));
    const T v = shotFinish<T>(acc, a);
    if (kEveryRank) {
      for (int r = 0; r < a.n; ++r) static_cast<T*>(p.scratch[r])[at + i] = v;
    } else {
      dst[i] = v;
    }
  }
}

/// Block b of this rank's one-shot all-reduce, chunk by chunk: copy my part of the chunk into
/// my scratch; in; reduce that part from every rank's scratch into my output; out. False when a
/// peer did not come (recorded; the output is then incomplete).
template <typename T, typename Op>
RAILCC_HD bool oneShotBlock(const ShotArgs& a, int b, int blocks, const ShotThreads& t, uint64_t deadline) {
  const T* in = static_cast<const T*>(a.input);
  T* out = static_cast<T*>(a.output);
  T* mine = static_cast<T*>(a.peers->scratch[a.me]);
  for (size_t c0 = 0; c0 < a.count; c0 += a.chunk) {
    const size_t len = a.count - c0 < a.chunk ? a.count - c0 : a.chunk;
    const uint32_t epoch = a.epochs[b];
    size_t s, e;
    shotPart(a.chunk, len, 0, 1, b, blocks, &s, &e);
    shotCopy(mine, in + c0, s, e, t);
    if (!shotBarrier(a, b, epoch, 1, deadline, t)) return false;
    shotReduce<T, Op, false>(a, 0, s, e, out + c0, t);
    if (!shotBarrier(a, b, epoch, 2, deadline, t)) return false;
    if (t.tid == 0) a.epochs[b] = epoch + 1;
    t.sync();
  }
  return true;
}

/// Block b of this rank's two-shot all-reduce, chunk by chunk: copy my part of every slice of
/// the chunk into my scratch; in; reduce my part of my slice from every scratch and write it
/// into every scratch; out; copy my part of every slice from my scratch to my output.
template <typename T, typename Op>
RAILCC_HD bool twoShotBlock(const ShotArgs& a, int b, int blocks, const ShotThreads& t, uint64_t deadline) {
  const T* in = static_cast<const T*>(a.input);
  T* out = static_cast<T*>(a.output);
  T* mine = static_cast<T*>(a.peers->scratch[a.me]);
  for (size_t c0 = 0; c0 < a.count; c0 += a.chunk) {
    const size_t len = a.count - c0 < a.chunk ? a.count - c0 : a.chunk;
    const uint32_t epoch = a.epochs[b];
    size_t s, e;
    for (int r = 0; r < a.n; ++r) {  // block b's part of every slice: what peers' block b reads
      shotPart(a.chunk, len, r, a.n, b, blocks, &s, &e);
      shotCopy(mine, in + c0, s, e, t);
    }
    if (!shotBarrier(a, b, epoch, 1, deadline, t)) return false;
    shotPart(a.chunk, len, a.me, a.n, b, blocks, &s, &e);
    shotReduce<T, Op, true>(a, 0, s, e, nullptr, t);
    if (!shotBarrier(a, b, epoch, 2, deadline, t)) return false;
    for (int r = 0; r < a.n; ++r) {  // every slice's part b is in my scratch now
      shotPart(a.chunk, len, r, a.n, b, blocks, &s, &e);
      shotCopy(out + c0, mine, s, e, t);
    }
    if (t.tid == 0) a.epochs[b] = epoch + 1;
    t.sync();
  }
  return true;
}

/// Block b of this rank's all-gather, chunk by chunk: copy my part of the chunk into my
/// scratch; in; copy that part of every rank's scratch into its place in my output; out.
template <typename T>
RAILCC_HD bool allGatherBlock(const ShotArgs& a, int b, int blocks, const ShotThreads& t, uint64_t deadline) {
  const T* in = static_cast<const T*>(a.input);
  T* out = static_cast<T*>(a.output);
  T* mine = static_cast<T*>(a.peers->scratch[a.me]);
  for (size_t c0 = 0; c0 < a.count; c0 += a.chunk) {
    const size_t len = a.count - c0 < a.chunk ? a.count - c0 : a.chunk;
    const uint32_t epoch = a.epochs[b];
    size_t s, e;
    shotPart(a.chunk, len, 0, 1, b, blocks, &s, &e);
    shotCopy(mine, in + c0, s, e, t);
    if (!shotBarrier(a, b, epoch, 1, deadline, t)) return false;
    for (int r = 0; r < a.n; ++r)
      shotCopy(out + static_cast<size_t>(r) * a.count + c0, static_cast<const T*>(a.peers->scratch[r]), s, e, t);
    if (!shotBarrier(a, b, epoch, 2, deadline, t)) return false;
    if (t.tid == 0) a.epochs[b] = epoch + 1;
    t.sync();
  }
  return true;
}

/// Block b of this rank's broadcast: the root copies its part of the chunk into its scratch;
/// in; every other rank copies that part of the root's scratch into its output; out.
template <typename T>
RAILCC_HD bool broadcastBlock(const ShotArgs& a, int b, int blocks, const ShotThreads& t, uint64_t deadline) {
  const T* in = static_cast<const T*>(a.input);
  T* out = static_cast<T*>(a.output);
  const T* root = static_cast<const T*>(a.peers->scratch[a.root]);
  for (size_t c0 = 0; c0 < a.count; c0 += a.chunk) {
    const size_t len = a.count - c0 < a.chunk ? a.count - c0 : a.chunk;
    const uint32_t epoch = a.epochs[b];
    size_t s, e;
    shotPart(a.chunk, len, 0, 1, b, blocks, &s, &e);
    if (a.me == a.root) shotCopy(static_cast<T*>(a.peers->scratch[a.me]), in + c0, s, e, t);
    if (!shotBarrier(a, b, epoch, 1, deadline, t)) return false;
    if (a.me != a.root) shotCopy(out + c0, root, s, e, t);
    if (!shotBarrier(a, b, epoch, 2, deadline, t)) return false;
    if (t.tid == 0) a.epochs[b] = epoch + 1;
    t.sync();
  }
  return true;
}

/// Elements of each rank's block that one chunk of a reduce-scatter carries: the scratch holds
/// that many of every block, in rank order (a multiple of 16, at least 16; 0 if it cannot).
RAILCC_HD size_t shotScatterChunk(size_t chunk, int n) {
  const size_t per = chunk / static_cast<size_t>(n) / 16 * 16;
  return per;
}

/// Block b of this rank's reduce-scatter: copy my part of every rank's block (this chunk of
/// it) into my scratch, block r at r * per; in; reduce my part of my block from every rank's
/// scratch into my output; out.
template <typename T, typename Op>
RAILCC_HD bool reduceScatterBlock(const ShotArgs& a, int b, int blocks, const ShotThreads& t, uint64_t deadline) {
  const T* in = static_cast<const T*>(a.input);
  T* out = static_cast<T*>(a.output);
  T* mine = static_cast<T*>(a.peers->scratch[a.me]);
  const size_t per = shotScatterChunk(a.chunk, a.n);
  if (per == 0) return false;  // refused at launch
  for (size_t c0 = 0; c0 < a.count; c0 += per) {
    const size_t len = a.count - c0 < per ? a.count - c0 : per;
    const uint32_t epoch = a.epochs[b];
    size_t s, e;
    shotPart(per, len, 0, 1, b, blocks, &s, &e);
    for (int r = 0; r < a.n; ++r)
      shotCopy(mine + static_cast<size_t>(r) * per, in + static_cast<size_t>(r) * a.count + c0, s, e, t);
    if (!shotBarrier(a, b, epoch, 1, deadline, t)) return false;
    shotReduce<T, Op, false>(a, static_cast<size_t>(a.me) * per, s, e, out + c0, t);
    if (!shotBarrier(a, b, epoch, 2, deadline, t)) return false;
    if (t.tid == 0) a.epochs[b] = epoch + 1;
    t.sync();
  }
  return true;
}

/// Whether a launch of kind `k` with `blocks` blocks can run `a` (the launchers refuse it
/// otherwise, before any rank waits on it).
RAILCC_HD bool shotArgsValid(const ShotArgs& a, ShotKind k, int blocks) {
  if (a.n < 1 || a.n > kMaxSignalPeers || a.me < 0 || a.me >= a.n || blocks < 1 || blocks > kMaxShotBlocks ||
      a.peers == nullptr || a.epochs == nullptr || a.chunk == 0)
    return false;
  if (k == ShotKind::kBroadcast && (a.root < 0 || a.root >= a.n)) return false;
  if (k == ShotKind::kReduceScatter && shotScatterChunk(a.chunk, a.n) == 0) return false;
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
  }
  return false;
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
  if (k == ShotKind::kAllGather || k == ShotKind::kBroadcast) {
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

}  // namespace railcc::cuda
