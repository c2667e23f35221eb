// Transport tests: the shared-memory FIFO and the socket stream, driven directly.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <thread>
#include <vector>

#include "engine/error.h"
#include "engine/types.h"
#include "transport/shm/shm_transport.h"
#include "transport/socket/socket_transport.h"

using namespace railcc;
using namespace railcc::transport;

TEST(Shm, FifoWrapsAndPreservesOrder) {
  // Two domains in one process stand for two ranks.
  shm::Domain a("ttest-a-" + std::to_string(getpid()), 2, 4096);
  shm::Domain b("ttest-b-" + std::to_string(getpid()), 2, 4096);
  a.attach(1, b.segmentName());
  b.attach(0, a.segmentName());
  a.unlinkOwn();
  b.unlinkOwn();
  auto ab = a.connect(0, 1, 0, 1);
  auto ba = b.connect(1, 0, 0, 1);
  std::vector<uint8_t> src(100000), dst(100000);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 31);
  size_t sent = 0, got = 0;
  while (got < dst.size()) {
    sent += ab->send(src.data() + sent, std::min<size_t>(src.size() - sent, 3000));
    got += ba->recv(dst.data() + got, dst.size() - got);
  }
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), src.size()));
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

TEST(Shm, StaleSegmentsOfDeadProcessesAreRemoved) {
  pid_t child = fork();
  if (child == 0) {
    // Create a segment and die without unlinking it, as a killed job would.
    new shm::Domain("stale-" + std::to_string(getpid()), 1, 4096);
    _exit(0);
  }
  int status;
  waitpid(child, &status, 0);
  EXPECT_GE(shm::Domain::cleanStale(), 1);
}

TEST(Socket, HandshakeRejectsStrangers) {
  sockaddr_in lo{};
  socket::pickInterface("=lo", lo);
  socket::Listener l(lo);
  // A stranger without the hello: dropped by readHello.
  std::thread stranger([&] {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ::connect(fd, reinterpret_cast<const sockaddr*>(&l.addr()), sizeof(sockaddr_in));
    const char junk[64] = "GET / HTTP/1.0\r\n\r\n garbage garbage garbage garbage garbage";
    (void)!::write(fd, junk, sizeof(junk));
    ::close(fd);
  });
  int fd = -1;
  sockaddr_in from{};
  for (int i = 0; i < 200 && fd < 0; ++i) {
    fd = l.accept(&from);
    if (fd < 0) usleep(10000);
  }
  ASSERT_GE(fd, 0);
  socket::Hello h{};
  EXPECT_FALSE(socket::readHello(fd, h, std::chrono::milliseconds(1000)));
  ::close(fd);
  stranger.join();
}

TEST(Socket, InterfaceSpecSyntax) {
  sockaddr_in a{};
  EXPECT_EQ(socket::pickInterface("=lo", a), "lo");
  EXPECT_EQ(socket::pickInterface("l", a), "lo");
  EXPECT_THROW(socket::pickInterface("=nosuchif0", a), Error);
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
