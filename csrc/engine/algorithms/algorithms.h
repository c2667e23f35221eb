#pragma once
// The host algorithms of one group: each op's entry (which asks the rule, choose.h, for a row
// of the table, table.h), the run functions the table's rows name, and what they keep between
// ops (scratch buffers, the ring order). They see their group through a narrow, read-only view
// (rank, size, the peers' hosts, this host's ranks, the rail, the placement the rule reads) and
// move data only through the channel layer (channels.h). Private to csrc/engine.
//
// Threads: everything here runs with the engine token held (the progress thread, or a caller
// running its own op). One algorithm a file:
//   dispatch.cpp  each op's entry: the rule's row, or the op's only algorithm
//   one_shot.cpp  every rank's whole buffer to every peer, reduced in rank order
//   pairwise.cpp  pairwise exchange schedules (rank r with r+s and r-s at step s)
//   ring.cpp      rings in host-by-host order (ringOrder)
//   tree.cpp      trees: recursive doubling then a binary tree (all-reduce), a binary tree (broadcast)
//   chain.cpp     chain broadcasts (along the rails where hosts are even)
//   hier.cpp      per host, then per rail (hosts that each run the same number of ranks)
//   shm_rings.cpp the shared-memory broadcast rings (every rank on one host)
//   direct.cpp    every peer at once: all-gather, all-to-all, gather, scatter, barrier, rounds
//   peers.cpp     the peers the plans meet (what set-up connects), this group's PlanShape
//   estimate.cpp  what an op would take, from the same plans (c10d's time estimator)

#include <functional>
#include <vector>

#include "common/config.h"
#include "engine/algorithms/choose.h"
#include "engine/algorithms/plan.h"
#include "engine/channels.h"
#include "engine/communicator.h"
#include "engine/telemetry.h"

namespace railcc::engine {

struct AlgoRow;

// What partial results are reduced with between ranks: a sum for PREMUL_SUM (each term scaled
// once where it entered) and AVG (divided once at the end).
inline ReduceOp acrossRanks(ReduceOp op) {
  return op == ReduceOp::kPremulSum || op == ReduceOp::kAvg ? ReduceOp::kSum : op;
}

// This rank's own term of a reduction into `dst` (may be `src`): PREMUL_SUM's factor applied.
inline void ownTerm(char* dst, const char* src, size_t count, DataType dt, ReduceOp op, double scale) {
  if (op == ReduceOp::kPremulSum) scaleCopy(dst, src, count, dt, scale);
  else if (dst != src && count) transport::moveBytes(dst, src, count * dtypeSize(dt));
}

// An all-gather's own piece, from the input to its place in the output (dispatch.cpp).
void copyOwnPiece(const ChannelLayer& ch, int n, char* own, const char* in, size_t bytes);

class Algorithms {
 public:
  // The group as the algorithms see it. Set-up (bootstrap.cpp) fills these in before the first
  // op and never changes them after; the algorithms only read them.
  struct Group {
    const std::vector<PeerInfo>& peers;   // hostId per rank
    const std::vector<int>& localRanks;   // the ranks sharing this host's memory, ours included
    const std::vector<int>& rail;         // see CommImpl::rail_
    const AlgoPlace& place;               // what the rule reads of the placement
    const std::vector<Algo>& prefer;      // RAILCC_ALGO / NCCL_ALGO
  };
  Algorithms(ChannelLayer& ch, const Config& config, Telemetry& tele, int rank, int size, Group g);

