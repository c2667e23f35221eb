#pragma once
// The wire format (a header before every message), the kinds of op it names, and the
// Transfer: one message to move, as the algorithms describe it to the channel layer.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common/types.h"
#include "engine/spin.h"

namespace railcc::engine {

using Millis = std::chrono::milliseconds;

// Wire format. Every message is a header followed by its payload, padded to 8 bytes so
// that stream positions stay aligned for in-place reductions out of shared memory.

enum class OpKind : uint8_t {
  kAllreduce = 1, kBroadcast, kReduce, kAllgather, kReduceScatter, kAlltoall, kGather, kScatter,
  kBarrier, kP2P, kAllreduceCoalesced,
};

inline const char* opKindName(OpKind k) {
  switch (k) {
    case OpKind::kAllreduce: return "allreduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kReduce: return "reduce";
    case OpKind::kAllgather: return "allgather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAlltoall: return "alltoall";
    case OpKind::kGather: return "gather";
    case OpKind::kScatter: return "scatter";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kP2P: return "send/recv";
    case OpKind::kAllreduceCoalesced: return "allreduce_coalesced";
  }
  return "?";
}

struct WireHeader {
  uint32_t magic;
  uint8_t kind;
  uint8_t dtype;
  uint8_t redop;
  uint8_t flags;
  int32_t root;
  int32_t tag;
  uint64_t seq;
  uint64_t count;
  uint64_t bytes;
  int64_t startUs;  // when the sender started this collective (wall clock): arrival lag
};
static_assert(sizeof(WireHeader) == 48, "wire header layout");
// flags: the payload is an AddressMsg, the sender's buffer, which the receiver reads itself
// (single copy between ranks of one host); the send completes on its acknowledgement.
constexpr uint8_t kWireByAddress = 1;
struct AddressMsg {
  uint64_t addr;
  uint64_t key;  // what the transport needs to read it (an RDMA rkey; 0 for the kernel's copy)
};
constexpr uint32_t kWireMagic = 0x52434331;  // "RCC1"
constexpr int kCollLane = 0;
constexpr int kP2PLane = 1;
constexpr int kLanes = 2;

inline size_t pad8(size_t n) { return (n + 7) & ~size_t(7); }

inline std::string describeCall(const WireHeader& h) {
  std::ostringstream os;
  auto kind = static_cast<OpKind>(h.kind);
  os << opKindName(kind);
  if (kind == OpKind::kP2P) {
    os << "(tag=" << h.tag << ", " << h.bytes << " bytes)";
    return os.str();
  }
  os << "(seq=" << h.seq << ", count=" << h.count << ", dtype=" << dtypeName(static_cast<DataType>(h.dtype));
  if (kind == OpKind::kAllreduce || kind == OpKind::kReduce || kind == OpKind::kReduceScatter ||
      kind == OpKind::kAllreduceCoalesced)
    os << ", op=" << reduceOpName(static_cast<ReduceOp>(h.redop));
  if (kind == OpKind::kBroadcast || kind == OpKind::kReduce || kind == OpKind::kGather || kind == OpKind::kScatter)
    os << ", root=" << h.root;
  os << ")";
  return os.str();
}

struct DeviceSide;  // engine/device.h

// One message to move: a send, a receive, or a receive that reduces into its destination.
struct Transfer {
  enum Kind : uint8_t { kSend, kRecv, kRecvReduce } kind = kSend;
  int peer = -1;
  int lane = kCollLane;
  const char* src = nullptr;
  char* dst = nullptr;
  size_t bytes = 0;
  WireHeader hdr{};  // sent as is, or what the received header must say
  DataType dtype = DataType::kUInt8;
  ReduceOp op = ReduceOp::kSum;
  double scale = 1.0;
  const size_t* limit = nullptr;  // forwarding: send no further than another transfer has received
  const Transfer* after = nullptr;  // send nothing, header included, until this receive has taken its header
  bool gates = false;               // a receive some send waits on (`after`): yield once its header is in
  size_t limitBase = 0;           // a share of a split send: where it starts in what `limit` counts
  int channel = 0;                // which of the pair's channels carries it
  std::shared_ptr<std::vector<Transfer>> parts;  // a message split across channels (post())
  bool bypassCache = false;       // a large receive from shared memory: non-temporal stores
  // Single copy: where a message passed by address stands (the acknowledgement that ends a
  // send is the peer's `ticket`-th).
  enum class ByAddress : uint8_t { kNo, kSending, kAwaitingAck, kReceiving } byAddress = ByAddress::kNo;
  uint64_t ticket = 0;
  bool mayPassAddress = false;  // set by the algorithm where single copy wins (ChannelLayer::singleCopy)
  bool landsInPlace = false;    // the peer's receive copies it into place, reducing nothing (ChannelLayer::zeroCopy)
  uint64_t addrKey = 0;         // passed by address: the key the peer reads it with
  DeviceSide* device = nullptr;  // GPU memory behind src/dst, until the way it moves is decided
  // progress
  size_t hdrDone = 0;
  size_t done = 0;
  size_t padDone = 0;
  bool matched = false;
  bool finished = false;
  Clock::time_point began{};  // first byte sent, or header received: for link throughput
};

// How far a send may go now: a forwarding send no further than its source has received.
inline size_t sendLimit(const Transfer& t) {
  if (!t.limit) return t.bytes;
  size_t got = *t.limit > t.limitBase ? *t.limit - t.limitBase : 0;
  return std::min(t.bytes, got);
}

// A send waiting for a receive to take its header first (a broadcast tail's acknowledgement).
inline bool gated(const Transfer& t) { return t.after && !(t.after->matched || t.after->done > 0 || t.after->finished); }

// False when a forwarding send has sent all it may until more arrives.
inline bool hasBytesToSend(const Transfer& t) {
  if (gated(t)) return false;
  if (t.byAddress != Transfer::ByAddress::kNo) return t.byAddress == Transfer::ByAddress::kSending;  // then only the ack
  if (t.hdrDone < sizeof(WireHeader) || t.done >= t.bytes) return true;
  return t.done < sendLimit(t);
}
// What every layer may know of the op being run: its kind, the fingerprint its messages
// carry, its timeout and its flight-recorder entry. The op queue's Op extends it.
struct OpStamp {
  OpKind kind = OpKind::kBarrier;
  WireHeader fp{};  // fingerprint carried by every message of the op
  Millis timeout{0};
  uint64_t traceId = 0;
};

// Element blocks of a buffer split n ways as evenly as may be (the first `rem` one larger).
struct Blocks {
  size_t base, rem, es;
  Blocks(size_t count, int n, size_t esize) : base(count / static_cast<size_t>(n)), rem(count % static_cast<size_t>(n)), es(esize) {}
  size_t count(int i) const { return base + (static_cast<size_t>(i) < rem ? 1 : 0); }
  size_t offset(int i) const { return (base * static_cast<size_t>(i) + std::min(static_cast<size_t>(i), rem)) * es; }
};

inline int positionIn(const std::vector<int>& g, int r) {
  return static_cast<int>(std::find(g.begin(), g.end(), r) - g.begin());
}

}  // namespace railcc::engine
