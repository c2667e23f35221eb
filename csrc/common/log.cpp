#include "common/log.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

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
