#pragma once
// The verbs transport: RC queue pairs between hosts (InfiniBand or RoCE), one per channel.
//
// Data path. Each side of a connection owns a receive ring of `ringBytes`, registered for
// remote writes, and a send staging area of the same size. send() copies bytes to the
// staging area at the offset the bytes will have in the peer's ring and RDMA-WRITEs them
// there with an immediate (the length), so the peer learns of them from one receive
// completion and reads them in place (peek/consume), as it would from shared memory. The
// receiver returns ring space and receive slots as credits, themselves zero-byte writes with
// an immediate. Memory per connection is fixed (two rings), registration happens once, and
// the completion channel's fd lets an idle progress thread sleep in poll().
//
// Rendezvous. A message of at least RAILCC_IB_RNDV_BYTES whose receive copies travels as its
// address and the rkey of its registration (MrCache); the receiver's NIC reads it straight
// into the destination (RDMA READ; the destination registered too) and the receiver then
// acknowledges with an empty write, which ends the send. No CPU touches the bytes. Where the
// destination cannot be registered, the read lands in a bounce buffer and is copied out.
// GPU memory takes the same path (GPUDirect RDMA) where it can be registered with the NIC
// (gpu_registration.h): the engine then hands the GPU's buffer itself, on either side.
//
// Why a ring and not receiver-posted buffers (NCCL's clear-to-send): the engine's protocol is
// a stream of headers and payloads that it reduces in place; a ring the sender writes into
// needs no round-trip before each message, which a clear-to-send FIFO costs on the first
// message of every op.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "transport/transport.h"
#include "transport/verbs/cq_hub.h"
#include "transport/verbs/verbs_devices.h"

namespace railcc::transport::verbs {

/// What one side of a connection publishes to the other.
struct QpInfo {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint64_t ringAddr = 0;
  uint32_t rkey = 0;
  uint64_t ringBytes = 0;
  uint16_t lid = 0;
  uint8_t gid[16] = {0};
  int mtu = 0;      // enum ibv_mtu
  bool roce = false;
  std::string dev;  // "rxe0:1", for messages
};

/// A peer's published endpoint: "verbs1;<dev>;<dev>...;c,<to>,<lane>,<ch>,<dev#>,<qpn>,<psn>,<addr>,<rkey>,<ring>;..."
/// with <dev> = "d,<name:port>,<lid>,<gid hex>,<mtu>,<roce>": its ports, then every queue pair
/// it made for a rank of another host.
struct Blob {
  std::vector<QpInfo> devs;
  std::map<std::tuple<int, int, int>, QpInfo> conns;  // keyed by (the rank it is meant for, lane, channel)
};
/// Parses a blob read from the store; false for anything malformed (a record another process
/// wrote: never throws, never reads out of bounds).
bool parseBlob(const std::string& s, Blob* b);

/// One RC queue pair to one peer with its rings. Not thread-safe except markFailed().
class VerbsConnection : public Connection, private CqSink {
 public:
  /// Creates the queue pair (state INIT, receives posted) and registers the rings.
  /// `peer` names the peer in messages ("rank 1 (host b)"). `hub`: the completion queues it
  /// shares with the group's other connections on `dev` (driven by the same thread); null:
  /// a queue and a channel of its own.
  VerbsConnection(std::shared_ptr<Device> dev, size_t ringBytes, const Config& cfg, std::string peer,
                  std::shared_ptr<CqHub> hub = nullptr);
  /// Completions one queue pair may have outstanding (every send and receive it posts).
  static int completionsPerQp();
  ~VerbsConnection() override;

  QpInfo local() const;
  /// Moves the queue pair to RTR and RTS towards `remote`. Blocks: no (two driver calls).
  void connectTo(const QpInfo& remote);

  size_t send(const void* p, size_t n) override;
  std::pair<const void*, size_t> peek() override;
  void consume(size_t n) override;
  bool canSend() override;
  int pollFd() const override;
  std::string describe() const override;
  void checkAlive() override;
  bool peerReportedFailure() override { return peerFailed_; }
  void markFailed() override;

