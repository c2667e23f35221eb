#include <cstring>

#include "engine/algorithms/algorithms.h"

namespace railcc::engine {

// The shared-memory broadcast rings, when every rank of the group shares this host: each
// rank writes into its own ring once and every peer copies out of it (n copies of the data
// in all, where per-peer FIFOs make 2(n-1)).

size_t Algorithms::shmRingSlice() const {
  const transport::BroadcastRing own = ch_.local()->broadcastRing(-1);
  size_t cap = own.capacity(), slice = cap / 2 / static_cast<size_t>(size_) / 64 * 64;
  return cap % 64 == 0 && slice >= 64 && (static_cast<size_t>(size_) - 1) * slice <= own.blockMax() ? slice : 0;
}

Algorithms::ShmRings Algorithms::shmRings() {
  ShmRings r;
  r.own = ch_.local()->broadcastRing(-1);
  r.of.resize(static_cast<size_t>(size_));
  r.myIdx = localIndex(rank_);
  for (int p = 0; p < size_; ++p)
    if (p != rank_) {
      r.of[static_cast<size_t>(p)] = ch_.local()->broadcastRing(localIndex(p));
      r.consumers.push_back(localIndex(p));
      r.wake.push_back(ch_.local()->doorbell(localIndex(p)));
      r.on.push_back({kCollLane, p});
    }
  return r;
}

void Algorithms::shmRingTurn(const ShmRings& r, size_t moved, const std::function<bool()>& ready) {
  for (auto& [lane, peer] : r.on)
    moved += ch_.progress(lane, peer);
  if (moved + ch_.pumpBeside() > 0) {
    ch_.touch();
    return;
  }
  ch_.checkInterrupted();
  ch_.idle(r.on, ch_.current()->timeout, opKindName(ch_.current()->kind), ready);
}

// Reductions when every rank shares this host, through the broadcast rings, in chunks. Per
// chunk k each rank q owns a piece of `count(k, q)` elements; `in(k, q)` is our input for it
// and `out(k, q)` where it ends. Each rank writes into its ring the pieces its peers reduce
// (block A: every piece but its own, in rank order), then reduces its own piece in one pass,
// in rank order, straight out of the peers' rings. With `gather` (all-reduce) it then writes
// that result into its ring (block B) and copies every peer's result out of theirs. Each ring
// carries A0 B0 A1 B1 ... (A0 A1 ... without gather); a peer may write A(k+1) while we still
// copy its B(k). For a 4-rank all-reduce of 16 MiB each rank reads and writes about 76 MiB
// where the pairwise reduce-scatter and ring all-gather moved 92 (n-1 reduction passes, each
// reading and writing the accumulator), with two waits per chunk instead of n. Headers are
// checked while the data moves, as in the ring broadcast.
struct Algorithms::ShmRingsReduce {
  size_t nchunks;  // every chunk but the last has the same counts
  std::function<size_t(size_t, int)> count;
  std::function<const char*(size_t, int)> in;
  std::function<char*(size_t, int)> out;
  bool gather;
};

void Algorithms::shmRingsReduce(const ShmRingsReduce& job, DataType dt, ReduceOp op, double scale, bool bypass) {
  const int n = size_, me = rank_;
  const size_t es = dtypeSize(dt), nchunks = job.nchunks, blocks = job.gather ? 2 : 1;
  ShmRings rs = shmRings();
  transport::BroadcastRing& own = rs.own;
  const int myIdx = rs.myIdx;
  std::vector<transport::BroadcastRing>& peerRing = rs.of;
  std::vector<Transfer> sends, recvs;
  headerRound(sends, recvs);
  ch_.exchange(sends);
  ch_.post(recvs);

  // Piece sizes of a chunk, worked out once for the full chunks and once for the last.
  struct Layout {
    std::vector<size_t> bytes, before;  // piece q's bytes, and those of pieces 0..q-1
    size_t total = 0;
  };
  auto layoutOf = [&](size_t k) {
    Layout l;
    for (int q = 0; q < n; ++q) {
      l.before.push_back(l.total);
      l.bytes.push_back(job.count(k, q) * es);
      l.total += l.bytes.back();
    }
    return l;
  };
  const Layout full = layoutOf(0), last = layoutOf(nchunks ? nchunks - 1 : 0);
  auto layout = [&](size_t k) -> const Layout& { return k + 1 == nchunks ? last : full; };
  auto bytes = [&](size_t k, int q) { return layout(k).bytes[static_cast<size_t>(q)]; };
  // Block A of producer p: every piece but p's, in rank order.
  auto offsetInA = [&](size_t k, int p, int q) {
    const Layout& l = layout(k);
    return l.before[static_cast<size_t>(q)] - (p < q ? l.bytes[static_cast<size_t>(p)] : 0);
  };
  auto bytesA = [&](size_t k, int p) { return layout(k).total - bytes(k, p); };

  size_t written = 0, reduced = 0;  // own blocks written (A0 B0 A1 ... or A0 A1 ...), chunks reduced
  std::vector<size_t> read(static_cast<size_t>(n), 0);  // blocks of each peer consumed
  read[static_cast<size_t>(me)] = blocks * nchunks;
  auto done = [&] {
    if (written < blocks * nchunks || reduced < nchunks) return false;
    for (size_t x : read)
      if (x < blocks * nchunks) return false;
    return true;
  };
  // The peers' A blocks of chunk `reduced`, once every one is there (and our own is written).
  auto inputsReady = [&] {
    if (reduced >= nchunks || written <= blocks * reduced) return false;
    for (int p = 0; p < n; ++p)
      if (p != me && (read[static_cast<size_t>(p)] != blocks * reduced ||
                      !peerRing[static_cast<size_t>(p)].block(myIdx, bytesA(reduced, p))))
        return false;
    return true;
  };
  // Our next block, once there is room for it (B only after its chunk is reduced).
  auto nextWrite = [&](bool commit) {
    if (written >= blocks * nchunks) return false;
    size_t k = written / blocks;
    bool isA = written % blocks == 0;
    if (!isA && reduced <= k) return false;
    size_t len = isA ? bytesA(k, me) : bytes(k, me);
    char* dst = own.reserve(len, rs.consumers);
    if (!dst || !commit) return dst != nullptr;
    if (isA) {
      for (int q = 0; q < n; ++q)
        if (q != me) transport::copyBytes(dst + offsetInA(k, me, q), job.in(k, q), bytes(k, q));
    } else {
      transport::copyBytes(dst, job.out(k, me), len);
    }
    own.publish(len, rs.wake);
    ++written;
    return true;
  };
  // A peer's result B(k), once it is there.
  auto resultOf = [&](int p) -> const char* {
    size_t x = read[static_cast<size_t>(p)];
    if (!job.gather || p == me || x % 2 == 0 || x >= 2 * nchunks) return nullptr;
    return peerRing[static_cast<size_t>(p)].block(myIdx, bytes(x / 2, p));
  };
  while (!done()) {
    size_t moved = 0;
    if (nextWrite(true)) moved += 1;
    if (inputsReady()) {
      size_t k = reduced, cnt = bytes(k, me) / es;
      char* out = job.out(k, me);
      const char* mine = job.in(k, me);
      if (op == ReduceOp::kPremulSum) scaleCopy(out, mine, cnt, dt, scale);
      else if (out != mine) transport::moveBytes(out, mine, cnt * es);
      for (int p = 0; p < n; ++p) {
        if (p == me) continue;
        auto& from = peerRing[static_cast<size_t>(p)];
        reduceInto(out, from.block(myIdx, bytesA(k, p)) + offsetInA(k, p, me), cnt, dt, op, scale);
        from.release(myIdx, bytesA(k, p));
        ++read[static_cast<size_t>(p)];
      }
      if (op == ReduceOp::kAvg) divideBy(out, cnt, dt, n);
      ++reduced;
      moved += cnt * es + 1;
    }
    for (int p = 0; p < n; ++p) {
      const char* src = resultOf(p);
      if (!src) continue;
      size_t k = read[static_cast<size_t>(p)] / 2, len = bytes(k, p);
      if (bypass) transport::streamCopy(job.out(k, p), src, len);
      else transport::copyBytes(job.out(k, p), src, len);
      peerRing[static_cast<size_t>(p)].release(myIdx, len);
      ++read[static_cast<size_t>(p)];
      moved += len + 1;
    }
    shmRingTurn(rs, moved, [&] {
      if (nextWrite(false) || inputsReady()) return true;
      for (int p = 0; p < n; ++p)
        if (resultOf(p)) return true;
      return false;
    });
  }
  ch_.complete(recvs);
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    size_t sent = 0, got = 0;  // p reads its piece of our A (and our B); we read ours of its
    for (size_t k = 0; k < nchunks; ++k) {
      sent += bytes(k, p) + (job.gather ? bytes(k, me) : 0);
      got += bytes(k, me) + (job.gather ? bytes(k, p) : 0);
    }
    tele_.opBytes(ch_.current()->traceId, p, sent, got);
  }
}

