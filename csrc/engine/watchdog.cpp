#include <pthread.h>
#include <sys/stat.h>

#include <fstream>

#include "common/error.h"
#include "common/log.h"
#include "common/pid.h"
#include "engine/callback_pool.h"
#include "engine/records.h"
#include "engine/watchdog.h"
#include "transport/local.h"

namespace railcc::engine {

// The watchdog: its thread and its store traffic, what the other ranks' progress records say
// (a peer gone, who never called an op, who froze), and the flight-recorder dump. Stragglers
// and slow links are in stragglers.cpp.

namespace {

std::string jsonText(const std::string& doc, const char* key) {
  std::string k = std::string("\"") + key + "\": \"";
  auto pos = doc.find(k);
  if (pos == std::string::npos) return "";
  auto end = doc.find('"', pos + k.size());
  return doc.substr(pos + k.size(), end - pos - k.size());
}

char processState(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(f, line);
  auto rp = line.rfind(')');
  return rp != std::string::npos && rp + 2 < line.size() ? line[rp + 2] : '?';
}

// The threads that run storeTryGet's reads, each kept 2 s for the next one (starting a thread
// costs ~35 us of CPU here, and a first op reads the endpoint of every peer it connects): a
// read takes an idle one or starts another, so one stuck in a frozen store holds up no other.
// Never destroyed (a read left behind still uses it); a forked child starts a pool of its own.
std::atomic<CallbackPool*> gReaders{nullptr};
CallbackPool& readers() {
  static std::once_flag once;
  std::call_once(once, [] {
    gReaders = new CallbackPool(-1);
    pthread_atfork(nullptr, nullptr, [] { gReaders = new CallbackPool(-1); });
  });
  return *gReaders.load();
}

}  // namespace

std::string Watchdog::progressRecord() const {
  Telemetry::Progress p = tele_.progress();
  std::ostringstream os;
  os << "{\"rank\": " << rank_ << ", \"pid\": " << getpid() << ", \"wall_us\": " << wallMicros()
     << ", \"every_ms\": " << opts_.config.progressIntervalMs
     << ", \"enqueued\": " << p.enqueued << ", \"started\": " << p.started << ", \"completed\": " << p.completed
     << ", \"last_op\": " << jsonString(p.lastOp) << ", \"slow_links\": [";
  std::lock_guard<std::mutex> g(strag_.mu);
  bool first = true;
  for (const auto& [peer, send] : strag_.linkFlagged) {
    os << (first ? "" : ", ") << "{\"src\": " << (send ? rank_ : peer) << ", \"dst\": " << (send ? peer : rank_) << "}";
    first = false;
  }
  os << "]}";
  return os.str();
}

bool Watchdog::storeTryGet(const std::string& key, Millis wait, std::string& out) {
  if (store_->lost()) return false;  // its host has exited: nothing to read, and no noise
  if (!wd_->keep) {  // a store the caller owns (tests): read in place, it cannot be left behind
    try {
      out = store_->get(key, wait);
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }
  struct Slot {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false, ok = false;
    std::string value;
  };
  auto slot = std::make_shared<Slot>();
  // Where no thread can start (helpers stuck in a dead store), the read waits for one; the
  // wait below gives up on it in time all the same.
  readers().post([slot, store = wd_->keep, key, wait] {
    std::string v;
    bool ok = false;
    try {
      v = store->get(key, wait);
      ok = true;
    } catch (const std::exception&) {
    }
    std::lock_guard<std::mutex> g(slot->mu);
    slot->done = true;
    slot->ok = ok;
    slot->value = std::move(v);
    slot->cv.notify_all();
  });
  std::unique_lock<std::mutex> g(slot->mu);
  if (!slot->cv.wait_for(g, wait + Millis(100), [&] { return slot->done; })) return false;
  out = slot->value;
  return slot->ok;
}

// A peer this rank waits on but has no connection to (made at first use: verbs pairs meet
// through the store, so nothing closes or refuses when the peer is gone) is alive while its
// watchdog rewrites its progress record. Unchanged for ten of its intervals (2 s at least), it
// is gone: the op fails now, naming it, instead of at its timeout.
bool Watchdog::heartbeatStopped(int peer, std::string& why) {
  std::string rec;
  if (!storeTryGet("progress/" + std::to_string(peer), Millis(2), rec)) return false;  // none yet, or a slow store: no verdict
  const auto now = Clock::now();
  auto& b = beats_[peer];
  if (b.record != rec) {  // first read (a record is never empty), or it moved: alive
    b.record = rec;
    b.since = now;
    return false;
  }
  long long every = 0;
  if (!jsonNumber(rec, "every_ms", every) || every <= 0) every = opts_.config.progressIntervalMs;
  const Millis limit = std::max(Millis(2000), Millis(10 * every));
  if (now - b.since < limit) return false;
  const double s = static_cast<double>(std::chrono::duration_cast<Millis>(now - b.since).count()) / 1000.0;
  beats_.erase(peer);
  why = "no connection to it is up for this op (made at first use), and its progress record in the store, "
        "rewritten every " + std::to_string(every) + " ms while its process group lives, has not changed for " +
        formatNumber("%.1f", s) + " s";
  return true;
}

void Watchdog::loop(std::shared_ptr<WatchdogShared> w) {
  log::setThreadRank(rank_);
  const int rank = rank_;
  const bool stragglers = opts_.config.stragglerAction != "off";
  const bool records = opts_.config.progressIntervalMs > 0;
  const Millis every(records ? opts_.config.progressIntervalMs : 1000);
  // Asked once now, after set-up: a store that watches its server (the c10d glue's) opens the
  // watch here, on this thread, rather than during set-up.
  bool storeGone = w->store->lost();
  auto nextBeat = Clock::now() + every;
  auto gpuNext = Clock::time_point::max();  // when GPU work is next due (engine/device/gpu_watch.cpp)
  while (true) {
    std::vector<std::pair<std::string, std::string>> todo;
    bool gpu = false;
    {
      std::unique_lock<std::mutex> g(w->mu);
      auto tasksNext = Clock::time_point::max();
      for (const WatchdogTask& t : w->tasks) tasksNext = std::min(tasksNext, t.next);
      w->cv.wait_until(g, std::min({nextBeat, gpuNext, tasksNext}), [&] { return w->stop || !w->publish.empty(); });
      todo.swap(w->publish);
      if (w->stop) {  // from here on the communicator may be gone: only the queued reports go out
        g.unlock();
        for (auto& [key, value] : todo) {
          if (storeGone || w->store->lost()) break;
          try {
            w->store->set(key, value);
          } catch (const std::exception&) {
          }
        }
        break;
      }
      if (Clock::now() >= nextBeat) {
        nextBeat = Clock::now() + every;
        if (stragglers) checkStragglers();
        if (records) todo.push_back({"progress/" + std::to_string(rank), progressRecord()});
      }
      // GPU work is checked outside `mu` (failing the group takes it); teardown waits for it.
      gpu = w->inComm = host_.gpuWatched();
    }
    if (gpu) {
      // Sleeps at most a second while GPU work is watched: entries queued meanwhile are due later.
      gpuNext = Clock::now() + std::chrono::seconds(1);
      host_.checkGpu(&gpuNext);
      std::lock_guard<std::mutex> g(w->mu);
      w->inComm = false;
      w->cv.notify_all();
    }
    // Work left from set-up (watchdog_tasks.h), one look each: never a wait, a beat is due.
    for (size_t i = 0; i < w->tasks.size();) {
      WatchdogTask& t = w->tasks[i];
      const auto now = Clock::now();
      if (now < t.next) {
        ++i;
      } else if (t.step()) {
        w->tasks.erase(w->tasks.begin() + static_cast<long>(i));
      } else {
        t.next = now + t.pace;
        t.pace = std::min(t.pace * 2, every);
        ++i;
      }
    }
    if (!storeGone && w->store->lost()) {
      storeGone = true;
      RAILCC_WARN(WATCHDOG, "the c10d store is gone (its host, usually rank 0 or the launcher, has exited): no more "
                  "progress records or failure reports through it; peer failures are still found by the transports");
    }
    for (auto& [key, value] : todo) {
      if (storeGone) break;
      try {
        w->store->set(key, value);
      } catch (const std::exception& e) {
        // The store's host is gone (it usually dies with rank 0 or the launcher): stop all
        // background traffic through it, which would only fail again, each time noisily.
        std::string what = e.what();
        RAILCC_WARN(WATCHDOG, "could not write '", key, "' to the c10d store, so railcc stops its background store "
                    "traffic (progress records, failure reports): ", what.substr(0, what.find('\n')));
        storeGone = true;
        break;
      }
    }
    {
      std::lock_guard<std::mutex> g(w->mu);
      w->drained = w->publish.empty();
    }
    w->cv.notify_all();
  }
  std::lock_guard<std::mutex> g(w->mu);
  w->exited = true;
  w->cv.notify_all();
}



std::string Watchdog::describePeerProgress(uint64_t seq, std::vector<int>& culprits) {
  if (opts_.config.progressIntervalMs <= 0) return "";
  std::ostringstream os;
  std::vector<int> never, frozen, joined;
  int64_t now = wallMicros();
  int64_t staleUs = 3 * opts_.config.progressIntervalMs * 1000 + 1000000;
  auto deadline = Clock::now() + Millis(2000);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const PeerInfo& p = peers_[static_cast<size_t>(r)];
    std::string rec;
    auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    if (left.count() <= 0) {
      os << "\n  (no time left to read the progress of ranks " << r << " and up: the store is slow)";
      break;
    }
    if (!storeTryGet("progress/" + std::to_string(r), std::max(Millis(1), std::min(Millis(100), left)), rec)) {
      os << "\n  " << host_.rankName(r) << " (host " << p.hostname << ") has no progress record in the store";
      frozen.push_back(r);
      continue;
    }
    long long enq = 0, comp = 0, wall = 0;
    jsonNumber(rec, "enqueued", enq);
    jsonNumber(rec, "completed", comp);
    jsonNumber(rec, "wall_us", wall);
    if (comp >= static_cast<long long>(seq)) continue;
    double age = static_cast<double>(now - wall) / 1e6;
    bool stale = now - wall > staleUs;
    bool stopped = p.hostId == peers_[static_cast<size_t>(rank_)].hostId && processState(p.pid) == 'T';
    std::string last = jsonText(rec, "last_op");
    std::string lastCall = "seq " + std::to_string(enq) + (enq > 0 && !last.empty() ? " (" + last + ")" : "");
    os << "\n  " << host_.rankName(r) << " (host " << p.hostname << ") ";
    if (stopped || stale) {
      // Its record is old: whether it reached this op is unknown, but it is not running.
      os << (stopped ? "is frozen: its process " + std::to_string(p.pid) + " is stopped (SIGSTOP or a debugger)"
                     : "is frozen or unreachable: it stopped reporting (SIGSTOP, debugger, swap storm, or hung "
                       "outside railcc)")
         << "; its last report, " << formatNumber("%.1f", age) << " s ago, said its last call was " << lastCall;
      frozen.push_back(r);
    } else if (enq < static_cast<long long>(seq)) {
      os << "never called seq " << seq << ": its last call was " << lastCall
         << "; it is alive and reporting, so it is still in code before this call";
      never.push_back(r);
    } else {
      os << "joined seq " << seq << " but has not finished it";
      joined.push_back(r);
    }
  }
  culprits = !never.empty() ? never : frozen;
  {
    std::ostringstream js;
    js << "{";
    bool first = true;
    for (auto* group : {&never, &frozen, &joined})
      for (int r : *group) {
        js << (first ? "" : ", ") << "\"" << r << "\": \""
           << (group == &never ? "never_called" : group == &frozen ? "frozen" : "joined") << "\"";
        first = false;
      }
    js << "}";
    std::lock_guard<std::mutex> g(strag_.mu);
    strag_.peerProgressJson = js.str();
  }
  std::string body = os.str();
  return body.empty() ? "" : "\nprogress of the other ranks:" + body;
}

std::vector<int> Watchdog::stillSilent(const std::vector<int>& globals) {
  if (opts_.config.progressIntervalMs <= 0) return globals;  // no records to tell by
  std::vector<int> out;
  const int64_t staleUs = 3 * opts_.config.progressIntervalMs * 1000 + 1000000;
  const std::string& myHost = peers_[static_cast<size_t>(rank_)].hostId;
  for (int g : globals) {
    int r = -1;
    for (int q = 0; q < size_ && r < 0; ++q)
      if (host_.globalRank(q) == g) r = q;
    if (r < 0 || r == rank_) continue;
    const PeerInfo& p = peers_[static_cast<size_t>(r)];
    const bool here = p.hostId == myHost && p.pid > 0 && p.pidNs == pidNamespace();
    if (here && (transport::processGone(p.pid) || processState(p.pid) == 'T')) {
      out.push_back(g);
      continue;
    }
    std::string rec;
    long long wall = 0;
    // Its record keeps being refreshed while its process runs, broken group or not.
    if (!storeTryGet("progress/" + std::to_string(r), Millis(200), rec) || !jsonNumber(rec, "wall_us", wall) ||
        wallMicros() - wall > staleUs)
      out.push_back(g);
  }
  return out;
}

std::string Watchdog::traceJson(const std::string& reason) const {
  std::ostringstream os;
  Telemetry::Progress p = tele_.progress();
  os << "{\n  \"version\": 1, \"group\": " << jsonString(opts_.name) << ", \"rank\": " << rank_ << ", \"size\": " << size_
     << ", \"host\": " << jsonString(hostname()) << ", \"pid\": " << getpid() << ",\n  \"dumped_at_us\": " << wallMicros()
     << ", \"reason\": " << jsonString(reason) << ",\n  \"error\": ";
  std::exception_ptr broken = host_.brokenError();
  if (!broken) {
    os << "null";
  } else {
    try {
      std::rethrow_exception(broken);
    } catch (const Error& e) {
      std::string code = errorCodeName(e.code());
      std::transform(code.begin(), code.end(), code.begin(), ::tolower);
      if (code == "peerfailure") code = "peer_failure";
      os << "{\"code\": " << jsonString(code) << ", \"message\": " << jsonString(e.what()) << ", \"ranks\": [";
      for (size_t i = 0; i < e.ranks.size(); ++i) os << (i ? ", " : "") << e.ranks[i];
      os << "], \"hosts\": [";
      for (size_t i = 0; i < e.hosts.size(); ++i) os << (i ? ", " : "") << jsonString(e.hosts[i]);
      os << "], \"seq\": " << (e.seq < 0 ? std::string("null") : std::to_string(e.seq))
         << ", \"op\": " << (e.op.empty() ? std::string("null") : jsonString(e.op)) << "}";
    } catch (const std::exception& e) {
      os << "{\"code\": \"internal\", \"message\": " << jsonString(e.what()) << "}";
    }
  }
  os << ",\n  \"progress\": {\"enqueued\": " << p.enqueued << ", \"started\": " << p.started
     << ", \"completed\": " << p.completed << "},\n  \"peers\": [";
  for (size_t r = 0; r < peers_.size(); ++r)
    os << (r ? ", " : "") << "{\"rank\": " << r << ", \"host\": " << jsonString(peers_[r].hostname)
       << ", \"transport\": " << jsonString(host_.linkOf(static_cast<int>(r))) << "}";
  auto lags = tele_.lags();
  const auto& mine = lags[static_cast<size_t>(rank_)];
  os << "],\n  \"ops\": " << tele_.opsJson() << ",\n  \"links\": " << tele_.linksJson()
     << ",\n  \"arrival\": {\"lag_us_mean\": " << formatNumber("%.1f", mine.meanUs) << ", \"lag_us_max\": " << formatNumber("%.1f", mine.maxUs)
     << ", \"last_count\": " << mine.ops << "},\n  \"lags\": " << tele_.lagsJson();
  {
    std::lock_guard<std::mutex> g(strag_.mu);
    os << ",\n  \"peer_progress\": " << strag_.peerProgressJson << "\n}\n";
  }
  return os.str();
}

namespace {
// Whether the dump at `path` is absent or this process's own (its header names our host and pid).
bool ownDumpAt(const std::string& path, const std::string& host, int pid) {
  std::ifstream f(path);
  if (!f) return true;
  char head[1024] = {0};
  f.read(head, sizeof(head) - 1);
  std::string h(head, static_cast<size_t>(f.gcount()));
  return h.find("\"pid\": " + std::to_string(pid) + ",") != std::string::npos &&
         h.find("\"host\": " + jsonString(host) + ",") != std::string::npos;
}
}  // namespace

bool Watchdog::ownDump(const std::string& path) const { return ownDumpAt(path, hostname(), getpid()); }

std::string Watchdog::writeTrace(const std::string& reason, const std::string& dirArg) const {
  std::lock_guard<std::mutex> serial(traceMu_);
  std::string dir = dirArg.empty() ? opts_.config.traceDir : dirArg;
  if (dir.empty()) return "";
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
    RAILCC_THROW(kSystem, "cannot create RAILCC_TRACE_DIR ", dir, ": ", detail::errnoString());
  std::string group = opts_.name.empty() ? "default" : opts_.name;
  for (char& c : group)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') c = '_';
  std::string path = dir + "/railcc-trace-" + group + "-rank" + std::to_string(rank_) + ".json";
  if (!ownDump(path)) {
    // Another process's dump (a second job sharing the directory): kept, and ours goes beside it.
    path = dir + "/railcc-trace-" + group + "-rank" + std::to_string(rank_) + "-" + hostname() + "-" +
           std::to_string(getpid()) + ".json";
  }
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << traceJson(reason);
    if (!f) RAILCC_THROW(kSystem, "writing ", tmp, " failed");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) RAILCC_THROW(kSystem, "renaming ", tmp, ": ", detail::errnoString());
  return path;
}

