// Transport tests: the shared-memory FIFO and the socket stream, driven directly.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "common/error.h"
#include "common/types.h"
#include "transport/broadcast_ring.h"
#include "transport/shm/shm_segment.h"
#include "common/crypto.h"
#include "transport/socket/rendezvous.h"
#include "transport/socket/socket_transport.h"

using namespace railcc;
using namespace railcc::transport;

TEST(Shm, FifoWrapsAndPreservesOrder) {
  // Two domains in one process stand for two ranks.
  shm::Domain a(2, 4096, 4096, false, 2);
  shm::Domain b(2, 4096, 4096, false, 2);
  a.attach(1, b.segmentName());
  b.attach(0, a.segmentName());
  EXPECT_TRUE(a.releaseName());  // each mapped by the other: the names go
  EXPECT_TRUE(b.releaseName());
  auto ab = a.connect(0, 1, 0, 1, true);
  auto ba = b.connect(1, 0, 0, 1, true);
  std::vector<uint8_t> src(100000), dst(100000);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 31);
  size_t sent = 0, got = 0;
  while (got < dst.size()) {
    sent += ab->send(src.data() + sent, std::min<size_t>(src.size() - sent, 3000));
    got += ba->recv(dst.data() + got, dst.size() - got);
  }
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), src.size()));
}

// A segment's name goes once every other rank of the host has mapped it (asked by the watchdog
// after set-up, so that no rank's set-up waits for the others'), and not before: a peer still to
// map it opens it by that name.
TEST(Shm, NameGoesOnceEveryPeerOfTheHostHasMappedIt) {
  shm::Domain a(3, 4096, 4096, false, 3), b(3, 4096, 4096, false, 3), c(3, 4096, 4096, false, 3);
  const std::string name = a.segmentName();
  auto there = [&] { return access(("/dev/shm" + name).c_str(), F_OK) == 0; };
  EXPECT_FALSE(a.releaseName());
  b.attach(0, name);
  EXPECT_FALSE(a.releaseName());  // c has not mapped it yet
  EXPECT_TRUE(there());
  c.attach(0, name);
  EXPECT_TRUE(a.releaseName());
  EXPECT_FALSE(there());
  EXPECT_TRUE(a.releaseName());  // asked again: still done, nothing else unlinked
  shm::Domain alone(1, 4096, 4096);  // no peer on its host: nothing to wait for
  EXPECT_TRUE(alone.releaseName());
}

// A group destroyed before its host's peers mapped its segment: after a set-up that succeeded the
// name stays for them and the last to map it unlinks it; after one that failed, or once the
// group failed, nobody will come and the name goes with the domain.
TEST(Shm, NameOfAGroupEndedEarlyIsLeftToItsPeersOnlyAfterASetUpThatSucceeded) {
  auto there = [](const std::string& name) { return access(("/dev/shm" + name).c_str(), F_OK) == 0; };
  std::string name;
  {
    shm::Domain a(3, 4096, 4096, false, 3);
    name = a.segmentName();
    a.keepNameForPeers();
  }
  EXPECT_TRUE(there(name));
  shm::Domain b(3, 4096, 4096, false, 3), c(3, 4096, 4096, false, 3);
  b.attach(0, name);
  EXPECT_TRUE(there(name));  // c has not mapped it yet
  c.attach(0, name);
  EXPECT_FALSE(there(name));  // c was the last
  {
    shm::Domain failedSetUp(2, 4096, 4096, false, 2);
    name = failedSetUp.segmentName();
  }
  EXPECT_FALSE(there(name));
  {
    shm::Domain failedLater(2, 4096, 4096, false, 2);
    name = failedLater.segmentName();
    failedLater.keepNameForPeers();
    failedLater.markFailed();
  }
  EXPECT_FALSE(there(name));
  // A rank that maps a name gone that way hears that its owner failed, not a system error of
  // its own (which it would publish as the job's reason).
  try {
    b.attach(1, name);
    ADD_FAILURE() << "a segment whose name is gone was mapped";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPeerFailure) << e.what();
  }
}

