// Engine tests: every rank is a thread with its own Communicator over one MemoryStore, so
// the real shm and socket transports run without Python or torch.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <thread>
#include <vector>

#include "engine/comm_impl.h"
#include "engine/communicator.h"
#include "engine/store_watch.h"
#include "engine/telemetry.h"
#include "common/error.h"
#include "ranks.h"
#include "transport/connection.h"

using namespace railcc;
using namespace railcc::engine;

namespace {

struct Param {
  int size;
  bool shm;
};

std::string paramName(const testing::TestParamInfo<Param>& p) {
  return std::string(p.param.shm ? "shm" : "tcp") + "_n" + std::to_string(p.param.size);
}

void runRanks(const Param& p, const std::function<void(Communicator&)>& body, Config cfg = Config::defaults()) {
  cfg.shmDisable = !p.shm;
  cfg.initTimeoutSec = 30;
  testing_util::runRanks(p.size, cfg, "test", body);
}

using testing_util::waitOk;

class Collectives : public testing::TestWithParam<Param> {};

TEST_P(Collectives, AllreduceSumCounts) {
  // 0, 1, odd, and larger than the 64 KiB FIFO configured below.
  Config cfg = Config::defaults();
  cfg.buffSize = 64 * 1024;
  cfg.stagingSize = 4096;
  runRanks(GetParam(), [](Communicator& c) {
    for (size_t count : {size_t(0), size_t(1), size_t(1001), size_t(70001)}) {
      std::vector<int64_t> v(count);
      for (size_t i = 0; i < count; ++i) v[i] = static_cast<int64_t>(i) * (c.rank() + 1);
      waitOk(c.allreduce(v.data(), count, DataType::kInt64, ReduceOp::kSum));
      int64_t f = static_cast<int64_t>(c.size()) * (c.size() + 1) / 2;
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(v[i], static_cast<int64_t>(i) * f) << "count " << count << " i " << i;
    }
  }, cfg);
}

TEST_P(Collectives, AllreduceFloatMaxAvg) {
  runRanks(GetParam(), [](Communicator& c) {
    std::vector<float> v(37, static_cast<float>(c.rank()));
    waitOk(c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kMax));
    for (float x : v) ASSERT_EQ(x, static_cast<float>(c.size() - 1));
    std::vector<double> a(5, static_cast<double>(c.rank()));
    waitOk(c.allreduce(a.data(), a.size(), DataType::kFloat64, ReduceOp::kAvg));
    for (double x : a) ASSERT_DOUBLE_EQ(x, (c.size() - 1) / 2.0);
  });
}

TEST_P(Collectives, BroadcastAllgatherReduceScatter) {
  runRanks(GetParam(), [](Communicator& c) {
    int n = c.size();
    std::vector<int32_t> b(100003, c.rank());
    waitOk(c.broadcast(b.data(), b.size(), DataType::kInt32, n - 1));
    for (int32_t x : b) ASSERT_EQ(x, n - 1);

    std::vector<int32_t> in(3, c.rank()), out(static_cast<size_t>(3 * n), -1);
    std::vector<void*> outs;
    for (int r = 0; r < n; ++r) outs.push_back(out.data() + 3 * r);
    waitOk(c.allgather(in.data(), 3, DataType::kInt32, outs));
    for (int r = 0; r < n; ++r) ASSERT_EQ(out[static_cast<size_t>(3 * r)], r);

    std::vector<int32_t> full(static_cast<size_t>(2 * n));
    std::iota(full.begin(), full.end(), 0);
    std::vector<const void*> ins;
    for (int r = 0; r < n; ++r) ins.push_back(full.data() + 2 * r);
    std::vector<int32_t> rs(2);
    waitOk(c.reduceScatter(ins, rs.data(), 2, DataType::kInt32, ReduceOp::kSum));
    ASSERT_EQ(rs[0], 2 * c.rank() * n);
    ASSERT_EQ(rs[1], (2 * c.rank() + 1) * n);
  });
}

