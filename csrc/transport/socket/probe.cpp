#include "transport/socket/probe.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace railcc::transport::socket {

ListenerProbe::ListenerProbe(const sockaddr_in& to, std::chrono::milliseconds every, std::chrono::milliseconds gone,
                             Clock::time_point first)
    : to_(to), every_(every), gone_(gone), nextAt_(first) {}

ListenerProbe::~ListenerProbe() {
  if (fd_ >= 0) ::close(fd_);
}

void ListenerProbe::start(Clock::time_point now) {
  startedAt_ = now;
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd_ < 0) {  // out of files: try again later, conclude nothing
    lastError_ = std::strerror(errno);
    nextAt_ = now + every_;
    return;
  }
  if (::connect(fd_, reinterpret_cast<const sockaddr*>(&to_), sizeof(to_)) == 0) finish(0, now);
  else if (errno != EINPROGRESS) finish(errno, now);
}

void ListenerProbe::finish(int err, Clock::time_point now) {
  if (err == 0) {
    // Something listens: leave the mark so the listener knows this for a probe, and go.
    uint8_t mark[8];
    for (int i = 0; i < 8; ++i) mark[i] = static_cast<uint8_t>(kProbeMagic >> (8 * i));
    if (::send(fd_, mark, sizeof(mark), MSG_DONTWAIT | MSG_NOSIGNAL) < 0) { /* the close says enough */ }
    refusing_ = false;
    lastError_.clear();
  } else if (err == ECONNREFUSED) {
    if (!refusing_) refusedSince_ = now;
    refusing_ = true;
    lastError_ = std::strerror(err);
  } else {  // unreachable, out of ports, ...: no answer either way
    lastError_ = std::strerror(err);
  }
  ::close(fd_);
  fd_ = -1;
  nextAt_ = now + every_;
}

bool ListenerProbe::refused(Clock::time_point now) {
  if (fd_ < 0 && now >= nextAt_) start(now);
  if (fd_ >= 0) {
    pollfd p{fd_, POLLOUT, 0};
    if (::poll(&p, 1, 0) > 0) {
      int err = 0;
      socklen_t len = sizeof(err);
      if (getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      finish(err, now);
    } else if (now - startedAt_ > gone_) {  // a host that does not answer at all: try again
      lastError_ = "no answer to a connect within " + std::to_string(gone_.count()) + " ms";
      ::close(fd_);
      fd_ = -1;
      nextAt_ = now;
    }
  }
  return refusing_ && now - refusedSince_ >= gone_;
}

}  // namespace railcc::transport::socket
