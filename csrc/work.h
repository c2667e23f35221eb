#pragma once
// c10d glue: WorkRailcc, the c10d Work of one call: the engine requests behind it, its
// tensors, its Future (made on demand for CPU tensors), and wait() with ProcessGroupNCCL's
// stream semantics on CUDA tensors. Included by backend.cpp only (one torch translation unit).

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <atomic>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "backend.h"
#include "common/error.h"

namespace railcc {

class WorkRailcc : public c10d::Work {
  using OpType = c10d::OpType;
  using RequestPtr = engine::RequestPtr;
  using Millis = engine::Millis;

 public:
  WorkRailcc(int rank, OpType type, const char* name, uint64_t seq, std::vector<RequestPtr> reqs,
             std::vector<at::Tensor> outputs, std::vector<at::Tensor> keep, engine::Communicator* comm,
             DeviceCallPtr dev, std::function<void()> after)
      : c10d::Work(rank, type),
        name_(name),
        seq_(seq),
        reqs_(std::move(reqs)),
        outputs_(std::move(outputs)),
        keep_(std::move(keep)),
        comm_(comm),
        dev_(std::move(dev)),
        after_(std::move(after)),
        sync_(engine::CallerWaits::active()) {
    // On CPU tensors the future is made when somebody asks for it (most synchronous calls
    // never do); on CUDA tensors it is made now and completed from the engine's side.
    if (dev_) future_ = newFuture();
    // A synchronous call on CPU tensors: its caller holds them until wait() returns, so the
    // work only needs to find them again for result(). A strong reference dropped here,
    // without the GIL, would take the GIL to release the tensor's Python object: one more
    // GIL round trip per call for nothing.
    if (weak()) {
      for (auto& t : outputs_) weakOutputs_.emplace_back(t.getIntrusivePtr());
      outputs_.clear();
      keep_.clear();
    }
  }

  ~WorkRailcc() override {
    // Only weak references to the caller's tensors: an op that nobody waited for must not
    // write into them after they are gone (torch always waits for a synchronous call).
    if (weak() && !done_.load()) {
      try {
        for (auto& r : reqs_)
          if (!r->completed()) comm_->wait(r, Millis(-1));
      } catch (const std::exception&) {
      }
    }
  }

  // Called once all requests exist; hooks completion of the last one to the future.
  void arm() {
    remaining_.store(static_cast<int>(reqs_.size()));
    if (reqs_.empty()) {
      complete();
      return;
    }
    c10::intrusive_ptr<WorkRailcc> self = c10::intrusive_ptr<WorkRailcc>::reclaim_copy(this);
    for (auto& r : reqs_)
      r->onComplete([self] {
        if (self->remaining_.fetch_sub(1) == 1) self->complete();
      });
  }

  bool isCompleted() override {
    // A synchronous op is run by the caller's wait(); one that polls instead hands it over.
    if (sync_ && !done_.load()) comm_->poke();
    if (!done_.load()) return false;
    // As ProcessGroupNCCL: on CUDA tensors, completed means the GPU is done with the op too.
    if (dev_ && !error_) {
      try {
        return dev_->end->query();
      } catch (const std::exception&) {
        return true;  // the error shows at the next call on the device
      }
    }
    return true;
  }
  bool isSuccess() const override { return done_.load() && !error_; }
  std::exception_ptr exception() const override { return error_; }
  int sourceRank() const override {
    for (auto& r : reqs_)
      if (r->sourceRank() >= 0) return r->sourceRank();
    return -1;
  }
  std::vector<at::Tensor> result() override { return outputs(); }
  // The caller's current stream waits for the op; the CPU does not.
  void synchronize() override {
    if (dev_ && done_.load() && !error_) {
      c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
      dev_->end->block(impl.getStream(dev_->device));
    }
  }
  uint64_t getSequencenumber() const override { return seq_; }

  bool wait(std::chrono::milliseconds timeout) override {
    bool finished = true;
    for (auto& r : reqs_) {
      // kNoTimeout (0 ms) waits for the engine, which fails the op after its own timeout.
      // A completed request never touches comm_, which may be gone (the group destroyed).
      if (!r->completed() && !comm_->wait(r, timeout.count() <= 0 ? Millis(-1) : timeout)) {
        finished = false;
        break;
      }
    }
    if (!finished) {
      // The engine may still be writing into these buffers: stop it before handing the
      // buffers back, so a caller that frees them after catching this is safe.
      std::ostringstream os;
      os << name_ << " (seq " << seq_ << ") timed out: not complete within work.wait(timeout=" << timeout.count()
         << " ms); the process group has been aborted";
      comm_->abort(os.str());
      for (auto& r : reqs_) r->wait(Millis(-1));
      Error e(ErrorCode::kTimeout, os.str());
      e.seq = static_cast<long long>(seq_);
      e.op = name_;
      throw RailccError(e, "railcc: ");
    }
    while (!done_.load()) std::this_thread::yield();  // the completion callback is finishing
    // As with gloo, a waited work's future is complete too (it may be completing on the
    // group's callback threads). One not made yet is made complete when asked for.
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    {
      std::lock_guard<std::mutex> g(futMu_);
      fut = future_;
    }
    if (fut) fut->wait();
    if (error_) std::rethrow_exception(error_);
    synchronize();
    return true;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    if (sync_ && !done_.load()) comm_->poke();
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    {
      std::lock_guard<std::mutex> g(futMu_);
      if (future_) return future_;
      future_ = newFuture();
      if (!finished_) return future_;
      fut = future_;
    }
    completeFuture(fut, outputs(), error_, stream());  // the op ended before anybody asked
    return fut;
  }

