// One discovery per machine for the processes that start together (discoverShared in
// topology.h). The first to take the lock discovers with hwloc and leaves the XML in a file,
// and the topology as railcc sees it in a second (compact.cpp); the others read the second
// without loading hwloc (microseconds, where loading hwloc and the XML took 1.4-2.3 ms of
// CPU), or, where it is unusable or GPUs are named, load the XML; either against 7-17 ms of
// discovery per process here, which 32 ranks on 2 cores paid about 250 ms of wall time for. The file is named by user and
// boot, written only by its owner (mode 0600, renamed into place whole) and used only while
// younger than the limit, so a NIC hot-plugged later is seen by the next job; anything wrong
// with it (missing, old, not the owner's, not XML) means a discovery of our own.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <fstream>
#include <iterator>
#include <thread>

#include "common/error.h"
#include "topology/topology.h"

namespace railcc::topology {

namespace {

// The boot's id, hex digits and dashes only ("" where the kernel gives none).
std::string bootId() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id, out;
  std::getline(f, id);
  for (char c : id)
    if (std::isxdigit(static_cast<unsigned char>(c)) || c == '-') out += c;
  return out.size() >= 8 ? out : "";
}

// A regular file of ours, written within the last `maxAgeSec` seconds.
bool freshOwnFile(const std::string& path, int64_t maxAgeSec) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != getuid()) return false;
  const int64_t age = static_cast<int64_t>(time(nullptr)) - static_cast<int64_t>(st.st_mtime);
  return age >= 0 && age <= maxAgeSec;
}

// Writes `xml` to a file beside `path` and renames it into place: a reader sees all or none.
// No fsync: the name carries the boot's id, so no later boot reads what a crash left behind.
void writeWhole(const std::string& path, const std::string& xml) {
  const std::string tmp = path + "." + std::to_string(getpid()) + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return;
  size_t done = 0;
  while (done < xml.size()) {
    ssize_t k = ::write(fd, xml.data() + done, xml.size() - done);
    if (k <= 0) break;
    done += static_cast<size_t>(k);
  }
  bool ok = done == xml.size();
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) ::unlink(tmp.c_str());
}

// A topology read from another process's file: says so, and names this host.
void markShared(Topology& topo, const std::string& path, int64_t maxAgeSec) {
  topo.method = "hwloc";
  topo.source = "this machine (hwloc, discovered by another process of this user within " + std::to_string(maxAgeSec) +
                " s and shared through " + path + ")";
  char hn[256] = {0};
  if (gethostname(hn, sizeof(hn) - 1) == 0 && hn[0]) topo.hostname = hn;
}

// The machine's topology from another process's fresh file; false where there is none or
// hwloc cannot read it (then the caller discovers, and replaces it).
bool loadShared(const DiscoverOptions& opts, const std::string& xmlPath, int64_t maxAgeSec, Topology& topo) {
  if (!freshOwnFile(xmlPath, maxAgeSec)) return false;
  try {
    DiscoverOptions o = opts;
    o.xmlFile = xmlPath;
    topo = discover(o);
  } catch (const Error&) {
    return false;
  }
  markShared(topo, xmlPath, maxAgeSec);
  return true;
}

// The same from the compact file beside it: no hwloc. Only where no GPUs are named (their
// order and the missing ones are worked out from the XML for the names asked).
bool loadCompact(const DiscoverOptions& opts, const std::string& path, int64_t maxAgeSec, Topology& topo) {
  if (!opts.gpuBusIds.empty() || !freshOwnFile(path, maxAgeSec)) return false;
  std::ifstream f(path, std::ios::binary);
  std::string text;
  text.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  if (!f.good() && !f.eof()) return false;
  if (!decodeCompact(text, topo)) return false;
  markShared(topo, path, maxAgeSec);
  return true;
}