// Receives larger than the local ranks' share of the last-level cache take the
// non-temporal copy (shm FIFO and broadcast ring); odd sizes and an unaligned destination.
TEST(LargeReceives, BroadcastAndAllgatherPastTheCache) {
  for (int n : {2, 3}) {
    size_t count = transport::lastLevelCacheBytes() / static_cast<size_t>(n) + 13;
    runRanks({n, true}, [count](Communicator& c) {
      int me = c.rank(), n = c.size();
      std::vector<uint8_t> b(count + 1, 0);
      uint8_t* buf = b.data() + 1;  // unaligned
      if (me == 0)
        for (size_t i = 0; i < count; ++i) buf[i] = static_cast<uint8_t>(i * 7 + 1);
      waitOk(c.broadcast(buf, count, DataType::kUInt8, 0));
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(buf[i], static_cast<uint8_t>(i * 7 + 1)) << i;
      std::vector<uint8_t> in(count, static_cast<uint8_t>(me + 1)), out(count * static_cast<size_t>(n) + 1, 0);
      std::vector<void*> outs;
      for (int r = 0; r < n; ++r) outs.push_back(out.data() + 1 + count * static_cast<size_t>(r));
      waitOk(c.allgather(in.data(), count, DataType::kUInt8, outs));
      for (int r = 0; r < n; ++r) {
        const uint8_t* o = static_cast<const uint8_t*>(outs[static_cast<size_t>(r)]);
        ASSERT_TRUE(std::all_of(o, o + count, [r](uint8_t x) { return x == r + 1; })) << "piece of rank " << r;
      }
    });
  }
}

TEST_P(Collectives, SendRecvRingAndBarrier) {
  runRanks(GetParam(), [](Communicator& c) {
    int n = c.size();
    waitOk(c.barrier());
    if (n == 1) return;
    std::vector<uint8_t> s(200001, static_cast<uint8_t>(c.rank())), r(200001, 255);
    auto a = c.send(s.data(), s.size(), (c.rank() + 1) % n, 0);
    auto b = c.recv(r.data(), r.size(), (c.rank() - 1 + n) % n, 0);
    waitOk(a);
    waitOk(b);
    for (uint8_t x : r) ASSERT_EQ(x, static_cast<uint8_t>((c.rank() - 1 + n) % n));
  });
}

// Ops queued under CallerWaits run on the caller's thread in Communicator::wait(), in queue
// order after the ones the progress thread was given; sends and receives in flight meanwhile
// still complete, and a synchronous op whose caller waits some other way is still run.
TEST_P(Collectives, CallerRunsSynchronousOps) {
  runRanks(GetParam(), [](Communicator& c) {
    int n = c.size();
    std::vector<int64_t> a(1001, c.rank() + 1), b(70001, c.rank());
    auto queued = c.allreduce(a.data(), a.size(), DataType::kInt64, ReduceOp::kSum);  // the progress thread's
    std::vector<uint8_t> s(5000, static_cast<uint8_t>(c.rank())), r(5000, 255);
    RequestPtr snd, rcv;
    if (n > 1) {
      snd = c.send(s.data(), s.size(), (c.rank() + 1) % n, 7);
      rcv = c.recv(r.data(), r.size(), (c.rank() - 1 + n) % n, 7);
    }
    RequestPtr mine;
    {
      CallerWaits cw(true);
      EXPECT_TRUE(CallerWaits::active());
      mine = c.broadcast(b.data(), b.size(), DataType::kInt64, n - 1);
    }
    EXPECT_FALSE(CallerWaits::active());
    ASSERT_TRUE(c.wait(mine));
    if (mine->error()) std::rethrow_exception(mine->error());
    ASSERT_TRUE(queued->completed());  // queued before: ran first
    for (int64_t x : b) ASSERT_EQ(x, n - 1);
    for (int64_t x : a) ASSERT_EQ(x, static_cast<int64_t>(n) * (n + 1) / 2);
    if (n > 1) {
      waitOk(snd);
      waitOk(rcv);
      for (uint8_t x : r) ASSERT_EQ(x, static_cast<uint8_t>((c.rank() - 1 + n) % n));
    }
    // Waited on with a timeout, or not through the communicator at all: still runs.
    std::vector<int32_t> v(3, 1), w(5, 2);
    RequestPtr timed, plain;
    {
      CallerWaits cw(true);
      timed = c.allreduce(v.data(), v.size(), DataType::kInt32, ReduceOp::kSum);
    }
    ASSERT_TRUE(c.wait(timed, Millis(60000)));
    {
      CallerWaits cw(true);
      plain = c.allreduce(w.data(), w.size(), DataType::kInt32, ReduceOp::kSum);
    }
    waitOk(plain);
    for (int32_t x : v) ASSERT_EQ(x, n);
    for (int32_t x : w) ASSERT_EQ(x, 2 * n);
  });
}

