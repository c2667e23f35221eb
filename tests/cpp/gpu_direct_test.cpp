// GPUDirect RDMA without a GPU. Two fakes, named so, stand in for what no machine of CI has:
// * FakeNic: a libibverbs table whose registrations only record what they were asked, for the
//   choice between dma-buf, nvidia_peermem and staging (gpu_registration.cpp);
// * SyncDevice: a GPU runtime whose "device memory" is host memory and whose copies run at once,
//   for the engine's side of sends and receives of GPU memory (engine/device/gpu_direct.cpp).
// Over shared memory and TCP (below, in CI) no transport reaches GPU memory: every byte must go
// through the host buffers. Over verbs (the Soft-RoCE VM runs the *Verbs* tests) the fake GPU
// memory is registered with the real rxe NIC the nvidia_peermem way (a plain registration, which
// host memory takes), so the rendezvous path reads and writes the "GPU" buffers themselves.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <vector>

#include "common/error.h"
#include "engine/device.h"
#include "ranks.h"
#include "transport/gpu_memory.h"
#include "transport/stats.h"
#include "transport/verbs/gpu_registration.h"
#include "transport/verbs/verbs_devices.h"

using namespace railcc;
using namespace railcc::engine;
using namespace railcc::transport;
using namespace railcc::transport::verbs;

namespace {

uint64_t stat(Stat s) { return statRow(StatKind::kVerbs).v[static_cast<size_t>(s)].load(); }

// --- Choosing how GPU memory is registered (FakeNic) ------------------------------------------

struct FakeNic {
  static inline int dmabufCalls = 0, regCalls = 0, dmabufErrno = 0, regErrno = 0;
  static inline uint64_t offset = 0, iova = 0;
  static inline size_t len = 0;
  static inline int fd = -1;
  static inline void* addr = nullptr;
  static inline ibv_mr mr{};

