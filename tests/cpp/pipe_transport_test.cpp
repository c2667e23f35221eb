// A toy third transport, written only for this test and registered from it: every byte goes
// through a pair of named pipes (FIFOs) per connection. It proves that a transport needs no
// edit to the engine: bootstrap finds it in the registry, publishes its endpoint (a directory)
// through the store, connects through its non-blocking connect/accept, and every collective
// runs over it, split across two channels per peer, bit-exact against a local reference.
#include <fcntl.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <numeric>
#include <thread>

#include "common/error.h"
#include "collective_checks.h"
#include "ranks.h"
#include "transport/transport.h"

using namespace railcc;
using namespace railcc::engine;

namespace {

// One direction in, one out. pollFd() is an epoll set: the read end level-triggered, the write
// end edge-triggered, so poll() wakes when data arrives or when a full pipe drains.
class PipeConnection : public transport::Connection {
 public:
  PipeConnection(int rfd, int wfd, std::string desc) : rfd_(rfd), wfd_(wfd), desc_(std::move(desc)) {
    ep_ = epoll_create1(EPOLL_CLOEXEC);
    epoll_event in{EPOLLIN, {}}, out{EPOLLOUT | EPOLLET, {}};
    epoll_ctl(ep_, EPOLL_CTL_ADD, rfd_, &in);
    epoll_ctl(ep_, EPOLL_CTL_ADD, wfd_, &out);
    buf_.resize(1 << 16);
  }
  ~PipeConnection() override {
    close(rfd_);
    close(wfd_);
    close(ep_);
  }
  size_t send(const void* p, size_t n) override {
    ssize_t k = write(wfd_, p, n);
    if (k < 0 && errno == EAGAIN) {
      drainEdges();
      k = write(wfd_, p, n);  // the pipe may have drained before the harvest: a lost edge
    }
    if (k >= 0) return static_cast<size_t>(k);
    if (errno == EAGAIN) return 0;
    RAILCC_THROW(kPeerFailure, "pipe to ", desc_, ": ", std::strerror(errno));
  }
  std::pair<const void*, size_t> peek() override {
    if (head_ == tail_) {
      head_ = tail_ = 0;
      ssize_t k = read(rfd_, buf_.data(), buf_.size());
      if (k == 0) RAILCC_THROW(kPeerFailure, "pipe from ", desc_, " closed");
      if (k < 0 && errno != EAGAIN) RAILCC_THROW(kPeerFailure, "pipe from ", desc_, ": ", std::strerror(errno));
      if (k > 0) tail_ = static_cast<size_t>(k);
    }
    return {buf_.data() + head_, tail_ - head_};
  }
  void consume(size_t n) override { head_ += n; }
  int pollFd() const override { return ep_; }
  std::string describe() const override { return "pipe " + desc_; }
  void markFailed() override { close(dup2(open("/dev/null", O_WRONLY), wfd_)); }