namespace {
// Bytes of /dev/shm a segment holds (its pages that exist), read through its name.
size_t shmBytesHeld(const std::string& name) {
  struct stat st {};
  if (stat(("/dev/shm" + name).c_str(), &st) != 0) return 0;
  return static_cast<size_t>(st.st_blocks) * 512;
}
}  // namespace

TEST(Shm, ReservationStepsGrowFromAFewPagesToAPiece) {
  const size_t piece = 256u << 10, cap = 4u << 20;
  EXPECT_EQ(shm::nextReserve(0, 8, cap, piece), 16u << 10);                // a small message
  EXPECT_EQ(shm::nextReserve(0, 100000, cap, piece), 102400u);             // all it needs, in pages
  EXPECT_EQ(shm::nextReserve(16u << 10, (16u << 10) + 1, cap, piece), 32u << 10);  // doubling
  EXPECT_EQ(shm::nextReserve(1u << 20, (1u << 20) + 1, cap, piece), (1u << 20) + piece);  // a piece at most
  EXPECT_EQ(shm::nextReserve(cap - 4096, cap, cap, piece), cap);           // never past the end
  EXPECT_EQ(shm::nextReserve(0, 10, 5000, piece), 8192u);                  // the end's whole page
}

TEST(Shm, BroadcastRingPagesAreReservedAsTheProducerReachesThem) {
  if (!shm::lazyReservation()) GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE: every page is reserved at init";
  shm::Domain a(2, 4096, 4u << 20), b(2, 4096, 4u << 20);
  b.attach(0, a.segmentName());
  const size_t atInit = shmBytesHeld(a.segmentName());
  EXPECT_LT(atInit, 1u << 20) << "the 4 MiB ring was reserved at init";
  BroadcastRing own = a.broadcastRing(-1), seen = b.broadcastRing(0);
  const std::vector<int> consumers{1};
  const std::vector<Doorbell*> none;
  const char msg[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  ASSERT_EQ(own.write(msg, sizeof(msg), consumers, none), sizeof(msg));
  const size_t afterSmall = shmBytesHeld(a.segmentName());
  EXPECT_GT(afterSmall, atInit);
  EXPECT_LE(afterSmall - atInit, 16u << 10) << "an 8-byte write reserved more than a first step";
  auto [p, n] = seen.peek(1);
  ASSERT_EQ(n, sizeof(msg));
  EXPECT_EQ(0, std::memcmp(p, msg, sizeof(msg)));
  seen.consume(1, n);
  // A block reserved where the ring wraps reaches the end: the whole ring then exists, and a
  // second lap reads what was written.
  std::vector<char> big(3u << 20, 7);
  size_t put = 0, got = 0;
  std::vector<char> back(big.size());
  for (int lap = 0; lap < 2; ++lap, put = got = 0)
    while (got < big.size()) {
      put += own.write(big.data() + put, big.size() - put, consumers, none);
      auto [q, k] = seen.peek(1);
      std::memcpy(back.data() + got, q, k);
      seen.consume(1, k);
      got += k;
    }
  EXPECT_EQ(back, big);
  EXPECT_GE(shmBytesHeld(a.segmentName()), atInit + (4u << 20));
}

TEST(Shm, PeersWithOtherSizesAreRefusedByName) {
  // Each side lays a segment out from its own sizes: a peer with other sizes would have the
  // two read and write different bytes, so attach() refuses it, naming the variables.
  shm::Domain a(2, 4096, 8192);
  shm::Domain fifo(2, 8192, 8192), ring(2, 4096, 4096), slots(4, 4096, 8192), same(2, 4096, 8192);
  for (shm::Domain* d : {&fifo, &ring, &slots}) {
    try {
      d->attach(0, a.segmentName());
      FAIL() << "attach accepted a segment of other sizes";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
      EXPECT_NE(std::string(e.what()).find("RAILCC_SHM_FIFO_BYTES"), std::string::npos) << e.what();
    }
  }
  same.attach(0, a.segmentName());
}

TEST(Shm, PublishedCpuIsSeenByAttachedPeers) {
  // A rank about to spin for a peer reads the CPU the peer last waited on from its header.
  shm::Domain a(2, 4096, 8192), b(2, 4096, 8192);
  b.attach(0, a.segmentName());
  EXPECT_EQ(b.headerOf(0)->cpu.load(), -1);  // not known until a wait publishes it
  a.publishCpu(1);
  EXPECT_EQ(b.headerOf(0)->cpu.load(), 1);
  a.publishCpu(0);
  EXPECT_EQ(b.headerOf(0)->cpu.load(), 0);
}

TEST(StreamCopy, EveryAlignmentAndTailMatchesMemcpy) {
  std::vector<unsigned char> src(4096 + 64), dst(4096 + 64), want(4096 + 64);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 31 + 7);
  for (size_t dOff = 0; dOff < 17; ++dOff)
    for (size_t sOff = 0; sOff < 3; ++sOff)
      for (size_t n : {size_t(0), size_t(1), size_t(15), size_t(16), size_t(63), size_t(64), size_t(65), size_t(1000),
                       size_t(4096)}) {
        std::fill(dst.begin(), dst.end(), 0xEE);
        want = dst;
        std::memcpy(want.data() + dOff, src.data() + sOff, n);
        streamCopy(dst.data() + dOff, src.data() + sOff, n);
        ASSERT_EQ(dst, want) << "dst offset " << dOff << " src offset " << sOff << " n " << n;
      }
}