  static ibv_mr* regDmabuf(ibv_pd*, uint64_t off, size_t n, uint64_t va, int f, int) {
    ++dmabufCalls;
    offset = off, len = n, iova = va, fd = f;
    if (dmabufErrno) return errno = dmabufErrno, nullptr;
    return &mr;
  }
  static ibv_mr* reg(ibv_pd*, void* p, size_t n, int) {
    ++regCalls;
    addr = p, len = n;
    if (regErrno) return errno = regErrno, nullptr;
    return &mr;
  }
  static IbvLib lib(bool withDmabuf = true) {
    dmabufCalls = regCalls = dmabufErrno = regErrno = 0;
    fd = -1;
    IbvLib l;
    l.regMr = reg;
    l.regDmabufMr = withDmabuf ? regDmabuf : nullptr;
    return l;
  }
};

// A GPU runtime's answers about one allocation; the dma-buf is a real fd (a memfd), so that the
// test can see it was closed after the registration.
struct FakeGpuMemory : GpuMemory {
  uintptr_t base = 0x7f0000000000;
  size_t bytes = 64 << 20;
  bool exportWorks = true;
  int exports = 0, lastFd = -1, flushes = 0;
  size_t exportedBytes = 0;
  bool allocation(const void*, const void** b, size_t* n, std::string*) override {
    *b = reinterpret_cast<const void*>(base);
    *n = bytes;
    return true;
  }
  int dmabufFd(const void*, size_t n, std::string* why) override {
    ++exports;
    exportedBytes = n;
    if (!exportWorks) return *why = "cuMemGetHandleForAddressRange: operation not supported (801)", -1;
    return lastFd = memfd_create("fake-dmabuf", 0);
  }
  void flushWrites(int) override { ++flushes; }
};

const void* at(const FakeGpuMemory& g, size_t off) { return reinterpret_cast<const void*>(g.base + off); }

TEST(GpuRegistration, DmaBufFirstOverThePagesOfTheBufferAndItsFdIsClosed) {
  IbvLib ibv = FakeNic::lib();
  FakeGpuMemory gm;
  const uint64_t before = stat(Stat::kRegistrations);
  const size_t pg = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  GpuRegistration r = registerGpuMemory(ibv, nullptr, gm, at(gm, 3 * pg + 100), 2 * pg, GdrMode::kDmabuf, true, 0);
  ASSERT_EQ(r.mr, &FakeNic::mr);
  EXPECT_STREQ(r.how, "dma-buf");
  EXPECT_EQ(r.why, "");
  EXPECT_EQ(FakeNic::dmabufCalls, 1);
  EXPECT_EQ(FakeNic::regCalls, 0);
  EXPECT_EQ(FakeNic::iova, gm.base + 3 * pg);  // the NIC addresses it at its virtual address
  EXPECT_EQ(FakeNic::offset, 0u);
  EXPECT_EQ(FakeNic::len, 3 * pg);  // the pages [3, 6) hold [3 pg + 100, 5 pg + 100)
  EXPECT_EQ(gm.exportedBytes, 3 * pg);
  EXPECT_EQ(FakeNic::fd, gm.lastFd);
  EXPECT_EQ(fcntl(gm.lastFd, F_GETFD), -1);  // closed: the registration keeps its own reference
  EXPECT_EQ(stat(Stat::kRegistrations), before + 1);
  std::string line = sayGpuRegistration("mlx5_test", 3, r);
  EXPECT_NE(line.find("GPU 3 memory registered with mlx5_test through dma-buf"), std::string::npos) << line;
}

TEST(GpuRegistration, ARefusedDmaBufFallsBackToPeermemSayingWhy) {
  IbvLib ibv = FakeNic::lib();
  FakeGpuMemory gm;
  FakeNic::dmabufErrno = EOPNOTSUPP;
  GpuRegistration r = registerGpuMemory(ibv, nullptr, gm, at(gm, 0), 4096, GdrMode::kDmabuf, true, 0);
  ASSERT_EQ(r.mr, &FakeNic::mr);
  EXPECT_STREQ(r.how, "nvidia_peermem");
  EXPECT_NE(r.why.find("ibv_reg_dmabuf_mr: "), std::string::npos) << r.why;
  EXPECT_EQ(FakeNic::addr, at(gm, 0));  // the device address itself, for the peer-memory client
  EXPECT_EQ(fcntl(gm.lastFd, F_GETFD), -1);

  // The runtime cannot export (an old driver): the same fallback, naming the driver's answer.
  FakeNic::lib();
  gm.exportWorks = false;
  r = registerGpuMemory(ibv, nullptr, gm, at(gm, 0), 4096, GdrMode::kDmabuf, true, 0);
  EXPECT_STREQ(r.how, "nvidia_peermem");
  EXPECT_NE(r.why.find("cuMemGetHandleForAddressRange"), std::string::npos) << r.why;
  EXPECT_EQ(FakeNic::dmabufCalls, 0);
}

TEST(GpuRegistration, WithNeitherWayTheBufferIsStagedAndTheLineSaysWhy) {
  IbvLib ibv = FakeNic::lib(/*withDmabuf=*/false);  // rdma-core < 34
  FakeGpuMemory gm;
  const uint64_t failures = stat(Stat::kRegFailures);
  GpuRegistration r = registerGpuMemory(ibv, nullptr, gm, at(gm, 0), 4096, GdrMode::kDmabuf, false, 0);
  EXPECT_EQ(r.mr, nullptr);
  EXPECT_EQ(FakeNic::regCalls, 0);  // no plain registration of a device address without nvidia_peermem
  EXPECT_NE(r.why.find("no ibv_reg_dmabuf_mr"), std::string::npos) << r.why;
  EXPECT_NE(r.why.find("nvidia_peermem is not loaded"), std::string::npos) << r.why;
  EXPECT_EQ(stat(Stat::kRegFailures), failures + 1);
  std::string line = sayGpuRegistration("mlx5_test", 0, r);
  EXPECT_NE(line.find("staged through host memory"), std::string::npos) << line;

  // nvidia_peermem loaded but the registration refused (the module cannot pin these pages).
  FakeNic::lib();
  FakeNic::regErrno = EFAULT;
  r = registerGpuMemory(ibv, nullptr, gm, at(gm, 0), 4096, GdrMode::kPeermem, true, 0);
  EXPECT_EQ(r.mr, nullptr);
  EXPECT_EQ(FakeNic::dmabufCalls, 0);  // the decision was peermem: dma-buf is not tried
  EXPECT_NE(r.why.find("Bad address"), std::string::npos) << r.why;
}

TEST(GpuRegistration, AStagedDecisionOrPagesBeyondTheAllocationTouchNothing) {
  IbvLib ibv = FakeNic::lib();
  FakeGpuMemory gm;
  GpuRegistration r = registerGpuMemory(ibv, nullptr, gm, at(gm, 0), 4096, GdrMode::kStaged, true, 0);
  EXPECT_EQ(r.mr, nullptr);
  EXPECT_EQ(FakeNic::dmabufCalls + FakeNic::regCalls + gm.exports, 0);
  EXPECT_NE(r.why.find("decision"), std::string::npos) << r.why;

  gm.bytes = 4096;  // a buffer whose last page lies past its allocation: never exported
  r = registerGpuMemory(ibv, nullptr, gm, at(gm, 100), 4096, GdrMode::kDmabuf, false, 0);
  EXPECT_EQ(r.mr, nullptr);
  EXPECT_EQ(gm.exports, 0);
  EXPECT_NE(r.why.find("beyond its allocation"), std::string::npos) << r.why;
}

// --- Sends and receives of GPU memory (SyncDevice) --------------------------------------------

struct SyncDevice {
  static inline std::atomic<int> flushes{0}, copies{0};
  struct Event {
    std::atomic<int> pendingPolls{0};
  };
  static const char* errorString(int) { return "fake device error"; }
  static int ok1(int* n) { return *n = 1, 0; }
  static int setDevice(int d) { return d == 0 ? 0 : 101; }
  static int getDevice(int* d) { return *d = 0, 0; }
  static int pointerDevice(const void*, int* d) { return *d = 0, 0; }
  static int hostAlloc(void** p, size_t n) { return *p = std::malloc(n ? n : 1), 0; }
  static int hostFree(void* p) { return std::free(p), 0; }
  static int streamCreate(void** s) { return *s = new int(0), 0; }
  static int streamDestroy(void* s) { return delete static_cast<int*>(s), 0; }
  static int streamSynchronize(void*) { return 0; }
  static int eventCreate(void** e) { return *e = new Event, 0; }
  static int eventDestroy(void* e) { return delete static_cast<Event*>(e), 0; }
  static int eventRecord(void*, void*) { return 0; }
  // An event answers "not ready" as often as it was told to (the caller's stream still busy).
  static int eventQuery(void* e) {
    auto* ev = static_cast<Event*>(e);
    return ev->pendingPolls.load() > 0 && ev->pendingPolls.fetch_sub(1) > 0 ? 600 : 0;
  }
  static int streamWaitEvent(void*, void*) { return 0; }
  static int memcpyAsync(void* d, const void* s, size_t n, void*) {
    ++copies;
    if (n) std::memcpy(d, s, n);
    return 0;
  }
  static int flush() { return ++flushes, 0; }
  static cuda::DeviceApi api() {
    cuda::DeviceApi a{};
    a.version = cuda::kDeviceApiVersion;
    a.name = "synchronous fake device (host memory)";
    a.notReady = 600;
    a.errorString = errorString;
    a.deviceCount = ok1;
    a.setDevice = setDevice;
    a.getDevice = getDevice;
    a.pointerDevice = pointerDevice;
    a.hostAlloc = hostAlloc;
    a.hostFree = hostFree;
    a.streamCreate = streamCreate;
    a.streamDestroy = streamDestroy;
    a.streamSynchronize = streamSynchronize;
    a.eventCreate = eventCreate;
    a.eventDestroy = eventDestroy;
    a.eventRecord = eventRecord;
    a.eventQuery = eventQuery;
    a.streamWaitEvent = streamWaitEvent;
    a.memcpyAsync = memcpyAsync;
    a.flushRdmaWrites = flush;  // no dma-buf export: registrations go the nvidia_peermem way
    return a;
  }
};
const cuda::DeviceApi kSync = SyncDevice::api();

struct UseSyncDevice {
  UseSyncDevice() { setDeviceApiForTesting(&kSync); }
  ~UseSyncDevice() { setDeviceApiForTesting(nullptr); }
};

uint8_t pattern(size_t i, size_t n) { return static_cast<uint8_t>((i * 131 + n) % 251); }

// Rank 0 sends each size from "GPU" memory to rank 1's "GPU" memory, then rank 1 answers from
// plain host memory into rank 0's GPU memory, and the GPU buffers are checked byte for byte.
// Host buffers start as garbage, so a byte that skipped its copy shows. Returns per size
// whether each side moved it directly: [size][0 = rank 0's send, 1 = rank 1's receive, 2 =
// rank 0's receive of the answer].
std::vector<std::array<bool, 3>> sendGpuMemory(const Config& cfg, const std::vector<size_t>& sizes,
                                               const std::function<void(int, Config&)>& perRank,
                                               int receiverPolls = 3) {
  std::vector<std::array<bool, 3>> direct(sizes.size());
  testing_util::runRanks(2, cfg, "gpu-direct", [&](Communicator& c) {
    for (size_t k = 0; k < sizes.size(); ++k) {
      const size_t n = sizes[k];
      std::vector<uint8_t> gpu(n + 1, 0), host(n + 1, 0xEE);
      auto side = std::make_shared<DeviceSide>();
      side->gpu = reinterpret_cast<char*>(gpu.data());
      side->device = 0;
      SyncDevice::Event ready;
      // The caller's stream reaches the call a little later (or, with `receiverPolls` large, the
      // receiver's not within the test: a receive through host memory must not wait for it).
      ready.pendingPolls = c.rank() == 0 ? 3 : receiverPolls;
      side->ready = &ready;
      if (c.rank() == 0) {
        for (size_t i = 0; i < n; ++i) gpu[i] = pattern(i, n);
        ASSERT_TRUE(c.wait(c.send(host.data(), n, 1, 5, Millis(0), side)));
        direct[k][0] = side->direct;
        if (!side->direct) EXPECT_EQ(std::memcmp(host.data(), gpu.data(), n), 0) << n << " B: not staged";
        // The answer, from host memory into this GPU buffer.
        std::fill(gpu.begin(), gpu.end(), 0);
        auto back = std::make_shared<DeviceSide>();
        back->gpu = reinterpret_cast<char*>(gpu.data());
        back->device = 0;
        std::fill(host.begin(), host.end(), 0xEE);
        ASSERT_TRUE(c.wait(c.recv(host.data(), n, 1, 6, Millis(0), back)));
        direct[k][2] = back->direct;
        if (!back->direct && n) std::memcpy(gpu.data(), host.data(), n);  // the glue's copy in
      } else {
        ASSERT_TRUE(c.wait(c.recv(host.data(), n, 0, 5, Millis(0), side)));
        direct[k][1] = side->direct;
        if (!side->direct && n) std::memcpy(gpu.data(), host.data(), n);
        std::vector<uint8_t> answer(gpu.begin(), gpu.end());
        ASSERT_TRUE(c.wait(c.send(answer.data(), n, 0, 6)));
      }
      for (size_t i = 0; i < n; ++i)
        if (gpu[i] != pattern(i, n)) FAIL() << "rank " << c.rank() << ", " << n << " B: byte " << i << " is wrong";
      EXPECT_EQ(gpu[n], 0) << "rank " << c.rank() << ", " << n << " B: a byte past the end was written";
    }
  }, perRank);
  return direct;
}

const std::vector<size_t> kSizes = {0, 1, 4093, 300001, size_t(3) << 20};

// Every rank a host of its own: whatever crosses between ranks goes over the network.
void ownHost(int r, Config& c) { c.hostId = "gpu-direct-host-" + std::to_string(r); }

// RAILCC_NET=verbs with a 256 KiB ring: send/recv of a ring or more goes by rendezvous.
Config overVerbs() {
  Config cfg = Config::defaults();
  cfg.net = "verbs";
  cfg.initTimeoutSec = 120;
  cfg.buffSize = 256 << 10;
  return cfg;
}

TEST(GpuDirectSendRecv, OverSharedMemoryAndTcpEveryByteGoesThroughHostMemory) {
  UseSyncDevice dev;
  for (bool shm : {true, false}) {
    Config cfg = Config::defaults();
    cfg.initTimeoutSec = 30;
    cfg.buffSize = 64 << 10;
    auto direct = sendGpuMemory(cfg, kSizes, [shm](int r, Config& c) {
      if (!shm) ownHost(r, c);
    });
    for (size_t k = 0; k < kSizes.size(); ++k)
      for (bool d : direct[k]) EXPECT_FALSE(d) << (shm ? "shm " : "tcp ") << kSizes[k] << " B";
  }
}

// A send whose caller's stream never reaches the call times out naming this rank's GPU, not the
// peer (which is waiting too, and says so of the sender).
TEST(GpuDirectSendRecv, ASendWhoseStreamNeverGetsThereNamesThisRanksGpu) {
  UseSyncDevice dev;
  Config cfg = Config::defaults();
  cfg.initTimeoutSec = 30;
  testing_util::runRanks(2, cfg, "gpu-direct-stall", [](Communicator& c) {
    std::vector<uint8_t> host(4096), gpu(4096);
    auto side = std::make_shared<DeviceSide>();
    side->gpu = reinterpret_cast<char*>(gpu.data());
    side->device = 0;
    SyncDevice::Event busy;
    busy.pendingPolls = 1 << 30;
    side->ready = &busy;
    RequestPtr req = c.rank() == 0 ? c.send(host.data(), host.size(), 1, 4, Millis(1500), side)
                                   : c.recv(host.data(), host.size(), 0, 4, Millis(1500));
    auto e = testing_util::failureOf(req);
    ASSERT_TRUE(e) << "rank " << c.rank() << " did not fail with a railcc error";
    std::string m = e->what();
    if (c.rank() == 0) {
      EXPECT_EQ(e->code(), ErrorCode::kTimeout) << m;
      EXPECT_NE(m.find("waiting for this rank's GPU: the caller's CUDA stream on cuda:0"), std::string::npos) << m;
      EXPECT_EQ(e->ranks, std::vector<int>{0}) << m;
    } else {
      EXPECT_EQ(m.find("this rank's GPU"), std::string::npos) << m;  // its wait is on rank 0
    }
    c.abort("test done");
  });
}

// --- Over real verbs (the Soft-RoCE VM) -------------------------------------------------------

TEST(GpuDirectVerbs, RendezvousMovesGpuMemoryStraightWhereTheNicTakesIt) {
  std::string why;
  auto devs = openDevices(Config::defaults(), &why);
  if (devs.empty()) GTEST_SKIP() << "no RDMA device here (the Soft-RoCE VM runs this)";
  UseSyncDevice dev;
  // No GPU in the VM: the decision is forced to nvidia_peermem for "GPU 0", whose memory here is
  // host memory, which a plain registration takes.
  for (auto& d : devs) d->setGdr(0, GdrMode::kPeermem, true);
  const uint64_t gpuBytes = stat(Stat::kGpuDirect), flushes = SyncDevice::flushes;
  auto direct = sendGpuMemory(overVerbs(), kSizes, ownHost);
  uint64_t expectGpu = 0, expectFlushes = 0;
  for (size_t k = 0; k < kSizes.size(); ++k) {
    const bool large = kSizes[k] >= (size_t(256) << 10);
    for (bool d : direct[k]) EXPECT_EQ(d, large) << kSizes[k] << " B";
    if (large) expectGpu += 3 * kSizes[k], expectFlushes += 2;  // exposed once, read into GPU memory twice
  }
  EXPECT_EQ(stat(Stat::kGpuDirect) - gpuBytes, expectGpu);
  EXPECT_EQ(SyncDevice::flushes - flushes, expectFlushes);
  for (auto& d : devs) d->setGdr(0, GdrMode::kStaged, false);
}

TEST(GpuDirectVerbs, AStagedDecisionKeepsGpuMemoryOffTheNic) {
  std::string why;
  auto devs = openDevices(Config::defaults(), &why);
  if (devs.empty()) GTEST_SKIP() << "no RDMA device here (the Soft-RoCE VM runs this)";
  UseSyncDevice dev;
  for (auto& d : devs) d->setGdr(0, GdrMode::kStaged, false);
  const uint64_t gpuBytes = stat(Stat::kGpuDirect);
  // The receiver's stream stays busy throughout: through host memory nothing waits for it.
  auto direct = sendGpuMemory(overVerbs(), kSizes, ownHost, 1 << 30);
  for (size_t k = 0; k < kSizes.size(); ++k)
    for (bool d : direct[k]) EXPECT_FALSE(d) << kSizes[k] << " B";
  EXPECT_EQ(stat(Stat::kGpuDirect), gpuBytes);
}

}  // namespace