  bool peerReadsUs() override { return connected_ && rndvMin_ != ~size_t(0); }
  // A send/recv that fits the ring completes without the receiver, as it always did: only
  // larger ones (which wait for the receiver anyway) go by rendezvous.
  size_t byAddressMinBytes(bool p2p) const override { return p2p ? std::max(rndvMin_, ring_) : rndvMin_; }
  bool takeNews() override { return std::exchange(news_, false); }
  bool exposeForRead(const void* p, size_t n, uint64_t* key) override;
  bool readRemote(void* dst, uint64_t addr, uint64_t key, size_t n) override;
  size_t readPieceBytes() const override { return size_t(16) << 20; }
  bool ackRemote() override;
  uint64_t remoteAcked() override;
  bool exposeDeviceForRead(const void* p, size_t n, int gpu, uint64_t* key) override;
  bool readsIntoDevice(void* dst, size_t n, int gpu, std::shared_ptr<void> keep) override;

 private:
  void release() noexcept;
  void onCompletion(const ibv_wc& wc) override;
  void progressCq();
  void handle(const ibv_wc& wc);
  void post(uint64_t localOff, size_t n, uint64_t remoteOff, uint32_t imm, bool withImm, bool signaled);
  void postRead(void* dst, uint32_t lkey, uint64_t addr, uint32_t rkey, size_t n);
  void postRecvs(int n);
  void maybeCredit();
  [[noreturn]] void fail(const std::string& why);
  size_t sendRoom() const;
  MrCache::Lease gpuLease(const void* p, size_t n, int gpu);

  std::shared_ptr<Device> dev_;
  const IbvLib* ibv_;
  Config cfg_;
  std::string peer_;
  size_t ring_;
  char* mem_ = nullptr;  // [receive ring | send staging], page-aligned
  ibv_mr* recvMr_ = nullptr;
  ibv_mr* sendMr_ = nullptr;
  std::shared_ptr<CqHub> hub_;
  ibv_qp* qp_ = nullptr;
  uint32_t psn_ = 0;
  QpInfo remote_;
  bool connected_ = false;

  // Sending: bytes written into the peer's ring and the peer's credits.
  uint64_t sent_ = 0, peerConsumed_ = 0;
  uint64_t sentMsgs_ = 0, peerPolledMsgs_ = 0;
  uint64_t sqPosted_ = 0, sqDone_ = 0;  // work requests; a signalled completion covers all before it
  int sinceSignal_ = 0;
  // Receiving: bytes that arrived, consumed, and returned to the peer as credit.
  uint64_t written_ = 0, read_ = 0, credited_ = 0;
  uint64_t polledMsgs_ = 0, creditedMsgs_ = 0;
  bool peerFailed_ = false;
  bool probing_ = false;
  // Rendezvous: this side's buffers the peer may read, in the order passed, until it
  // acknowledges each; the read this side has in flight.
  size_t rndvMin_ = ~size_t(0);
  std::deque<MrCache::Lease> exposed_;
  uint64_t acked_ = 0;
  bool news_ = false;  // a completion of ours was taken on another connection's call
  MrCache::Lease readLease_;
  bool reading_ = false;
  uint64_t readWr_ = 0;
  size_t readDone_ = 0;
  MrCache::Lease deviceRead_;  // the GPU memory the message being read lands in (GPUDirect RDMA)
  int deviceGpu_ = -1;
  std::shared_ptr<void> deviceKeep_;  // keeps that memory allocated while the NIC may write it
  char* bounce_ = nullptr;  // reads whose destination could not be registered land here
  ibv_mr* bounceMr_ = nullptr;
  std::chrono::steady_clock::time_point lastProbe_{};
  std::string error_;
};

/// The verbs transport for the registry (verbs_transport.cpp).
std::unique_ptr<railcc::transport::Transport> makeTransport();

}  // namespace railcc::transport::verbs
