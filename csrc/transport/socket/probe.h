#pragma once
// Whether a peer that is to dial this rank still exists. With connections made at first use,
// the rank that accepts a pair's connection has nothing of that peer's to watch until it
// dials: no socket closes when the peer's process dies. So while it waits, it knocks on the
// peer's listener now and then (a TCP connect that sends one 8-byte mark and closes; the
// listener drops it without a word). A process that has exited leaves nothing listening,
// and its host's kernel refuses the connect at once.

#include <netinet/in.h>

#include <chrono>
#include <cstdint>
#include <string>

namespace railcc::transport::socket {

/// The 8 bytes a probe sends before it closes: "railccpr".
constexpr uint64_t kProbeMagic = 0x7261696c63637072ull;

class ListenerProbe {
 public:
  using Clock = std::chrono::steady_clock;
  /// Knocks on `to` every `every`, the first time at `first` (at once by default); refusals
  /// that go on for `gone` mean nothing listens there.
  ListenerProbe(const sockaddr_in& to, std::chrono::milliseconds every, std::chrono::milliseconds gone,
                Clock::time_point first = {});
  ~ListenerProbe();
  ListenerProbe(const ListenerProbe&) = delete;
  ListenerProbe& operator=(const ListenerProbe&) = delete;

  /// Moves the probe on without blocking (starts a knock when one is due, reads the answer of
  /// the one under way). True once the address has refused every knock for `gone`.
  bool refused(Clock::time_point now);
  /// What the last knock met ("" while none was refused): for the error that names the peer.
  const std::string& lastError() const { return lastError_; }
  const sockaddr_in& address() const { return to_; }

 private:
  void start(Clock::time_point now);
  void finish(int err, Clock::time_point now);

  sockaddr_in to_{};
  std::chrono::milliseconds every_, gone_;
  int fd_ = -1;
  Clock::time_point nextAt_, startedAt_{}, refusedSince_{};
  bool refusing_ = false;
  std::string lastError_;
};

}  // namespace railcc::transport::socket
