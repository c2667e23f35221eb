#pragma once
// FakeDeviceApi is a fake, named so: there is no GPU on the machines that run this suite, so
// "device memory" is host memory. What it does keep from a real GPU is the part the engine's
// device logic can get wrong: copies are only queued by memcpyAsync and run, in stream order,
// when an event recorded after them is polled (which first answers "not ready"), so a chunk
// used before its copy was waited for, or a result not copied back before the op completes,
// shows up as wrong data. A stream's wait on another rank's event runs that rank's stream up to
// the event first, so a missing cross-rank wait shows up the same way; IPC handles carry plain
// pointers (ranks are threads here). A one-kernel collective runs the host build of
// cuda/shots.h, a thread per block, once its stream reaches it. A stream can be captured into a
// graph (beginCapture .. endCapture) and the graph replayed, each replay a fresh run of what was
// captured with the arguments it was captured with, as in CUDA; what CUDA forbids during a
// capture (querying or waiting on the host for captured work, waiting on work from outside
// it) fails and is counted in gCaptureViolations. The real runtime behind the same table is
// csrc/cuda/plugin.cu. Used by staging_test.cpp and shot_engine_test.cpp.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/types.h"
#include "cuda/device_api.h"
#include "cuda/shots.h"

namespace railcc::engine::fake_device {

constexpr int kNotReady = 600;

// One lock for every fake stream: a stream that waits on another's event drains that one
// from inside its own drain, and ranks are threads.
inline std::recursive_mutex gFakeMu;

// Memory handles opened and closed so far (every mapping is closed once: opened == closed
// when nothing is mapped), and a pointer whose handle fails to open (a peer that cannot map it).
inline std::atomic<int> gMemOpened{0}, gMemClosed{0};
inline std::atomic<void*> gRefuseOpen{nullptr};

// While set, a stream stops at its "kernel that never finishes" (Fake::hangAsync).
inline std::atomic<bool> gHung{false};
inline std::atomic<long> gShotLaunches{0};       // one-kernel collectives launched
inline std::atomic<int> gShotBlocksRunning{0};  // their blocks started and not finished
inline std::atomic<long> gQueries{0};  // eventQuery calls: how often somebody asked the "GPU"
inline std::atomic<long> gCaptureViolations{0};  // calls CUDA refuses while a stream is captured
constexpr int kCaptureError = 900;               // cudaErrorStreamCaptureUnsupported's stand-in

// A captured graph: what each step of the captured stream would enqueue, made afresh per replay.
using FakeGraph = std::vector<std::function<std::function<bool()>()>>;

struct FakeStream;
inline std::vector<FakeStream*> gStreams;  // the live ones, which a wait on a value may drive

struct FakeStream {
  FakeStream() {
    std::lock_guard<std::recursive_mutex> g(gFakeMu);
    gStreams.push_back(this);
  }
  ~FakeStream() {
    std::lock_guard<std::recursive_mutex> g(gFakeMu);
    gStreams.erase(std::remove(gStreams.begin(), gStreams.end(), this), gStreams.end());
  }
  FakeStream(const FakeStream&) = delete;
  FakeStream& operator=(const FakeStream&) = delete;
  std::deque<std::function<bool()>> q;  // an entry returns false while it cannot run yet (a wait)
  uint64_t queued = 0, done = 0;
  uint64_t hangAt = ~uint64_t(0);  // position of a kernel that never finishes
  bool draining = false;           // drain() is running it (a wait may lead back here)
  bool waitingValue = false;       // its next entry waits on a value another stream will write
  FakeGraph* capture = nullptr;    // being captured into this graph
  uint64_t capturedFrom = 0;       // `queued` when the capture began
};
struct FakeEvent {
  FakeEvent* alias = nullptr;  // an event opened from an IPC handle refers to the original
  FakeStream* s = nullptr;
  uint64_t at = 0;
  int polls = 0;
  bool captured = false;  // its last record was captured (it marks a node, not a time)
  FakeEvent* self() { return alias ? alias : this; }
};
// Destroyed streams and events, kept to the end of the process: a stream that waits on
// another rank's event may look at it after that rank's teardown (the work it waits for is
// done; on a GPU the wait is then a no-op), and the fake must not read freed memory there.
inline std::vector<std::unique_ptr<FakeStream>> gDeadStreams;
inline std::vector<std::unique_ptr<FakeEvent>> gDeadEvents;

struct Fake {
  static const char* errorString(int) { return "fake device error"; }
  static int deviceCount(int* n) { return *n = 1, 0; }
  static int setDevice(int d) { return d == 0 ? 0 : 101; }
  static int getDevice(int* d) { return *d = 0, 0; }
  static int pointerDevice(const void*, int* d) { return *d = 0, 0; }
  static int hostAlloc(void** p, size_t n) {
    *p = std::malloc(n);
    std::memset(*p, 0xAB, n);  // stale bytes, not zeros: unstaged data must not pass
    return 0;
  }
  static int hostFree(void* p) { return std::free(p), 0; }
  static int streamCreate(void** s) { return *s = new FakeStream, 0; }
  static int streamDestroy(void* s) {
    std::lock_guard<std::recursive_mutex> g(gFakeMu);
    gStreams.erase(std::remove(gStreams.begin(), gStreams.end(), static_cast<FakeStream*>(s)), gStreams.end());
    gDeadStreams.emplace_back(static_cast<FakeStream*>(s));
    return 0;
  }
  // Runs the stream as far as it can go; while a one-kernel op's blocks run somewhere (they
  // may be what it waits for), it keeps polling, as the GPU would go on by itself, for at most
  // a minute. A hung kernel or a wait that nothing will satisfy stops it.
  static int streamSynchronize(void* s) {
    auto* st = static_cast<FakeStream*>(s);
    {
      std::lock_guard<std::recursive_mutex> g(gFakeMu);
      if (st->capture) return gCaptureViolations.fetch_add(1), kCaptureError;
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::minutes(1);
    // Stuck: nothing left to run here moves and no kernel runs anywhere, twice in a row (a
    // kernel's blocks may finish between its step's last look and this one: the next drain
    // takes it off and starts what follows, so one such look proves nothing).
    int still = 0;
    for (;;) {
      uint64_t before;
      {
        std::lock_guard<std::recursive_mutex> g(gFakeMu);
        before = st->done;
      }
      drain(st, ~uint64_t(0));
      {
        std::lock_guard<std::recursive_mutex> g(gFakeMu);
        if (st->q.empty()) return 0;
        // A wait on a value (this stream's, or one this stream waits behind through an event)
        // may be met once another rank's thread queues the write: not stuck.
        const bool valueWait =
            std::any_of(gStreams.begin(), gStreams.end(), [](const FakeStream* o) { return o->waitingValue; });
        still = gShotBlocksRunning.load() == 0 && !valueWait && st->done == before ? still + 1 : 0;
        if (still >= 2) return 0;
      }
      if (std::chrono::steady_clock::now() > until) return 0;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  static int eventCreate(void** e) { return *e = new FakeEvent, 0; }
  static int eventDestroy(void* e) {
    std::lock_guard<std::recursive_mutex> g(gFakeMu);
    gDeadEvents.emplace_back(static_cast<FakeEvent*>(e));
    return 0;
  }
  static int eventRecord(void* e, void* s) {
    std::lock_guard<std::recursive_mutex> g(gFakeMu);
    auto* ev = static_cast<FakeEvent*>(e)->self();
    auto* st = static_cast<FakeStream*>(s);
    ev->s = st;
    ev->at = st->queued;
    ev->captured = st->capture != nullptr;
    return 0;
  }
  static int eventQuery(void* e) {
    std::lock_guard<std::recursive_mutex> g(gFakeMu);
    gQueries.fetch_add(1);
    auto* ev = static_cast<FakeEvent*>(e)->self();
    if (ev->captured || (ev->s && ev->s->capture)) return gCaptureViolations.fetch_add(1), kCaptureError;
    if (!ev->s) return 0;
    if (++ev->polls % 2 == 1) return kNotReady;
    drain(ev->s, ev->at);
    return ev->s->done >= ev->at ? 0 : kNotReady;
  }
  // A kernel that runs until gHung is cleared (a test's stand-in for torch.cuda._sleep).
  static void hangAsync(void* s) {
    std::lock_guard<std::recursive_mutex> g(gFakeMu);
    static_cast<FakeStream*>(s)->hangAt = static_cast<FakeStream*>(s)->queued;
    enqueue(s, [] {});
  }
  // The wait binds to the event's latest record at the time of the call, as in CUDA.
  static int streamWaitEvent(void* s, void* e) {
    std::lock_guard<std::recursive_mutex> g(gFakeMu);
    auto* ev = static_cast<FakeEvent*>(e)->self();
    FakeStream* src = ev->s;
    uint64_t at = ev->at;
    auto* st = static_cast<FakeStream*>(s);
    // A captured stream may wait on work captured into the same graph only (the join of a side
    // stream); an event recorded outside the capture is refused, as CUDA refuses it.
    if (st->capture && src && src != st && !ev->captured) return gCaptureViolations.fetch_add(1), kCaptureError;
    if (st->capture && ev->captured) return 0;  // within one graph: the fake's graph is one stream
    // A stream behind a wait does not pass it until the other stream has (a hung kernel there
    // holds this one too, as on a GPU), whatever order the ranks' threads query them in.
    if (src && src != s) enqueueStep(s, [src, at] { return drain(src, at), src->done >= at; });
    return 0;
  }
  // Stream memory operations: the write runs in stream order; the wait holds its stream until
  // the value is there, driving every other stream meanwhile (on a GPU the peers' streams run
  // by themselves; here they run when polled, and the one that writes may be nobody's current).
  static int streamWriteValue64(void* s, void* addr, uint64_t v) {
    return enqueue(s, [=] { __atomic_store_n(static_cast<uint64_t*>(addr), v, __ATOMIC_RELEASE); }), 0;
  }
  static int streamWaitValue64(void* s, void* addr, uint64_t v) {
    std::lock_guard<std::recursive_mutex> g(gFakeMu);
    if (static_cast<FakeStream*>(s)->capture) return gCaptureViolations.fetch_add(1), kCaptureError;
    auto* me = static_cast<FakeStream*>(s);
    enqueueStep(s, [me, addr, v] {
      auto there = [&] { return __atomic_load_n(static_cast<const uint64_t*>(addr), __ATOMIC_ACQUIRE) >= v; };
      if (!there())
        for (FakeStream* o : gStreams)  // under gFakeMu (drain holds it)
          if (o != me) drain(o, ~uint64_t(0));
      me->waitingValue = !there();
      return !me->waitingValue;
    });
    return 0;
  }
  static int memcpyAsync(void* dst, const void* src, size_t n, void* s) {
    return enqueue(s, [=] { std::memcpy(dst, src, n); }), 0;
  }
  static int deviceMalloc(void** p, size_t n) { return hostAlloc(p, n); }
  static int deviceFree(void* p) { return hostFree(p); }
  static int canAccessPeer(int, int, int* can) { return *can = 1, 0; }
  // Ranks are threads of one process, so a handle can simply carry the pointer.
  static int ipcGetMemHandle(void* h, void* p) { return std::memcpy(h, &p, sizeof(p)), 0; }
  static int ipcOpenMemHandle(void** p, const void* h) {
    void* q = nullptr;
    std::memcpy(&q, h, sizeof(q));
    if (q != nullptr && q == gRefuseOpen.load()) return 1;
    *p = q;
    ++gMemOpened;
    return 0;
  }
  static int ipcCloseMemHandle(void*) { return ++gMemClosed, 0; }
  static int ipcGetEventHandle(void* h, void* e) { return std::memcpy(h, &e, sizeof(e)), 0; }
  static int ipcOpenEventHandle(void** e, const void* h) {
    FakeEvent* orig = nullptr;
    std::memcpy(&orig, h, sizeof(orig));
    auto* ev = new FakeEvent;
    ev->alias = orig;
    return *e = ev, 0;
  }
  static int reduceAsync(void* dst, const void* src, size_t n, DataType t, ReduceOp op, double scale, void* s) {
    return enqueue(s, [=] { reduceInto(dst, src, n, t, op, scale); }), 0;
  }
  static int divideAsync(void* buf, size_t n, DataType t, double by, void* s) {
    return enqueue(s, [=] { divideBy(buf, n, t, by); }), 0;
  }
  static int scaleCopyAsync(void* dst, const void* src, size_t n, DataType t, double scale, void* s) {
    return enqueue(s, [=] { scaleCopy(dst, src, n, t, scale); }), 0;
  }
  // The one-kernel all-reduce: started when the stream reaches it (its earlier work done), a
  // thread per block running the host build of cuda/shots.h, done when every block is.
  struct ShotBlocks {
    std::vector<std::thread> threads;
    std::atomic<int> done{0};
    bool started = false;
    ~ShotBlocks() {
      for (auto& t : threads) t.join();
    }
  };
  struct ShotLaunch {
    cuda::ShotArgs a;
    cuda::ShotKind k;
    int blocks;
    void* s;
    template <typename T, typename Op>
    int run() const {
      // A factory of the kernel's step: a replayed graph runs the kernel afresh each time.
      enqueueMade(s, [a = a, k = k, blocks = blocks]() -> std::function<bool()> {
        auto st = std::make_shared<ShotBlocks>();
        return [a, k, blocks, st] {
        if (!st->started) {
          st->started = true;
          gShotBlocksRunning.fetch_add(blocks);
          for (int b = 0; b < blocks; ++b)
            st->threads.emplace_back([a, k, blocks, b, st = st.get()] {
              const uint64_t deadline = cuda::signalNow() + a.timeoutNs;
              cuda::shotBlock<T, Op>(k, a, b, blocks, cuda::ShotThreads{0, 1}, deadline);
              st->done.fetch_add(1);
              gShotBlocksRunning.fetch_sub(1);
            });
        }
        return st->done.load() == blocks;
        };
      });
      return 0;
    }
    template <typename U>
    int move() const {
      return run<U, cuda::ShotSum>();  // shotBlock() picks the moving kind's body
    }
  };
  static int shotAsync(const cuda::ShotArgs* a, DataType t, cuda::ShotKind k, int blocks, void* s) {
    gShotLaunches.fetch_add(1);
    if (!cuda::shotArgsValid(*a, k, blocks)) return 1;
    return cuda::shotDispatch<void, void>(k, t, a->op, ShotLaunch{*a, k, blocks, s}, 1);
  }
  static void enqueue(void* s, std::function<void()> f) {
    enqueueStep(s, [f = std::move(f)] { return f(), true; });
  }
  static void enqueueStep(void* s, std::function<bool()> f) {
    enqueueMade(s, [f = std::move(f)] { return f; });
  }
  static void enqueueMade(void* s, std::function<std::function<bool()>()> make) {
    std::lock_guard<std::recursive_mutex> g(gFakeMu);
    auto* st = static_cast<FakeStream*>(s);
    if (st->capture) {
      st->capture->push_back(std::move(make));
      ++st->queued;  // events recorded after it mark a later node
      return;
    }
    st->q.push_back(make());
    ++st->queued;
  }
  // torch.cuda.graph's side, for the tests: capture `s` into `g`, then replay `g` onto `s`.
  static int streamCapturing(void* s, int* capturing) {
    std::lock_guard<std::recursive_mutex> g(gFakeMu);
    return *capturing = static_cast<FakeStream*>(s)->capture ? 1 : 0, 0;
  }
  static int exchangeCaptureMode(int*) { return 0; }
  static void beginCapture(void* s, FakeGraph* g) {
    streamSynchronize(s);  // the stream is idle: its count of queued steps is its count of done ones
    std::lock_guard<std::recursive_mutex> l(gFakeMu);
    auto* st = static_cast<FakeStream*>(s);
    st->capture = g;
    st->capturedFrom = st->queued;
  }
  static void endCapture(void* s) {
    std::lock_guard<std::recursive_mutex> l(gFakeMu);
    auto* st = static_cast<FakeStream*>(s);
    st->capture = nullptr;
    st->queued = st->capturedFrom;  // the graph's nodes never ran on the stream itself
  }
  static void replay(const FakeGraph& g, void* s) {
    for (auto& make : g) enqueueMade(s, make);
  }
  // Runs `s` up to position `upTo`, stopping at a hung kernel or a wait not satisfied yet. A
  // drain that reaches back into a stream being drained returns at once: what that stream has
  // done so far is what the wait sees.
  static void drain(FakeStream* s, uint64_t upTo) {
    std::lock_guard<std::recursive_mutex> g(gFakeMu);
    if (s->draining) return;
    s->draining = true;
    while (s->done < upTo && !s->q.empty()) {
      if (s->done == s->hangAt && gHung) break;
      if (!s->q.front()()) break;
      s->q.pop_front();
      ++s->done;
    }
    s->draining = false;
  }
};

inline const cuda::DeviceApi kFake = {
    cuda::kDeviceApiVersion, "fake device (host memory)", kNotReady, Fake::errorString, Fake::deviceCount,
    Fake::setDevice, Fake::getDevice, Fake::pointerDevice, Fake::hostAlloc, Fake::hostFree, Fake::streamCreate,
    Fake::streamDestroy, Fake::streamSynchronize, Fake::eventCreate, Fake::eventDestroy, Fake::eventRecord,
    Fake::eventQuery, Fake::streamWaitEvent, Fake::memcpyAsync, Fake::deviceMalloc, Fake::deviceFree,
    Fake::canAccessPeer, Fake::ipcGetMemHandle, Fake::ipcOpenMemHandle, Fake::ipcCloseMemHandle, Fake::eventCreate,
    Fake::ipcGetEventHandle, Fake::ipcOpenEventHandle, Fake::reduceAsync, Fake::divideAsync, Fake::scaleCopyAsync,
    nullptr, nullptr, nullptr, Fake::shotAsync, Fake::streamCapturing, Fake::exchangeCaptureMode,
    Fake::streamWriteValue64, Fake::streamWaitValue64,
};

}  // namespace railcc::engine::fake_device
