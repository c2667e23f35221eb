#pragma once
// A doorbell: the word a rank sleeps on while it waits for peers of its own host, and that
// they ring after producing data for it or freeing space it waits for. It lives in memory the
// host's ranks share (a futex), so waking a rank costs one system call and only when it sleeps.

#include <atomic>
#include <cstdint>

namespace railcc::transport {

struct Doorbell {
  std::atomic<uint32_t> bell;      // bumped by every ring
  std::atomic<uint32_t> sleeping;  // raised while the owner sleeps (or is about to)
};

/// Rings `d`: bumps it and wakes its owner. Thread-safe; never blocks.
void ring(Doorbell* d);
/// Rings `d` only if its owner sleeps: the cheap call for every producer.
inline void wake(Doorbell* d) {
  if (d->sleeping.load(std::memory_order_seq_cst)) ring(d);
}
/// Blocks while *addr == expected, at most `timeoutUs` (a futex wait; spurious returns happen).
void futexWait(std::atomic<uint32_t>* addr, uint32_t expected, long timeoutUs);
/// The owner's side: sleeps until `d` is rung or `timeoutUs` passes. `recheck` runs after the
/// sleeping flag is raised, so a ring that races with going to sleep is never lost: when it
/// returns true (work is there) the call returns at once.
template <typename F>
void sleepOn(Doorbell* d, long timeoutUs, F&& recheck) {
  d->sleeping.store(1, std::memory_order_seq_cst);
  uint32_t v = d->bell.load(std::memory_order_seq_cst);
  if (!recheck()) futexWait(&d->bell, v, timeoutUs);
  d->sleeping.store(0, std::memory_order_relaxed);
}

}  // namespace railcc::transport
