#include "engine/device/segments.h"

#include <cstring>

#include <map>
#include <optional>

#include "common/log.h"
#include "engine/allocator_segments.h"
#include "engine/device/device_guards.h"

namespace railcc::engine {

namespace {
// A cell of the kernels' table: read by kernels (at system scope) while this host writes it.
void setCell(char** table, size_t i, char* p) { __atomic_store_n(&table[i], p, __ATOMIC_RELEASE); }
constexpr uint32_t kSlots = static_cast<uint32_t>(cuda::kSegSlots);
constexpr long kWatchNapUs = 200000;  // the watcher looks even unrung this often
}  // namespace

SegmentRegistry::SegmentRegistry(const cuda::DeviceApi& api, int rank, std::vector<SegmentBoard*> boards, char** table,
                                 int device, std::chrono::milliseconds revokeWait,
                                 std::function<std::string(int)> rankName, std::function<void()> release)
    : api_(api), rank_(rank), boards_(std::move(boards)), table_(table), device_(device), revokeWait_(revokeWait),
      rankName_(std::move(rankName)), release_(std::move(release)), own_(kSlots), silent_(boards_.size(), false),
      seen_(boards_.size() * kSlots, 0) {}

SegmentRegistry::~SegmentRegistry() {
  shutdown();
  for (Own& o : own_)
    if (o.lastUse) api_.eventDestroy(o.lastUse);
  if (release_) release_();
}

// ---------------------------------------------------------------------------------------
// The owner's side

uint64_t SegmentRegistry::place(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> g(ownMu_);
  SegmentBoard* mine = boards_[static_cast<size_t>(rank_)];
  for (uint32_t s = 0; s < kSlots; ++s) {
    Own& o = own_[s];
    if (!o.base || o.refused || (o.gen & 1) == 0) continue;
    const uint64_t off = cuda::shotOffsetIn(o.base, o.bytes, p, bytes);
    if (off == cuda::kInScratch) continue;
    if (!o.usable) {
      bool all = true;
      for (int q = 0; q < peers() && all; ++q) {
        if (q == rank_) continue;
        const uint32_t a = mine->ack[q][s].load(std::memory_order_acquire);
        if (a == (o.gen | kAckRefused)) o.refused = true;
        all = a == o.gen;
      }
      if (!all) return cuda::kInScratch;
      o.usable = true;
    }
    return cuda::shotSegmentPlace(static_cast<int>(s), off);
  }
  return cuda::kInScratch;
}

bool SegmentRegistry::offered(const void* p) {
  std::lock_guard<std::mutex> g(ownMu_);
  for (const Own& o : own_)
    if (o.base && cuda::shotOffsetIn(o.base, o.bytes, p, 1) != cuda::kInScratch) return true;
  return false;
}

void SegmentRegistry::used(uint64_t place, void* stream) {
  if (place == cuda::kInScratch || (place >> cuda::kPlaceShift) == 0) return;  // the scratch, or the heap
  const size_t s = static_cast<size_t>((place >> cuda::kPlaceShift) - 1);
  std::lock_guard<std::mutex> g(ownMu_);
  if (s >= kSlots) return;
  Own& o = own_[s];
  if (!o.lastUse && api_.eventCreate(&o.lastUse) != 0) o.lastUse = nullptr;
  // Without the event, revoke() cannot tell when the kernel is done: the segment goes back to
  // the scratch for good rather than risk a peer closing it under a running kernel.
  if (!o.lastUse || api_.eventRecord(o.lastUse, stream) != 0) o.refused = true;
}

bool SegmentRegistry::offer(char* base, size_t bytes) {
  std::lock_guard<std::mutex> g(ownMu_);
  if (shut_ || bytes == 0 || bytes > cuda::kPlaceOffset) return false;
  size_t free = kSlots;
  for (size_t s = 0; s < kSlots; ++s) {
    const Own& o = own_[s];
    if (o.base && cuda::shotOffsetIn(o.base, o.bytes, base, 1) != cuda::kInScratch) return false;  // offered
    if (!o.base && !o.closing && (o.gen & 1) == 0 && free == kSlots) free = s;
  }
  if (free == kSlots) return false;  // every slot taken: the buffer goes through the scratch
  Own& o = own_[free];
  SegmentSlot& slot = boards_[static_cast<size_t>(rank_)]->slots[free];
  o.base = base;
  o.bytes = bytes;
  o.usable = false;
  o.refused = api_.ipcGetMemHandle(slot.handle, base) != 0;
  if (o.refused) return false;  // not exportable (memory CUDA IPC cannot share): kept as refused
  slot.bytes = bytes;
  setCell(table_, static_cast<size_t>(rank_) * kSlots + free, base);  // where this rank's kernel finds it
  o.gen = slot.gen.load(std::memory_order_relaxed) + 1;
  slot.gen.store(o.gen, std::memory_order_release);
  for (int q = 0; q < peers(); ++q)
    if (q != rank_) transport::ring(&boards_[static_cast<size_t>(q)]->changed);
  return true;
}

bool SegmentRegistry::revoke(const char* base) {
  std::unique_lock<std::mutex> g(ownMu_);
  for (bool waited = false;;) {
    size_t s = 0;
    while (s < kSlots && own_[s].base != base && !(own_[s].closing && own_[s].closingBase == base)) ++s;
    if (s == kSlots) return true;  // never offered here
    if (own_[s].base != base)      // another thread (teardown) is closing it: the memory may go once that is done
      return closed_.wait_for(g, revokeWait_ + std::chrono::seconds(1), [&] { return !own_[s].closing; });
    if (!waited) {  // its last kernels first; the slot may change hands meanwhile, so look again
      waitUnused(g, s);
      waited = true;
      continue;
    }
    std::vector<std::pair<size_t, uint32_t>> slots;
    if (revokeLocked(s)) slots.push_back({s, own_[s].gen});
    return waitClosed(g, slots);
  }
}

void SegmentRegistry::waitUnused(std::unique_lock<std::mutex>& g, size_t s) {
  void* ev = own_[s].lastUse;
  if (!ev) return;
  g.unlock();
  {
    // railcc's own query: relaxed, so that it neither fails nor breaks a capture another thread
    // began (the allocator frees from any thread).
    RelaxedCapture relaxed(api_);
    const auto deadline = std::chrono::steady_clock::now() + revokeWait_;
    while (api_.eventQuery(ev) == api_.notReady && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  g.lock();
}

bool SegmentRegistry::revokeLocked(size_t s) {
  Own& o = own_[s];
  char* const base = o.base;
  const bool live = (o.gen & 1) != 0;
  o.base = nullptr;
  o.usable = o.refused = false;
  setCell(table_, static_cast<size_t>(rank_) * kSlots + s, nullptr);
  if (!live) return false;  // never offered (its handle failed): no peer has it
  o.closing = true;          // not offered again until every peer closed it
  o.closingBase = base;
  boards_[static_cast<size_t>(rank_)]->slots[s].gen.store(++o.gen, std::memory_order_release);
  return true;
}

bool SegmentRegistry::waitClosed(std::unique_lock<std::mutex>& g, const std::vector<std::pair<size_t, uint32_t>>& slots) {
  if (slots.empty()) return true;
  SegmentBoard* mine = boards_[static_cast<size_t>(rank_)];
  for (int q = 0; q < peers(); ++q)
    if (q != rank_) transport::ring(&boards_[static_cast<size_t>(q)]->changed);
  auto closed = [&](int q) {
    if (silent_[static_cast<size_t>(q)] || boards_[static_cast<size_t>(q)]->gone.load(std::memory_order_acquire) != 0)
      return true;
    for (const auto& [s, gen] : slots)
      if ((mine->ack[q][s].load(std::memory_order_acquire) & ~kAckRefused) != gen) return false;
    return true;
  };
  auto allClosed = [&] {
    for (int q = 0; q < peers(); ++q)
      if (q != rank_ && !closed(q)) return false;
    return true;
  };
  // Peers answer from their watchers; other slots may be offered meanwhile.
  g.unlock();
  const auto deadline = std::chrono::steady_clock::now() + revokeWait_;
  while (!allClosed() && std::chrono::steady_clock::now() < deadline)
    transport::sleepOn(&mine->acked, 10000, allClosed);
  g.lock();
  if (allClosed()) {
    for (const auto& sg : slots) own_[sg.first].closing = false;
    closed_.notify_all();
    return true;
  }
  std::string who;
  for (int q = 0; q < peers(); ++q)
    if (q != rank_ && !closed(q)) {
      who += (who.empty() ? "" : ", ") + rankName_(q);
      silent_[static_cast<size_t>(q)] = true;  // later revokes do not wait for it again
    }
  for (const auto& [s, gen] : slots) {
    own_[s].gen = gen | 1;  // never offered again: a peer may still map it
    own_[s].closing = false;
  }
  closed_.notify_all();
  RAILCC_WARN(COLL, "GPU memory is being freed while ", who, " may still map it: no answer within ", revokeWait_.count(),
              " ms (stopped, or stuck); what those ranks read from it from now on is undefined");
  return false;
}

void SegmentRegistry::shutdown() {
  {
    std::unique_lock<std::mutex> g(ownMu_);
    if (shut_) return;
    shut_ = true;
    std::vector<std::pair<size_t, uint32_t>> slots;
    for (size_t s = 0; s < kSlots; ++s)
      if (own_[s].base && revokeLocked(s)) slots.push_back({s, own_[s].gen});
    waitClosed(g, slots);
  }
  stop_ = true;
  SegmentBoard* mine = boards_[static_cast<size_t>(rank_)];
  transport::ring(&mine->changed);
  if (watcher_.joinable()) watcher_.join();
  {
    std::lock_guard<std::mutex> g(peerMu_);
    for (size_t i = 0; i < seen_.size(); ++i)
      if (char* m = table_[i]; m && i / kSlots != static_cast<size_t>(rank_)) {
        setCell(table_, i, nullptr);
        api_.ipcCloseMemHandle(m);
      }
  }
  mine->gone.store(1, std::memory_order_release);
  for (int q = 0; q < peers(); ++q)
    if (q != rank_) transport::ring(&boards_[static_cast<size_t>(q)]->acked);
}

// ---------------------------------------------------------------------------------------
// The peers' side

bool SegmentRegistry::changedSince() {
  std::lock_guard<std::mutex> g(peerMu_);
  for (int q = 0; q < peers(); ++q) {
    if (q == rank_) continue;
    const SegmentBoard* b = boards_[static_cast<size_t>(q)];
    for (uint32_t s = 0; s < kSlots; ++s)
      if (b->slots[s].gen.load(std::memory_order_acquire) != seen_[static_cast<size_t>(q) * kSlots + s]) return true;
  }
  return false;
}

void SegmentRegistry::catchUp() {
  std::lock_guard<std::mutex> g(peerMu_);
  std::optional<DeviceScope> on;  // the watcher's calls go to the group's device, once there are any
  for (int q = 0; q < peers(); ++q) {
    if (q == rank_) continue;
    SegmentBoard* b = boards_[static_cast<size_t>(q)];
    bool answered = false;
    for (uint32_t s = 0; s < kSlots; ++s) {
      const size_t i = static_cast<size_t>(q) * kSlots + s;
      const uint32_t gen = b->slots[s].gen.load(std::memory_order_acquire);
      if (gen == seen_[i]) continue;
      if (!on) on.emplace(api_, device_);
      if (char* m = table_[i]) {
        setCell(table_, i, nullptr);
        api_.ipcCloseMemHandle(m);
      }
      uint32_t ack = gen;
      if (gen & 1) {
        void* p = nullptr;
        const int err = api_.ipcOpenMemHandle(&p, b->slots[s].handle);
        if (err == 0) {
          setCell(table_, i, static_cast<char*>(p));
        } else {
          ack |= kAckRefused;
          RAILCC_WARN(COLL, "cannot map a block of ", rankName_(q), "'s GPU memory (",
                      api_.errorString ? api_.errorString(err) : "?", "): ops on it go through the scratch");
        }
      }
      seen_[i] = gen;
      b->ack[rank_][s].store(ack, std::memory_order_release);
      answered = true;
    }
    if (answered) transport::ring(&b->acked);
  }
}

size_t SegmentRegistry::mappedCount() {
  std::lock_guard<std::mutex> g(peerMu_);
  size_t n = 0;
  for (size_t i = 0; i < seen_.size(); ++i) n += table_[i] != nullptr && i / kSlots != static_cast<size_t>(rank_);
  return n;
}

void SegmentRegistry::startWatcher() {
  SegmentBoard* mine = boards_[static_cast<size_t>(rank_)];
  watcher_ = std::thread([this, mine] {
    while (!stop_.load()) {
      catchUp();
      transport::sleepOn(&mine->changed, kWatchNapUs, [this] { return stop_.load() || changedSince(); });
    }
  });
}


// ---------------------------------------------------------------------------------------
// The allocator's segments, as its hook tells them, and the registries that may have offered
// them.

namespace {
struct Directory {
  std::mutex mu;
  std::map<char*, size_t> segments;  // base -> bytes
  std::vector<std::weak_ptr<SegmentRegistry>> registries;
};
Directory& directory() {
  static Directory* d = new Directory;  // used by the allocator until the process ends
  return *d;
}
}  // namespace

void segmentMade(char* base, size_t bytes) {
  Directory& d = directory();
  std::lock_guard<std::mutex> g(d.mu);
  d.segments[base] = bytes;
}

void segmentFreeing(char* base) {
  Directory& d = directory();
  std::vector<std::shared_ptr<SegmentRegistry>> live;
  {
    std::lock_guard<std::mutex> g(d.mu);
    d.segments.erase(base);
    for (auto it = d.registries.begin(); it != d.registries.end();) {
      if (auto r = it->lock()) {
        live.push_back(std::move(r));
        ++it;
      } else {
        it = d.registries.erase(it);
      }
    }
  }
  for (auto& r : live) r->revoke(base);
}

size_t segmentsKnown() {
  Directory& d = directory();
  std::lock_guard<std::mutex> g(d.mu);
  return d.segments.size();
}

namespace {
std::atomic<SegmentFinder> gFinder{nullptr};
}  // namespace

void setSegmentFinder(SegmentFinder f) { gFinder.store(f); }

bool findSegment(const void* p, char** base, size_t* bytes) {
  {
    Directory& d = directory();
    std::lock_guard<std::mutex> g(d.mu);
    const char* c = static_cast<const char*>(p);
    auto it = d.segments.upper_bound(const_cast<char*>(c));
    if (it != d.segments.begin()) {
      --it;
      if (c < it->first + it->second) {
        *base = it->first;
        *bytes = it->second;
        return true;
      }
    }
  }
  // Not seen made (before the hook was attached): the allocator's own lookup, outside our lock.
  SegmentFinder f = gFinder.load();
  return f && f(p, base, bytes);
}

void enlistSegments(const std::shared_ptr<SegmentRegistry>& r) {
  Directory& d = directory();
  std::lock_guard<std::mutex> g(d.mu);
  d.registries.push_back(r);
}

}  // namespace railcc::engine