INSTANTIATE_TEST_SUITE_P(Sizes, Collectives,
                         testing::Values(Param{1, true}, Param{2, true}, Param{3, true}, Param{4, true}, Param{5, true},
                                         Param{6, true}, Param{7, true}, Param{8, true}, Param{9, true},
                                         Param{13, true}, Param{2, false}, Param{3, false}, Param{5, false},
                                         Param{9, false}, Param{13, false}),
                         paramName);

TEST(Errors, InvalidArgumentsThrowOnCaller) {
  runRanks({2, true}, [](Communicator& c) {
    int x = 0;
    EXPECT_THROW(c.broadcast(&x, 1, DataType::kInt32, 5), Error);
    EXPECT_THROW(c.allreduce(&x, 1, DataType::kInt32, ReduceOp::kAvg), Error);
    EXPECT_THROW(c.send(&x, 4, c.rank(), 0), Error);
    float f = 1;
    EXPECT_THROW(c.allreduce(&f, 1, DataType::kFloat32, ReduceOp::kBxor), Error);
    // still usable afterwards
    waitOk(c.allreduce(&x, 1, DataType::kInt32, ReduceOp::kSum));
  });
}

// An error quoting what another process wrote stays something Python can decode and print:
// bytes that are not UTF-8 escaped, megabytes cut to a few KiB with what was cut said.
TEST(Errors, MessagesAreValidTextOfBoundedLength) {
  const std::string plain = "rank 3 (host a) failed: it said so";
  EXPECT_EQ(Error(ErrorCode::kPeerFailure, plain).what(), plain);
  const std::string utf8 = "host caf\xc3\xa9 and tab\there\nline two";
  EXPECT_EQ(Error(ErrorCode::kPeerFailure, utf8).what(), utf8);
  const std::string odd = Error(ErrorCode::kInvalidUsage, std::string("ep/2 is 'a\xff\xfe\x01" "b\xc3'")).what();
  EXPECT_EQ(odd, "ep/2 is 'a\\xff\\xfe\\x01b\\xc3'");
  EXPECT_TRUE(printableText(odd));
  std::string huge = "rank 2's endpoint record '" + std::string(4 << 20, 'x') + "\xff' is malformed; fix it";
  const std::string cut = Error(ErrorCode::kInvalidUsage, huge).what();
  EXPECT_LE(cut.size(), kMaxErrorChars + 64);
  EXPECT_EQ(cut.rfind("rank 2's endpoint record", 0), 0u) << cut.substr(0, 80);
  EXPECT_NE(cut.find("bytes cut"), std::string::npos);
  EXPECT_NE(cut.find("malformed; fix it"), std::string::npos) << cut.substr(cut.size() - 80);
  // A message made long by escapes alone is cut too, and never splits a character.
  const std::string escaped = Error(ErrorCode::kInvalidUsage, std::string(3000, '\x01') + "\xc3\xa9").what();
  EXPECT_LE(escaped.size(), kMaxErrorChars + 64);
  EXPECT_TRUE(printableText(escaped)) << escaped.substr(escaped.size() - 40);
  EXPECT_EQ(quoteBytes("abc", 10), "abc");
  EXPECT_EQ(quoteBytes(std::string(50, 'y'), 10), std::string(10, 'y') + "... (50 bytes in all)");
}