TEST(StreamCopy, LastLevelCacheSizeIsSane) {
  size_t b = lastLevelCacheBytes();
  EXPECT_GE(b, size_t(256) << 10);
  EXPECT_LE(b, size_t(4) << 30);
}

TEST(CopyBytes, EveryPageOffsetAndTailMatchesMemcpy) {
  // The destination's offset from the source modulo a page picks the path (1-63 bytes ahead:
  // the vector loop), so sweep it across and around that band, with lengths either side of
  // the 2 KiB where the loop starts and tails that are not whole vectors.
  std::vector<unsigned char> src(3 * 4096 + 20000), dst(3 * 4096 + 20000);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 31 + 7);
  auto* s0 = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(src.data()) + 4095) & ~uintptr_t(4095));
  auto* d0 = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(dst.data()) + 4095) & ~uintptr_t(4095));
  for (size_t ahead : {size_t(0), size_t(1), size_t(7), size_t(8), size_t(15), size_t(16), size_t(33), size_t(63),
                       size_t(64), size_t(65), size_t(4000), size_t(4095)})
    for (size_t n : {size_t(0), size_t(100), size_t(2047), size_t(2048), size_t(2049), size_t(4096 + 17), size_t(16384)}) {
      unsigned char* s = s0 + 5;
      unsigned char* d = d0 + 5 + ahead;
      std::fill(dst.begin(), dst.end(), 0xEE);
      copyBytes(d, s, n);
      ASSERT_TRUE(std::equal(s, s + n, d)) << "ahead " << ahead << " n " << n;
      ASSERT_TRUE(std::all_of(dst.data(), d, [](unsigned char c) { return c == 0xEE; })) << "ahead " << ahead << " n " << n;
      ASSERT_TRUE(std::all_of(d + n, dst.data() + dst.size(), [](unsigned char c) { return c == 0xEE; }))
          << "ahead " << ahead << " n " << n;
    }
}

TEST(CopyBytes, MoveBytesHandlesOverlapBothWays) {
  // An output that is a view of its input a few bytes on: the alias band with overlap must
  // still copy as memmove does.
  for (long shift : {-8L, -1L, 1L, 8L, 40L}) {
    std::vector<unsigned char> buf(20000), want;
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<unsigned char>(i * 13 + 1);
    want = buf;
    size_t n = 8192;
    std::memmove(want.data() + 4096 + shift, want.data() + 4096, n);
    moveBytes(buf.data() + 4096 + shift, buf.data() + 4096, n);
    ASSERT_EQ(buf, want) << "shift " << shift;
  }
}

