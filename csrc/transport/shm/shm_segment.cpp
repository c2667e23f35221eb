#include "transport/shm/shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>

#include "common/error.h"
#include "common/log.h"

namespace railcc::transport {

namespace shm {
namespace {

constexpr uint64_t kMagic = 0x7261696c63637368ull;  // "railccsh"
#ifndef MADV_POPULATE_WRITE
constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14; older headers lack the name
#endif
constexpr size_t alignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }
constexpr const char* kShmRoomHint = " (is /dev/shm large enough? docker: --shm-size; or lower RAILCC_BUFFSIZE)";

}  // namespace



Segment::Segment(const std::string& name, size_t bytes) : name_(name), size_(bytes), owner_(true) {
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  RAILCC_SYSCHECK(fd, "shm_open(" + name + ")");
  linked_ = true;
  // Locked before it has a size: cleanStale() leaves empty segments alone, so no other
  // process can take this one for stale between its creation and this lock.
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    std::string err = detail::errnoString();
    close(fd);
    shm_unlink(name.c_str());
    RAILCC_THROW(kSystem, "flock of shared memory ", name, ": ", err);
  }
  // Sized, not yet reserved: the creator reserves what must exist before anyone touches it
  // (reserve()); a FIFO's data pages are reserved by its producer as it first reaches them
  // (populateForWrite()), so a job pays for the FIFOs its algorithms use, not for every pair.
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    std::string err = detail::errnoString();
    close(fd);
    shm_unlink(name.c_str());
    RAILCC_THROW(kSystem, "sizing ", bytes, " bytes of shared memory for ", name, ": ", err);
  }
  // Not MAP_POPULATE: mapping pages as they are first touched costs a minor fault each, where
  // populating mapped every FIFO of the host into every rank at set-up.
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    std::string err = detail::errnoString();
    close(fd);
    shm_unlink(name.c_str());
    RAILCC_THROW(kSystem, "mmap of shared memory ", name, ": ", err);
  }
  fd_ = fd;  // kept open: it holds the lock
  base_ = static_cast<char*>(p);
}

int populateForWrite(char* p, size_t bytes) {
  while (madvise(p, bytes, MADV_POPULATE_WRITE) != 0) {
    if (errno != EINTR) return errno;
  }
  return 0;
}

size_t nextReserve(size_t reserved, size_t end, size_t cap, size_t maxStep) {
  constexpr size_t kFirstStep = 16u << 10;
  const size_t step = std::min(std::max(reserved, kFirstStep), maxStep);
  return std::min(alignUp(cap, 4096), std::max(alignUp(end, 4096), reserved + step));
}

void reserveAhead(char* data, size_t& reserved, size_t end, size_t cap, size_t maxStep, const std::string& what) {
  const size_t to = nextReserve(reserved, end, cap, maxStep);
  int err = populateForWrite(data + reserved, to - reserved);
  if (err == ENOMEM || err == EFAULT)  // EFAULT: the write would have raised SIGBUS
    RAILCC_THROW(kSystem, "/dev/shm is full: no room for the next ", (to - reserved) >> 10, " KiB of ", what,
                 " (docker: --shm-size; or lower RAILCC_BUFFSIZE)");
  if (err != 0) RAILCC_THROW(kSystem, "reserving ", to - reserved, " bytes of ", what, ": ", strerror(err));
  reserved = to;
}

bool lazyReservation() {
  // Whether this kernel populates shared pages on request (MADV_POPULATE_WRITE, Linux 5.14),
  // telling a failure by its return value instead of a SIGBUS: tried once on a page of a scratch
  // mapping. Every rank of a host runs the same kernel, so producer and creator agree.
  static const bool yes = [] {
    void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return false;
    bool ok = populateForWrite(static_cast<char*>(p), 4096) == 0;
    munmap(p, 4096);
    return ok;
  }();
  return yes;
}