void Algorithms::allreduceShmRings(char* buf, size_t count, DataType dt, ReduceOp op, double scale) {
  const size_t es = dtypeSize(dt), chunkElems = shmRingSlice() / es * static_cast<size_t>(size_);
  auto chunkOf = [=](size_t k) { return Blocks(std::min(chunkElems, count - k * chunkElems), size_, es); };
  auto piece = [=](size_t k, int q) { return buf + k * chunkElems * es + chunkOf(k).offset(q); };
  ShmRingsReduce job{(count + chunkElems - 1) / chunkElems, [=](size_t k, int q) { return chunkOf(k).count(q); },
                 piece, piece, true};
  shmRingsReduce(job, dt, op, scale, count * es >= ch_.streamMin());
}

void Algorithms::reduceScatterShmRings(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op,
                                       double scale) {
  const size_t es = dtypeSize(dt), chunkElems = shmRingSlice() / es;
  const int me = rank_;
  auto cnt = [=](size_t k) { return std::min(chunkElems, count - k * chunkElems); };
  ShmRingsReduce job{(count + chunkElems - 1) / chunkElems, [=](size_t k, int) { return cnt(k); },
                 [=, &ins](size_t k, int q) -> const char* { return ins[static_cast<size_t>(q)] + k * chunkElems * es; },
                 [=](size_t k, int q) -> char* { return q == me ? out + k * chunkElems * es : nullptr; }, false};
  shmRingsReduce(job, dt, op, scale, false);
}

