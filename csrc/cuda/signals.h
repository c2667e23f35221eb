#pragma once
// Device signals: how the ranks of one GPU collective tell each other, with no host between
// launch and completion, that their data is there. Written once for both sides: nvcc compiles
// it into the kernels (csrc/cuda), and the host compiler into tests/cpp/signals_test.cpp, where
// CPU threads play the ranks (the same protocol, the same memory orders, on host memory).
//
// The protocol
// * Every rank owns a pad (SignalPad) in memory its peers map (CUDA IPC, or VMM memory
//   exported once). Slot `peer` of rank r's pad counts the signals `peer` sent r: a monotonic
//   32-bit counter, never reset (a captured CUDA graph replays the same adds; a reset between
//   ops would race a fast peer's next signal).
// * To signal, a rank adds one to its slot in the peer's pad, with release order at system
//   scope: its earlier writes (the data it put in the peer's memory, or its own buffer the peer
//   will read) are visible to whoever sees the new count.
// * To wait, a rank reads its own pad's slot for that peer with acquire order until the count
//   reaches what it expects: `expected` is how many signals that peer has sent it by the end of
//   this op, which each rank tracks alone (its own count of ops, times signals per op), so no
//   counter is ever read back or agreed on. Counts compare modulo 2^32 (wait until
//   int32(count - expected) >= 0), so they wrap without harm while ranks are within 2^31
//   signals of each other.
// * A wait is bounded: it gives up at a deadline (the device's global timer, or the host's
//   steady clock) or when the host raises the pad's abort flag, and then records the first
//   failure, {op sequence number, the peer it waited for, timed out or aborted}, in a record the
//   host reads (host-mapped memory): the kernel exits instead of trapping, and the watchdog
//   raises the error naming that rank. A peer that never arrives never hangs the GPU.

#include <chrono>
#include <cstdint>
#include <thread>

#if defined(__CUDACC__)
#define RAILCC_HD __host__ __device__ __forceinline__
#else
#define RAILCC_HD inline
#endif

namespace railcc::cuda {

constexpr int kMaxSignalPeers = 72;  // ranks of one collective on one host (NVLink domain) at most

/// A rank's pad: what its peers add to, and the host's abort flag for its waits.
struct SignalPad {
  uint32_t count[kMaxSignalPeers];  // count[p]: signals rank p sent this rank
  uint32_t abort;                   // set by the host (watchdog, abort()): every wait gives up
  uint32_t pad_[3];
};

/// The first failure of a group's waits, in host-mapped memory: the host polls `state`.
struct SignalFailure {
  uint32_t state;       // 0 none; kTimedOut or kAborted, written last
  int32_t peer;         // the rank waited for
  uint64_t seq;         // the op's sequence number
  uint32_t count;       // the count seen, and the one expected
  uint32_t expected;
};

enum SignalWait : uint32_t { kSignalled = 0, kTimedOut = 1, kAborted = 2 };

// --- memory orders at system scope -------------------------------------------------------

RAILCC_HD uint32_t loadAcquire(const uint32_t* p) {
#if defined(__CUDA_ARCH__)
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

RAILCC_HD void addRelease(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
  __atomic_fetch_add(p, v, __ATOMIC_RELEASE);
#endif
}

RAILCC_HD uint32_t loadRelaxed(const uint32_t* p) {
#if defined(__CUDA_ARCH__)
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#else
  return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}

/// A pointer that another thread of the host writes (pinned host memory), read at system scope.
RAILCC_HD char* loadPointer(char* const* p) {
#if defined(__CUDA_ARCH__)
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return reinterpret_cast<char*>(v);
#else
  return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}

/// Nanoseconds on a clock that only moves forward: the device's global timer, the host's steady clock.
RAILCC_HD uint64_t signalNow() {
#if defined(__CUDA_ARCH__)
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
#else
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
#endif
}

/// Whether `count` has reached `expected`, modulo 2^32.
RAILCC_HD bool signalReached(uint32_t count, uint32_t expected) { return static_cast<int32_t>(count - expected) >= 0; }

/// Signals `peerPad`'s owner once from rank `me`: everything this thread wrote before is
/// visible to the owner once it sees the count.
RAILCC_HD void signalPeer(SignalPad* peerPad, int me) { addRelease(&peerPad->count[me], 1); }

/// Records the first failure only; later ones (other peers, other blocks) keep it.
RAILCC_HD void recordFailure(SignalFailure* f, uint32_t why, int peer, uint64_t seq, uint32_t count, uint32_t expected) {
  if (f == nullptr) return;
#if defined(__CUDA_ARCH__)
  if (atomicCAS(reinterpret_cast<unsigned int*>(&f->state), 0u, 0xffffffffu) != 0u) return;
#else
  uint32_t none = 0;
  if (!__atomic_compare_exchange_n(&f->state, &none, 0xffffffffu, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) return;
#endif
  f->peer = peer;
  f->seq = seq;
  f->count = count;
  f->expected = expected;
#if defined(__CUDA_ARCH__)
  __threadfence_system();
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(&f->state), "r"(why) : "memory");
#else
  __atomic_store_n(&f->state, why, __ATOMIC_RELEASE);
#endif
}

/// Waits until rank `peer` has signalled `pad`'s owner `expected` times in all (modulo 2^32),
/// or `deadlineNs` (signalNow()'s clock) passes, or the host raises pad->abort or `hostAbort`
/// (a flag in host-mapped memory the host can set while the GPU is busy; may be null); the
/// failures are recorded in `failure` with `seq`. After kSignalled, the peer's writes before its
/// signal are visible here.
RAILCC_HD SignalWait signalWait(const SignalPad* pad, int peer, uint32_t expected, uint64_t deadlineNs, uint64_t seq,
                                SignalFailure* failure, const uint32_t* hostAbort = nullptr) {
  for (uint32_t spins = 0;; ++spins) {
    const uint32_t seen = loadAcquire(&pad->count[peer]);
    if (signalReached(seen, expected)) return kSignalled;
    // The clock and the flag every 64 reads: a read of the global timer is not free.
    if ((spins & 63) == 63) {
      if (loadRelaxed(&pad->abort) != 0 || (hostAbort != nullptr && loadRelaxed(hostAbort) != 0)) {
        recordFailure(failure, kAborted, peer, seq, seen, expected);
        return kAborted;
      }
      if (signalNow() >= deadlineNs) {
        recordFailure(failure, kTimedOut, peer, seq, seen, expected);
        return kTimedOut;
      }
#if !defined(__CUDA_ARCH__)
      std::this_thread::yield();  // host threads stand in for ranks sharing a GPU: let the peer run
#endif
    }
  }
}

}  // namespace railcc::cuda