void Segment::reserve(size_t offset, size_t bytes) {
  // Reserved pages exist: a /dev/shm too small for them (64 MiB in a default container, or
  // filled by another process) fails here with a message, never as a SIGBUS at a write into a
  // hole later.
  int rc = posix_fallocate(fd_, static_cast<off_t>(offset), static_cast<off_t>(bytes));
  if (rc != 0)
    RAILCC_THROW(kSystem, "reserving ", bytes, " bytes of shared memory for ", name_, ": ", std::strerror(rc), kShmRoomHint);
}

Segment::Segment(const std::string& name, bool keepFd) : name_(name) {
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  // Gone: its rank's set-up or group failed (and let the name go) before this one mapped it.
  if (fd < 0 && errno == ENOENT)
    RAILCC_THROW(kPeerFailure, "its shared memory ", name, " is gone: it failed or left before this rank mapped it");
  RAILCC_SYSCHECK(fd, "shm_open(" + name + ") of a peer's segment");
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    close(fd);
    RAILCC_THROW(kSystem, "fstat of ", name, ": ", detail::errnoString());
  }
  size_ = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);  // faulted in as used
  if (p == MAP_FAILED) {
    std::string err = detail::errnoString();
    close(fd);
    RAILCC_THROW(kSystem, "mmap of ", name, ": ", err);
  }
  base_ = static_cast<char*>(p);
  if (keepFd) fd_ = fd;  // ownerAlive() probes the creator's lock through it
  else close(fd);        // the mapping stays
}

Segment::~Segment() {
  if (base_ != nullptr && munmap(base_, size_) != 0)
    RAILCC_WARN(SHM, "munmap of ", name_, " failed: ", detail::errnoString());
  if (owner_) unlink();
  if (fd_ >= 0) close(fd_);
}

bool Segment::ownerAlive() const {
  if (fd_ < 0) return true;  // mapped without its fd: the creator's pid tells (samePidNamespace)
  // A shared lock is refused only while the creator holds its exclusive one. Several peers may
  // probe at once: shared locks do not refuse each other.
  if (flock(fd_, LOCK_SH | LOCK_NB) == 0) {
    flock(fd_, LOCK_UN);
    return false;
  }
  return errno == EWOULDBLOCK || errno == EINTR;
}

// Removes a segment's name; gone already (another rank of the host did) is fine.
static void unlinkName(const std::string& name) {
  if (shm_unlink(name.c_str()) != 0 && errno != ENOENT)
    RAILCC_WARN(SHM, "shm_unlink(", name, ") failed: ", detail::errnoString());
}

void Segment::unlink() {
  if (linked_.exchange(false)) unlinkName(name_);
}

namespace {
// Layout: segment header | nslots x (FIFO header, FIFO data) | broadcast ring header (tail,
// then one cache line per consumer) | broadcast ring data.
constexpr size_t kSegHeaderBytes = alignUp(sizeof(SegmentHeader), 4096);
constexpr size_t kFifoHeaderBytes = alignUp(sizeof(FifoHeader), 4096);
// Where slot `i` (its FIFO header, then its data) starts in a segment.
size_t slotOffset(int i, size_t fifoBytes) {
  return kSegHeaderBytes + static_cast<size_t>(i) * (kFifoHeaderBytes + alignUp(fifoBytes, 4096));
}
size_t fifosEnd(int nslots, size_t fifoBytes) { return slotOffset(nslots, fifoBytes); }
size_t bcastHeaderBytes(int nslots) { return alignUp(64 * (1 + static_cast<size_t>(nslots)), 4096); }

// This rank's broadcast ring, reserved as its producer first reaches it (as a FIFO is): a job
// whose broadcasts are small, or that has none, reserves a few pages of it, not all of them.
class OwnRingPages : public RingPages {
 public:
  OwnRingPages(char* data, size_t cap) : data_(data), cap_(cap) {}
  void reserveUpTo(size_t end) override {
    reserveAhead(data_, ready, end, cap_, 1u << 20, "this rank's shared-memory broadcast ring");
  }

 private:
  char* data_;
  size_t cap_;
};
}  // namespace

size_t Domain::segmentBytes(int nslots, size_t fifoBytes, size_t ringBytes) {
  return fifosEnd(nslots, fifoBytes) + bcastHeaderBytes(nslots) + alignUp(ringBytes, 4096);
}