namespace {
bool shmExists(const std::string& name) { return access(("/dev/shm" + name).c_str(), F_OK) == 0; }
}  // namespace

TEST(Shm, StaleSegmentsOfDeadProcessesAreRemoved) {
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  pid_t child = fork();
  if (child == 0) {
    // Create a segment and die without unlinking it, as a killed job would.
    auto* d = new shm::Domain(1, 4096, 4096);
    std::string n = d->segmentName();
    (void)!write(pipefd[1], n.c_str(), n.size() + 1);
    _exit(0);
  }
  char name[256] = {0};
  ASSERT_GT(read(pipefd[0], name, sizeof(name) - 1), 0);
  int status;
  waitpid(child, &status, 0);
  ASSERT_TRUE(shmExists(name));
  EXPECT_GE(shm::Domain::cleanStale(), 1);
  EXPECT_FALSE(shmExists(name));
  close(pipefd[0]);
  close(pipefd[1]);
}

TEST(Shm, LiveSegmentsAreNeverTakenForStaleAndOwnersAreSeenAlive) {
  // Whatever its pid looks like from here (another pid namespace makes it look gone), a
  // segment whose creator lives holds its lock; once the creator dies, the lock goes.
  int toParent[2], toChild[2];
  ASSERT_EQ(pipe(toParent), 0);
  ASSERT_EQ(pipe(toChild), 0);
  pid_t child = fork();
  if (child == 0) {
    shm::Domain d(1, 4096, 4096);
    std::string n = d.segmentName();
    (void)!write(toParent[1], n.c_str(), n.size() + 1);
    char c;
    (void)!read(toChild[0], &c, 1);  // live until told
    _exit(0);
  }
  char name[256] = {0};
  ASSERT_GT(read(toParent[0], name, sizeof(name) - 1), 0);
  shm::Domain::cleanStale();
  EXPECT_TRUE(shmExists(name)) << "a live process's segment was removed as stale";
  {
    shm::Segment peer(name);
    EXPECT_TRUE(peer.ownerAlive());
    (void)!write(toChild[1], "x", 1);
    int status;
    waitpid(child, &status, 0);
    EXPECT_FALSE(peer.ownerAlive());
  }
  EXPECT_GE(shm::Domain::cleanStale(), 1);
  EXPECT_FALSE(shmExists(name));
  for (int fd : {toParent[0], toParent[1], toChild[0], toChild[1]}) close(fd);
}

namespace {
std::string hex(const railcc::Digest& d) {
  static const char* x = "0123456789abcdef";
  std::string s;
  for (uint8_t b : d) {
    s += x[b >> 4];
    s += x[b & 15];
  }
  return s;
}
std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
}  // namespace