  // ---- each op's entry (dispatch.cpp, direct.cpp)
  void allreduce(char* buf, size_t count, DataType dt, ReduceOp op, double scale);
  // Fuses small buffers into buckets of RAILCC_BUCKET_SIZE; one all-reduce per bucket.
  void allreduceCoalesced(const std::vector<char*>& bufs, const std::vector<size_t>& counts, DataType dt, ReduceOp op,
                          double scale);
  void reduce(char* buf, size_t count, DataType dt, ReduceOp op, double scale, int root);
  void allgather(const char* in, size_t bytes, const std::vector<char*>& outs);
  void reduceScatter(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op, double scale);
  void broadcast(char* buf, size_t bytes, int root);
  void alltoall(const std::vector<char*>& ins, const std::vector<size_t>& inCounts, const std::vector<char*>& outs,
                const std::vector<size_t>& outCounts, DataType dt);
  void gather(const char* in, size_t bytes, const std::vector<char*>& outs, int root);
  void scatter(const std::vector<char*>& ins, char* out, size_t bytes, int root);
  void barrier();
  // A zero-byte message to and from every peer: each rank knows every peer has reached this
  // point of the op (and the headers check that all called the same op).
  void syncRound();
  // The transfers of one such round, for callers that wait on the two halves separately.
  void headerRound(std::vector<Transfer>& sends, std::vector<Transfer>& recvs);

  // ---- what others ask of the algorithms
  bool oneshot(size_t bytes) const { return size_ > 1 && static_cast<int64_t>(bytes) <= config_.oneshotBytes; }
  // Whether every rank shares this host's memory and there are enough of them for the
  // broadcast rings to save copies (with two ranks a ring and a FIFO copy the same).
  bool shmRingsCover() const { return size_ > 2 && static_cast<int>(localRanks_.size()) == size_; }
  // Bytes of one rank's slice per chunk of the two-shot all-reduce: a multiple of 64, so that a
  // chunk's n-1 slices (block A) stay within BroadcastRing::blockMax(); 0 where rings are too small.
  size_t shmRingSlice() const;
  const std::vector<int>& ringOrder();  // ring.cpp: hosts in order of their lowest rank
  PlanShape planShape();                // peers.cpp: this group's shape, for its algorithms' plans
  std::vector<int> collectivePeers();   // peers.cpp: the peers the collectives' plans meet
  // estimate.cpp: how long an op of `bytes` (a rank's block for reduce_scatter and all_gather,
  // the most to one peer for all-to-all) would take on this rank, without running it (c10d's
  // time estimator). Each step of this rank's plan costs the largest latency of the peers it
  // meets plus the time of its bytes on each peer's link (`byPeer`, indexed by rank); the ops
  // without a row of the table by their one shape. Reductions' own time is not counted.
  struct LinkCost {
    double latencyUs = 0, usPerByte = 0;
  };
  double estimateUs(OpKind kind, size_t bytes, const std::vector<LinkCost>& byPeer);

 private:
  friend const AlgoRow& algoRow(Algo a);  // the table names the run functions
  Algo algoFor(AlgoOp op, size_t bytes) const { return chooseAlgo(op, bytes, place_, prefer_, nullptr); }
  int localIndex(int r) const { return ch_.localIndex(r); }

  // one_shot.cpp. One step: `blockOf(p)` goes to every peer p, and every peer's block for us
  // lands in the scratch area; then block 0 (op) block 1 (op) ... in rank order, so every rank
  // computes bit-identical results whatever order the messages arrived in.
  void oneshotReduce(const std::function<const char*(int)>& blockOf, char* out, size_t count, DataType dt,
                     ReduceOp op, double scale);
  void allreduceOneShot(char* buf, size_t count, DataType dt, ReduceOp op, double scale);
  void reduceScatterOneShot(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op,
                            double scale);
  // pairwise.cpp: among the ranks `g` (which include us), on `count` elements of `buf` split
  // into |g| blocks: block j ends reduced at g[j]; then every block everywhere.
  void pairwiseReduceScatter(const std::vector<int>& g, char* buf, size_t count, DataType dt, ReduceOp op,
                             double scale);
  void pairwiseAllgather(const std::vector<int>& g, char* buf, size_t count, size_t es);
  void allreducePairwise(char* buf, size_t count, DataType dt, ReduceOp op, double scale);
  void reduceScatterPairwise(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op,
                             double scale);
  // ring.cpp: neighbours only, host by host.
  void ringReduceScatter(const std::vector<int>& g, char* buf, size_t count, DataType dt, ReduceOp op);
  void ringAllgather(const std::vector<int>& g, const std::vector<char*>& blocks, const std::vector<size_t>& sizes);
  void ringAllgatherBlocks(const std::vector<int>& g, char* buf, size_t count, size_t es);  // g.size() blocks
  void allreduceRing(char* buf, size_t count, DataType dt, ReduceOp op, double scale);
  void allgatherRing(const char* in, size_t bytes, const std::vector<char*>& outs);  // own piece in place
  void reduceScatterRing(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op,
                         double scale);
  // hier.cpp: per host, then per rail.
  void allreduceHier(char* buf, size_t count, DataType dt, ReduceOp op, double scale);
  void allgatherHier(const char* in, size_t bytes, const std::vector<char*>& outs);  // own piece in place
  void reduceScatterHier(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op,
                         double scale);
  // tree.cpp: all-reduce by recursive doubling (then a binary tree along the rails at scale),
  // broadcast by a binary tree along the root's rail and within each host.
  void allreduceTree(char* buf, size_t count, DataType dt, ReduceOp op, double scale);
  void broadcastTree(char* buf, size_t bytes, int root);
  // chain.cpp
  void broadcastChain(char* buf, size_t bytes, int root);
  void broadcastRailChain(char* buf, size_t bytes, int root);  // the chain where hosts hold equal counts
  void broadcastChains(char* buf, size_t bytes, int root);     // the rail chain where it runs, else the chain
  void allgatherDirect(const char* in, size_t bytes, const std::vector<char*>& outs);  // direct.cpp
  // One turn of progress on every peer's channel, for a step whose transfers are posted: the
  // peers get our addresses (or first bytes) before this rank copies its own piece (direct.cpp).
  void startPeers();

