#include "engine/callback_pool.h"

#include <system_error>
#include <thread>

#include "common/log.h"

namespace railcc::engine {

namespace {
thread_local bool tEngineThread = false;
// An idle thread exits after this long; the next post() starts one again (tens of
// microseconds), so a training loop keeps its thread and an idle group holds none for long.
constexpr std::chrono::seconds kIdleExit(2);
}  // namespace

bool CallbackPool::onEngineThread() { return tEngineThread; }
void CallbackPool::markEngineThread() { tEngineThread = true; }

CallbackPool::CallbackPool(int rank) : s_(std::make_shared<State>()), rank_(rank) {}

CallbackPool::~CallbackPool() { shutdown(std::chrono::milliseconds(2000)); }

void CallbackPool::post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> g(s_->mu);
    if (!s_->stop) {
      s_->queue.push_back(std::move(fn));
      if (s_->idle >= static_cast<int>(s_->queue.size())) {
        s_->cv.notify_one();
        return;
      }
      // Every thread is busy (maybe waiting on an op whose completion is this very post):
      // one more, or the callbacks could wait on each other forever.
      try {
        std::thread(loop, s_, rank_).detach();
        ++s_->threads;
      } catch (const std::system_error& e) {
        RAILCC_WARN(COLL, "could not start a callback thread (", e.what(), "); ", s_->threads,
                    " are busy, the callback waits for one of them");
      }
      return;
    }
  }
  fn();  // shut down: nobody else will run it
}

void CallbackPool::loop(std::shared_ptr<State> s, int rank) {
  log::setThreadRank(rank);
  std::unique_lock<std::mutex> g(s->mu);
  while (true) {
    if (s->queue.empty()) {
      if (s->stop) break;
      ++s->idle;
      bool got = s->cv.wait_for(g, kIdleExit, [&] { return !s->queue.empty() || s->stop; });
      --s->idle;
      if (!got) break;
      continue;
    }
    std::function<void()> fn = std::move(s->queue.front());
    s->queue.pop_front();
    g.unlock();
    try {
      fn();
    } catch (const std::exception& e) {
      RAILCC_WARN(COLL, "completion callback threw: ", e.what());
    } catch (...) {
      RAILCC_WARN(COLL, "completion callback threw");
    }
    fn = nullptr;  // whatever it captured goes before the lock is taken again
    g.lock();
  }
  --s->threads;
  s->cv.notify_all();
}

void CallbackPool::shutdown(std::chrono::milliseconds grace) {
  std::unique_lock<std::mutex> g(s_->mu);
  if (s_->stop && s_->threads == 0) return;
  s_->stop = true;
  s_->cv.notify_all();
  if (!s_->cv.wait_for(g, grace, [&] { return s_->threads == 0; }))
    RAILCC_WARN(COLL, s_->threads, " completion callback thread(s) still running after ", grace.count(),
                " ms at shutdown; leaving them behind");
}

}  // namespace railcc::engine
