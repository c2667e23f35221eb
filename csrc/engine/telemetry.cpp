#include "engine/telemetry.h"

#include <ctime>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>

namespace railcc::engine {

int64_t wallMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int64_t processCpuMicros() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

namespace {
// Length of the well-formed UTF-8 sequence at s[i] (1-4), or 0 when the bytes there are not one.
size_t utf8Length(const std::string& s, size_t i) {
  auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  unsigned char c = b(i);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k)
    if ((b(i + k) >> 6) != 2) return 0;
  uint32_t cp = n == 1 ? c : n == 2 ? c & 0x1f : n == 3 ? c & 0x0f : c & 0x07;
  for (size_t k = 1; k < n; ++k) cp = cp << 6 | (b(i + k) & 0x3f);
  static const uint32_t least[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < least[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;  // overlong, surrogate
  return n;
}
}  // namespace

// Strict JSON: bytes that are not UTF-8 (an error message quoting what another process sent)
// become U+FFFD, so no reader refuses the whole dump for one stray byte.
bool jsonNumber(const std::string& doc, const char* key, long long& out) {
  std::string k = std::string("\"") + key + "\": ";
  auto pos = doc.find(k);
  if (pos == std::string::npos) return false;
  out = std::strtoll(doc.c_str() + pos + k.size(), nullptr, 10);
  return true;
}

std::string formatNumber(const char* f, double v) {
  char buf[64];
  snprintf(buf, sizeof(buf), f, v);
  return buf;
}

std::string jsonString(const std::string& s) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (static_cast<unsigned char>(c) >= 0x80) {
      size_t n = utf8Length(s, i);
      if (n == 0) {
        out += "\\ufffd";
      } else {
        out.append(s, i, n);
        i += n - 1;
      }
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

namespace {
const char* stateName(Telemetry::State s) {
  switch (s) {
    case Telemetry::State::kQueued: return "queued";
    case Telemetry::State::kRunning: return "running";
    case Telemetry::State::kCompleted: return "completed";
    case Telemetry::State::kFailed: return "failed";
  }
  return "?";
}

std::string orNull(int64_t us) { return us > 0 ? std::to_string(us) : "null"; }
}  // namespace

Telemetry::Telemetry(int rank, int size, size_t ringSize, size_t window)
    : rank_(rank), size_(size), window_(std::max<size_t>(window, 1)), ring_(std::max<size_t>(ringSize, 1)) {
  lag_.assign(static_cast<size_t>(size), {});
  lagPos_.assign(static_cast<size_t>(size), 0);
  for (int d = 0; d < 2; ++d) {
    link_[d].assign(static_cast<size_t>(size), {});
    linkPos_[d].assign(static_cast<size_t>(size), 0);
  }
}

Telemetry::OpTrace* Telemetry::find(uint64_t id) {
  OpTrace& t = ring_[id % ring_.size()];
  return t.id == id ? &t : nullptr;
}

uint64_t Telemetry::opQueued(uint64_t seq, const char* op, const char* dtype, const char* redop, int root,
                             uint64_t count, int64_t startedUs) {
  std::lock_guard<std::mutex> g(mu_);
  uint64_t id = nextId_++;
  OpTrace& t = ring_[id % ring_.size()];
  // Reuse the slot's rows: recording an op allocates nothing once the ring is warm. Rows an
  // op with many peers needed (all-to-all) are let go, so that the ring holds only what
  // recent ops of few peers use.
  std::vector<OpTrace::PeerBytes> rows = std::move(t.bytes);
  std::vector<int> waiting = std::move(t.waitingOn);
  t = OpTrace{};
  rows.clear();
  if (rows.capacity() > kKeepRows) rows.shrink_to_fit();
  waiting.clear();
  t.bytes = std::move(rows);
  t.waitingOn = std::move(waiting);
  t.id = id;
  t.seq = seq;
  t.op = op;
  t.dtype = dtype;
  t.redop = redop;
  t.root = root;
  t.count = count;
  t.enqueueUs = startedUs > 0 ? startedUs : wallMicros();
  if (seq > progress_.enqueued) {
    progress_.enqueued = seq;
    progress_.lastOp = op;
  }
  if (startedUs > 0) {
    t.state = State::kRunning;
    t.startUs = startedUs;
    if (seq > 0) progress_.started = std::max(progress_.started, seq);
  }
  return id;
}

void Telemetry::opStarted(uint64_t id, uint64_t seq, int64_t nowUs) {
  std::lock_guard<std::mutex> g(mu_);
  if (seq > 0) progress_.started = std::max(progress_.started, seq);
  if (OpTrace* t = find(id)) {
    t->state = State::kRunning;
    t->startUs = nowUs;
  }
}

namespace {
// Rows sorted by peer, one per peer, in place.
void compact(std::vector<Telemetry::OpTrace::PeerBytes>& v) {
  std::sort(v.begin(), v.end(), [](auto& a, auto& b) { return a.peer < b.peer; });
  size_t out = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    if (out > 0 && v[out - 1].peer == v[i].peer) {
      v[out - 1].sent += v[i].sent;
      v[out - 1].recvd += v[i].recvd;
    } else {
      v[out++] = v[i];
    }
  }
  v.resize(out);
}
}  // namespace

void Telemetry::addBytes(OpTrace& t, int peer, uint64_t sent, uint64_t recvd) {
  if (sent == 0 && recvd == 0) return;
  // The same peer again (a ring's neighbour step after step) most often: the last rows.
  for (size_t i = t.bytes.size(), k = 0; i > 0 && k < 4; --i, ++k)
    if (t.bytes[i - 1].peer == peer) {
      t.bytes[i - 1].sent += sent;
      t.bytes[i - 1].recvd += recvd;
      return;
    }
  t.bytes.push_back({peer, sent, recvd});
  // Otherwise rows pile up, merged once they double: O(log) per row whatever the op's peers.
  if (t.bytes.size() >= std::max<size_t>(t.compactAt, 16)) {
    compact(t.bytes);
    t.compactAt = 2 * t.bytes.size();
  }
}

void Telemetry::opBytes(uint64_t id, int peer, uint64_t sent, uint64_t recvd) {
  if (peer < 0 || peer >= size_) return;
  std::lock_guard<std::mutex> g(mu_);
  if (OpTrace* t = find(id)) addBytes(*t, peer, sent, recvd);
}

void Telemetry::opBytes(uint64_t id, const std::vector<std::array<uint64_t, 3>>& rows) {
  std::lock_guard<std::mutex> g(mu_);
  OpTrace* t = find(id);
  if (!t) return;
  for (auto& [peer, sent, recvd] : rows)
    if (peer < static_cast<uint64_t>(size_)) addBytes(*t, static_cast<int>(peer), sent, recvd);
}

void Telemetry::opFinished(uint64_t id, uint64_t seq, const std::string& error, const std::vector<int>& waitingOn,
                           const std::vector<std::pair<int, int64_t>>* startUs) {
  std::lock_guard<std::mutex> g(mu_);
  if (startUs) arrivalsLocked(*startUs);
  if (seq > 0 && error.empty()) progress_.completed = std::max(progress_.completed, seq);
  OpTrace* t = find(id);
  if (!t) return;
  t->state = error.empty() ? State::kCompleted : State::kFailed;
  t->endUs = wallMicros();
  if (t->startUs == 0) t->startUs = t->endUs;
  t->error = error.substr(0, error.find('\n'));
  t->waitingOn = waitingOn;
}

void Telemetry::arrivalsLocked(const std::vector<std::pair<int, int64_t>>& startUs) {
  int64_t first = 0;
  for (auto& [r, s] : startUs)
    if (s > 0 && (first == 0 || s < first)) first = s;
  if (first == 0) return;
  for (auto& [r, s] : startUs) {
    if (s <= 0 || r < 0 || static_cast<size_t>(r) >= lag_.size()) continue;
    auto& w = lag_[static_cast<size_t>(r)];
    double lag = static_cast<double>(s - first);
    if (w.size() < window_) w.push_back(lag);
    else w[lagPos_[static_cast<size_t>(r)]++ % window_] = lag;
  }
}

void Telemetry::linkSample(int peer, bool send, uint64_t bytes, int64_t busyUs) {
  if (peer < 0 || peer >= size_ || bytes == 0) return;
  std::lock_guard<std::mutex> g(mu_);
  auto& w = link_[send ? 1 : 0][static_cast<size_t>(peer)];
  Sample s{bytes, std::max<int64_t>(busyUs, 1)};
  size_t& pos = linkPos_[send ? 1 : 0][static_cast<size_t>(peer)];
  if (w.size() < window_) w.push_back(s);
  else w[pos++ % window_] = s;
}

std::vector<Telemetry::LagStats> Telemetry::lags() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<LagStats> out(lag_.size());
  for (size_t r = 0; r < lag_.size(); ++r) {
    for (double v : lag_[r]) {
      out[r].meanUs += v;
      out[r].maxUs = std::max(out[r].maxUs, v);
    }
    out[r].ops = static_cast<int>(lag_[r].size());
    if (out[r].ops > 0) out[r].meanUs /= out[r].ops;
  }
  return out;
}

std::vector<Telemetry::LinkStats> Telemetry::links() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<LinkStats> out;
  for (int d = 0; d < 2; ++d)
    for (size_t p = 0; p < link_[d].size(); ++p) {
      if (link_[d][p].empty()) continue;
      LinkStats l;
      l.peer = static_cast<int>(p);
      l.send = d == 1;
      for (const Sample& s : link_[d][p]) {
        l.bytes += s.bytes;
        l.busyUs += s.busyUs;
      }
      l.samples = static_cast<int>(link_[d][p].size());
      out.push_back(l);
    }
  return out;
}

