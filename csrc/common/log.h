#pragma once

#include <sstream>
#include <string>

namespace railcc::log {

enum class Level { kWarn = 1, kInfo = 2, kTrace = 3 };

enum Subsys : unsigned {
  INIT = 1u << 0,
  NET = 1u << 1,
  SHM = 1u << 2,
  COLL = 1u << 3,
  P2P = 1u << 4,
  WATCHDOG = 1u << 5,
  ENV = 1u << 6,
  IB = 1u << 7,
  ALL = ~0u,
};

/// Cheap gate checked before any formatting happens.
bool enabled(Level level, unsigned subsys);
void write(Level level, unsigned subsys, const std::string& msg);

/// The rank shown in log lines of the calling thread ([-1] prints as [?]).
void setThreadRank(int rank);

/// Re-reads RAILCC_DEBUG, RAILCC_DEBUG_SUBSYS and RAILCC_DEBUG_FILE (tests change them).
void reinit();

template <typename... Args>
void emit(Level level, unsigned subsys, const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  write(level, subsys, os.str());
}

}  // namespace railcc::log

#define RAILCC_LOG_AT(level, subsys, ...)                                    \
  do {                                                                       \
    if (::railcc::log::enabled(level, ::railcc::log::subsys))                \
      ::railcc::log::emit(level, ::railcc::log::subsys, __VA_ARGS__);        \
  } while (0)

#define RAILCC_WARN(subsys, ...) RAILCC_LOG_AT(::railcc::log::Level::kWarn, subsys, __VA_ARGS__)
#define RAILCC_INFO(subsys, ...) RAILCC_LOG_AT(::railcc::log::Level::kInfo, subsys, __VA_ARGS__)
#define RAILCC_TRACE(subsys, ...) RAILCC_LOG_AT(::railcc::log::Level::kTrace, subsys, __VA_ARGS__)
