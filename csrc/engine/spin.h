#pragma once
// Waiting for a condition that is usually microseconds away: spin, then yield, then give up
// (the caller sleeps). Shared by the channel layer, the op queue and a request's wait().

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace railcc::engine {

using Clock = std::chrono::steady_clock;

// Polls `ready` for up to `us` microseconds before a waiter goes to sleep; true once it holds.
// For the first `busyUs` of them it spins in place (a CPU pause between polls): a peer a few
// hundred nanoseconds away is seen at once, where a yield is a system call that costs about as
// much as the whole exchange of a small message, and a yield gives any other busy process on
// the core a whole time slice. Only a rank that has a core to itself may do that, and only
// while the peer it waits for is not on the same core (see CommImpl::busyFor). After that,
// between polls it yields: that hands the core to any other runnable thread at once (the peer
// rank, or our own progress thread when ranks share cores), while a waiter that owns its core
// keeps it awake and reacts within a microsecond, where sleeping would cost a wake-up of tens
// of microseconds (far more in a VM, whose idle virtual CPUs halt).
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

template <typename F>
inline bool pollFor(int64_t us, F&& ready, int64_t busyUs = 0) {
  if (ready()) return true;
  auto start = Clock::now();
  auto until = start + std::chrono::microseconds(us);
  auto busyUntil = start + std::chrono::microseconds(std::min(busyUs, us));
  while (true) {
    auto now = Clock::now();
    if (now >= until) return false;
    if (now < busyUntil) {
      for (int i = 0; i < 8; ++i) cpuRelax();
    } else {
      sched_yield();
    }
    if (ready()) return true;
  }
}

}  // namespace railcc::engine
