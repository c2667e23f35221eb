#include "engine/channels.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <thread>

#include "common/error.h"
#include "transport/copy.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// ChannelLayer: moving an op's transfers over its connections. Headers are read and checked
// against the op's fingerprint, sends and receives (and receive-reduce) advance as far as the
// connections let them, exchange/post/complete run a step's transfers together, and idle()
// waits for the peers a step waits on (spin, then poll() or the doorbell), checking liveness
// and the op's timeout.

// A small message read in one go once all of it is there: header, payload, padding, one
// consume (one publication back to the sender). False, having read nothing, while it is not.
bool ChannelLayer::recvWhole(Channel& ch, Transfer& t, int lane, int peer, size_t& moved) {
  const size_t pad = pad8(t.bytes) - t.bytes, total = sizeof(WireHeader) + t.bytes + pad;
  auto [p, avail] = ch.conn->peek();
  if (avail < total) return false;
  std::memcpy(&ch.inHdr, p, sizeof(WireHeader));
  acceptHeader(ch, t, lane, peer);
  const char* payload = static_cast<const char*>(p) + sizeof(WireHeader);
  if (t.kind == Transfer::kRecv) {
    if (t.bytes) std::memcpy(t.dst, payload, t.bytes);
  } else if (t.bytes) {
    reduceInto(t.dst, payload, t.bytes / dtypeSize(t.dtype), t.dtype, t.op, t.scale);
  }
  ch.conn->consume(total);
  t.done = t.bytes;
  t.padDone = pad;
  t.finished = true;
  moved += total;
  return true;
}

// The peer's header (in ch.inHdr) for receive `t`: checked against our own call, and its start
// time noted for the arrival lags.
void ChannelLayer::acceptHeader(Channel& ch, Transfer& t, int lane, int peer) {
  checkHeader(t, ch.inHdr, peer);
  t.matched = true;
  if (lane == kCollLane && arrivals_[static_cast<size_t>(peer)] == 0 && ch.inHdr.startUs > 0) {
    arrivals_[static_cast<size_t>(peer)] = ch.inHdr.startUs;
    arrived_.push_back({peer, ch.inHdr.startUs});
  }
}

bool ChannelLayer::readHeader(Channel& ch, size_t& moved) {
  while (ch.inHdrGot < sizeof(WireHeader)) {
    size_t k = ch.conn->recv(reinterpret_cast<char*>(&ch.inHdr) + ch.inHdrGot, sizeof(WireHeader) - ch.inHdrGot);
    if (k == 0) return false;
    ch.inHdrGot += k;
    moved += k;
  }
  return true;
}

void ChannelLayer::checkHeader(const Transfer& t, const WireHeader& h, int peer) {
  if (h.magic != kWireMagic)
    RAILCC_THROW(kInternal, "corrupt message from ", host_.peerName(peer), " (bad magic ", h.magic, ")");
  const WireHeader& e = t.hdr;
  bool same = h.kind == e.kind;
  if (same && e.kind == static_cast<uint8_t>(OpKind::kP2P)) {
    if (h.tag != e.tag || h.bytes != e.bytes) same = false;
  } else if (same) {
    same = h.seq == e.seq && h.dtype == e.dtype && h.redop == e.redop && h.root == e.root && h.count == e.count &&
           h.bytes == e.bytes;
  }
  if (same) return;
  Error err(ErrorCode::kMismatch,
            "collective mismatch between " + host_.rankName(rank_) + " and " + host_.peerName(peer) +
                ":\n  " + host_.rankName(rank_) + " called " + describeCall(e) + (e.kind == h.kind &&
                e.kind != static_cast<uint8_t>(OpKind::kP2P) && h.seq == e.seq && h.bytes != e.bytes
                ? " expecting " + std::to_string(e.bytes) + " bytes from it" : "") +
                "\n  " + host_.rankName(peer) + " called " + describeCall(h) +
                (h.bytes != e.bytes ? " sending " + std::to_string(h.bytes) + " bytes" : ""));
  err.ranks = {rank_, peer};
  err.hosts = {host_.hostOf(rank_), host_.hostOf(peer)};
  err.seq = static_cast<long long>(e.seq);
  err.op = opKindName(static_cast<OpKind>(e.kind));
  throw err;
}