 private:
  void complete() {
    std::exception_ptr err;
    for (auto& r : reqs_)
      if (r->error()) {
        err = toTorchError(r->error(), std::string("railcc ") + name_ + ": ");
        break;
      }
    if (!dev_) {
      finish(err);
      return;
    }
    // Runs on the progress thread. With the group's stream current (and its device set),
    // the end event and the future's events mark the point where the results are ready.
    try {
      c10::StreamGuard g(dev_->comm);
      if (!err && after_) {
        dev_->start->block(dev_->comm);
        // Not the caller's thread: no autograd here, and an inference tensor may be written.
        c10::InferenceMode noGrad;
        after_();
      }
      dev_->end->record(dev_->comm);
      finish(err);
    } catch (const std::exception& e) {
      if (!done_.load()) {
        Error ee(ErrorCode::kDevice, std::string("finishing on ") + dev_->device.str() + " failed: " + e.what());
        finish(std::make_exception_ptr(RailccError(ee, std::string("railcc ") + name_ + ": ")));
      }
    }
  }

  // A future on CUDA tensors carries its device, so then() callbacks and DDP comm hooks
  // wait for the group's stream instead of racing it.
  c10::intrusive_ptr<c10::ivalue::Future> newFuture() const {
    return c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::ofTensors(), dev_ ? std::vector<c10::Device>{dev_->device} : std::vector<c10::Device>{});
  }

  // The group's stream on CUDA tensors (the results are ready where it has come to).
  std::optional<c10::Stream> stream() const {
    return dev_ ? std::optional<c10::Stream>(dev_->comm) : std::nullopt;
  }

  static void completeFuture(const c10::intrusive_ptr<c10::ivalue::Future>& fut, const std::vector<at::Tensor>& outputs,
                             std::exception_ptr err, std::optional<c10::Stream> stream) {
    if (err) {
      fut->setError(err);
      return;
    }
    // markCompleted records the future's events and checks the tensors' devices; should it
    // throw, the future still ends (with that error), or its waiters would hang. It records
    // them on the calling thread's current stream: that must be the group's stream, or a
    // then() callback or DDP's reducer reads the results while the GPU still writes them
    // (this thread is a callback thread or the caller's, whose current stream is another).
    try {
      c10::OptionalStreamGuard onStream(stream);
      fut->markCompleted(c10::IValue(outputs));
    } catch (const std::exception&) {
      if (!fut->completed()) fut->setError(std::current_exception());
    }
  }

  void finish(std::exception_ptr err) {
    error_ = err;
    keep_.clear();
    after_ = nullptr;
    done_.store(true);
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    {
      std::lock_guard<std::mutex> g(futMu_);
      finished_ = true;
      fut = future_;
    }
    if (!fut) return;  // getFuture() will make it complete
    // Completing the future runs the user's then() callbacks and comm hooks, which may wait on
    // other ops of this group (PowerSGD does): never on the engine's progress thread.
    auto complete = [fut, outputs = outputs(), err, s = stream()] { completeFuture(fut, outputs, err, s); };
    if (reqs_.empty()) complete();
    else reqs_.front()->runUserCode(std::move(complete));
  }

  const char* name_;
  uint64_t seq_;
  std::vector<RequestPtr> reqs_;
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> keep_;
  // A synchronous CPU call keeps its outputs as weak references instead (see the constructor).
  bool weak() const { return sync_ && !dev_; }
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> weakOutputs_;
  std::vector<at::Tensor> outputs() const {
    if (!weak()) return outputs_;
    std::vector<at::Tensor> out;
    for (auto& w : weakOutputs_) {
      auto p = w.lock();
      if (p) out.emplace_back(std::move(p));
    }
    return out;
  }
  engine::Communicator* comm_;
  DeviceCallPtr dev_;
  std::function<void()> after_;  // on CUDA tensors: what runs on the group's stream once the engine is done
  const bool sync_;  // queued under CallerWaits: nothing woke the progress thread for it
  std::mutex futMu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // made on demand for CPU tensors (getFuture)
  bool finished_ = false;                            // under futMu_: finish() has run
  std::atomic<int> remaining_{0};
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
};

}  // namespace railcc
