#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace railcc {

/// What went wrong, coarse enough for the glue to pick a Python exception class.
enum class ErrorCode {
  kInvalidUsage,  // bad arguments from the caller; the communicator stays usable
  kSystem,        // an OS call failed
  kTimeout,       // an op made no progress for its timeout
  kPeerFailure,   // a peer closed its connection, died or stopped answering
  kMismatch,      // ranks called different collectives at the same sequence number
  kAborted,       // abort() or shutdown() ended the op
  kStraggler,     // a rank or link is far slower than the rest (RAILCC_STRAGGLER_ACTION=raise)
  kDevice,        // a GPU runtime call failed, or there is no GPU runtime
  kInternal,
};

const char* errorCodeName(ErrorCode code);

/// An error message as it may be shown: bytes that are not UTF-8 (or are control characters
/// other than newline and tab) written as \xNN, and a message longer than kMaxErrorChars cut in
/// the middle, saying how much was cut. Messages quote records other processes wrote through
/// the store; one of them must never make an exception Python cannot decode, nor megabytes of
/// one.
constexpr size_t kMaxErrorChars = 4096;
std::string tidyMessage(const std::string& msg);
/// The same for a part quoted inside a message: at most `max` characters, marked where cut.
std::string quoteBytes(const std::string& s, size_t max);
/// Whether `s` is UTF-8 with no control characters (what a host name or id in a record must be).
bool printableText(std::string_view s);

/// The one exception type of the engine. Structured fields let the glue build typed
/// Python exceptions that name the rank, host and op at fault.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& msg) : std::runtime_error(tidyMessage(msg)), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

  // Optional attribution, filled by whoever knows it.
  std::vector<int> ranks;           // ranks at fault (dead, missing, mismatched)
  std::vector<std::string> hosts;   // their hosts, same order
  long long seq = -1;               // collective sequence number, -1 if none
  std::string op;                   // e.g. "allreduce"
  bool ranksGlobal = false;         // `ranks` are already ranks of the default group
  bool ranksDead = false;           // seen gone (process exited, connection dropped), not merely silent
  // A set-up failure that names a peer but that the peers must still hear of, or they wait for
  // this rank until RAILCC_INIT_TIMEOUT: a handshake that failed authentication (keys differ).
  bool tellPeers = false;

 private:
  ErrorCode code_;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace railcc

#define RAILCC_THROW(code, ...) \
  throw ::railcc::Error(::railcc::ErrorCode::code, ::railcc::detail::concat(__VA_ARGS__))

/// Checks a caller-visible condition; the message names the argument at fault.
#define RAILCC_CHECK_ARG(cond, ...)                     \
  do {                                                  \
    if (!(cond)) RAILCC_THROW(kInvalidUsage, __VA_ARGS__); \
  } while (0)

/// Checks an internal invariant, printing both operands with file and line.
#define RAILCC_CHECK_EQ(a, b)                                                              \
  do {                                                                                     \
    auto _va = (a);                                                                        \
    auto _vb = (b);                                                                        \
    if (!(_va == _vb))                                                                     \
      RAILCC_THROW(kInternal, __FILE__, ":", __LINE__, ": check failed: " #a " == " #b " (", \
                   _va, " vs ", _vb, ")");                                                 \
  } while (0)

/// Wraps a -1/errno returning syscall.
#define RAILCC_SYSCHECK(expr, what)                                                    \
  do {                                                                                 \
    if ((expr) < 0)                                                                    \
      RAILCC_THROW(kSystem, what, ": ", ::railcc::detail::errnoString(), " (", __FILE__, \
                   ":", __LINE__, ")");                                                \
  } while (0)

namespace railcc::detail {
std::string errnoString();
}