size_t ChannelLayer::sendByAddress(Channel& ch, Transfer& t) {
  size_t moved = 0;
  if (t.byAddress == Transfer::ByAddress::kSending) {
    struct {
      WireHeader h;
      AddressMsg a;
    } f{t.hdr, {reinterpret_cast<uint64_t>(t.src), t.addrKey}};
    f.h.flags |= kWireByAddress;
    while (t.hdrDone < sizeof f) {
      size_t k = ch.conn->send(reinterpret_cast<const char*>(&f) + t.hdrDone, sizeof f - t.hdrDone);
      if (k == 0) return moved;
      t.hdrDone += k;
      moved += k;
    }
    t.byAddress = Transfer::ByAddress::kAwaitingAck;
    t.ticket = ++ch.addrSent;
  }
  if (ch.conn->remoteAcked() < t.ticket) return moved;
  t.done = t.bytes;
  t.finished = true;
  return moved + t.bytes;
}

size_t ChannelLayer::recvByAddress(Channel& ch, Transfer& t) {
  size_t moved = 0;
  while (ch.inAddrGot < sizeof(AddressMsg)) {
    size_t k = ch.conn->recv(reinterpret_cast<char*>(&ch.inAddr) + ch.inAddrGot, sizeof(AddressMsg) - ch.inAddrGot);
    if (k == 0) return moved;
    ch.inAddrGot += k;
    moved += k;
  }
  // Only steps whose receives copy pass addresses (ChannelLayer::singleCopy, zeroCopy): a reducing
  // receive never meets one unless an algorithm marked it wrongly.
  if (t.kind != Transfer::kRecv)
    RAILCC_THROW(kInternal, "a reducing receive from ", host_.peerName(t.peer), " was sent an address");
  if (t.device && !startDeviceRecv(ch, t)) return moved;
  // A piece per call, so that the op's other transfers (a forwarding send) move in between.
  if (t.done < t.bytes) {
    size_t k = std::min(t.bytes - t.done, ch.conn->readPieceBytes());
    if (!ch.conn->readRemote(t.dst + t.done, ch.inAddr.addr + t.done, ch.inAddr.key, k)) return moved;
    t.done += k;
    moved += k;
    if (t.done < t.bytes) return moved;
  }
  // A sender that failed meanwhile may have returned and reused its buffer: what was read
  // then is not its message.
  if (ch.conn->peerReportedFailure())
    RAILCC_THROW(kPeerFailure, "it failed while its buffer was being read (passed by address: CMA or an RDMA read)");
  if (!ch.conn->ackRemote()) return moved;
  ch.inAddrGot = 0;
  t.finished = true;
  return moved;
}

size_t ChannelLayer::progressSend(Channel& ch, Transfer& t) {
  if (gated(t)) return 0;
  if (t.device && !startDeviceSend(ch, t)) return 0;
  if (t.hdrDone == 0 && t.byAddress == Transfer::ByAddress::kNo && sendsByAddress(ch, t)) {
    if (ch.conn->exposeForRead(t.src, t.bytes, &t.addrKey)) t.byAddress = Transfer::ByAddress::kSending;
    else t.landsInPlace = false;  // the transport could not expose it: this one goes on the stream
  }
  if (t.byAddress != Transfer::ByAddress::kNo) return sendByAddress(ch, t);
  size_t moved = 0;
  if (t.hdrDone == 0 && t.bytes <= kInlineBytes && sendLimit(t) == t.bytes) {
    // Header, payload and padding in one write: the receiver sees the whole message at once
    // (one publication and one wake-up check instead of three).
    char frame[sizeof(WireHeader) + kInlineBytes + 8];
    const size_t pad = pad8(t.bytes) - t.bytes, total = sizeof(WireHeader) + t.bytes + pad;
    std::memcpy(frame, &t.hdr, sizeof(WireHeader));
    if (t.bytes) std::memcpy(frame + sizeof(WireHeader), t.src, t.bytes);
    std::memset(frame + sizeof(WireHeader) + t.bytes, 0, pad);
    size_t k = ch.conn->send(frame, total);
    t.hdrDone = std::min(k, sizeof(WireHeader));
    t.done = std::min(k - t.hdrDone, t.bytes);
    t.padDone = k - t.hdrDone - t.done;
    moved = k;
    if (k == total) {
      t.finished = true;
      return moved;
    }
  }
  while (t.hdrDone < sizeof(WireHeader)) {
    size_t k = ch.conn->send(reinterpret_cast<const char*>(&t.hdr) + t.hdrDone, sizeof(WireHeader) - t.hdrDone);
    if (k == 0) return moved;
    t.hdrDone += k;
    moved += k;
  }
  while (t.done < t.bytes) {
    size_t upto = sendLimit(t);
    if (t.done >= upto) return moved;
    size_t k = ch.conn->send(t.src + t.done, upto - t.done);
    if (k == 0) return moved;
    t.done += k;
    moved += k;
  }
  static const char zeros[8] = {0};
  size_t pad = pad8(t.bytes) - t.bytes;
  while (t.padDone < pad) {
    size_t k = ch.conn->send(zeros, pad - t.padDone);
    if (k == 0) return moved;
    t.padDone += k;
    moved += k;
  }
  t.finished = true;
  return moved;
}

