#include "common/log.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <algorithm>

#include "common/error.h"

namespace railcc {

const char* errorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidUsage: return "InvalidUsage";
    case ErrorCode::kSystem: return "System";
    case ErrorCode::kTimeout: return "Timeout";
    case ErrorCode::kPeerFailure: return "PeerFailure";
    case ErrorCode::kMismatch: return "Mismatch";
    case ErrorCode::kAborted: return "Aborted";
    case ErrorCode::kStraggler: return "Straggler";
    case ErrorCode::kDevice: return "Device";
    case ErrorCode::kInternal: return "Internal";
  }
  return "Unknown";
}

namespace {
// Length of the UTF-8 sequence at s[i] (1-4), or 0 where the bytes there are not one.
size_t utf8Length(const std::string& s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  size_t n = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k)
    if ((b(i + k) & 0xc0) != 0x80) return 0;
  if (n == 3 && ((c == 0xe0 && b(i + 1) < 0xa0) || (c == 0xed && b(i + 1) >= 0xa0))) return 0;  // overlong, surrogate
  if (n == 4 && ((c == 0xf0 && b(i + 1) < 0x90) || (c == 0xf4 && b(i + 1) >= 0x90))) return 0;  // overlong, > U+10FFFF
  return n;
}

// `s` with every byte that is not part of printable UTF-8 (newline and tab pass) as \xNN.
std::string escapeBytes(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = utf8Length(s, i);
    if (n == 0 || (c < 0x20 && c != '\n' && c != '\t') || c == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
      ++i;
      continue;
    }
    out.append(s, i, n);
    i += n;
  }
  return out;
}

// The first `n` bytes of `s`, less a UTF-8 sequence cut at the end.
size_t utf8Cut(const std::string& s, size_t n) {
  while (n > 0 && n < s.size() && (static_cast<unsigned char>(s[n]) & 0xc0) == 0x80) --n;
  return n;
}
}  // namespace

bool printableText(std::string_view s) {
  const std::string t(s);
  for (size_t i = 0; i < t.size();) {
    const unsigned char c = static_cast<unsigned char>(t[i]);
    const size_t n = utf8Length(t, i);
    if (n == 0 || c < 0x20 || c == 0x7f) return false;
    i += n;
  }
  return true;
}

std::string quoteBytes(const std::string& s, size_t max) {
  std::string out = escapeBytes(s.substr(0, utf8Cut(s, std::min(s.size(), max))));
  if (out.size() <= max && s.size() <= max) return out;
  if (out.size() > max) out.resize(utf8Cut(out, max));  // escapes made it longer
  return out + "... (" + std::to_string(s.size()) + " bytes in all)";
}

std::string tidyMessage(const std::string& msg) {
  // A cheap look first: most messages are short printable ASCII.
  bool plain = msg.size() <= kMaxErrorChars;
  for (size_t i = 0; plain && i < msg.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(msg[i]);
    plain = (c >= 0x20 && c < 0x7f) || c == '\n' || c == '\t';
  }
  if (plain) return msg;
  if (msg.size() <= kMaxErrorChars) {
    std::string all = escapeBytes(msg);
    if (all.size() <= kMaxErrorChars) return all;
  }
  // Keep the head (what failed and why) and the tail (the advice); cut the middle.
  constexpr size_t head = kMaxErrorChars * 3 / 4, tail = kMaxErrorChars / 8;
  const size_t headEnd = utf8Cut(msg, std::min(msg.size(), head));
  size_t tailFrom = std::max(headEnd, msg.size() > tail ? msg.size() - tail : 0);
  while (tailFrom < msg.size() && (static_cast<unsigned char>(msg[tailFrom]) & 0xc0) == 0x80) ++tailFrom;
  std::string a = escapeBytes(msg.substr(0, headEnd)), b = escapeBytes(msg.substr(tailFrom));
  if (a.size() > head) a.resize(utf8Cut(a, head));  // escapes made them longer
  if (b.size() > tail) {
    size_t k = b.size() - tail;
    while (k < b.size() && (static_cast<unsigned char>(b[k]) & 0xc0) == 0x80) ++k;
    b = b.substr(k);
  }
  return a + " [... " + std::to_string(tailFrom - headEnd) + " bytes cut ...] " + b;
}

namespace detail {
std::string errnoString() {
  int e = errno;
  char buf[128];
  // GNU strerror_r may return a static string instead of filling buf.
  const char* s = strerror_r(e, buf, sizeof(buf));
  return std::string(s) + " (errno " + std::to_string(e) + ")";
}
}  // namespace detail