TEST(Errors, MismatchedCollectivesFailWithBothCalls) {
  runRanks({2, true}, [](Communicator& c) {
    std::vector<float> v(4, 1.0f);
    RequestPtr req = c.rank() == 0 ? c.allreduce(v.data(), 4, DataType::kFloat32, ReduceOp::kSum)
                                   : c.broadcast(v.data(), 4, DataType::kFloat32, 0);
    auto e = testing_util::failureOf(req);
    ASSERT_TRUE(e) << "rank " << c.rank() << " did not fail with a railcc error";
    // Whoever saw the other's message names both calls, and the other rank learns the
    // same through the failure report: both fail as a mismatch, with both calls.
    std::string m = e->what();
    EXPECT_EQ(e->code(), ErrorCode::kMismatch) << m;
    EXPECT_NE(m.find("allreduce"), std::string::npos) << m;
    EXPECT_NE(m.find("broadcast"), std::string::npos) << m;
    c.abort("test done");
  });
}

TEST(Errors, AbortUnblocksPendingRecv) {
  runRanks({2, true}, [](Communicator& c) {
    if (c.rank() == 0) {
      int x;
      auto req = c.recv(&x, 4, 1, 0);
      std::thread t([&] {
        std::this_thread::sleep_for(Millis(200));
        c.abort("stop");
      });
      ASSERT_TRUE(req->wait(Millis(10000)));
      t.join();
      ASSERT_TRUE(req->error() != nullptr);
      try {
        std::rethrow_exception(req->error());
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kAborted);
      }
    }
  });
}

// Flight-recorder strings quote what other processes sent: the JSON must stay valid UTF-8.
TEST(TraceJson, BytesThatAreNotUtf8BecomeReplacementCharacters) {
  EXPECT_EQ(jsonString("plain \"q\"\n"), "\"plain \\\"q\\\"\\n\"");
  EXPECT_EQ(jsonString("h\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), "\"h\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\"");
  EXPECT_EQ(jsonString("a\xff" "b"), "\"a\\ufffdb\"");
  EXPECT_EQ(jsonString("\xc0\xaf"), "\"\\ufffd\\ufffd\"");      // overlong '/'
  EXPECT_EQ(jsonString("\xe2\x82"), "\"\\ufffd\\ufffd\"");      // cut short
  EXPECT_EQ(jsonString("\xed\xa0\x80"), "\"\\ufffd\\ufffd\\ufffd\"");  // a surrogate
}

}  // namespace