size_t ChannelLayer::progressRecv(Channel& ch, Transfer& t) {
  if (t.byAddress == Transfer::ByAddress::kReceiving) return recvByAddress(ch, t);
  size_t moved = 0;
  if (t.kind == Transfer::kRecv) {
    while (t.done < t.bytes) {
      size_t k;
      if (t.bypassCache) {
        // In pieces, each consumed at once, so the producer refills behind this copy.
        auto [src, avail] = ch.conn->peek();
        k = std::min({avail, t.bytes - t.done, size_t(256) << 10});
        if (k) {
          transport::streamCopy(t.dst + t.done, src, k);
          ch.conn->consume(k);
        }
      } else {
        k = ch.conn->recv(t.dst + t.done, t.bytes - t.done);
      }
      if (k == 0) return moved;
      t.done += k;
      moved += k;
    }
  } else {
    size_t es = dtypeSize(t.dtype);
    while (t.done < t.bytes) {
      if (ch.carryGot > 0) {  // finish an element split across socket reads
        size_t k = ch.conn->recv(ch.carry + ch.carryGot, es - ch.carryGot);
        if (k == 0) return moved;
        ch.carryGot += k;
        moved += k;
        if (ch.carryGot < es) return moved;
        reduceInto(t.dst + t.done, ch.carry, 1, t.dtype, t.op, t.scale);
        t.done += es;
        ch.carryGot = 0;
        continue;
      }
      auto [p, avail] = ch.conn->peek();
      // In pieces, so that the sender can refill the FIFO while this reduces.
      size_t want = std::min({avail, t.bytes - t.done, size_t(256u << 10)});
      size_t whole = want / es * es;
      if (whole == 0) {
        if (want == 0) return moved;
        std::memcpy(ch.carry, p, want);
        ch.carryGot = want;
        ch.conn->consume(want);
        moved += want;
        continue;
      }
      reduceInto(t.dst + t.done, p, whole / es, t.dtype, t.op, t.scale);
      ch.conn->consume(whole);
      t.done += whole;
      moved += whole;
    }
  }
  size_t pad = pad8(t.bytes) - t.bytes;
  char sink[8];
  while (t.padDone < pad) {
    size_t k = ch.conn->recv(sink, pad - t.padDone);
    if (k == 0) return moved;
    t.padDone += k;
    moved += k;
  }
  t.finished = true;
  return moved;
}

size_t ChannelLayer::progress(int lane, int peer) {
  // A peer on another host may be met for the first time: connect, then move bytes.
  if (!pair(lane, peer)[0].conn && !host_.connectPeer(peer, lane)) return 0;
  try {
    size_t moved = 0;
    for (Channel& ch : pair(lane, peer))
      if (!ch.sendq.empty() || !ch.recvq.empty()) moved += progressPair(ch, lane, peer);
    return moved;
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kPeerFailure) host_.peerFailed(peer, e.what());
    throw;
  }
}