namespace log {
namespace {

struct State {
  std::atomic<int> level{0};
  std::atomic<unsigned> mask{ALL};
  FILE* out = stderr;
  std::mutex mu;
  char host[64] = {0};
  bool ready = false;
};

State& state() {
  static State s;
  return s;
}

const char* getenv2(const char* a, const char* b) {
  const char* v = std::getenv(a);
  return v ? v : std::getenv(b);
}

unsigned parseSubsys(const char* spec) {
  if (spec == nullptr || *spec == '\0') return ALL;
  std::string s(spec);
  bool invert = false;
  if (s[0] == '^') {
    invert = true;
    s = s.substr(1);
  }
  unsigned mask = 0;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    std::string tok = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    for (auto& c : tok) c = static_cast<char>(toupper(c));
    if (tok == "ALL") mask |= ALL;
    else if (tok == "INIT") mask |= INIT;
    else if (tok == "NET") mask |= NET;
    else if (tok == "SHM") mask |= SHM;
    else if (tok == "COLL") mask |= COLL;
    else if (tok == "P2P") mask |= P2P;
    else if (tok == "WATCHDOG") mask |= WATCHDOG;
    else if (tok == "ENV") mask |= ENV;
    else if (tok == "IB") mask |= IB;
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return invert ? ~mask : mask;
}

void initLocked(State& s) {
  const char* lvl = getenv2("RAILCC_DEBUG", "NCCL_DEBUG");
  int level = static_cast<int>(Level::kWarn);
  if (lvl != nullptr) {
    std::string v(lvl);
    for (auto& c : v) c = static_cast<char>(toupper(c));
    if (v == "INFO" || v == "VERSION") level = static_cast<int>(Level::kInfo);
    else if (v == "TRACE") level = static_cast<int>(Level::kTrace);
    else if (v == "NONE" || v == "OFF") level = 0;
  }
  s.mask.store(parseSubsys(getenv2("RAILCC_DEBUG_SUBSYS", "NCCL_DEBUG_SUBSYS")));
  gethostname(s.host, sizeof(s.host) - 1);
  if (s.out != stderr && s.out != nullptr) fclose(s.out);
  s.out = stderr;
  if (const char* file = getenv2("RAILCC_DEBUG_FILE", "NCCL_DEBUG_FILE")) {
    std::string path;
    for (const char* p = file; *p; ++p) {
      if (p[0] == '%' && p[1] == 'h') {
        path += s.host;
        ++p;
      } else if (p[0] == '%' && p[1] == 'p') {
        path += std::to_string(getpid());
        ++p;
      } else {
        path += *p;
      }
    }
    if (FILE* f = fopen(path.c_str(), "a")) {
      s.out = f;
    } else {
      // Said once, on stderr, where the lines now go: a silent fallback looks like no logging.
      std::string err = std::strerror(errno);
      fprintf(stderr, "%s:%d RAILCC WARN RAILCC_DEBUG_FILE=%s: cannot open %s for appending (%s); logging to stderr\n",
              s.host, getpid(), file, path.c_str(), err.c_str());
    }
  }
  s.level.store(level);
  s.ready = true;
}

thread_local int tRank = -1;

}  // namespace

void reinit() {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  initLocked(s);
}

bool enabled(Level level, unsigned subsys) {
  State& s = state();
  if (!s.ready) reinit();
  return static_cast<int>(level) <= s.level.load(std::memory_order_relaxed) &&
         (s.mask.load(std::memory_order_relaxed) & subsys) != 0;
}

void setThreadRank(int rank) { tRank = rank; }

void write(Level level, unsigned subsys, const std::string& msg) {
  State& s = state();
  const char* lv = level == Level::kWarn ? "WARN" : level == Level::kInfo ? "INFO" : "TRACE";
  const char* ss = subsys == INIT ? "INIT" : subsys == NET ? "NET" : subsys == SHM ? "SHM"
                 : subsys == COLL ? "COLL" : subsys == P2P ? "P2P" : subsys == WATCHDOG ? "WATCHDOG"
                 : subsys == ENV ? "ENV" : subsys == IB ? "IB" : "";
  std::string rank = tRank < 0 ? "?" : std::to_string(tRank);
  std::lock_guard<std::mutex> g(s.mu);
  fprintf(s.out, "%s:%d:%ld [%s] RAILCC %s %s %s\n", s.host, getpid(), syscall(SYS_gettid),
          rank.c_str(), lv, ss, msg.c_str());
  fflush(s.out);
}

}  // namespace log
}  // namespace railcc