  // shm_rings.cpp: every same-host rank's broadcast ring, as an op that moves data through
  // them sees them.
  struct ShmRings {
    transport::BroadcastRing own;
    std::vector<transport::BroadcastRing> of;  // by rank; ours is empty
    std::vector<int> consumers;                 // local indices of the peers reading ours
    std::vector<transport::Doorbell*> wake;
    std::vector<std::pair<int, int>> on;  // the collective lane of every peer
    int myIdx = 0;
  };
  ShmRings shmRings();
  // The end of one pass of a ring op's loop: reads the messages posted on the collective lane
  // before the op (its header receives), so that a rank that took another path fails here and
  // not at its timeout; then, if nothing moved, sleeps until `ready` may hold.
  void shmRingTurn(const ShmRings& r, size_t moved, const std::function<bool()>& ready);
  struct ShmRingsReduce;
  void shmRingsReduce(const ShmRingsReduce& job, DataType dt, ReduceOp op, double scale, bool bypass);
  void shmRingsGather(const char* mine, const std::vector<size_t>& sizes, const std::vector<char*>& outs,
                      bool headers);
  void allreduceShmRings(char* buf, size_t count, DataType dt, ReduceOp op, double scale);
  void reduceScatterShmRings(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op,
                             double scale);
  void allgatherShmRings(const char* in, size_t bytes, const std::vector<char*>& outs);
  void broadcastShmRings(char* buf, size_t bytes, int root);

  ChannelLayer& ch_;
  const Config& config_;
  Telemetry& tele_;
  const int rank_, size_;
  const std::vector<PeerInfo>& peers_;
  const std::vector<int>& localRanks_;
  const std::vector<int>& rail_;
  const AlgoPlace& place_;
  const std::vector<Algo>& prefer_;

  // Kept between ops, so that a warm op allocates nothing.
  std::vector<char> bucket_;       // allreduceCoalesced's bucket
  std::vector<int> ring_;          // ringOrder(), once known
  std::vector<char> treeScratch_;  // what a recursive-doubling step sends while buf is reduced into
  // One-shot receive area (n blocks of at most RAILCC_ONESHOT_BYTES); the partial sums of the
  // ring and per-rail reduce-scatters (let go after an op that needed more than kScratchKeep).
  std::vector<char> scratch_;
  std::vector<Transfer> oneshotXs_;  // oneshotReduce()'s
  // The reduce-scatters' partial sums up to this size are kept (a bucket of a few tens of MiB
  // per host is reused op after op); a larger one is let go after its op.
  static constexpr size_t kScratchKeep = size_t(64) << 20;
};

}  // namespace railcc::engine