size_t ChannelLayer::progressPair(Channel& ch, int lane, int peer) {
  size_t moved = 0;
  while (!ch.sendq.empty()) {
    Transfer& t = *ch.sendq.front();
    bool fresh = t.hdrDone == 0;
    size_t k = progressSend(ch, t);
    if (fresh && k > 0 && sampled(t)) t.began = Clock::now();
    moved += k;
    if (!t.finished) break;
    sampleLink(t, true);
    ch.sendq.pop_front();
  }
  while (!ch.recvq.empty()) {
    Transfer& t = *ch.recvq.front();
    if (!t.matched && ch.inHdrGot == 0 && t.bytes <= kInlineBytes && recvWhole(ch, t, lane, peer, moved)) {
      ch.recvq.pop_front();
      continue;
    }
    if (!t.matched) {
      if (!readHeader(ch, moved)) break;
      acceptHeader(ch, t, lane, peer);
      if (ch.inHdr.flags & kWireByAddress) t.byAddress = Transfer::ByAddress::kReceiving;
      if (sampled(t)) t.began = Clock::now();
      if (t.gates) break;  // let the send waiting on this header go before the payload is copied
    }
    moved += progressRecv(ch, t);
    if (!t.finished) break;
    sampleLink(t, false);
    ch.recvq.pop_front();
    ch.inHdrGot = 0;
  }
  return moved;
}

void ChannelLayer::post(std::vector<Transfer>& xs) {
  for (auto& t : xs) {
    t.lane = kCollLane;
    if (t.peer == rank_) RAILCC_THROW(kInternal, "transfer to self");
    auto& chs = pair(kCollLane, t.peer);
    // Large messages are split across the pair's channels, the same way on both sides: the
    // shares depend only on the size, the pair's channel count and RAILCC_CHANNEL_MIN_BYTES.
    size_t minShare = static_cast<size_t>(config_.channelMinBytes);
    size_t k = std::min(chs.size(), t.bytes / std::max<size_t>(minShare, 1));
    if (k < 2) {
      (t.kind == Transfer::kSend ? chs[0].sendq : chs[0].recvq).push_back(&t);
      continue;
    }
    size_t share = (t.bytes + k - 1) / k;
    share = (share + 63) / 64 * 64;  // element-aligned for every dtype
    t.parts = std::make_shared<std::vector<Transfer>>();
    t.parts->reserve(k);
    for (size_t i = 0, off = 0; i < k && off < t.bytes; ++i, off += share) {
      Transfer p = t;
      p.parts.reset();
      p.channel = static_cast<int>(i);
      p.bytes = std::min(share, t.bytes - off);
      p.hdr.bytes = p.bytes;
      if (p.src) p.src += off;
      if (p.dst) p.dst += off;
      p.limitBase = t.limitBase + off;
      t.parts->push_back(p);
    }
    for (Transfer& p : *t.parts) {
      Channel& ch = chs[static_cast<size_t>(p.channel)];
      (p.kind == Transfer::kSend ? ch.sendq : ch.recvq).push_back(&p);
    }
  }
}

// A split message is done when every share is; its `done` counts the bytes moved without a
// gap from its start, which is what a forwarding send limited by it may rely on.
void ChannelLayer::refreshSplit(Transfer& t) {
  if (!t.parts) return;
  size_t prefix = 0;
  bool all = true, gap = false;
  for (const Transfer& p : *t.parts) {
    all = all && p.finished;
    if (!gap) prefix += p.done;
    gap = gap || !p.finished;
    if (t.began == Clock::time_point{} && p.began != Clock::time_point{}) t.began = p.began;
  }
  t.done = prefix;
  t.finished = all;
}

void ChannelLayer::complete(std::vector<Transfer>& xs) {
  std::vector<std::pair<int, int>>& chans = completeChans_;  // kept: no allocation per step
  chans.clear();
  for (auto& t : xs)
    if (std::find(chans.begin(), chans.end(), std::make_pair(kCollLane, t.peer)) == chans.end())
      chans.push_back({kCollLane, t.peer});
  // Bytes per peer go to the flight recorder, and on failure the peers still owed bytes.
  struct Account {
    ChannelLayer* c;
    std::vector<Transfer>& xs;
    ~Account() {
      if (!c->op_) return;
      try {
        auto& rows = c->byteRows_;
        rows.clear();
        for (auto& t : xs) rows.push_back({static_cast<uint64_t>(t.peer), t.kind == Transfer::kSend ? t.done : 0,
                                           t.kind == Transfer::kSend ? 0 : t.done});
        c->tele_.opBytes(c->op_->traceId, rows);
      } catch (const std::bad_alloc&) {  // the trace goes without these bytes
      }
      for (auto& t : xs) {
        if (!t.finished && std::uncaught_exceptions() > 0 &&
            std::find(c->waitingOn_.begin(), c->waitingOn_.end(), t.peer) == c->waitingOn_.end())
          c->waitingOn_.push_back(t.peer);
      }
    }
  } account{this, xs};
  while (true) {
    size_t moved = 0;
    bool all = true;
    for (auto& [lane, peer] : chans) moved += progress(lane, peer);
    for (auto& t : xs) {
      refreshSplit(t);
      all = all && t.finished;
    }
    moved += host_.pumpBeside();
    if (all) return;
    if (moved) {
      lastProgress_ = Clock::now();
      continue;
    }
    host_.checkInterrupted();
    std::vector<std::pair<int, int>>& on = completeWaitOn_;  // kept: no allocation per wait
    on.clear();
    for (auto& t : xs)
      if (!t.finished) on.push_back({kCollLane, t.peer});
    idle(on, op_->timeout, opKindName(op_->kind));
  }
}

