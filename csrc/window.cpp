// torch 2.14's one-sided windows (C10D_BACKEND_HAS_WINDOW) on railcc groups: new_window gives
// a c10d::Window whose put, signal and wait_signal run over transport/window.h (the target's
// memory read through the kernel between ranks of one host, else TCP). Each returns once done:
// a put once the bytes are in the target's tensor, so a later signal is seen after them. Host
// tensors only. Compiled only against a torch whose headers have the API.

#include "backend.h"

#ifdef C10D_BACKEND_HAS_WINDOW

#include <torch/csrc/distributed/c10d/Window.hpp>

#include "common/waits.h"
#include "transport/window.h"
#include "work.h"

namespace railcc {

namespace {

[[noreturn]] void refuse(const std::string& msg) { C10_THROW_ERROR(ValueError, "railcc window: " + msg); }

class RailccWindow : public c10d::Window {
 public:
  RailccWindow(std::unique_ptr<transport::WindowEndpoint> ep, std::chrono::milliseconds timeout)
      : ep_(std::move(ep)), timeout_(timeout) {}

  void tensor_register(const at::Tensor& tensor, bool owning) override {
    if (!tensor.defined()) refuse("tensor_register of an undefined tensor");
    if (!tensor.device().is_cpu())
      refuse("tensor_register: railcc windows hold host memory; got a tensor on " + tensor.device().str());
    if (!tensor.is_contiguous()) refuse("tensor_register: the tensor must be contiguous (a window is one region)");
    guard("window tensor_register", [&] {
      ep_->registerRegion(tensor.data_ptr(), tensor.nbytes(), tensor.element_size(),
                          std::string(c10::toString(tensor.scalar_type())));
    });
    // Not owning: the caller keeps the storage alive; a view of it serves map_remote_tensor.
    tensor_ = owning ? tensor : at::from_blob(tensor.data_ptr(), tensor.sizes(), tensor.options());
  }

  void tensor_deregister() override {
    guard("window tensor_deregister", [&] { ep_->deregister(timeout_); });
    tensor_.reset();
  }

  c10::intrusive_ptr<c10d::Work> put(const at::Tensor& tensor, int64_t dstRank, int64_t targetOffsetNelems,
                                     bool /*asyncOp*/, const c10d::PutOptions& opts) override {
    if (!tensor.defined() || !tensor.device().is_cpu())
      refuse("put: railcc windows move host tensors; got " +
             (tensor.defined() ? "a tensor on " + tensor.device().str() : std::string("an undefined tensor")));
    if (targetOffsetNelems < 0) refuse("put: targetOffsetNelems is " + std::to_string(targetOffsetNelems));
    const at::Tensor src = tensor.contiguous();
    guard("window put", [&] {
      ep_->put(src.data_ptr(), src.nbytes(), std::string(c10::toString(src.scalar_type())), static_cast<int>(dstRank),
               static_cast<size_t>(targetOffsetNelems), timeoutOf(opts.timeout));
    });
    return done("window put");
  }

  at::Tensor map_remote_tensor(int64_t rank) override {
    if (rank == ep_->rank() && tensor_.defined()) return tensor_;
    if (!tensor_.defined()) refuse("map_remote_tensor before tensor_register");
    refuse("map_remote_tensor(" + std::to_string(rank) + "): another rank's host memory cannot be mapped into this "
           "process; write to it with put() and signal()");
  }

  c10::intrusive_ptr<c10d::Work> signal(int64_t peerRank, bool /*asyncOp*/, const c10d::SignalOptions& opts) override {
    guard("window signal", [&] { ep_->signal(static_cast<int>(peerRank), timeoutOf(opts.timeout)); });
    return done("window signal");
  }

  c10::intrusive_ptr<c10d::Work> wait_signal(int64_t peerRank, bool /*asyncOp*/,
                                             const c10d::WaitSignalOptions& opts) override {
    guard("window wait_signal", [&] { ep_->waitSignal(static_cast<int>(peerRank), timeoutOf(opts.timeout)); });
    return done("window wait_signal");
  }

  c10d::WindowAttr get_attr(int64_t peerRank) override {
    if (peerRank < 0 || peerRank >= ep_->size())
      refuse("get_attr(" + std::to_string(peerRank) + "): the group has ranks 0.." + std::to_string(ep_->size() - 1));
    return c10d::WindowAttr{c10d::WindowAccessType::UNIFIED};
  }

 private:
  std::chrono::milliseconds timeoutOf(std::chrono::milliseconds t) const { return t.count() > 0 ? boundedWait(t) : timeout_; }
  c10::intrusive_ptr<c10d::Work> done(const char* name) {
    auto w = c10::make_intrusive<WorkRailcc>(ep_->rank(), c10d::OpType::UNKNOWN, name, 0, std::vector<engine::RequestPtr>{},
                                             std::vector<at::Tensor>{}, std::vector<at::Tensor>{}, nullptr, nullptr,
                                             std::function<void()>{});
    w->arm();
    return w;
  }

  std::unique_ptr<transport::WindowEndpoint> ep_;
  std::chrono::milliseconds timeout_;
  at::Tensor tensor_;
};

}  // namespace

c10::intrusive_ptr<c10d::Window> ProcessGroupRailcc::new_window(const std::optional<at::Tensor>& tensor) {
  const uint64_t n = ++windows_;
  auto store = store_;
  const std::string prefix = "window/" + std::to_string(n) + "/";
  transport::Directory dir;
  dir.set = [store, prefix](const std::string& k, const std::string& v) { store->set(prefix + k, v); };
  dir.get = [store, prefix](const std::string& k, std::chrono::milliseconds t) { return store->get(prefix + k, t); };
  dir.add = [store, prefix](const std::string& k, int64_t d) { return store->add(prefix + k, d); };
  std::vector<transport::WindowPeer> peers;
  for (const auto& p : comm_->peers()) peers.push_back({p.hostId, p.hostname, p.pidNs});
  auto window = guard("new_window", [&] {
    return c10::make_intrusive<RailccWindow>(
        std::make_unique<transport::WindowEndpoint>(std::move(dir), getRank(), std::move(peers),
                                                    "window " + std::to_string(n) + " of group '" + groupName_ + "'",
                                                    timeout_),
        timeout_);
  });
  if (tensor && tensor->defined()) window->tensor_register(*tensor, true);
  return window;
}

}  // namespace railcc

#endif  // C10D_BACKEND_HAS_WINDOW