Watchdog::Watchdog(WatchdogHost& host, const CommOptions& opts, Telemetry& tele, int rank, int size,
                   const std::vector<PeerInfo>& peers, Store* store, std::shared_ptr<Store> keep)
    : host_(host), opts_(opts), tele_(tele), rank_(rank), size_(size), peers_(peers), store_(store),
      wd_(std::make_shared<WatchdogShared>()) {
  wd_->keep = std::move(keep);
  wd_->store = store_;
  strag_.lagFlagged.assign(static_cast<size_t>(size_), false);
}

void Watchdog::start() {
  if (size_ < 2) return;
  // A first progress record now, so that a rank frozen before the thread's first beat is
  // still told apart from one that never published anything.
  if (opts_.config.progressIntervalMs > 0) store_->set("progress/" + std::to_string(rank_), progressRecord());
  thread_ = std::thread([this, w = wd_] { loop(w); });
}

void Watchdog::stop() {
  if (!thread_.joinable()) return;
  std::unique_lock<std::mutex> g(wd_->mu);
  wd_->stop = true;
  wd_->cv.notify_all();
  wd_->cv.wait(g, [&] { return !wd_->inComm; });  // a GPU check in progress uses the communicator
  // A watchdog blocked in an unreachable store must not hold up destroy_process_group: it
  // never touches the communicator once `stop` is set, so it can be left to finish alone.
  // Without a keep-alive the store is the caller's, and may go right after us: always join.
  if (!wd_->keep || wd_->cv.wait_for(g, Millis(2000), [&] { return wd_->exited; })) {
    wd_->cv.wait(g, [&] { return wd_->exited; });
    g.unlock();
    thread_.join();
  } else {
    g.unlock();
    RAILCC_WARN(WATCHDOG, "the watchdog thread is blocked in the c10d store; leaving it behind");
    thread_.detach();
  }
}

void Watchdog::publish(const std::string& key, const std::string& value) {
  if (size_ < 2) return;
  {
    std::lock_guard<std::mutex> g(wd_->mu);
    wd_->publish.push_back({key, value});
    wd_->drained = false;
  }
  wd_->cv.notify_all();
}

void Watchdog::waitPublished(Millis wait) {
  std::unique_lock<std::mutex> g(wd_->mu);
  wd_->cv.wait_for(g, wait, [&] { return wd_->drained; });
}




}  // namespace railcc::engine
