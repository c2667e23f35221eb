#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

namespace railcc::engine {

/// Threads that run user code on completion (c10d Future callbacks, DDP comm hooks) for one
/// communicator, so that it never runs on a thread the engine needs. A callback may block and
/// wait on other ops of the same communicator (PowerSGD's hook does): when every thread is
/// busy in such a wait, post() starts another, so a chain of callbacks that each wait on the
/// next op never starves. Threads that stay idle for a while exit; shutdown() waits for all.
class CallbackPool {
 public:
  explicit CallbackPool(int rank);
  ~CallbackPool();
  CallbackPool(const CallbackPool&) = delete;
  CallbackPool& operator=(const CallbackPool&) = delete;

  /// Queues `fn`. Thread-safe; blocks: no. After shutdown() it runs `fn` on the caller.
  void post(std::function<void()> fn);
  /// Runs what is queued, then waits up to `grace` for every thread to exit; threads still in a
  /// callback then are left to finish alone (they hold only the pool's shared state).
  /// Idempotent.
  void shutdown(std::chrono::milliseconds grace);

  /// True on a thread that must not run user code (set by the progress thread for itself).
  static bool onEngineThread();
  static void markEngineThread();

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> queue;
    int threads = 0, idle = 0;
    bool stop = false;
  };
  static void loop(std::shared_ptr<State> s, int rank);
  std::shared_ptr<State> s_;
  int rank_;
};

}  // namespace railcc::engine
