#pragma once

#include <netinet/in.h>
#include <poll.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "transport/socket/probe.h"

namespace railcc::transport::socket {

class Listener;

/// Sets up the TCP connections of one group at one rank: it dials the peers this rank
/// connects to and accepts those that connect to it, all at once in one poll() loop, so no
/// handshake waits for another and a stranger that connects and says nothing costs nothing.
///
/// Every connection is authenticated both ways by challenge-response, and the group secret
/// never crosses the wire: the dialer sends its ranks, lane and a nonce; the acceptor answers
/// with its own nonce and HMAC-SHA256(secret, "server" | hello | its nonce); the dialer checks
/// it (in constant time) and answers HMAC-SHA256(secret, "client" | hello | acceptor's nonce);
/// the acceptor checks that and acknowledges. A listener that does not hold the secret is
/// refused by the dialer; a dialer that does not is dropped by the acceptor and logged with
/// its address. Connections are returned blocking-free (O_NONBLOCK) and tuned for collectives.
///
/// One thread runs a rendezvous from start to end; only shutdownAll() may come from another.
class Rendezvous {
 public:
  /// `listener` may be null when no peer connects to this rank.
  Rendezvous(std::vector<uint8_t> secret, int rank, Listener* listener);
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  /// One more listener whose connections count (one per interface of a multi-rail rank).
  void addListener(Listener* listener);
  /// This rank connects to `peer` for `lane` at `to`, from the address `from` (its channel's
  /// interface) when given. Blocks: no.
  void dial(int peer, int lane, const sockaddr_in& to, const sockaddr_in* from = nullptr);
  /// `peer` connects to this rank for `lane`. Blocks: no.
  void expect(int peer, int lane);
  /// While the rendezvous is open and `peer` has a connection expected that has not arrived
  /// (or one this rank dials that has not finished: dial() watches on its own while open),
  /// knock on its listener at `listener` now and then (probe.h): once it has refused for 0.5 s,
  /// step() throws kPeerFailure naming the peer (its process or its group is gone). Blocks: no.
  void watch(int peer, const sockaddr_in& listener,
             std::chrono::steady_clock::time_point firstKnock = std::chrono::steady_clock::time_point{});
  /// How long a side waiting at first use lets the peer answer before its first knock (a live
  /// peer has by then, and costs no knock: a whole TCP connection on both sides).
  static constexpr std::chrono::milliseconds kFirstKnockAfter{250};

  /// Drives every handshake until all are done. Blocks: yes, until then or `deadline`.
  /// Throws railcc::Error with the peer in `ranks`: kPeerFailure when a peer refuses or fails
  /// authentication, or its address stays refused for 0.5 s (its process exited); kTimeout at
  /// the deadline, naming the peers still missing and any strangers that were dropped.
  void run(std::chrono::steady_clock::time_point deadline);
  /// While open, more dial()/expect() calls may come: listeners are served, strangers judged,
  /// and a peer's hello that arrives before its expect() waits for it; step() never reports
  /// done. The owner closes it once every connection is registered.
  void keepOpen(bool open) { open_ = open; }
  /// One pass of run(): moves every handshake on, waiting at most `budget` in poll(). True once
  /// all are done (then strangers are closed, once). Throws as run() does.
  bool step(std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds budget);

  /// What step() would poll on, for a caller that sleeps in a poll of its own: appends the
  /// listeners (while connections are awaited) and the handshakes' fds with their events, and
  /// returns the ms until step() must run regardless (a dial's retry, a knock; at most 50).
  int pollFds(std::vector<pollfd>& out) const;
  /// (peer, lane) has finished its handshake: take() may be called (as soon as a step() has
  /// moved it to the finished ones).
  bool ready(int peer, int lane) const {
    auto it = done_.find({peer, lane});
    return it != done_.end() && it->second.first >= 0;
  }
  /// The connected fd of (peer, lane) once run() returned; the caller owns it from then on.
  int take(int peer, int lane);
  /// The address at the other end of (peer, lane), "ip:port".
  std::string remoteAddress(int peer, int lane) const;
  /// One line per connection dropped because it failed the handshake: "ip:port: why".
  const std::vector<std::string>& dropped() const { return dropped_; }
  /// The group failed here: every connection this rendezvous still holds (mid-handshake, or
  /// finished and not taken) is shut down, so the peer at its other end, which may hold it as
  /// connected already, learns at once instead of at its op's timeout. Any thread; the fds stay
  /// this rendezvous's (closed by it), so its owner's poll is safe.
  void shutdownAll();

 private:
  struct Conn;
  void startConnect(Conn& c);
  void drop(size_t i, const std::string& why, bool quiet = false);
  void knock(std::chrono::steady_clock::time_point now);  // the probes of watch()
  void adopt(int fd, const sockaddr_in& from);  // an accepted connection starts its handshake
  void closeStrangers();                        // set-up is done: name and close the rest
  bool awaiting() const;  // connections may still arrive (open, or one expected has not)
  // Appends what step() polls: the listeners while awaiting(), then every handshake's fd with
  // its events; `who` (when given) gets the Conn of each (null for a listener). Returns how
  // many listeners lead the list.
  size_t pollSet(std::vector<pollfd>& fds, std::vector<Conn*>* who) const;
  bool advance(Conn& c);  // false: the connection is done for (dropped or failed)
  void finishClientHello(Conn& c);
  void finishServerHello(Conn& c);
  void finishProof(Conn& c);

  // Held by the owner's thread while it changes the connections (dial, expect, step, take,
  // teardown), and by shutdownAll(): no fd is shut after it was closed and its number reused.
  mutable std::recursive_mutex mu_;
  std::vector<uint8_t> secret_;
  int rank_;
  std::vector<Listener*> listeners_;
  bool finished_ = false;
  bool open_ = false;
  std::vector<std::unique_ptr<Conn>> conns_;
  std::map<std::pair<int, int>, bool> expected_;  // (peer, lane) -> arrived
  std::map<std::pair<int, int>, std::pair<int, std::string>> done_;  // (peer, lane) -> fd, address
  std::vector<std::string> dropped_;
  std::map<int, ListenerProbe> probes_;  // peer -> its listener, while we wait for it to dial
};

}  // namespace railcc::transport::socket