ChannelLayer::ChannelLayer(ChannelHost& host, const Config& config, Telemetry& tele, int rank, int size)
    : host_(host), config_(config), tele_(tele), rank_(rank), size_(size) {
  wakeFd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  RAILCC_SYSCHECK(wakeFd_, "eventfd");
  chans_.resize(kLanes);
  for (auto& lane : chans_) lane.resize(static_cast<size_t>(size_));
  nchan_.assign(static_cast<size_t>(size_), 1);
  arrivals_.assign(static_cast<size_t>(size_), 0);
  shmPeer_.assign(static_cast<size_t>(size_), false);
  lastProgress_ = lastAliveCheck_ = Clock::now();
}

ChannelLayer::~ChannelLayer() {
  close();
  if (wakeFd_ >= 0) ::close(wakeFd_);
}

void ChannelLayer::setShmPeers(std::vector<bool> shm, std::vector<int> localRanks, size_t streamMin, int64_t busyUs,
                           int64_t cmaBytes) {
  byAddressMin_ = cmaBytes > 0 ? std::max<size_t>(static_cast<size_t>(cmaBytes), 4096) : ~size_t(0);
  shmPeer_ = std::move(shm);
  localRanks_ = std::move(localRanks);
  streamMin_ = streamMin;
  busyUs_ = busyUs;
  lastProgress_ = lastAliveCheck_ = Clock::now();
}

void ChannelLayer::begin(const OpStamp* op) {
  op_ = op;
  lastProgress_ = Clock::now();
  for (auto& [peer, us] : arrived_) arrivals_[static_cast<size_t>(peer)] = 0;
  arrived_.clear();
  waitingOn_.clear();
}

void ChannelLayer::sampleLink(const Transfer& t, bool send) {
  if (!sampled(t) || t.began == Clock::time_point{}) return;
  tele_.linkSample(t.peer, send, t.bytes,
                   std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t.began).count());
}

void ChannelLayer::wake(bool ifSleeping) {
  if (ifSleeping && !sleeping_.load()) return;
  {
    std::lock_guard<std::mutex> g(connMu_);
    if (local_) local_->wakeSelf();
  }
  uint64_t one = 1;
  if (write(wakeFd_, &one, sizeof(one)) < 0) { /* wake-up is best effort */ }
}

void ChannelLayer::makePair(std::vector<Channel>& v, int peer) {
  // Under connMu_: wake(), markFailed() and close() walk every pair from other threads.
  std::lock_guard<std::mutex> g(connMu_);
  v.resize(std::max<size_t>(nchan_[static_cast<size_t>(peer)], 1));
}

void ChannelLayer::markFailed() {
  std::lock_guard<std::mutex> g(connMu_);
  if (local_) local_->markFailed();
  for (auto& lane : chans_)
    for (auto& peer : lane)
      for (auto& ch : peer)
        if (ch.conn) ch.conn->markFailed();
}

void ChannelLayer::close() {
  std::lock_guard<std::mutex> g(connMu_);
  chans_.clear();
  local_.reset();
}

void ChannelLayer::clear() {
  for (auto& lane : chans_)
    for (auto& peer : lane)
      for (auto& ch : peer) {
        ch.sendq.clear();
        ch.recvq.clear();
        ch.inAddrGot = 0;
      }
}

}  // namespace railcc::engine
