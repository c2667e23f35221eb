#include <pthread.h>
#include <sys/stat.h>

#include <fstream>

#include "engine/comm_impl.h"
#include "engine/records.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// Watchdog: progress records, stragglers, flight-recorder dumps

namespace {

// Reads a number that follows "key": in a flat JSON record we wrote ourselves.
bool jsonNumber(const std::string& doc, const char* key, long long& out) {
  std::string k = std::string("\"") + key + "\": ";
  auto pos = doc.find(k);
  if (pos == std::string::npos) return false;
  out = std::strtoll(doc.c_str() + pos + k.size(), nullptr, 10);
  return true;
}

std::string jsonText(const std::string& doc, const char* key) {
  std::string k = std::string("\"") + key + "\": \"";
  auto pos = doc.find(k);
  if (pos == std::string::npos) return "";
  auto end = doc.find('"', pos + k.size());
  return doc.substr(pos + k.size(), end - pos - k.size());
}

std::string transportKind(const std::string& t) { return t.substr(0, t.find(' ')); }

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

std::string fmt(const char* f, double v) {
  char buf[64];
  snprintf(buf, sizeof(buf), f, v);
  return buf;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

}  // namespace

std::string CommImpl::progressRecord() const {
  Telemetry::Progress p = tele_->progress();
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

bool CommImpl::storeTryGet(const std::string& key, Millis wait, std::string& out) {
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
void CommImpl::checkHeartbeat(int peer) {
  std::string rec;
  if (!storeTryGet("progress/" + std::to_string(peer), Millis(2), rec)) return;  // none yet, or a slow store: no verdict
  const auto now = Clock::now();
  auto& b = health_.beats[peer];
  if (b.record != rec) {  // first read (a record is never empty), or it moved: alive
    b.record = rec;
    b.since = now;
    return;
  }
  long long every = 0;
  if (!jsonNumber(rec, "every_ms", every) || every <= 0) every = opts_.config.progressIntervalMs;
  const Millis limit = std::max(Millis(2000), Millis(10 * every));
  if (now - b.since < limit) return;
  const double s = static_cast<double>(std::chrono::duration_cast<Millis>(now - b.since).count()) / 1000.0;
  health_.beats.erase(peer);
  peerFailed(peer, "no connection to it is up for this op (made at first use), and its progress record in the store, "
                   "rewritten every " + std::to_string(every) + " ms while its process group lives, has not changed for " +
                   fmt("%.1f", s) + " s");
}

void CommImpl::watchdogLoop(std::shared_ptr<WatchdogShared> w) {
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
      gpu = w->inComm = dev_.gpuWatched.load(std::memory_order_relaxed);
    }
    if (gpu) {
      // Sleeps at most a second while GPU work is watched: entries queued meanwhile are due later.
      gpuNext = Clock::now() + std::chrono::seconds(1);
      checkGpuWork(&gpuNext);
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

void CommImpl::checkStragglers() {
  std::lock_guard<std::mutex> serial(strag_.checkMu);  // the watchdog and straggler_report() both call this
  const Config& cfg = opts_.config;
  bool raise = cfg.stragglerAction == "raise";
  std::vector<std::string> news;
  std::vector<int> newRanks;
  // Compute stragglers: ranks that arrive last, by far, collective after collective.
  auto lags = tele_->lags();
  double limit = static_cast<double>(cfg.stragglerLagMs) * 1000.0;
  int minOps = static_cast<int>(std::min<int64_t>(8, cfg.stragglerWindow));
  // Only ranks this one heard from have lags (its algorithms' peers: a few at any job size),
  // so the comparison runs over those, not over every pair of ranks of the group.
  std::vector<size_t> heard;
  for (size_t r = 0; r < lags.size(); ++r)
    if (lags[r].ops > 0) heard.push_back(r);
  std::vector<double> others;
  for (size_t r : heard) {
    const auto& l = lags[r];
    others.clear();  // the typical rank, this one left out (with 2 ranks: the other)
    for (size_t q : heard)
      if (q != r) others.push_back(lags[q].meanUs);
    double med = median(others);
    bool bad = l.ops >= minOps && l.meanUs > limit && l.meanUs > 4 * med;
    if (bad && !strag_.lagFlagged[r]) {
      news.push_back(rankName(r) + " (host " + peers_[r].hostname + ") is a straggler: it entered the last " +
                     std::to_string(l.ops) + " collectives " + fmt("%.1f", l.meanUs / 1000) + " ms after the first rank on average (max " +
                     fmt("%.1f", l.maxUs / 1000) + " ms; median rank " + fmt("%.1f", med / 1000) + " ms)");
      newRanks.push_back(static_cast<int>(r));
    }
    if (bad) strag_.lagFlagged[r] = true;
    else if (l.meanUs < limit / 2) strag_.lagFlagged[r] = false;
  }
  // Slow links: far below the median link of the same transport.
  auto links = tele_->links();
  auto byKind = ratesByClass(links);
  std::set<std::pair<int, bool>> flagged;
  for (auto& l : links) {
    auto& all = byKind[linkClass(l)];
    double m = median(all);
    if (l.samples < kMinLinkSamples || all.size() < 2 || l.gbps() >= m * static_cast<double>(cfg.stragglerLinkPct) / 100.0) continue;
    flagged.insert({l.peer, l.send});
    std::lock_guard<std::mutex> g(strag_.mu);
    if (strag_.linkFlagged.count({l.peer, l.send})) continue;
    int src = l.send ? rank_ : l.peer, dst = l.send ? l.peer : rank_;
    news.push_back("slow link: rank " + std::to_string(src) + " -> rank " + std::to_string(dst) + " (" +
                   peers_[src].hostname + " -> " + peers_[dst].hostname + ", " + linkOf(static_cast<int>(l.peer)) + ") moves " +
                   fmt("%.3f", l.gbps()) + " GB/s against a median of " + fmt("%.3f", m) + " GB/s over the " +
                   std::to_string(all.size()) + " " + linkClass(l) + " links of rank " + std::to_string(rank_));
    newRanks.push_back(l.peer);
  }
  std::lock_guard<std::mutex> g(strag_.mu);
  strag_.linkFlagged = flagged;
  for (auto& m : news) RAILCC_WARN(WATCHDOG, m);
  if (raise && !news.empty()) {
    strag_.msg.clear();
    for (auto& m : news) strag_.msg += (strag_.msg.empty() ? "" : "\n") + m;
    strag_.pending.store(true);
    strag_.ranks = newRanks;
  }
}

std::string CommImpl::stragglerReport() {
  checkStragglers();
  std::ostringstream os;
  auto lags = tele_->lags();
  os << "{\"rank\": " << rank_ << ", \"window\": " << opts_.config.stragglerWindow << ", \"ranks\": [";
  {
    std::lock_guard<std::mutex> g(strag_.mu);
    for (size_t r = 0; r < lags.size(); ++r)
      os << (r ? ", " : "") << "{\"rank\": " << r << ", \"host\": " << jsonString(peers_[r].hostname)
         << ", \"lag_us_mean\": " << fmt("%.1f", lags[r].meanUs) << ", \"lag_us_max\": " << fmt("%.1f", lags[r].maxUs)
         << ", \"ops\": " << lags[r].ops << ", \"straggler\": " << (strag_.lagFlagged[r] ? "true" : "false") << "}";
  }
  os << "], \"links\": [";
  auto links = tele_->links();
  auto byKind = ratesByClass(links);
  std::set<std::pair<int, int>> slow;
  bool first = true;
  for (auto& l : links) {
    std::string kind = transportKind(linkOf(static_cast<int>(l.peer)));
    double m = median(byKind[linkClass(l)]);
    int src = l.send ? rank_ : l.peer, dst = l.send ? l.peer : rank_;
    bool isSlow;
    {
      std::lock_guard<std::mutex> g(strag_.mu);
      isSlow = strag_.linkFlagged.count({l.peer, l.send}) > 0;
    }
    if (isSlow) slow.insert({src, dst});
    os << (first ? "" : ", ") << "{\"src\": " << src << ", \"dst\": " << dst << ", \"src_host\": "
       << jsonString(peers_[src].hostname) << ", \"dst_host\": " << jsonString(peers_[dst].hostname)
       << ", \"transport\": " << jsonString(kind) << ", \"link\": " << jsonString(linkOf(static_cast<int>(l.peer))) << ", \"bytes\": " << l.bytes << ", \"samples\": " << l.samples << ", \"gbps\": " << fmt("%.4f", l.gbps())
       << ", \"median_gbps\": " << fmt("%.4f", m) << ", \"slow\": " << (isSlow ? "true" : "false") << "}";
    first = false;
  }
  // Slow links other ranks found (published with their progress records), read within 2 s in
  // all: at thousands of ranks the report must not wait 20 ms for each rank with no record.
  int unread = 0;
  if (opts_.config.progressIntervalMs > 0) {
    const Clock::time_point until = Clock::now() + Millis(2000);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const auto left = std::chrono::duration_cast<Millis>(until - Clock::now());
      if (left.count() <= 0) {
        unread = size_ - r - (rank_ > r ? 1 : 0);
        break;
      }
      std::string rec;
      if (!storeTryGet("progress/" + std::to_string(r), std::max(Millis(1), std::min(Millis(20), left)), rec)) continue;
      size_t pos = 0;
      while ((pos = rec.find("{\"src\": ", pos)) != std::string::npos) {
        long long a = std::strtoll(rec.c_str() + pos + 8, nullptr, 10), b = -1;
        jsonNumber(rec.substr(pos, rec.find('}', pos) - pos + 1), "dst", b);
        if (a >= 0 && a < size_ && b >= 0 && b < size_) slow.insert({static_cast<int>(a), static_cast<int>(b)});
        ++pos;
      }
    }
  }
  os << "], \"stragglers\": [";
  first = true;
  {
    std::lock_guard<std::mutex> g(strag_.mu);
    for (size_t r = 0; r < strag_.lagFlagged.size(); ++r)
      if (strag_.lagFlagged[r]) {
        os << (first ? "" : ", ") << r;
        first = false;
      }
  }
  os << "], \"slow_links\": [";
  first = true;
  for (auto& [a, b] : slow) {
    os << (first ? "" : ", ") << "{\"src\": " << a << ", \"dst\": " << b << ", \"src_host\": " << jsonString(peers_[a].hostname)
       << ", \"dst_host\": " << jsonString(peers_[b].hostname) << "}";
    first = false;
  }
  os << "], \"records_unread\": " << unread << "}";
  return os.str();
}

std::string CommImpl::describePeerProgress(uint64_t seq, std::vector<int>& culprits) {
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
      os << "\n  " << rankName(r) << " (host " << p.hostname << ") has no progress record in the store";
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
    os << "\n  " << rankName(r) << " (host " << p.hostname << ") ";
    if (stopped || stale) {
      // Its record is old: whether it reached this op is unknown, but it is not running.
      os << (stopped ? "is frozen: its process " + std::to_string(p.pid) + " is stopped (SIGSTOP or a debugger)"
                     : "is frozen or unreachable: it stopped reporting (SIGSTOP, debugger, swap storm, or hung "
                       "outside railcc)")
         << "; its last report, " << fmt("%.1f", age) << " s ago, said its last call was " << lastCall;
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

std::vector<int> CommImpl::stillSilent(const std::vector<int>& globals) {
  if (opts_.config.progressIntervalMs <= 0) return globals;  // no records to tell by
  std::vector<int> out;
  const int64_t staleUs = 3 * opts_.config.progressIntervalMs * 1000 + 1000000;
  const std::string& myHost = peers_[static_cast<size_t>(rank_)].hostId;
  for (int g : globals) {
    int r = -1;
    for (int q = 0; q < size_ && r < 0; ++q)
      if (globalRank(q) == g) r = q;
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

std::string CommImpl::traceJson(const std::string& reason) const {
  std::ostringstream os;
  Telemetry::Progress p = tele_->progress();
  os << "{\n  \"version\": 1, \"group\": " << jsonString(opts_.name) << ", \"rank\": " << rank_ << ", \"size\": " << size_
     << ", \"host\": " << jsonString(hostname_) << ", \"pid\": " << getpid() << ",\n  \"dumped_at_us\": " << wallMicros()
     << ", \"reason\": " << jsonString(reason) << ",\n  \"error\": ";
  std::exception_ptr broken;
  {
    std::lock_guard<std::mutex> g(health_.errMu);
    broken = health_.broken;
  }
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
       << ", \"transport\": " << jsonString(linkOf(static_cast<int>(r))) << "}";
  auto lags = tele_->lags();
  const auto& mine = lags[static_cast<size_t>(rank_)];
  os << "],\n  \"ops\": " << tele_->opsJson() << ",\n  \"links\": " << tele_->linksJson()
     << ",\n  \"arrival\": {\"lag_us_mean\": " << fmt("%.1f", mine.meanUs) << ", \"lag_us_max\": " << fmt("%.1f", mine.maxUs)
     << ", \"last_count\": " << mine.ops << "},\n  \"lags\": " << tele_->lagsJson();
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

bool CommImpl::ownDump(const std::string& path) const { return ownDumpAt(path, hostname_, getpid()); }

std::string CommImpl::writeTrace(const std::string& reason, const std::string& dirArg) const {
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
    path = dir + "/railcc-trace-" + group + "-rank" + std::to_string(rank_) + "-" + hostname_ + "-" +
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

}  // namespace railcc::engine
