#pragma once
// The completion queues of one group's queue pairs on one RDMA device, behind one completion
// channel: one file descriptor per device and group however many peers it talks to (a queue
// pair per peer, lane and channel, made at first use). Completions are handed to the
// connection whose queue pair they belong to. A completion queue serves kQpsPerCq queue pairs
// (each may have every send and receive it posted complete at once, a flush after an error),
// so a group with more gets another queue on the same channel.
//
// Driven by the thread that drives the group's connections; attach/detach and poll are
// serialised by a lock, so a connection may be torn down from another thread.
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "transport/verbs/ibv_lib.h"

namespace railcc::transport::verbs {

class Device;

/// What a connection does with its completions; must not throw (a connection keeps its error
/// and raises it on its own next call).
class CqSink {
 public:
  virtual ~CqSink() = default;
  virtual void onCompletion(const ibv_wc& wc) = 0;
};

class CqHub {
 public:
  /// `perQp`: the completions one queue pair may have outstanding.
  CqHub(std::shared_ptr<Device> dev, int perQp);
  ~CqHub();
  CqHub(const CqHub&) = delete;
  CqHub& operator=(const CqHub&) = delete;

  /// The completion queue for the next queue pair (create the queue pair on it, then attach).
  ibv_cq* nextCq();
  void attach(uint32_t qpn, CqSink* sink);
  void detach(uint32_t qpn);
  /// Hands every completion waiting to its connection, reads the channel's events where one
  /// was raised and arms every queue again. Throws kPeerFailure when polling fails.
  void poll();
  int fd() const;

  static constexpr int kQpsPerCq = 16;

 private:
  struct Cq {
    ibv_cq* cq;
    int qps = 0;
    bool armed = false;
    bool eventDue = false;  // a completion arrived while armed: an event waits on the channel
    unsigned unacked = 0;
  };
  bool drain(Cq& c);
  void pollLocked();

  std::shared_ptr<Device> dev_;
  const IbvLib* ibv_;
  const int perQp_;
  ibv_comp_channel* channel_ = nullptr;
  std::vector<Cq> cqs_;
  std::mutex mu_;
  std::unordered_map<uint32_t, CqSink*> sinks_;
  std::unordered_set<uint32_t> retired_;  // numbers of queue pairs gone, whose completions may remain
};

}  // namespace railcc::transport::verbs
