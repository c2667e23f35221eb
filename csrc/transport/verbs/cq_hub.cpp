#include "transport/verbs/cq_hub.h"

#include <fcntl.h>

#include "common/error.h"
#include "common/log.h"
#include "transport/verbs/verbs_devices.h"

namespace railcc::transport::verbs {

CqHub::CqHub(std::shared_ptr<Device> dev, int perQp) : dev_(std::move(dev)), ibv_(dev_->ibv()), perQp_(perQp) {
  channel_ = ibv_->createCompChannel(dev_->ctx());
  if (channel_ == nullptr) RAILCC_THROW(kSystem, "cannot create a completion channel on ", dev_->name());
  int fl = fcntl(channel_->fd, F_GETFL);
  fcntl(channel_->fd, F_SETFL, fl | O_NONBLOCK);
}

CqHub::~CqHub() {
  for (Cq& c : cqs_) {
    if (c.unacked) ibv_->ackCqEvents(c.cq, c.unacked);
    if (ibv_->destroyCq(c.cq) != 0) RAILCC_WARN(IB, "destroying a completion queue on ", dev_->name(), " failed");
  }
  if (channel_ && ibv_->destroyCompChannel(channel_) != 0) RAILCC_WARN(IB, "destroying a completion channel failed");
}

ibv_cq* CqHub::nextCq() {
  std::lock_guard<std::mutex> g(mu_);
  if (cqs_.empty() || cqs_.back().qps >= kQpsPerCq) {
    ibv_cq* cq = ibv_->createCq(dev_->ctx(), perQp_ * kQpsPerCq, nullptr, channel_, 0);
    if (cq == nullptr)
      RAILCC_THROW(kSystem, "cannot create a completion queue of ", perQp_ * kQpsPerCq, " entries on ", dev_->name(), ": ",
                   detail::errnoString());
    cqs_.push_back(Cq{cq});
  }
  ++cqs_.back().qps;
  return cqs_.back().cq;
}

void CqHub::attach(uint32_t qpn, CqSink* sink) {
  std::lock_guard<std::mutex> g(mu_);
  // A new queue pair with a gone one's number: that one's completions still queued must not
  // reach it. Everything queued now is handed out first (its own are dropped: not attached).
  if (retired_.erase(qpn)) pollLocked();
  sinks_[qpn] = sink;
}

// A queue pair's place on its queue is not given back: its completions still there are
// dropped as they come (the queue pair is gone), and queues stay until the group goes.
void CqHub::detach(uint32_t qpn) {
  std::lock_guard<std::mutex> g(mu_);
  sinks_.erase(qpn);
  retired_.insert(qpn);
}

int CqHub::fd() const { return channel_->fd; }

bool CqHub::drain(Cq& c) {
  ibv_wc wcs[32];
  bool any = false;
  while (true) {
    int n = ibv_poll_cq(c.cq, 32, wcs);
    if (n < 0) RAILCC_THROW(kPeerFailure, "polling a completion queue on ", dev_->name(), " failed");
    for (int i = 0; i < n; ++i) {
      auto it = sinks_.find(wcs[i].qp_num);
      if (it != sinks_.end()) it->second->onCompletion(wcs[i]);
    }
    if (n == 0) return any;
    any = true;
    c.eventDue = c.eventDue || c.armed;  // armed, a new completion raises an event
  }
}

void CqHub::poll() {
  std::lock_guard<std::mutex> g(mu_);
  pollLocked();
}

void CqHub::pollLocked() {
  bool readEvents = false;
  for (Cq& c : cqs_) {
    drain(c);
    readEvents = readEvents || (c.armed && c.eventDue);
  }
  // Only an event raised since arming needs reading (it leaves the fd readable until then), so
  // a busy stream and an idle wait cost no read() here.
  if (readEvents) {
    ibv_cq* cq = nullptr;
    void* ctx = nullptr;
    while (ibv_->getCqEvent(channel_, &cq, &ctx) == 0)
      for (Cq& c : cqs_)
        if (c.cq == cq) {
          ++c.unacked;
          c.armed = c.eventDue = false;
        }
    for (Cq& c : cqs_)
      if (c.unacked >= 64) {
        ibv_->ackCqEvents(c.cq, c.unacked);
        c.unacked = 0;
      }
  }
  // Arm, then look once more: a completion between the last poll and the arming raises no event.
  for (Cq& c : cqs_) {
    if (c.armed) continue;
    if (ibv_req_notify_cq(c.cq, 0) != 0) RAILCC_THROW(kPeerFailure, "arming a completion queue on ", dev_->name(), " failed");
    c.armed = true;
    drain(c);
  }
}

}  // namespace railcc::transport::verbs