BroadcastRing Domain::broadcastRing(int index) {
  Segment* seg = index < 0 ? own_.get() : peers_.at(static_cast<size_t>(index)).get();
  RAILCC_CHECK_ARG(seg != nullptr, "shm peer ", index, " not attached");
  char* base = seg->data() + fifosEnd(nslots_, fifoBytes_);
  return BroadcastRing(&reinterpret_cast<SegmentHeader*>(seg->data())->door, reinterpret_cast<std::atomic<uint64_t>*>(base),
                       base + 64, base + bcastHeaderBytes(nslots_), ringBytes_, index < 0 ? ringPages_.get() : nullptr);
}

SegmentHeader* Domain::headerOf(int index) {
  Segment* seg = index < 0 ? own_.get() : peers_.at(static_cast<size_t>(index)).get();
  return reinterpret_cast<SegmentHeader*>(seg->data());
}


std::string randomToken() {
  uint8_t b[8];
  size_t got = 0;
  while (got < sizeof(b)) {
    ssize_t r = getrandom(b + got, sizeof(b) - got, 0);
    if (r < 0 && errno != EINTR) RAILCC_THROW(kSystem, "getrandom: ", detail::errnoString());
    if (r > 0) got += static_cast<size_t>(r);
  }
  char hex[17];
  for (size_t i = 0; i < sizeof(b); ++i) snprintf(hex + 2 * i, 3, "%02x", b[i]);
  return hex;
}

Domain::Domain(int nslots, size_t fifoBytes, size_t ringBytes, bool singleCopy, int hostRanks)
    : nslots_(nslots), fifoBytes_(fifoBytes), ringBytes_(ringBytes), singleCopy_(singleCopy), hostRanks_(hostRanks) {
  // Under Yama's ptrace_scope 1 only a declared tracer may read this process's memory: every
  // process of this user is declared (as Open MPI's CMA path does). EINVAL: no Yama, nothing
  // to declare.
  if (singleCopy_) (void)prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  // Once per process: a segment goes stale only where its creator died in the moment between
  // creating it and its peers mapping it (and its watchdog seeing they had), and the sweep reads all of /dev/shm (hundreds of
  // entries on a busy host), which every group's set-up paid before.
  static std::once_flag swept;
  std::call_once(swept, [] { cleanStale(); });
  // The pid is for people reading /dev/shm; nothing decides by it.
  std::string name = "/railcc-" + std::to_string(getuid()) + "-" + std::to_string(getpid()) + "-" + randomToken();
  const size_t bytes = segmentBytes(nslots, fifoBytes, ringBytes);
  checkRoom(bytes, hostRanks);
  own_ = std::make_unique<Segment>(name, bytes);
  if (lazyReservation()) {
    // What peers touch before any data flows: the headers and this rank's broadcast ring. A
    // FIFO's data pages are reserved by its producer as it reaches them (ShmConnection::send).
    own_->reserve(0, kSegHeaderBytes);
    for (int i = 0; i < nslots; ++i) own_->reserve(slotOffset(i, fifoBytes), kFifoHeaderBytes);
    own_->reserve(fifosEnd(nslots, fifoBytes), bcastHeaderBytes(nslots));
    ringPages_ = std::make_unique<OwnRingPages>(own_->data() + fifosEnd(nslots, fifoBytes) + bcastHeaderBytes(nslots),
                                                ringBytes);
  } else {
    own_->reserve(0, bytes);  // no populate-on-request here: every page now, or a SIGBUS later
  }
  auto* h = header();
  h->door.bell.store(0);
  h->door.sleeping.store(0);
  h->failed.store(0);
  h->pid = getpid();
  h->nslots = static_cast<uint32_t>(nslots);
  h->cpu.store(-1);
  h->fifoBytes = fifoBytes;
  h->ringBytes = ringBytes;
  h->magic = kMagic;
  h->selfAddr = reinterpret_cast<uint64_t>(own_->data());
  h->attached.store(0);
  h->hostRanks = static_cast<uint32_t>(hostRanks);
  peers_.resize(static_cast<size_t>(nslots));
  readable_.assign(static_cast<size_t>(nslots), -1);
}