 private:
  // Harvests a pending write edge, so poll() on the set sleeps until the next one (the read
  // end, level-triggered, stays reported while data waits).
  void drainEdges() {
    epoll_event ev[2];
    epoll_wait(ep_, ev, 2, 0);
  }
  int rfd_, wfd_, ep_;
  std::string desc_;
  std::vector<char> buf_;
  size_t head_ = 0, tail_ = 0;
};

// Endpoint: a directory of this rank. A connecting peer makes two FIFOs in it, named by its
// rank, lane and channel; a FIFO's write end opens (non-blocking) only once a reader has it,
// which is what makes connect and accept resumable.
class PipeSetup : public transport::Setup {
 public:
  explicit PipeSetup(const transport::SetupContext& ctx, bool lazy = false) : ctx_(ctx), lazy_(lazy) {}
  bool lazy() const override { return lazy_; }
  bool ready(int peer, int lane, int ch) override {
    auto it = pending_.find({peer, lane, ch});
    return it != pending_.end() && up(it->second);
  }
  ~PipeSetup() override {
    for (auto& [k, c] : pending_) {
      if (c.rfd >= 0) close(c.rfd);
      if (c.wfd >= 0) close(c.wfd);
    }
    finish();
  }
  std::string endpoint() override {
    char tmpl[] = "/tmp/railcc-pipe-XXXXXX";
    RAILCC_SYSCHECK(mkdtemp(tmpl) != nullptr ? 0 : -1, "mkdtemp");
    dir_ = tmpl;
    return dir_;
  }
  int channels() const override { return 2; }
  std::string reach(const transport::PeerRecord& peer) override {
    struct stat st {};
    return stat(peer.endpoint.c_str(), &st) == 0 ? "its pipe directory is visible here" : "";
  }
  void connect(const transport::PeerRecord& peer, int lane, int ch) override {
    std::string base = peer.endpoint + "/" + name(ctx_.rank, lane, ch);
    RAILCC_SYSCHECK(mkfifo((base + ".down").c_str(), 0600), "mkfifo");
    RAILCC_SYSCHECK(mkfifo((base + ".up").c_str(), 0600), "mkfifo");
    Pending& c = pending_[{peer.rank, lane, ch}];
    c.dialer = true;
    c.base = base;
    c.rfd = open((base + ".down").c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  }
  void accept(const transport::PeerRecord& peer, int lane, int ch) override {
    Pending& c = pending_[{peer.rank, lane, ch}];
    c.base = dir_ + "/" + name(peer.rank, lane, ch);
  }
  bool progress(std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds) override {
    bool all = true;
    for (auto& [k, c] : pending_) {
      if (up(c)) continue;
      if (!c.dialer && c.rfd < 0) {  // the dialer made both FIFOs before it opened one
        c.rfd = open((c.base + ".up").c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
        if (c.rfd < 0) {
          all = false;
          continue;
        }
      }
      if (c.wfd < 0) {
        c.wfd = open((c.base + (c.dialer ? ".up" : ".down")).c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
        if (c.wfd < 0 && errno != ENXIO && errno != ENOENT)
          RAILCC_THROW(kSystem, "open ", c.base, ": ", std::strerror(errno));
        // The dialer says hello once both its ends are open; the acceptor is done only when
        // it has read it, so it never removes the FIFOs (finish()) before the dialer opened them.
        if (c.wfd >= 0 && c.dialer && write(c.wfd, "h", 1) != 1) RAILCC_THROW(kSystem, "hello to ", c.base);
      }
      if (c.wfd >= 0 && !c.dialer && !c.hello) {
        char h = 0;
        c.hello = read(c.rfd, &h, 1) == 1;
      }
      all = all && up(c);
    }
    if (!all && std::chrono::steady_clock::now() > deadline) RAILCC_THROW(kTimeout, "pipe connections not set up");
    if (!all) usleep(1000);
    return all;
  }
  std::unique_ptr<transport::Connection> take(int peer, int lane, int ch) override {
    Pending c = pending_.at({peer, lane, ch});
    pending_.erase({peer, lane, ch});
    return std::make_unique<PipeConnection>(c.rfd, c.wfd, c.base);
  }
  void finish() override {
    if (dir_.empty()) return;
    std::string cmd = "rm -rf '" + dir_ + "'";
    if (system(cmd.c_str()) != 0) { /* best effort */ }
    dir_.clear();
  }

 private:
  struct Pending {
    bool dialer = false;
    bool hello = false;
    std::string base;
    int rfd = -1, wfd = -1;
  };
  static bool up(const Pending& c) { return c.wfd >= 0 && (c.dialer || c.hello); }
  static std::string name(int r, int lane, int ch) {
    return std::to_string(r) + "-" + std::to_string(lane) + "-" + std::to_string(ch);
  }
  transport::SetupContext ctx_;
  bool lazy_;
  std::string dir_;
  std::map<std::tuple<int, int, int>, Pending> pending_;
};

// `lazy`: connects at first use; `absentOn`: a rank where it does not open (as verbs on a host
// without an RDMA NIC).
class PipeTransport : public transport::Transport {
 public:
  explicit PipeTransport(bool lazy = false, int absentOn = -1) : lazy_(lazy), absentOn_(absentOn) {}
  std::string name() const override { return "pipe"; }
  bool interHost() const override { return true; }
  std::unique_ptr<transport::Setup> open(const transport::SetupContext& ctx, std::string& whyNot) override {
    if (ctx.rank == absentOn_) {
      whyNot = "not on this rank (the test's choice)";
      return nullptr;
    }
    return std::make_unique<PipeSetup>(ctx, lazy_);
  }

 private:
  bool lazy_;
  int absentOn_;
};

// Every rank its own "host", so nothing goes through shared memory, and RAILCC_NET=pipe.
// Shares of 4 KiB: messages of 8 KiB and more are split across the two channels.
void runOverPipes(int n, const std::function<void(Communicator&)>& body) {
  signal(SIGPIPE, SIG_IGN);
  transport::registerTransport("pipe", 50, [] { return std::make_unique<PipeTransport>(); });
  Config cfg = Config::defaults();
  cfg.net = "pipe";
  cfg.initTimeoutSec = 30;
  cfg.channelMinBytes = 4096;
  testing_util::runRanks(n, cfg, "pipe", body, [](int r, Config& c) { c.hostId = "pipe-host-" + std::to_string(r); });
  transport::unregisterTransport("pipe");
}

using testing_util::waitOk;

class Pipes : public testing::TestWithParam<int> {};

TEST_P(Pipes, EveryCollectiveIsBitExact) {
  const int n = GetParam();
  // Large messages at 2 ranks only: three threads polling the toy's pipes on this 2-core
  // machine took 11 s for the 300001-element round alone (the real transports: under 1 s).
  runOverPipes(n, [n](Communicator& c) { testing_util::everyCollectiveIsBitExact(c, n, "pipe ", n == 2 ? 300001 : 4099); });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Pipes, testing::Values(2, 3), [](const testing::TestParamInfo<int>& p) {
  return "n" + std::to_string(p.param);
});

TEST(Pipes, ForcingAnUnregisteredTransportNamesTheRegisteredOnes) {
  Config cfg = Config::defaults();
  cfg.net = "carrier-pigeon";
  cfg.initTimeoutSec = 10;
  std::vector<std::string> errs = testing_util::initErrors(2, cfg);
  for (auto& e : errs) {
    EXPECT_NE(e.find("carrier-pigeon"), std::string::npos) << e;
    EXPECT_NE(e.find("socket"), std::string::npos) << e;
  }
}

// One rank's view of the shared store: counts its reads of ranks' endpoints ("ep/<rank>"),
// and once `mute` is set drops its progress records, as a process that died stops writing them.
class RankStore : public Store {
 public:
  explicit RankStore(Store& base) : base_(base) {}
  void set(const std::string& k, const std::string& v) override {
    if (mute && k.find("progress/") != std::string::npos) return;
    base_.set(k, v);
  }
  std::string get(const std::string& k, Millis t) override {
    note(k);
    return base_.get(k, t);
  }
  int64_t add(const std::string& k, int64_t d) override { return base_.add(k, d); }
  std::vector<std::string> getAll(const std::vector<std::string>& keys, Millis t) override {
    for (const std::string& k : keys) note(k);
    return base_.getAll(keys, t);
  }
  std::atomic<int> reads{0};
  std::atomic<bool> mute{false};

 private:
  void note(const std::string& k) {
    if (k.rfind("ep/", 0) == 0 || k.find("/ep/") != std::string::npos) ++reads;
  }
  Store& base_;
};

TEST(Pipes, WithTwoTransportsBetweenHostsEachPairChoosesAtFirstUse) {
  // Two transports between hosts, both connecting at first use (the toy, preferred, on ranks
  // 0-2 only, and TCP): set-up reads no other rank's endpoint (before, every rank read every
  // rank's: N store reads per rank at init); each pair reads its peer's at first use and takes
  // the first transport both ends offer, the same on both sides.
  signal(SIGPIPE, SIG_IGN);
  const int n = 4;
  transport::registerTransport("pipe", 50, [] { return std::make_unique<PipeTransport>(true, 3); });
  Config cfg = Config::defaults();
  cfg.initTimeoutSec = 30;
  cfg.nchannels = 2;  // the toy's count: a pair keeps the count of this rank's first transport
  cfg.channelMinBytes = 4096;
  MemoryStore store;
  std::vector<std::unique_ptr<RankStore>> stores;
  for (int r = 0; r < n; ++r) stores.push_back(std::make_unique<RankStore>(store));
  std::vector<int> atInit(n, -1);
  std::vector<std::vector<std::string>> via(n, std::vector<std::string>(n));
  std::vector<std::string> errors(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        CommOptions o;
        o.rank = r;
        o.size = n;
        o.name = "two-nets";
        o.timeout = Millis(60000);
        o.config = cfg;
        o.config.hostId = "two-nets-host-" + std::to_string(r);
        Communicator c(*stores[static_cast<size_t>(r)], o);
        atInit[static_cast<size_t>(r)] = stores[static_cast<size_t>(r)]->reads.load();
        testing_util::everyCollectiveIsBitExact(c, n, "", 4099);  // named before the first op: see below
        for (int p = 0; p < n; ++p)
          if (p != r) via[static_cast<size_t>(r)][static_cast<size_t>(p)] = c.transportTo(p);
        c.shutdown();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  transport::unregisterTransport("pipe");
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    // Rank 0 may read one endpoint per other host for its rail check (when the topology has rails).
    EXPECT_LE(atInit[static_cast<size_t>(r)], r == 0 ? n - 1 : 0) << "rank " << r << " read endpoints at init";
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      const std::string& v = via[static_cast<size_t>(r)][static_cast<size_t>(p)];
      const char* want = (r == 3 || p == 3) ? "socket" : "pipe";
      EXPECT_EQ(v.rfind(want, 0), 0u) << "rank " << r << " -> " << p << ": " << v;
    }
  }
}

TEST(Pipes, RequestsAndRegisteredMemoryOverAConnection) {
  // The request half of the contract, on the toy's connections: registered buffers, several
  // sends in flight, a receive that is too small is refused by name.
  int a[2], b[2];
  ASSERT_EQ(pipe2(a, O_NONBLOCK), 0);
  ASSERT_EQ(pipe2(b, O_NONBLOCK), 0);
  PipeConnection x(b[0], a[1], "x"), y(a[0], b[1], "y");
  std::vector<char> big(200000), got(200000), small(10);
  std::iota(big.begin(), big.end(), 1);
  auto mr = x.regMr(big.data(), big.size(), transport::MemoryKind::kHost);
  EXPECT_THROW(x.regMr(big.data(), 1, transport::MemoryKind::kCuda), Error);
  int s1 = x.isend(big.data(), big.size(), &mr), s2 = x.isend(big.data(), 3, &mr);
  int r1 = y.irecv(got.data(), got.size(), nullptr), r2 = y.irecv(small.data(), small.size(), nullptr);
  size_t n1 = 0, n2 = 0;
  bool d[4] = {false, false, false, false};
  for (int spin = 0; spin < 100000 && !(d[0] && d[1] && d[2] && d[3]); ++spin) {
    if (!d[0]) d[0] = x.test(s1, nullptr);
    if (!d[1]) d[1] = x.test(s2, nullptr);
    if (!d[2]) d[2] = y.test(r1, &n1);
    if (!d[3]) d[3] = y.test(r2, &n2);
  }
  ASSERT_TRUE(d[0] && d[1] && d[2] && d[3]);
  EXPECT_EQ(n1, big.size());
  EXPECT_EQ(n2, 3u);
  EXPECT_EQ(got, big);
  EXPECT_EQ(small[2], big[2]);
  x.deregMr(mr);
  EXPECT_EQ(mr.addr, nullptr);
  int s3 = x.isend(big.data(), 50, nullptr);
  bool refused = false;
  try {
    int r3 = y.irecv(small.data(), small.size(), nullptr);  // may already meet the message
    for (int spin = 0; spin < 100000; ++spin) {
      x.test(s3, nullptr);
      y.test(r3, nullptr);
    }
  } catch (const Error& e) {
    refused = std::string(e.what()).find("irecv of at most 10 bytes met a message of 50 bytes") != std::string::npos;
  }
  EXPECT_TRUE(refused);
}

// Three ranks on three hosts over the toy connecting at first use, where nothing refuses or
// closes when a peer is gone (as verbs, whose pairs meet through the store). Ranks 0 and 1
// connect to each other only, then all_reduce with rank 2, which never came to the pair.
// `dies`: rank 2's progress records stop after init and it never calls; else it calls 3 s
// late, its records flowing meanwhile. Returns each rank's error ("" for none) and seconds.
std::vector<std::pair<std::string, double>> allReduceWithAPeerNeverMet(bool dies) {
  signal(SIGPIPE, SIG_IGN);
  const int n = 3;
  transport::registerTransport("pipe", 50, [] { return std::make_unique<PipeTransport>(true); });
  Config cfg = Config::defaults();
  cfg.net = "pipe";
  cfg.initTimeoutSec = 30;
  cfg.progressIntervalMs = 100;  // a peer is judged gone after 2 s (10 intervals, 2 s at least)
  MemoryStore store;
  std::vector<std::unique_ptr<RankStore>> stores;
  for (int r = 0; r < n; ++r) stores.push_back(std::make_unique<RankStore>(store));
  std::vector<std::pair<std::string, double>> out(n);
  std::atomic<int> finished{0};
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        CommOptions o;
        o.rank = r;
        o.size = n;
        o.name = dies ? "never-met-dead" : "never-met-late";
        o.timeout = Millis(60000);
        o.config = cfg;
        o.config.hostId = "never-met-host-" + std::to_string(r);
        Communicator c(*stores[static_cast<size_t>(r)], o);
        std::vector<int> x(5, r + 1);
        if (r < 2) {
          int v = 7;
          waitOk(r == 0 ? c.send(&v, sizeof v, 1, 0) : c.recv(&v, sizeof v, 0, 0));
        } else if (dies) {
          stores[2]->mute = true;
          while (finished.load() < 2) std::this_thread::sleep_for(Millis(10));
          c.abort("the test's dead rank");
          return;
        } else {
          std::this_thread::sleep_for(Millis(3000));
        }
        auto t0 = std::chrono::steady_clock::now();
        RequestPtr req = c.allreduce(x.data(), x.size(), DataType::kInt32, ReduceOp::kSum);
        if (!req->wait(Millis(30000))) {
          out[static_cast<size_t>(r)].first = "did not end within 30 s";
        } else if (req->error()) {
          try {
            std::rethrow_exception(req->error());
          } catch (const Error& e) {
            out[static_cast<size_t>(r)].first = e.what();
            if (e.code() != ErrorCode::kPeerFailure || e.ranks != std::vector<int>{2})
              out[static_cast<size_t>(r)].first += " [not a peer failure naming rank 2 alone]";
          } catch (...) {
            out[static_cast<size_t>(r)].first = "failed with an exception that is not a railcc Error";
          }
        } else if (x != std::vector<int>(5, 6)) {
          out[static_cast<size_t>(r)].first = "wrong sum";
        }
        out[static_cast<size_t>(r)].second =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        ++finished;
        if (out[static_cast<size_t>(r)].first.empty()) c.shutdown();
        else c.abort("test done");
      } catch (const std::exception& e) {
        out[static_cast<size_t>(r)].first = std::string("threw: ") + e.what();
        ++finished;
      }
    });
  for (auto& t : ts) t.join();
  transport::unregisterTransport("pipe");
  return out;
}

