#include "common/log.h"
#include "common/waits.h"
#include "engine/comm_impl.h"

namespace railcc::engine {

namespace {
thread_local bool tCallerWaits = false;
}  // namespace

CallerWaits::CallerWaits(bool on) : prev_(tCallerWaits) { tCallerWaits = on; }
CallerWaits::~CallerWaits() { tCallerWaits = prev_; }
bool CallerWaits::active() { return tCallerWaits; }

// ---------------------------------------------------------------------------------------
// Request

// doneFlag_ is set (release) under mu_ after done_ and error_: a reader that sees it (acquire)
// sees them too, without the lock.
bool Request::completed() const { return doneFlag_.load(std::memory_order_acquire); }

bool Request::wait(Millis timeout) {
  // Small ops finish within microseconds of being queued: poll briefly before blocking.
  if (pollFor(spinUs_, [&] { return doneFlag_.load(std::memory_order_acquire); })) return true;
  std::unique_lock<std::mutex> g(mu_);
  if (timeout.count() < 0) {
    cv_.wait(g, [&] { return done_; });
    return true;
  }
  return cv_.wait_for(g, boundedWait(timeout), [&] { return done_; });
}

std::exception_ptr Request::error() const {
  if (doneFlag_.load(std::memory_order_acquire)) return error_;  // written once, before the flag
  std::lock_guard<std::mutex> g(mu_);
  return error_;
}

void Request::onComplete(std::function<void()> cb) {
  if (doneFlag_.load(std::memory_order_acquire)) {  // finished for good: no lock needed
    cb();
    return;
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!done_) {
      callbacks_.push_back(std::move(cb));
      return;
    }
  }
  cb();
}

void Request::runUserCode(std::function<void()> fn) {
  if (pool_ && CallbackPool::onEngineThread()) pool_->post(std::move(fn));
  else fn();
}

void Request::finish(std::exception_ptr err) {
  std::vector<std::function<void()>> cbs;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (done_) return;
    done_ = true;
    if (!err) err = straggler_;
    error_ = err;
    doneFlag_.store(true, std::memory_order_release);
    cbs.swap(callbacks_);
  }
  cv_.notify_all();
  for (auto& cb : cbs) {
    try {
      cb();
    } catch (const std::exception& e) {
      RAILCC_WARN(COLL, "completion callback threw: ", e.what());
    } catch (...) {
      RAILCC_WARN(COLL, "completion callback threw");
    }
  }
}

}  // namespace railcc::engine