// A store watch never connects to the store's server: a TCPStore server looks up the name of
// every connection it accepts, which can stall it (and every rank's store calls) for a
// resolver's timeout. It watches the connection the process already has, without reading it.
TEST(StoreWatch, WatchesTheProcesssOwnConnectionAndNeverDialsTheServer) {
  int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(lfd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(lfd, 16), 0);
  socklen_t len = sizeof(a);
  ASSERT_EQ(getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const uint16_t port = ntohs(a.sin_port);
  auto accepted = [&](int waitMs) {
    pollfd p{lfd, POLLIN, 0};
    return poll(&p, 1, waitMs) == 1 ? ::accept(lfd, nullptr, nullptr) : -1;
  };
  auto dial = [&]() {  // what torch's store client does
    int c = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    EXPECT_EQ(::connect(c, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    return c;
  };

  // No client connection yet: nothing to watch, never reported gone, and no dial.
  auto w = railcc::engine::StoreWatch::of("127.0.0.1", port);
  EXPECT_FALSE(w->gone());
  EXPECT_EQ(w->watchedFd(), -1);
  EXPECT_LT(accepted(200), 0) << "the watch dialed the store's server";

  int client = dial();
  int server = accepted(2000);
  ASSERT_GE(server, 0);
  EXPECT_EQ(w->watchedFd(), client) << "the watch did not find the process's connection to the server";
  EXPECT_FALSE(w->gone());
  ASSERT_EQ(::send(server, "x", 1, 0), 1);  // a reply torch has not read yet: still there, and unread
  usleep(20000);
  EXPECT_FALSE(w->gone());
  char c = 0;
  EXPECT_EQ(::recv(client, &c, 1, MSG_DONTWAIT), 1) << "the watch took a byte of torch's";
  railcc::engine::StoreWatch* first = w.get();
  w.reset();  // the last group using it is gone
  w = railcc::engine::StoreWatch::of("127.0.0.1", port);
  EXPECT_EQ(w.get(), first) << "a new group made a new watch";
  EXPECT_LT(accepted(200), 0) << "the store's server was dialed";

  ::close(server);  // the store's process exits
  for (int i = 0; i < 100 && !w->gone(); ++i) usleep(10000);
  EXPECT_TRUE(w->gone());
  ::close(client);

  // A new store at that address, and a new client: a new watch, on the new connection.
  int client2 = dial();
  int server2 = accepted(2000);
  ASSERT_GE(server2, 0);
  auto again = railcc::engine::StoreWatch::of("127.0.0.1", port);
  EXPECT_NE(again.get(), first);
  EXPECT_EQ(again->watchedFd(), client2);
  EXPECT_FALSE(again->gone());
  EXPECT_LT(accepted(200), 0) << "the store's server was dialed";
  ::close(server2);
  ::close(client2);
  ::close(lfd);
}

// The open-files check (engine/connections.cpp), in a child process whose limits it may lower:
// what is needed now must fit the limit; room for connections that may come later is made
// as far as the hard limit allows and is not an error; a connection at first use that does
// not fit is said with where it happened and the number needed.
TEST(FdLimit, WhatIsNeededNowMustFitAndRoomForLaterIsMadeWhereTheHardLimitAllows) {
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    size_t open = 0;
    if (DIR* d = opendir("/proc/self/fd")) {
      while (readdir(d) != nullptr) ++open;
      closedir(d);
    }
    // Soft below hard first: the hard limit, once lowered, cannot be raised again.
    rlimit loose{static_cast<rlim_t>(open + 70), static_cast<rlim_t>(open + 5000)};
    if (setrlimit(RLIMIT_NOFILE, &loose) != 0) _exit(10);
    checkFdLimit(1, "g", 500, "init");
    rlimit now{};
    getrlimit(RLIMIT_NOFILE, &now);
    if (now.rlim_cur < open + 500 + 64) _exit(11);  // raised for what may come
    rlimit tight{static_cast<rlim_t>(open + 90), static_cast<rlim_t>(open + 90)};
    if (setrlimit(RLIMIT_NOFILE, &tight) != 0) _exit(15);
    try {
      checkFdLimit(10, "g", 1000, "init");  // 10 fit, 1000 do not: no error
    } catch (...) {
      _exit(16);
    }
    try {
      checkFdLimit(100, "g", 0, "connecting to rank 7 at first use");
      _exit(12);
    } catch (const Error& e) {
      const std::string w = e.what();
      if (w.find("at connecting to rank 7 at first use") == std::string::npos) _exit(13);
      if (w.find("raise it to at least") == std::string::npos) _exit(14);
    }
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "10-11: the soft limit was not raised; 12-14: a first-use need that does not "
                                       "fit was not said as it should be; 15-16: a later need failed init";
}
