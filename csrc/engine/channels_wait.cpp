#include "engine/channels.h"

#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <thread>

#include "common/error.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// The channel layer's waiting: idle() waits for the peers a step waits on (spin while this
// rank may keep its core, then poll() or the shared-memory doorbell), and between waits checks
// liveness (a peer's report, a dead shared-memory peer) and the op's timeout.

int64_t ChannelLayer::busyFor(const std::vector<std::pair<int, int>>& waitOn) {
  if (busyUs_ == 0 || !local_) return busyUs_;
  int cpu = sched_getcpu();
  if (cpu < 0) return busyUs_;
  local_->publishCpu(cpu);
  for (const auto& [lane, peer] : waitOn)
    if (shmPeer(peer) &&
        local_->lastCpu(localIndex(peer)) == cpu)
      return 0;
  return busyUs_;
}

void ChannelLayer::idle(const std::vector<std::pair<int, int>>& waitOn, Millis timeout, const char* what,
                    const std::function<bool()>& alsoReady) {
  host_.checkInterrupted();
  auto now = Clock::now();
  if (host_.shuttingDown() && now - lastProgress_ > Millis(1000))
    RAILCC_THROW(kAborted, what, " was still pending when the process group was shut down");
  if (now - lastProgress_ > timeout) {
    std::vector<Transfer*> pending;
    for (auto& [lane, peer] : waitOn)
      for (Channel& ch : pair(lane, peer)) {
        if (!ch.sendq.empty()) pending.push_back(ch.sendq.front());
        if (!ch.recvq.empty()) pending.push_back(ch.recvq.front());
      }
    host_.stalled(pending, timeout);
  }
  // A peer that failed but lives on may hold a connection that looks healthy from here, or never
  // make the one we wait for: after a second without progress, once a second, read its report.
  if (now - lastProgress_ > Millis(1000) && now - lastReportCheck_ > Millis(1000)) {
    lastReportCheck_ = now;
    host_.checkPeersReported(waitOn);
  }
  // Dead peers on shared memory cannot close anything: look for them a few times a second.
  // Every lane of the pair: one still being connected hears of a cut cable through the other.
  if (now - lastAliveCheck_ > Millis(200)) {
    lastAliveCheck_ = now;
    for (auto& [lane, peer] : waitOn) {
      try {
        for (auto& l : chans_)
          for (Channel& ch : l[static_cast<size_t>(peer)])
            if (ch.conn) ch.conn->checkAlive();
      } catch (const Error& e) {
        host_.peerFailed(peer, e.what());
      }
    }
  }
  std::vector<pollfd> fds;
  bool hasDoorbell = false, connecting = false;
  for (auto& [lane, peer] : waitOn)
    for (Channel& ch : pair(lane, peer)) {
      if (!ch.conn) {  // still being connected (at first use): look again in a millisecond
        connecting = true;
        continue;
      }
      int fd = ch.conn->pollFd();
      if (fd < 0) {
        hasDoorbell = true;
        continue;
      }
      short ev = 0;
      if (!ch.sendq.empty()) ev |= POLLOUT;
      if (!ch.recvq.empty() || lane == kP2PLane) ev |= POLLIN;
      fds.push_back({fd, ev, 0});
    }
  // Spin briefly (a peer is usually microseconds away), then sleep so that ranks sharing a
  // core do not starve the one that has work. Memory transports are looked at directly;
  // descriptors (sockets, RDMA completion channels) with a poll that does not wait, so that
  // bytes arriving during the spin end it, not the spin's end (over TCP a small message
  // otherwise took the whole spin, ~60 us, whenever it arrived a moment after the wait began).
  auto anyReady = [&] {
    if (alsoReady && alsoReady()) return true;
    for (auto& [lane, peer] : waitOn)
      for (Channel& ch : pair(lane, peer)) {
        if (ch.conn && (!ch.sendq.empty() || !ch.recvq.empty()) && ch.conn->takeNews()) return true;
        if (!ch.conn || ch.conn->pollFd() >= 0) continue;
        if (!ch.recvq.empty() && ch.conn->peek().second > 0) return true;
        if (!ch.sendq.empty() && hasBytesToSend(*ch.sendq.front()) && ch.conn->canSend()) return true;
        if (!ch.sendq.empty() && ch.sendq.front()->byAddress == Transfer::ByAddress::kAwaitingAck &&
            ch.conn->remoteAcked() >= ch.sendq.front()->ticket)
          return true;
      }
    if (!fds.empty() && poll(fds.data(), fds.size(), 0) > 0) return true;
    return host_.opsQueued();
  };
  if (pollFor(config_.spinUs, anyReady, busyFor(waitOn))) return;
  if (std::exchange(deviceWait_, false)) {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    return;
  }
  // Connections still coming up: sleep on their handshakes' and listeners' fds too, not in
  // 1 ms naps (64 ranks on 2 cores napping so spent the CPU the handshakes needed).
  int waitMs = hasDoorbell ? 1 : 100;
  if (connecting) waitMs = std::min(waitMs, host_.connectingFds(fds));
  sleeping_.store(true);
  if (!fds.empty() || connecting) {
    fds.push_back({wakeFd_, POLLIN, 0});
    if (!host_.opsQueued()) poll(fds.data(), fds.size(), waitMs);
    uint64_t v;
    if (read(wakeFd_, &v, sizeof(v)) < 0) { /* nothing pending */ }
  } else if (local_) {
    // The timeout only bounds how late abort, liveness and timeout checks can run.
    local_->sleep(100000, [&] { return anyReady(); });
  }
  sleeping_.store(false);
}


}  // namespace railcc::engine