void Domain::checkRoom(size_t segmentBytes, int hostRanks) {
  // FIFO pages are reserved as they are first used, so a /dev/shm too small for what the host's
  // ranks may come to use is said here, at init, rather than by an op that fails mid-job.
  struct statvfs fs {};
  if (statvfs("/dev/shm", &fs) != 0 || fs.f_frsize == 0) return;  // no /dev/shm to ask: the reserve says
  const unsigned long long total = static_cast<unsigned long long>(fs.f_blocks) * fs.f_frsize;
  const unsigned long long need = static_cast<unsigned long long>(segmentBytes) * static_cast<unsigned long long>(std::max(hostRanks, 1));
  if (need > total)
    RAILCC_THROW(kSystem, "shared memory: the ", hostRanks, " ranks of this host need up to ", need >> 20, " MiB of /dev/shm (",
                 segmentBytes >> 20, " MiB each) but it holds ", total >> 20, " MiB", kShmRoomHint);
}

bool Domain::canReadPeer(int index, std::string* why) {
  if (!singleCopy_) {
    if (why) *why = "RAILCC_CMA_BYTES=0";
    return false;
  }
  int& known = readable_.at(static_cast<size_t>(index));
  SegmentHeader* h = headerOf(index);
  if (known < 0) {
    uint64_t magic = 0;
    int err = readProcessMemory(h->pid, &magic, h->selfAddr + offsetof(SegmentHeader, magic), sizeof(magic));
    known = err == 0 && magic == kMagic;
    if (!known && why) {
      *why = err ? std::string("process_vm_readv of process ") + std::to_string(h->pid) + ": " + strerror(err) : "read back another value";
      std::ifstream yama("/proc/sys/kernel/yama/ptrace_scope");
      int scope = -1;
      if (err == EPERM && (yama >> scope) && scope >= 2)
        *why += " (Yama ptrace_scope=" + std::to_string(scope) + " allows it only to CAP_SYS_PTRACE)";
      else if (err == EPERM)
        *why += " (seccomp, or a peer of another user without CAP_SYS_PTRACE)";
    }
  }
  return known == 1;
}

// A group torn down before every peer of its host mapped its segment (made and destroyed at
// once, its set-up no longer waiting for theirs) leaves the name to the last of them to map it;
// one whose set-up or run failed does not: its peers will not come to map it.
Domain::~Domain() {
  if (own_ && keepName_ && header()->failed.load() == 0 &&
      header()->attached.load(std::memory_order_acquire) + 1 < static_cast<uint32_t>(hostRanks_))
    own_->leaveName();
}

void Domain::attach(int localIndex, const std::string& name, bool samePidNamespace) {
  auto seg = std::make_unique<Segment>(name, !samePidNamespace);
  auto* h = reinterpret_cast<SegmentHeader*>(seg->data());
  if (seg->size() < sizeof(SegmentHeader) || h->magic != kMagic)
    RAILCC_THROW(kSystem, "shared memory segment ", name, " is not a railcc segment");
  checkLayout("same-host rank with pid " + std::to_string(h->pid), h->nslots, h->fifoBytes, h->ringBytes);
  if (seg->size() < segmentBytes(nslots_, fifoBytes_, ringBytes_))
    RAILCC_THROW(kSystem, "shared memory segment ", name, " is smaller than its header says");
  peers_.at(static_cast<size_t>(localIndex)) = std::move(seg);
  // Its creator may now let its name go; the last to map it does, should the creator be gone.
  if (h->attached.fetch_add(1, std::memory_order_acq_rel) + 2 == h->hostRanks) unlinkName(name);
}

bool Domain::releaseName() {
  if (header()->attached.load(std::memory_order_acquire) + 1 < static_cast<uint32_t>(hostRanks_)) return false;
  own_->unlink();
  return true;
}