// Another process's discovery, from whichever of its two files serves: the compact one first.
bool loadEither(const DiscoverOptions& opts, const std::string& base, int64_t maxAgeSec, Topology& topo) {
  return loadCompact(opts, base + ".txt", maxAgeSec, topo) || loadShared(opts, base + ".xml", maxAgeSec, topo);
}

// discoverShared, or with `wait` false (discoverSharedNow) false at once where another process
// holds the lock: it is discovering, and its file will serve later (`topo` may then hold what
// an unusable file left in it).
bool shared(const DiscoverOptions& opts, const std::string& dir, int64_t maxAgeSec, bool wait, Topology& topo) {
  auto ownDiscovery = [&] {
    topo = discover(opts);
    return true;
  };
  if (!opts.xmlFile.empty() || opts.sysfs || maxAgeSec <= 0 || dir.empty()) return ownDiscovery();
  const std::string boot = bootId();
  if (boot.empty()) return ownDiscovery();
  const std::string base = dir + "/railcc-topo-" + std::to_string(getuid()) + "-" + boot;
  const std::string xmlPath = base + ".xml", compactPath = base + ".txt";
  // A fresh file is read without the lock: it was renamed into place whole, and readers that
  // queued for the lock one after another cost 32 ranks here 40-270 ms each.
  if (loadEither(opts, base, maxAgeSec, topo)) return true;
  int lock = ::open((base + ".lock").c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  struct stat st {};
  if (lock >= 0 && (fstat(lock, &st) != 0 || st.st_uid != getuid())) {  // someone else's: not ours to trust
    ::close(lock);
    lock = -1;
  }
  if (lock < 0) return ownDiscovery();
  // One process discovers while the others wait for its file; a holder that takes longer
  // than 10 s (hwloc stuck on a device) costs the others a discovery of their own, not a hang.
  // While waiting, the file is looked for without the lock too: waiters that took the lock in
  // turn only to read the file queued behind each other (64 ranks on 2 cores: up to 1.1 s for
  // a 38 ms discovery). The waits grow from 1 ms to 16 ms, to leave the cores to the discovery.
  bool locked = ::flock(lock, LOCK_EX | LOCK_NB) == 0;
  if (!locked && !wait) {
    ::close(lock);
    return false;
  }
  auto nap = std::chrono::milliseconds(1);
  for (auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
       !locked && std::chrono::steady_clock::now() < until; locked = ::flock(lock, LOCK_EX | LOCK_NB) == 0) {
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::milliseconds(16));
    if (loadEither(opts, base, maxAgeSec, topo)) {
      ::close(lock);
      return true;
    }
  }
  // The holder before us has most likely just written it.
  if (!loadEither(opts, base, maxAgeSec, topo)) {
    try {
      topo = discover(opts);
    } catch (...) {
      if (locked) ::flock(lock, LOCK_UN);
      ::close(lock);
      throw;
    }
    if (topo.method == "hwloc" && !topo.xml.empty()) {
      // The compact file first: the waiters look for it first (loadEither), and one that found
      // the XML alone would load hwloc and parse it (1.4-2.3 ms of CPU and its pages).
      // GPUs named in `opts` would be in that order, or marked missing: not the machine's own.
      const std::string compact = opts.gpuBusIds.empty() ? encodeCompact(topo) : "";
      if (!compact.empty()) writeWhole(compactPath, compact);
      writeWhole(xmlPath, topo.xml);
    }
  }
  if (locked) ::flock(lock, LOCK_UN);
  ::close(lock);
  return true;
}

}  // namespace

Topology discoverShared(const DiscoverOptions& opts, const std::string& dir, int64_t maxAgeSec) {
  Topology topo;
  shared(opts, dir, maxAgeSec, true, topo);
  return topo;
}

bool discoverSharedNow(const DiscoverOptions& opts, const std::string& dir, int64_t maxAgeSec, Topology& topo) {
  return shared(opts, dir, maxAgeSec, false, topo);
}

}  // namespace railcc::topology
