#include "common/error.h"
#include "common/log.h"
#include "engine/comm_impl.h"

namespace railcc::engine {

// c10d's time estimator (torch.distributed's _time_estimator: the backend's
// _start_time_estimate / _end_time_estimate): between the two, every op on this communicator
// is costed by the plan its algorithm runs by (Algorithms::estimateUs) and returns finished,
// moving nothing. Each peer's link costs a latency and a time per byte, a typical figure for
// its transport (a few microseconds and several GB/s through shared memory, tens of
// microseconds and about 1 GB/s over TCP, RDMA between the two; the flight recorder's own
// timings of a link were tried and misled: a send passed by address "finishes" at once), and
// every op a fixed cost more.
// docs/benchmarks.md sets estimates beside measured times.

namespace {

// `sharesCores`: this host's ranks outnumber its CPUs, so a peer waited for has to be woken and
// scheduled first (tens of microseconds on the 2-core machines of docs/benchmarks.md).
Algorithms::LinkCost typical(const std::string& link, bool sameHost, bool sharesCores) {
  auto gbps = [](double latencyUs, double gbPerS) { return Algorithms::LinkCost{latencyUs, 1.0 / (gbPerS * 1e3)}; };
  if (link.rfind("shm", 0) == 0 || (link.empty() && sameHost)) return gbps(sharesCores ? 30 : 3, 6);
  if (link.rfind("verbs", 0) == 0) return gbps(5, 10);
  return gbps(25, 1.2);  // TCP, or a peer not connected yet on another host
}

// What every op costs beyond its messages: c10d's dispatch, the engine's queue and the Work
// (an 8-byte all_reduce of 2 ranks on one host takes 12-16 us where its messages take 3-4).
constexpr double kPerOpUs = 8;

}  // namespace

void CommImpl::startEstimate() {
  checkOwner();
  std::vector<Algorithms::LinkCost> byPeer(static_cast<size_t>(size_));
  const std::string& myHost = peers_[static_cast<size_t>(rank_)].hostId;
  for (int r = 0; r < size_; ++r)
    if (r != rank_) {
      std::string link;
      {
        std::lock_guard<std::mutex> g(links_.mu);
        link = peers_[static_cast<size_t>(r)].transport;
      }
      byPeer[static_cast<size_t>(r)] = typical(link, peers_[static_cast<size_t>(r)].hostId == myHost, hostSharesCores_);
    }
  std::lock_guard<std::mutex> g(estimate_.mu);
  RAILCC_CHECK_ARG(!estimate_.on.load(), "group '", opts_.name, "': a time estimate is already running on it");
  estimate_.byPeer = std::move(byPeer);
  estimate_.us = 0;
  estimate_.on.store(true);
}

double CommImpl::endEstimate() {
  std::lock_guard<std::mutex> g(estimate_.mu);
  RAILCC_CHECK_ARG(estimate_.on.load(), "group '", opts_.name, "': no time estimate was started on it");
  estimate_.on.store(false);
  return estimate_.us;
}

RequestPtr CommImpl::estimated(const Op& op) {
  size_t bytes = 0;
  if (op.p2p) {
    bytes = op.xfer.bytes;
  } else {
    const size_t es = dtypeSize(static_cast<DataType>(op.fp.dtype));
    bytes = op.fp.count * es;
  }
  {
    std::lock_guard<std::mutex> g(estimate_.mu);
    if (op.p2p) {
      const Algorithms::LinkCost& c = estimate_.byPeer[static_cast<size_t>(std::max(op.xfer.peer, 0))];
      estimate_.us += kPerOpUs + c.latencyUs + static_cast<double>(bytes) * c.usPerByte;
    } else {
      estimate_.us += kPerOpUs + algos_.estimateUs(static_cast<OpKind>(op.fp.kind), bytes, estimate_.byPeer);
    }
  }
  auto req = std::make_shared<Request>(opts_.config.spinUs, userPool_);
  req->finish(nullptr);
  return req;
}

}  // namespace railcc::engine