Telemetry::Progress Telemetry::progress() const {
  std::lock_guard<std::mutex> g(mu_);
  return progress_;
}

std::string Telemetry::opsJson() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<const OpTrace*> live;
  for (const OpTrace& t : ring_)
    if (t.id != 0) live.push_back(&t);
  std::sort(live.begin(), live.end(), [](const OpTrace* a, const OpTrace* b) { return a->id < b->id; });
  std::ostringstream os;
  os << "[";
  bool firstOp = true;
  for (const OpTrace* t : live) {
    os << (firstOp ? "\n    " : ",\n    ");
    firstOp = false;
    os << "{\"seq\": " << t->seq << ", \"op\": " << jsonString(t->op) << ", \"dtype\": " << jsonString(t->dtype)
       << ", \"count\": " << t->count << ", \"redop\": " << jsonString(t->redop) << ", \"root\": " << t->root
       << ", \"state\": \"" << stateName(t->state) << "\", \"enqueue_us\": " << t->enqueueUs
       << ", \"start_us\": " << orNull(t->startUs) << ", \"end_us\": " << orNull(t->endUs);
    std::vector<OpTrace::PeerBytes> rows = t->bytes;
    compact(rows);
    for (int dir = 0; dir < 2; ++dir) {
      os << (dir == 0 ? ", \"bytes_sent\": {" : ", \"bytes_recv\": {");
      bool first = true;
      for (auto& r : rows) {
        uint64_t b = dir == 0 ? r.sent : r.recvd;
        if (r.peer == rank_ || b == 0) continue;
        os << (first ? "" : ", ") << "\"" << r.peer << "\": " << b;
        first = false;
      }
      os << "}";
    }
    os << ", \"waiting_on\": [";
    for (size_t i = 0; i < t->waitingOn.size(); ++i) os << (i ? ", " : "") << t->waitingOn[i];
    os << "], \"error\": " << (t->error.empty() ? "null" : jsonString(t->error)) << "}";
  }
  os << (live.empty() ? "]" : "\n  ]");
  return os.str();
}

std::string Telemetry::linksJson() const {
  std::ostringstream os;
  os << "[";
  bool first = true;
  char buf[32];
  for (const LinkStats& l : links()) {
    snprintf(buf, sizeof(buf), "%.4f", l.gbps());
    os << (first ? "" : ", ") << "{\"peer\": " << l.peer << ", \"dir\": \"" << (l.send ? "send" : "recv")
       << "\", \"bytes\": " << l.bytes << ", \"samples\": " << l.samples << ", \"busy_us\": " << l.busyUs
       << ", \"gbps\": " << buf << "}";
    first = false;
  }
  os << "]";
  return os.str();
}

std::string Telemetry::lagsJson() const {
  std::ostringstream os;
  os << "[";
  auto l = lags();
  char buf[96];
  for (size_t r = 0; r < l.size(); ++r) {
    snprintf(buf, sizeof(buf), "{\"rank\": %zu, \"lag_us_mean\": %.1f, \"lag_us_max\": %.1f, \"ops\": %d}", r,
             l[r].meanUs, l[r].maxUs, l[r].ops);
    os << (r ? ", " : "") << buf;
  }
  os << "]";
  return os.str();
}

}  // namespace railcc::engine
