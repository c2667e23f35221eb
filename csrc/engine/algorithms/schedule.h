#pragma once
// Which peer and which block, step by step: the schedules of the engine's algorithms as pure
// functions of (group size, position, step). The algorithms (ring.cpp, tree.cpp,
// pairwise.cpp, chain.cpp) move bytes by them, and the scale simulation (engine/simulate.h) counts
// by them, so a simulated schedule is the one the engine runs.

namespace railcc::engine::schedule {

inline int mod(int a, int m) { return ((a % m) + m) % m; }

/// One step of a ring of `m` at position `i`: the block sent to i+1, the block received from
/// i-1.
struct RingStep {
  int send, recv;
};

/// Reduce-scatter around the ring, steps s = 0 .. m-2: block j ends reduced at position j.
/// The block received (and reduced) at step s is the one sent at step s + 1.
inline RingStep ringReduceStep(int m, int i, int s) { return {mod(i - 1 - s, m), mod(i - 2 - s, m)}; }

/// All-gather around the ring, steps s = 0 .. m-2: block j starts at position j.
inline RingStep ringGatherStep(int m, int i, int s) { return {mod(i - s, m), mod(i - 1 - s, m)}; }

/// Pairwise exchange, steps s = 1 .. m-1: position i sends to i+s and receives from i-s.
struct PairStep {
  int to, from;
};
inline PairStep pairwiseStep(int m, int i, int s) { return {mod(i + s, m), mod(i - s, m)}; }

/// Recursive doubling among n ranks (tree.cpp). With p the largest power of two up to n, the
/// first 2(n - p) ranks fold in pairs (the even one hands its buffer to the odd one after it
/// and gets the result back); the p ranks left exchange with the partner whose virtual index
/// differs in one bit, one bit per step.
struct Doubling {
  int p = 1, folded = 0;
  int v = -1;         // this rank's virtual index among the p; -1 for a rank that handed on
  int foldPeer = -1;  // the rank it folds with, -1 when none
  bool hands = false; // it hands its buffer on (and gets the result back)
};

inline Doubling doubling(int n, int r) {
  Doubling d;
  while (d.p * 2 <= n) d.p *= 2;
  d.folded = n - d.p;
  d.v = r - d.folded;
  if (r < 2 * d.folded) {
    d.hands = r % 2 == 0;
    d.v = d.hands ? -1 : r / 2;
    d.foldPeer = d.hands ? r + 1 : r - 1;
  }
  return d;
}

/// The steps this rank takes: log2(p) exchanges, plus handing on and taking back for a rank
/// that folds (only those two for the one that hands its buffer on).
inline int doublingSteps(const Doubling& d) {
  int bits = 0;
  for (int bit = 1; bit < d.p; bit <<= 1) ++bits;
  return d.foldPeer < 0 ? bits : d.v < 0 ? 2 : bits + 2;
}

/// The rank this one exchanges with at the step of `bit` (1, 2, 4, ... below p).
inline int doublingPartner(const Doubling& d, int bit) {
  const int pv = d.v ^ bit;
  return pv < d.folded ? 2 * pv + 1 : pv + d.folded;
}

/// A binary tree over m positions rooted at 0 (the small all-reduce along a rail, tree.cpp):
/// position i's parent is (i-1)/2, its children 2i+1 and 2i+2 where they exist. A rank
/// receives its children's sums in one step (and reduces them in child order, so that every
/// rail computes the same bits), sends the sum up, gets the whole back and sends it down:
/// 1 step with children, 2 with a parent, 1 more with children.
struct TreeLinks {
  int parent = -1;
  int kids[2] = {-1, -1};
  int nkids = 0;
};

inline TreeLinks binaryTree(int m, int i) {
  TreeLinks t;
  if (i > 0) t.parent = (i - 1) / 2;
  for (int c = 2 * i + 1; c <= 2 * i + 2 && c < m; ++c) t.kids[t.nkids++] = c;
  return t;
}

inline int treeSteps(const TreeLinks& t) { return (t.parent >= 0 ? 2 : 0) + (t.nkids > 0 ? 2 : 0); }

/// The small broadcast (tree.cpp) over H hosts of L ranks each, ranks numbered h*L + l
/// (host h, local index l), from the root at (hr, lr): the ranks of the root's local index run
/// a binary tree over the hosts from the root's host on, and each of them heads a binary tree
/// over its host's ranks from its own local index on. Only H - 1 messages cross the network;
/// with L = 1 it is one binary tree over all ranks. A rank with a parent takes the payload
/// from it, then sends it to its children (those across hosts first) while it waits for each
/// child's empty acknowledgement, then acknowledges to its parent: the root returns only once
/// every rank took a message that named the same root. Depth down, and as much back up.
struct BcastLinks {
  int parent = -1;
  int kids[4] = {-1, -1, -1, -1};
  int nkids = 0;
};

inline BcastLinks bcastTree(int H, int L, int hr, int lr, int h, int l) {
  BcastLinks b;
  const int p = mod(h - hr, H), q = mod(l - lr, L);
  auto at = [&](int hp, int lq) { return mod(hp + hr, H) * L + mod(lq + lr, L); };
  if (q == 0) {
    const TreeLinks t = binaryTree(H, p);
    if (t.parent >= 0) b.parent = at(t.parent, 0);
    for (int k = 0; k < t.nkids; ++k) b.kids[b.nkids++] = at(t.kids[k], 0);
  }
  const TreeLinks u = binaryTree(L, q);
  if (q > 0) b.parent = at(p, u.parent);
  for (int k = 0; k < u.nkids; ++k) b.kids[b.nkids++] = at(p, u.kids[k]);
  return b;
}

inline int bcastSteps(const BcastLinks& b) { return (b.parent >= 0 ? 2 : 0) + (b.nkids > 0 ? 1 : 0); }

/// The large broadcast across hosts of L >= 2 ranks each (direct.cpp), ranks numbered h*L + l,
/// from the root at (hr, lr): a pipelined chain along the root's rail (H - 1 hops), and from
/// each rank of it a chain through its host's other ranks (L - 1 hops): the last rank has the
/// payload H + L - 2 hops after the root, where one chain through every rank takes n - 1.
/// Every rank forwards bytes as they arrive. Acknowledgements: a host's last rank tells its
/// host's rail rank once it took a header naming the same root; a rail rank, once it has the
/// whole payload and both its host's and the next host's acknowledgements, tells the rail rank
/// before it; so the root returns once every rank has agreed.
struct ChainLinks {
  int from = -1;                // the payload comes from
  int to[2] = {-1, -1};         // and goes on to (the next host's rail rank first)
  int nto = 0;
  int acksFrom[2] = {-1, -1};   // acknowledgements awaited with the payload
  int nacks = 0;
  int tailAck = -1;             // a host's last rank: acknowledges here once its header is in
  int ackTo = -1;               // a rail rank: acknowledges here once everything above is done
};

inline ChainLinks railChain(int H, int L, int hr, int lr, int h, int l) {
  ChainLinks c;
  const int p = mod(h - hr, H), q = mod(l - lr, L);
  auto at = [&](int hp, int lq) { return mod(hp + hr, H) * L + mod(lq + lr, L); };
  if (q == 0) {
    if (p > 0) c.from = c.ackTo = at(p - 1, 0);
    if (p < H - 1) c.to[c.nto++] = c.acksFrom[c.nacks++] = at(p + 1, 0);
    if (L > 1) {
      c.to[c.nto++] = at(p, 1);
      c.acksFrom[c.nacks++] = at(p, L - 1);
    }
  } else {
    c.from = at(p, q - 1);
    if (q < L - 1) c.to[c.nto++] = at(p, q + 1);
    else c.tailAck = at(p, 0);
  }
  return c;
}

/// Steps as the simulation counts them: take the payload; forward it (and await or send the
/// acknowledgements); a rail rank with a rail rank before it acknowledges in a step of its own.
inline int railChainSteps(const ChainLinks& c) {
  return (c.from >= 0 ? 1 : 0) + (c.nto > 0 || c.nacks > 0 || c.tailAck >= 0 ? 1 : 0) + (c.ackTo >= 0 ? 1 : 0);
}

}  // namespace railcc::engine::schedule