// All-gather through the broadcast rings: each rank writes its piece once into its own ring
// and copies every peer's piece out of theirs, n copies of each piece in all where per-peer
// FIFOs make 2(n-1). With `headers`, header-only messages check every peer's call first.
void Algorithms::shmRingsGather(const char* mine, const std::vector<size_t>& sizes, const std::vector<char*>& outs,
                                bool headers) {
  int n = size_, me = rank_;
  if (headers) syncRound();
  const size_t chunk = 256u << 10;
  ShmRings rs = shmRings();
  transport::BroadcastRing& own = rs.own;
  const int myIdx = rs.myIdx;
  const size_t myBytes = sizes[static_cast<size_t>(me)];
  size_t total = 0;
  for (size_t s : sizes) total += s;
  size_t wrote = 0;
  std::vector<size_t> got(static_cast<size_t>(n), 0);
  got[static_cast<size_t>(me)] = myBytes;
  auto complete = [&] {
    if (wrote < myBytes) return false;
    for (int p = 0; p < n; ++p)
      if (got[static_cast<size_t>(p)] < sizes[static_cast<size_t>(p)]) return false;
    return true;
  };
  while (!complete()) {
    size_t moved = 0;
    if (wrote < myBytes) {
      size_t k = own.write(mine + wrote, std::min(chunk, myBytes - wrote), rs.consumers, rs.wake);
      wrote += k;
      moved += k;
    }
    for (int p = 0; p < n; ++p) {
      size_t want = sizes[static_cast<size_t>(p)] - got[static_cast<size_t>(p)];
      if (p == me || want == 0) continue;
      auto& ring = rs.of[static_cast<size_t>(p)];
      auto [src, avail] = ring.peek(myIdx);
      size_t k = std::min(avail, want);
      if (k == 0) continue;
      if (ch_.streamPiece(total, sizes[static_cast<size_t>(p)]))
        transport::streamCopy(outs[static_cast<size_t>(p)] + got[static_cast<size_t>(p)], src, k);
      else
        transport::copyBytes(outs[static_cast<size_t>(p)] + got[static_cast<size_t>(p)], src, k);
      ring.consume(myIdx, k);
      got[static_cast<size_t>(p)] += k;
      moved += k;
    }
    shmRingTurn(rs, moved, [&] {
      if (wrote < myBytes && own.canWrite(rs.consumers)) return true;
      for (int p = 0; p < n; ++p)
        if (p != me && got[static_cast<size_t>(p)] < sizes[static_cast<size_t>(p)] &&
            rs.of[static_cast<size_t>(p)].readable(myIdx))
          return true;
      return false;
    });
  }
  for (int p = 0; p < n; ++p)
    if (p != me) tele_.opBytes(ch_.current()->traceId, p, myBytes, sizes[static_cast<size_t>(p)]);
}

void Algorithms::allgatherShmRings(const char* in, size_t bytes, const std::vector<char*>& outs) {
  shmRingsGather(in, std::vector<size_t>(outs.size(), bytes), outs, true);
}

// Broadcast when every rank shares this host: an all-gather through the rings in which only
// the root's piece is not empty. The root writes each byte once and every other rank copies it
// out (n copies of the data in all; a chain of FIFOs makes 2(n-1)).
//
// Every rank sends its call's header to every other rank and checks theirs after the data has
// moved: each waits for one event (the root's data, or for the root the ring's space) instead
// of two (every header, then the data), which on shared cores is one wake-up fewer per rank on
// the critical path. A rank that disagrees (count, dtype, root, another op) makes every rank
// that checks its header fail, the root included, and the root's failure reaches a rank that
// waits on the wrong ring. The header receives are posted before the ring and read while it
// runs, so a rank that took the FIFO chain instead (a root whose count is at most
// RAILCC_ONESHOT_BYTES when ours is larger) fails the rank it sends to at once. Only a
// broadcast larger than the ring has the root wait for the headers first: its writes wait for
// every reader to make room, and a rank reading another ring never would.
void Algorithms::broadcastShmRings(char* buf, size_t bytes, int root) {
  std::vector<size_t> sizes(static_cast<size_t>(size_), 0);
  std::vector<char*> outs(static_cast<size_t>(size_), nullptr);
  sizes[static_cast<size_t>(root)] = bytes;
  outs[static_cast<size_t>(root)] = buf;
  if (rank_ == root && bytes > ch_.local()->broadcastRing(-1).capacity()) {
    syncRound();
    return shmRingsGather(buf, sizes, outs, false);
  }
  std::vector<Transfer> sends, recvs;
  headerRound(sends, recvs);
  ch_.exchange(sends);
  ch_.post(recvs);
  shmRingsGather(buf, sizes, outs, false);
  ch_.complete(recvs);
}

}  // namespace railcc::engine