void Domain::checkLayout(const std::string& who, uint64_t nslots, uint64_t fifoBytes, uint64_t ringBytes) const {
  // Each side lays the segment out from its own settings: sizes that differ would have the
  // two read and write different bytes.
  if (nslots != static_cast<uint64_t>(nslots_) || fifoBytes != fifoBytes_ || ringBytes != ringBytes_)
    RAILCC_THROW(kInvalidUsage, who, " set up shared memory with ", nslots, " FIFOs of ", fifoBytes,
                 " bytes and a broadcast ring of ", ringBytes, ", this process with ", nslots_, " of ", fifoBytes_, " and ",
                 ringBytes_, ": RAILCC_BUFFSIZE and RAILCC_SHM_FIFO_BYTES must be equal on every rank of a host");
}

std::unique_ptr<Connection> Domain::connect(int myIndex, int peerIndex, int lane, int nlanes, bool samePidNamespace) {
  Segment* peer = peers_.at(static_cast<size_t>(peerIndex)).get();
  RAILCC_CHECK_ARG(peer != nullptr, "shm peer ", peerIndex, " not attached");
  auto at = [&](Segment* s, int idx) { return s->data() + slotOffset(idx, fifoBytes_); };
  char* out = at(peer, myIndex * nlanes + lane);
  char* in = at(own_.get(), peerIndex * nlanes + lane);
  // The peer may send us addresses instead of bytes once we know we can read its memory.
  std::string why;
  if (samePidNamespace && canReadPeer(peerIndex, &why)) {
    reinterpret_cast<FifoHeader*>(in)->readable.store(1);
    static std::once_flag once;
    std::call_once(once, [&] {
      RAILCC_INFO(SHM, "single copy (CMA) works: this process reads same-host peers' memory (tried on pid ",
                  headerOf(peerIndex)->pid, ")");
    });
  } else if (singleCopy_ && lane == 0) {
    static std::once_flag once;  // said once per process: every peer usually answers alike
    std::call_once(once, [&] {
      RAILCC_INFO(SHM, "single copy (CMA) is off from same-host peer with pid ", headerOf(peerIndex)->pid, ": ",
                  samePidNamespace ? why : std::string("it is in another pid namespace"),
                  "; its large messages go through the shared-memory FIFO");
    });
  }
  return fifoConnection(reinterpret_cast<FifoHeader*>(out), out + kFifoHeaderBytes,
                        reinterpret_cast<SegmentHeader*>(peer->data()), reinterpret_cast<FifoHeader*>(in),
                        in + kFifoHeaderBytes, fifoBytes_, peer, samePidNamespace);
}


int Domain::cleanStale() {
  std::string prefix = "railcc-" + std::to_string(getuid()) + "-";
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return 0;
  int removed = 0;
  while (struct dirent* e = readdir(d)) {
    std::string n = e->d_name;
    if (n.compare(0, prefix.size(), prefix) != 0) continue;
    // The pid in the name is a live process here: most likely the creator, which holds the
    // lock. Not opened, then: a host's ranks each sweep at set-up, and opening and locking the
    // segment of every live peer made set-up cost O(ranks on the host) syscalls per rank. (A
    // stale segment whose pid another process took since is left for a later sweep.)
    pid_t pid = static_cast<pid_t>(std::strtol(n.c_str() + prefix.size(), nullptr, 10));
    if (pid > 0 && (kill(pid, 0) == 0 || errno == EPERM)) continue;
    int fd = shm_open(("/" + n).c_str(), O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) continue;
    struct stat st {};
    // Empty: its creator is between shm_open and its lock (or died there: a few bytes of name).
    bool stale = fstat(fd, &st) == 0 && st.st_size > 0 && flock(fd, LOCK_EX | LOCK_NB) == 0;
    if (stale && shm_unlink(("/" + n).c_str()) == 0) {
      ++removed;
      RAILCC_INFO(SHM, "removed stale segment /dev/shm/", n, ": no live process holds it");
    }
    close(fd);
  }
  closedir(d);
  return removed;
}

}  // namespace shm
}  // namespace railcc::transport
