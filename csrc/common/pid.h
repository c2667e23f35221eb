#pragma once
// This process's id without a system call: glibc stopped caching getpid(), and the engine asks
// on every op whether it runs in the process that made the group (a child forked after init
// must not use it). A fork handler refreshes the copy in the child.

#include <pthread.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>

namespace railcc {

inline pid_t thisPid() {
  static std::atomic<pid_t> pid{0};
  static const bool registered = [] {
    pid.store(getpid(), std::memory_order_relaxed);
    pthread_atfork(nullptr, nullptr, [] { pid.store(getpid(), std::memory_order_relaxed); });
    return true;
  }();
  (void)registered;
  return pid.load(std::memory_order_relaxed);
}

}  // namespace railcc
