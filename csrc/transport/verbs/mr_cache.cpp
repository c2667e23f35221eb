#include "transport/verbs/mr_cache.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "transport/stats.h"

namespace railcc::transport::verbs {
namespace {

constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ;

uintptr_t pageSize() {
  static const uintptr_t p = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  return p;
}

}  // namespace

MrCache::MrCache(const IbvLib* ibv, ibv_pd* pd, std::string dev, size_t capBytes)
    : ibv_(ibv), pd_(pd), dev_(std::move(dev)), cap_(capBytes) {}

MrCache::~MrCache() {
  std::lock_guard<std::mutex> g(mu_);
  while (!entries_.empty()) dropAt(entries_.size() - 1);
}

ibv_mr* MrCache::reg(uintptr_t begin, uintptr_t end) {
  ibv_mr* mr = ibv_->regMr(pd_, reinterpret_cast<void*>(begin), end - begin, kAccess);
  if (!mr && bytes_ > 0) {
    // Refused, perhaps by the locked-memory limit that the cache itself uses up: the
    // registrations nobody is using go, and it is tried once more.
    const size_t before = bytes_;
    for (size_t i = entries_.size(); i-- > 0;)
      if (entries_[i].uses == 0) dropAt(i);
    if (bytes_ < before) mr = ibv_->regMr(pd_, reinterpret_cast<void*>(begin), end - begin, kAccess);
  }
  if (mr) {
    addStat(StatKind::kVerbs, Stat::kRegistrations, 1);
    return mr;
  }
  int err = errno;
  addStat(StatKind::kVerbs, Stat::kRegFailures, 1);
  if (!saidRefused_) {
    saidRefused_ = true;
    rlimit rl{};
    getrlimit(RLIMIT_MEMLOCK, &rl);
    RAILCC_INFO(IB, dev_, ": registering ", (end - begin) >> 10, " KiB of user memory failed (", strerror(err),
                "; locked-memory limit ", rl.rlim_cur == RLIM_INFINITY ? std::string("unlimited")
                                                                        : std::to_string(rl.rlim_cur >> 10) + " KiB",
                "): such messages are copied through the connection's rings instead (said once)");
  }
  return nullptr;
}

void MrCache::dropAt(size_t i) {
  Entry& e = entries_[i];
  ibv_->deregMr(e.mr);
  bytes_ -= e.end - e.begin;
  subStat(StatKind::kVerbs, Stat::kRegisteredBytes, e.end - e.begin);
  entries_[i] = std::move(entries_.back());
  entries_.pop_back();
}

// Makes room for `need` more bytes: registrations of freed memory go first, then the least
// recently used ones that no message is using.
void MrCache::trim(size_t need) {
  for (size_t i = entries_.size(); i-- > 0;)
    if (entries_[i].uses == 0 && !entries_[i].owner->alive()) dropAt(i);
  while (bytes_ + need > cap_) {
    size_t victim = entries_.size();
    for (size_t i = 0; i < entries_.size(); ++i)
      if (entries_[i].uses == 0 && (victim == entries_.size() || entries_[i].lastUse < entries_[victim].lastUse))
        victim = i;
    if (victim == entries_.size()) break;
    dropAt(victim);
  }
}

MrCache::Lease MrCache::acquire(const void* p, size_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), pg = pageSize();
  std::lock_guard<std::mutex> g(mu_);
  for (Entry& e : entries_) {
    if (a < e.begin || a + n > e.end || !e.owner->alive()) continue;
    ++e.uses;
    e.lastUse = ++clock_;
    addStat(StatKind::kVerbs, Stat::kRegCacheHits, 1);
    return Lease{e.mr, true};
  }
  const void* base = nullptr;
  size_t bytes = 0;
  auto owner = memoryOwnerOf(p, n, &base, &bytes);
  if (owner) {
    // The owner's whole range: other views of the same storage then find it too.
    uintptr_t b = reinterpret_cast<uintptr_t>(base) & ~(pg - 1);
    uintptr_t e = (reinterpret_cast<uintptr_t>(base) + bytes + pg - 1) & ~(pg - 1);
    if (e - b <= cap_) {
      trim(e - b);
      if (bytes_ + (e - b) <= cap_) {
        ibv_mr* mr = reg(b, e);
        if (!mr) return Lease{};
        entries_.push_back(Entry{b, e, mr, std::move(owner), 1, ++clock_});
        bytes_ += e - b;
        addStat(StatKind::kVerbs, Stat::kRegisteredBytes, e - b);
        return Lease{mr, true};
      }
    }
  }
  // No owner vouches for the memory after this message (or the cache is full of busy ones).
  return Lease{reg(a & ~(pg - 1), (a + n + pg - 1) & ~(pg - 1)), false};
}

void MrCache::release(Lease& l) {
  if (!l.mr) return;
  std::lock_guard<std::mutex> g(mu_);
  if (!l.cached) {
    ibv_->deregMr(l.mr);
  } else {
    for (Entry& e : entries_)
      if (e.mr == l.mr) {
        --e.uses;
        break;
      }
  }
  l = Lease{};
}

size_t MrCache::cachedBytes() const {
  std::lock_guard<std::mutex> g(mu_);
  return bytes_;
}

}  // namespace railcc::transport::verbs
