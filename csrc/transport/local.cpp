#include "transport/local.h"

#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>

namespace railcc::transport {

void ring(Doorbell* d) {
  d->bell.fetch_add(1, std::memory_order_seq_cst);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&d->bell), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

void futexWait(std::atomic<uint32_t>* addr, uint32_t expected, long timeoutUs) {
  struct timespec ts;
  ts.tv_sec = timeoutUs / 1000000;
  ts.tv_nsec = (timeoutUs % 1000000) * 1000;
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

bool processGone(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  // A killed child that its parent has not reaped yet is a zombie: gone for our purposes.
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = fopen(path, "r");
  if (f == nullptr) return errno == ENOENT;
  char buf[256];
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char* rp = strrchr(buf, ')');
  return rp != nullptr && (rp[2] == 'Z' || rp[2] == 'X');
}

}  // namespace railcc::transport