TEST(Auth, Sha256AndHmacMatchPublishedVectors) {
  EXPECT_EQ(hex(railcc::sha256("abc", 3)), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(hex(railcc::sha256("", 0)), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  std::string two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";  // 56 bytes: two blocks
  EXPECT_EQ(hex(railcc::sha256(two.data(), two.size())),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // RFC 4231, test cases 1, 2 and 6 (a key longer than the block).
  EXPECT_EQ(hex(railcc::hmacSha256(std::vector<uint8_t>(20, 0x0b), bytes("Hi There"))),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(hex(railcc::hmacSha256(bytes("Jefe"), bytes("what do ya want for nothing?"))),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(hex(railcc::hmacSha256(std::vector<uint8_t>(131, 0xaa),
                                   bytes("Test Using Larger Than Block-Size Key - Hash Key First"))),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  railcc::Digest a{}, b{};
  EXPECT_TRUE(railcc::equalConstantTime(a, b));
  b[31] = 1;
  EXPECT_FALSE(railcc::equalConstantTime(a, b));
  EXPECT_NE(railcc::randomHex(16), railcc::randomHex(16));
}

namespace {
using Clock = std::chrono::steady_clock;
std::vector<uint8_t> secretOf(uint8_t v) { return std::vector<uint8_t>(32, v); }
int connectRaw(const sockaddr_in& to) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof(to)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}
}  // namespace

TEST(Rendezvous, PeersWithTheSecretConnectEveryLaneWhileStrangersIdle) {
  sockaddr_in lo{};
  socket::pickInterface("=lo", lo);
  socket::Listener l(lo);
  // Strangers that connect and say nothing: they must not delay the group.
  std::vector<int> strangers;
  for (int i = 0; i < 20; ++i) strangers.push_back(connectRaw(l.addr()));
  auto deadline = Clock::now() + std::chrono::seconds(20);
  socket::Rendezvous acceptor(secretOf(7), 1, &l);
  acceptor.expect(0, 0);
  acceptor.expect(0, 1);
  std::thread dialer([&] {
    socket::Rendezvous d(secretOf(7), 0, nullptr);
    d.dial(1, 0, l.addr());
    d.dial(1, 1, l.addr());
    d.run(deadline);
    for (int lane = 0; lane < 2; ++lane) {
      int fd = d.take(1, lane);
      uint8_t v = static_cast<uint8_t>(40 + lane);
      EXPECT_EQ(::send(fd, &v, 1, MSG_NOSIGNAL), 1);
      ::close(fd);
    }
  });
  auto t0 = Clock::now();
  acceptor.run(deadline);
  auto took = Clock::now() - t0;
  dialer.join();
  for (int lane = 0; lane < 2; ++lane) {
    int fd = acceptor.take(0, lane);
    uint8_t v = 0;
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, 5000);
    EXPECT_EQ(::recv(fd, &v, 1, 0), 1);
    EXPECT_EQ(v, 40 + lane);
    ::close(fd);
  }
  // Not a speed claim: far below the 2 s per stranger that reading hellos one by one cost.
  EXPECT_LT(took, std::chrono::seconds(10));
  // Each stranger is named once set-up is over, whether it was accepted or still queued.
  EXPECT_EQ(acceptor.dropped().size(), strangers.size());
  for (const std::string& line : acceptor.dropped())
    EXPECT_NE(line.find("still mid-handshake when set-up ended"), std::string::npos) << line;
  for (int fd : strangers) ::close(fd);
}

TEST(Rendezvous, WrongSecretFailsBothSidesNamingThePeer) {
  sockaddr_in lo{};
  socket::pickInterface("=lo", lo);
  socket::Listener l(lo);
  socket::Rendezvous acceptor(secretOf(1), 1, &l);
  acceptor.expect(0, 0);
  std::string dialerError;
  std::thread dialer([&] {
    socket::Rendezvous d(secretOf(2), 0, nullptr);
    d.dial(1, 0, l.addr());
    try {
      d.run(Clock::now() + std::chrono::seconds(10));
    } catch (const Error& e) {
      dialerError = e.what();
      EXPECT_EQ(e.code(), ErrorCode::kPeerFailure);
      EXPECT_EQ(e.ranks, std::vector<int>{1});
    }
  });
  try {
    acceptor.run(Clock::now() + std::chrono::seconds(3));
    ADD_FAILURE() << "the acceptor connected a dialer with another secret";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_EQ(e.ranks, std::vector<int>{0});
    EXPECT_NE(std::string(e.what()).find("failed railcc's handshake"), std::string::npos) << e.what();
  }
  dialer.join();
  EXPECT_NE(dialerError.find("failed authentication"), std::string::npos) << dialerError;
  EXPECT_EQ(acceptor.dropped().size(), 1u) << "the dialer refused the answer and hung up: one drop";
}

TEST(Rendezvous, ImpostorListenerLearnsNothingAndIsRefused) {
  // Whoever listens at a peer's address sees only the dialer's hello (ranks, lane, nonce): never
  // the secret. An answer that does not prove the secret is refused.
  sockaddr_in lo{};
  socket::pickInterface("=lo", lo);
  socket::Listener l(lo);
  const std::vector<uint8_t> secret = secretOf(0x5a);
  std::vector<uint8_t> seen;
  std::thread impostor([&] {
    int fd = -1;
    sockaddr_in from{};
    for (int i = 0; i < 500 && fd < 0; ++i) {
      fd = l.accept(&from);
      if (fd < 0) usleep(10000);
    }
    ASSERT_GE(fd, 0);
    uint8_t buf[256];
    pollfd p{fd, POLLIN, 0};
    while (poll(&p, 1, 500) == 1) {
      ssize_t r = ::recv(fd, buf, sizeof(buf), 0);
      if (r <= 0) break;
      seen.insert(seen.end(), buf, buf + r);
      // The old protocol's fixed acknowledgement, then garbage where a proof should be.
      uint64_t ack = 0x7261696c63636f6bull;
      std::vector<uint8_t> reply(56, 0xee);
      std::memcpy(reply.data(), &ack, 8);
      (void)!::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL);
    }
    ::close(fd);
  });
  socket::Rendezvous d(secret, 0, nullptr);
  d.dial(1, 0, l.addr());
  EXPECT_THROW(d.run(Clock::now() + std::chrono::seconds(10)), Error);
  impostor.join();
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(std::search(seen.begin(), seen.end(), secret.begin(), secret.begin() + 8), seen.end())
      << "secret bytes on the wire";
}

namespace {
// Steps `r` from now, when its peer `rank` went away without finishing the handshake: the wait
// must end in a peer failure naming that rank as not finished connecting, within 3 s.
void expectUnfinishedPeerNamed(socket::Rendezvous& r, int rank, const char* ifNever) {
  const auto far = Clock::now() + std::chrono::hours(1), gone = Clock::now();
  try {
    while (Clock::now() - gone < std::chrono::seconds(10)) r.step(far, std::chrono::milliseconds(5));
    ADD_FAILURE() << ifNever;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPeerFailure);
    EXPECT_EQ(e.ranks, std::vector<int>{rank});
    EXPECT_NE(std::string(e.what()).find("has not finished connecting with this rank"), std::string::npos) << e.what();
    EXPECT_LT(Clock::now() - gone, std::chrono::seconds(3)) << "promise: about 0.5 s";
  }
}
}  // namespace

TEST(Rendezvous, AWaitingRankKnocksOnItsPeerAndNamesItOnceNothingListens) {
  // Connections made at first use: rank 1 waits for rank 0 to dial. While rank 0's listener
  // is there, rank 1's knocks cost rank 0 nothing (no log line, no drop) and rank 1 waits on;
  // once it is closed (the process exited), rank 1's wait ends within a second, naming rank 0.
  sockaddr_in lo{};
  socket::pickInterface("=lo", lo);
  auto peerListener = std::make_unique<socket::Listener>(lo);
  sockaddr_in peerAddr = peerListener->addr();
  socket::Rendezvous peer(secretOf(3), 0, peerListener.get());
  peer.keepOpen(true);
  socket::Listener mine(lo);
  socket::Rendezvous waiting(secretOf(3), 1, &mine);
  waiting.keepOpen(true);
  waiting.expect(0, 0);
  waiting.watch(0, peerAddr);
  auto until = Clock::now() + std::chrono::milliseconds(1500);
  auto far = Clock::now() + std::chrono::hours(1);
  while (Clock::now() < until) {
    EXPECT_FALSE(waiting.step(far, std::chrono::milliseconds(5)));
    peer.step(far, std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(peer.dropped().empty()) << peer.dropped().front();
  peerListener.reset();  // what an exiting process leaves behind: nothing listening
  expectUnfinishedPeerNamed(waiting, 0, "the waiting rank never noticed its peer's listener was gone");
}

TEST(Rendezvous, ADialThePeerHoldsUnansweredEndsOnceItsListenerCloses) {
  // Connections made at first use: rank 0 dials rank 1 before rank 1 has met rank 0, so rank 1
  // holds the hello unanswered. Rank 1 then gives up on the group (its listener shut, as a
  // failed group's is) without ever answering: rank 0 must name it within about a second,
  // not wait on the held socket until its op times out.
  sockaddr_in lo{};
  socket::pickInterface("=lo", lo);
  socket::Listener peerListener(lo);
  socket::Rendezvous peer(secretOf(4), 1, &peerListener);
  peer.keepOpen(true);
  socket::Rendezvous dialer(secretOf(4), 0, nullptr);
  dialer.keepOpen(true);
  dialer.dial(1, 0, peerListener.addr());
  auto far = Clock::now() + std::chrono::hours(1);
  auto until = Clock::now() + std::chrono::milliseconds(1000);
  while (Clock::now() < until) {
    EXPECT_FALSE(dialer.step(far, std::chrono::milliseconds(5)));
    peer.step(far, std::chrono::milliseconds(5));
  }
  EXPECT_FALSE(peer.ready(0, 0)) << "rank 1 never expected rank 0: the hello stays held";
  ::shutdown(peerListener.fd(), SHUT_RDWR);  // what a failed group does (the held socket stays open)
  expectUnfinishedPeerNamed(dialer, 1, "the dialer waited on past its peer's closed listener");
}

TEST(Rendezvous, ShutdownAllEndsConnectionsNeverTakenFromAnotherThread) {
  // Rank 1 finished a handshake with rank 0 but failed before taking the connection: rank 0
  // holds it as connected. Rank 1's shutdownAll() (from another thread, as a failing group's)
  // must end it, so rank 0's wait ends at once.
  sockaddr_in lo{};
  socket::pickInterface("=lo", lo);
  socket::Listener l(lo);
  socket::Rendezvous acceptor(secretOf(5), 1, &l);
  acceptor.keepOpen(true);
  acceptor.expect(0, 0);
  socket::Rendezvous dialer(secretOf(5), 0, nullptr);
  dialer.dial(1, 0, l.addr());
  auto far = Clock::now() + std::chrono::hours(1);
  auto until = Clock::now() + std::chrono::seconds(10);
  while (!dialer.ready(1, 0) && Clock::now() < until) {
    dialer.step(far, std::chrono::milliseconds(5));
    acceptor.step(far, std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(dialer.ready(1, 0));
  for (int i = 0; i < 5 && !acceptor.ready(0, 0); ++i) acceptor.step(far, std::chrono::milliseconds(5));
  ASSERT_TRUE(acceptor.ready(0, 0)) << "the acceptor's side is done, not taken";
  int fd = dialer.take(1, 0);
  std::thread([&] { acceptor.shutdownAll(); }).join();
  pollfd p{fd, POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 3000), 1) << "the connection stayed open";
  char b;
  EXPECT_EQ(::recv(fd, &b, 1, 0), 0) << "the peer's end was shut down: end of stream";
  ::close(fd);
}

TEST(Socket, InterfaceSpecSyntax) {
  sockaddr_in a{};
  EXPECT_EQ(socket::pickInterface("=lo", a), "lo");
  EXPECT_EQ(socket::pickInterface("l", a), "lo");
  EXPECT_THROW(socket::pickInterface("=nosuchif0", a), Error);
}

// The machine's own listing: loopback with its netmask, and the same list again while fresh.
TEST(Socket, InterfaceListingHasLoopbackWithItsNetmask) {
  auto first = railcc::listInterfaces();
  auto lo = std::find_if(first.begin(), first.end(), [](const socket::InterfaceAddr& a) { return a.loopback; });
  ASSERT_NE(lo, first.end());
  EXPECT_TRUE(lo->up);
  EXPECT_EQ(socket::formatAddr(lo->addr), "127.0.0.1:0");
  EXPECT_EQ(lo->mask.sin_family, AF_INET);
  EXPECT_EQ(ntohl(lo->mask.sin_addr.s_addr), 0xff000000u);
  auto again = railcc::listInterfaces();
  ASSERT_EQ(again.size(), first.size());
  for (size_t i = 0; i < first.size(); ++i) EXPECT_EQ(again[i].name, first[i].name);
}

// The rule behind pickInterfaces on a given list: what `railcc doctor` asks through railcc._C.
TEST(Socket, InterfaceChoiceFromAList) {
  auto at = [](const char* name, bool up, bool lo, const char* ip) {
    socket::InterfaceAddr a;
    a.name = name;
    a.up = up;
    a.loopback = lo;
    a.addr.sin_family = AF_INET;
    inet_pton(AF_INET, ip, &a.addr.sin_addr);
    a.addr.sin_port = htons(99);
    return a;
  };
  std::vector<socket::InterfaceAddr> host = {at("lo", true, true, "127.0.0.1"), at("eth0", false, false, "10.0.0.1"),
                                             at("docker0", true, false, "172.17.0.1"), at("eth1", true, false, "10.1.0.1"),
                                             at("eth1", true, false, "10.1.0.2"), at("eth2", true, false, "10.2.0.1")};
  auto names = [](const std::vector<socket::Interface>& v) {
    std::string s;
    for (auto& i : v) s += (s.empty() ? "" : ",") + i.name + "=" + socket::formatAddr(i.addr);
    return s;
  };
  EXPECT_EQ(names(socket::chooseInterfaces(host, "")), "eth1=10.1.0.1:0");  // first up, not lo or docker
  EXPECT_EQ(names(socket::chooseInterfaces(host, "eth")), "eth1=10.1.0.1:0,eth2=10.2.0.1:0");  // one address per name
  EXPECT_EQ(names(socket::chooseInterfaces(host, "^eth1")), "lo=127.0.0.1:0,docker0=172.17.0.1:0,eth2=10.2.0.1:0");
  EXPECT_EQ(names(socket::chooseInterfaces(host, "=eth")), "");
  EXPECT_EQ(names(socket::chooseInterfaces(host, "eth0")), "");  // down
  EXPECT_EQ(names(socket::chooseInterfaces({host[0], host[2]}, "")), "lo=127.0.0.1:0");  // only loopback otherwise
  EXPECT_EQ(names(socket::chooseInterfaces({host[0]}, "eth")), "");
  EXPECT_TRUE(socket::matchSpec("eth0", "^=eth"));
  EXPECT_FALSE(socket::matchSpec("eth0", "^eth"));
}

TEST(Reduce, HalfTypesAndBool) {
  uint16_t a[2] = {0x3c00, 0x4000};  // fp16 1.0, 2.0
  uint16_t b[2] = {0x3c00, 0x3c00};
  reduceInto(a, b, 2, DataType::kFloat16, ReduceOp::kSum, 1.0);
  EXPECT_EQ(a[0], 0x4000);  // 2.0
  EXPECT_EQ(a[1], 0x4200);  // 3.0
  uint16_t c[1] = {0x3f80};  // bf16 1.0
  uint16_t d[1] = {0x4000};  // bf16 2.0
  reduceInto(c, d, 1, DataType::kBFloat16, ReduceOp::kMax, 1.0);
  EXPECT_EQ(c[0], 0x4000);
  uint8_t x[3] = {1, 0, 1}, y[3] = {0, 0, 1};
  reduceInto(x, y, 3, DataType::kBool, ReduceOp::kProduct, 1.0);
  EXPECT_EQ(x[0], 0);
  EXPECT_EQ(x[2], 1);
  EXPECT_THROW(checkReduceSupported(ReduceOp::kAvg, DataType::kInt32), Error);
}
