#pragma once

// Every collective of the engine, checked bit-exact against a reference computed here, at
// odd and zero counts: what a new transport must carry (pipe and verbs tests).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ranks.h"

namespace railcc::engine::testing_util {

// Integer-valued data: every reduction below is exact in any order.
inline float val(int rank, size_t i, int salt) {
  return static_cast<float>((static_cast<int>(i) * (rank + 3) + salt + rank) % 97 - 48);
}

/// Runs every collective on `c` (one of `n` ranks) and checks each result; `transport` is the
/// start of the description every peer's connection must have ("pipe ", "verbs ").
inline void everyCollectiveIsBitExact(Communicator& c, int n, const std::string& transport, size_t maxCount = 300001) {
  const int r = c.rank();
  EXPECT_EQ(c.peers()[static_cast<size_t>((r + 1) % n)].transport.rfind(transport, 0), 0u)
      << c.peers()[static_cast<size_t>((r + 1) % n)].transport;
  for (size_t count : {size_t(0), size_t(1), size_t(7), size_t(4099), size_t(300001)}) {
    if (count > maxCount) continue;
    int salt = static_cast<int>(count % 13);
    auto ref = [&](size_t i, ReduceOp op) {
      float acc = val(0, i, salt);
      for (int q = 1; q < n; ++q) {
        float v = val(q, i, salt);
        acc = op == ReduceOp::kSum ? acc + v : op == ReduceOp::kMax ? std::max(acc, v) : std::min(acc, v);
      }
      return acc;
    };
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
      std::vector<float> b(count);
      for (size_t i = 0; i < count; ++i) b[i] = val(r, i, salt);
      waitOk(c.allreduce(b.data(), count, DataType::kFloat32, op));
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(b[i], ref(i, op)) << "allreduce " << reduceOpName(op) << " i=" << i;
    }
    {  // int64 product over small values and a coalesced pair
      std::vector<int64_t> a(count), d(count + 3);
      for (size_t i = 0; i < count; ++i) a[i] = (static_cast<int64_t>(i) + r) % 3 + 1;
      for (size_t i = 0; i < count + 3; ++i) d[i] = static_cast<int64_t>(i) * (r + 1);
      waitOk(c.allreduce(a.data(), count, DataType::kInt64, ReduceOp::kProduct));
      waitOk(c.allreduceCoalesced({d.data()}, {count + 3}, DataType::kInt64, ReduceOp::kSum));
      for (size_t i = 0; i < count; ++i) {
        int64_t want = 1;
        for (int q = 0; q < n; ++q) want *= (static_cast<int64_t>(i) + q) % 3 + 1;
        ASSERT_EQ(a[i], want);
      }
      for (size_t i = 0; i < count + 3; ++i) ASSERT_EQ(d[i], static_cast<int64_t>(i) * n * (n + 1) / 2);
    }
    int root = n - 1;
    {
      std::vector<float> b(count);
      for (size_t i = 0; i < count; ++i) b[i] = val(r == root ? 100 : r, i, salt);
      waitOk(c.broadcast(b.data(), count, DataType::kFloat32, root));
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(b[i], val(100, i, salt)) << "broadcast";
      for (size_t i = 0; i < count; ++i) b[i] = val(r, i, salt);
      waitOk(c.reduce(b.data(), count, DataType::kFloat32, ReduceOp::kSum, root));
      if (r == root)
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(b[i], ref(i, ReduceOp::kSum)) << "reduce";
    }
    {
      std::vector<float> in(count);
      for (size_t i = 0; i < count; ++i) in[i] = val(r, i, salt);
      std::vector<std::vector<float>> outs(static_cast<size_t>(n), std::vector<float>(count));
      std::vector<void*> po;
      for (auto& o : outs) po.push_back(o.data());
      waitOk(c.allgather(in.data(), count, DataType::kFloat32, po));
      for (int q = 0; q < n; ++q)
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(outs[static_cast<size_t>(q)][i], val(q, i, salt)) << "allgather";
      std::vector<std::vector<float>> g(static_cast<size_t>(n), std::vector<float>(count, -1));
      std::vector<void*> pg;
      for (auto& o : g) pg.push_back(o.data());
      waitOk(c.gather(in.data(), count, DataType::kFloat32, r == 0 ? pg : std::vector<void*>{}, 0));
      if (r == 0)
        for (int q = 0; q < n; ++q)
          for (size_t i = 0; i < count; ++i) ASSERT_EQ(g[static_cast<size_t>(q)][i], val(q, i, salt)) << "gather";
      // reduce_scatter: block q of rank p is val(p, q * count + i)
      std::vector<std::vector<float>> blocks(static_cast<size_t>(n), std::vector<float>(count));
      std::vector<const void*> pb;
      for (int q = 0; q < n; ++q) {
        for (size_t i = 0; i < count; ++i) blocks[static_cast<size_t>(q)][i] = val(r, static_cast<size_t>(q) * count + i, salt);
        pb.push_back(blocks[static_cast<size_t>(q)].data());
      }
      std::vector<float> out(count);
      waitOk(c.reduceScatter(pb, out.data(), count, DataType::kFloat32, ReduceOp::kSum));
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(out[i], ref(static_cast<size_t>(r) * count + i, ReduceOp::kSum)) << "reduce_scatter";
      // scatter from rank 0: rank q gets block q of rank 0's
      std::vector<float> sc(count, -1);
      waitOk(c.scatter(r == 0 ? pb : std::vector<const void*>{}, sc.data(), count, DataType::kFloat32, 0));
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(sc[i], val(0, static_cast<size_t>(r) * count + i, salt)) << "scatter";
      // alltoall with uneven counts: rank p sends (p + q) % 3 * count / 2 elements to q
      auto cnt = [&](int p, int q) { return static_cast<size_t>((p + q) % 3) * count / 2; };
      std::vector<std::vector<float>> src(static_cast<size_t>(n)), dst(static_cast<size_t>(n));
      std::vector<const void*> ps;
      std::vector<void*> pd;
      std::vector<size_t> ic, oc;
      for (int q = 0; q < n; ++q) {
        src[static_cast<size_t>(q)].resize(cnt(r, q));
        for (size_t i = 0; i < cnt(r, q); ++i) src[static_cast<size_t>(q)][i] = val(r * n + q, i, salt);
        dst[static_cast<size_t>(q)].resize(cnt(q, r));
        ps.push_back(src[static_cast<size_t>(q)].data());
        pd.push_back(dst[static_cast<size_t>(q)].data());
        ic.push_back(cnt(r, q));
        oc.push_back(cnt(q, r));
      }
      waitOk(c.alltoall(ps, ic, pd, oc, DataType::kFloat32));
      for (int q = 0; q < n; ++q)
        for (size_t i = 0; i < cnt(q, r); ++i) ASSERT_EQ(dst[static_cast<size_t>(q)][i], val(q * n + r, i, salt)) << "alltoall";
    }
    {  // send/recv around the ring, then a barrier
      std::vector<float> s(count), got(count, -1);
      for (size_t i = 0; i < count; ++i) s[i] = val(r, i, salt + 1);
      auto sr = c.send(s.data(), count * sizeof(float), (r + 1) % n, 5);
      waitOk(c.recv(got.data(), count * sizeof(float), (r - 1 + n) % n, 5));
      waitOk(sr);
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(got[i], val((r - 1 + n) % n, i, salt + 1)) << "send/recv";
      waitOk(c.barrier());
    }
  }
}

}  // namespace railcc::engine::testing_util