TEST(Pipes, AWaitedPeerThatNeverConnectedIsNamedOnceItsRecordsStop) {
  // A rank that dies before any pair with it was made closes nothing: its peers learn of it
  // from its progress record, which stops changing, well before the op's 60 s timeout.
  auto out = allReduceWithAPeerNeverMet(true);
  for (int r = 0; r < 2; ++r) {
    const std::string& m = out[static_cast<size_t>(r)].first;
    EXPECT_NE(m.find("rank 2 (host "), std::string::npos) << "rank " << r << ": " << m;
    EXPECT_NE(m.find("not connected yet: connects at first use)) is gone: no connection to it is up for this op"), std::string::npos) << "rank " << r << ": " << m;
    EXPECT_NE(m.find("has not changed for"), std::string::npos) << "rank " << r << ": " << m;
    EXPECT_EQ(m.find("[not a peer failure"), std::string::npos) << "rank " << r << ": " << m;
    EXPECT_LT(out[static_cast<size_t>(r)].second, 10.0) << "rank " << r << ": " << m;
  }
}

TEST(Pipes, AWaitedPeerThatIsLateButAliveIsWaitedFor) {
  // The same wait on a rank that is alive but 3 s late (longer than the 2 s a stopped record
  // takes to condemn it): its records keep changing, so the op waits and is exact.
  auto out = allReduceWithAPeerNeverMet(false);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(out[static_cast<size_t>(r)].first, "") << "rank " << r;
  EXPECT_GT(out[0].second, 2.0);  // it did wait for rank 2
}

}  // namespace
