#include "engine/communicator.h"

#include "common/pid.h"
#include "common/log.h"
#include "common/waits.h"
#include "engine/comm_impl.h"

namespace railcc::engine {

// ---------------------------------------------------------------------------------------
// Communicator: validation on the caller's thread, then the op's body for the progress thread.

Communicator::Communicator(Store& store, CommOptions opts)
    : impl_(std::make_unique<CommImpl>(store, std::move(opts))), ownerPid_(static_cast<int>(thisPid())) {}
Communicator::~Communicator() {
  // A forked child has none of the parent's threads (joining them would hang) and must not
  // close or unlink what the parent still uses: it leaves the copy as it is.
  if (forked()) (void)impl_.release();
}
bool Communicator::forked() const { return static_cast<int>(thisPid()) != ownerPid_; }
int Communicator::rank() const { return impl_->rank_; }
int Communicator::size() const { return impl_->size_; }
const std::vector<PeerInfo>& Communicator::peers() const { return impl_->peers_; }
std::string Communicator::transportTo(int r) const { return impl_->linkOf(r); }
const Config& Communicator::config() const { return impl_->opts_.config; }
void Communicator::abort(const std::string& why) {
  if (!forked()) impl_->abort(why);
}
void Communicator::poke() { impl_->poke(); }
bool Communicator::drain(Millis timeout) {
  if (forked()) return true;  // the parent's ops are none of this process's
  impl_->poke();              // an op queued under CallerWaits that nobody waits on
  auto until = std::chrono::steady_clock::now() + boundedWait(timeout);
  while (impl_->opsLive_.load(std::memory_order_acquire) > 0) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(Millis(1));
  }
  return true;
}
bool Communicator::wait(const RequestPtr& req, Millis timeout) {
  if (req->completed()) return true;
  if (forked()) impl_->checkOwner();  // never run or wake a parent's op in a child
  if (timeout.count() < 0) impl_->helpRun(req.get());
  else impl_->poke();  // it may have been queued under CallerWaits, with nobody woken for it
  return req->wait(timeout);
}
void Communicator::shutdown() {
  if (!forked()) impl_->shutdown();
}
std::exception_ptr Communicator::brokenError() const {
  std::lock_guard<std::mutex> g(impl_->health_.errMu);
  return impl_->health_.broken;
}
std::vector<int> Communicator::laterDead() const {
  std::lock_guard<std::mutex> g(impl_->health_.errMu);
  return impl_->health_.laterDead;
}
std::vector<int> Communicator::stillSilent(const std::vector<int>& globals) { return impl_->watchdog_.stillSilent(globals); }
std::string Communicator::traceJson(const std::string& reason) const { return impl_->watchdog_.traceJson(reason); }
std::string Communicator::dumpTrace(const std::string& reason, const std::string& dir) const {
  return impl_->watchdog_.writeTrace(reason, dir);
}
std::string Communicator::stragglerReport() { return impl_->watchdog_.stragglerReport(); }
uint64_t Communicator::collectiveCount() const { return impl_->q_.collSeq.load(); }
void Communicator::startTimeEstimate() { impl_->startEstimate(); }
double Communicator::endTimeEstimate() { return impl_->endEstimate(); }
std::shared_ptr<void> Communicator::allocateShared(int device, size_t bytes) {
  return forked() ? nullptr : impl_->device_.allocateShared(device, bytes);
}
bool Communicator::offersShared() const { return !forked() && impl_->device_.offersShared(); }

namespace {
void checkRoot(int root, int size, const char* what) {
  RAILCC_CHECK_ARG(root >= 0 && root < size, what, ": root rank ", root, " is out of range for a group of size ", size);
}

// A send or receive on the point-to-point lane, its header filled in; the caller sets the buffer.
std::unique_ptr<Op> p2pOp(Transfer::Kind kind, int peer, size_t bytes, int tag, Millis timeout,
                          std::shared_ptr<DeviceSide> gpu) {
  auto o = std::make_unique<Op>();
  o->kind = OpKind::kP2P;
  o->p2p = true;
  o->timeout = timeout;
  o->xfer.kind = kind;
  o->xfer.lane = kP2PLane;
  o->xfer.peer = peer;
  o->xfer.bytes = bytes;
  o->xfer.device = gpu.get();
  o->gpu = std::move(gpu);
  o->xfer.hdr.magic = kWireMagic;
  o->xfer.hdr.kind = static_cast<uint8_t>(OpKind::kP2P);
  o->xfer.hdr.tag = tag;
  o->xfer.hdr.bytes = bytes;
  return o;
}
}  // namespace

RequestPtr Communicator::allreduce(void* buf, size_t count, DataType dt, ReduceOp op, double scale, Millis timeout,
                                   Placement where) {
  checkReduceSupported(op, dt);
  CommImpl* c = impl_.get();
  auto o = c->collective(OpKind::kAllreduce, dt, op, 0, count, timeout);
  auto run = [c, dt, op, scale](char* b, size_t n) { c->algos_.allreduce(b, n, dt, op, scale); };
  char* b8 = static_cast<char*>(buf);
  c->device_.setBody(*o, where, dt, [b8, count, run] { run(b8, count); }, [&] {
    return DevicePlan::of(Region::inOut(b8, count),
                [run](const std::vector<char*>& h, const std::vector<size_t>& n) { run(h[0], n[0]); },
                [c, b8, count, dt, op, scale](const DeviceOp& dv) {
                  c->device_.runIpcAllreduce(dv, {{b8, count}}, dt, op, scale);
                });
  });
  return c->enqueue(std::move(o));
}


RequestPtr Communicator::allreduceCoalesced(std::vector<void*> bufs, std::vector<size_t> counts, DataType dt,
                                            ReduceOp op, double scale, Millis timeout, Placement where) {
  checkReduceSupported(op, dt);
  RAILCC_CHECK_ARG(bufs.size() == counts.size(), "allreduce_coalesced: ", bufs.size(), " buffers but ", counts.size(), " counts");
  CommImpl* c = impl_.get();
  size_t total = 0;
  for (size_t n : counts) total += n;
  auto o = c->collective(OpKind::kAllreduceCoalesced, dt, op, 0, total, timeout);
  std::vector<char*> ptrs;
  for (void* b : bufs) ptrs.push_back(static_cast<char*>(b));
  c->device_.setBody(*o, where, dt, [c, ptrs, counts, dt, op, scale] { c->algos_.allreduceCoalesced(ptrs, counts, dt, op, scale); }, [&] {
    DevicePlan p;
    std::vector<std::pair<char*, size_t>> segs;
    for (size_t i = 0; i < ptrs.size(); ++i) {
      p.regions.push_back(Region::inOut(ptrs[i], counts[i]));
      segs.push_back({ptrs[i], counts[i]});
    }
    p.slots = p.regions.size();
    p.host = [c, dt, op, scale](const std::vector<char*>& h, const std::vector<size_t>& n) {
      c->algos_.allreduceCoalesced(h, n, dt, op, scale);
    };
    p.ipc = [c, segs, dt, op, scale](const DeviceOp& dv) { c->device_.runIpcAllreduce(dv, segs, dt, op, scale); };
    return p;
  });
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::broadcast(void* buf, size_t count, DataType dt, int root, Millis timeout, Placement where) {
  CommImpl* c = impl_.get();
  checkRoot(root, c->size_, "broadcast");
  auto o = c->collective(OpKind::kBroadcast, dt, ReduceOp::kSum, root, count, timeout);
  auto run = [c, dt, root](char* buf, size_t count) { c->algos_.broadcast(buf, count * dtypeSize(dt), root); };
  char* b8 = static_cast<char*>(buf);
  c->device_.setBody(*o, where, dt, [b8, count, run] { run(b8, count); }, [&] {
    bool isRoot = c->rank_ == root;
    return DevicePlan::of(isRoot ? Region::input(b8, count) : Region::output(b8, count),
                [run](const std::vector<char*>& h, const std::vector<size_t>& n) { run(h[0], n[0]); },
                [c, b8, count, dt, root](const DeviceOp& dv) { c->device_.runIpcBroadcast(dv, b8, count, dt, root); });
  });
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::reduce(void* buf, size_t count, DataType dt, ReduceOp op, int root, double scale, Millis timeout,
                                Placement where) {
  checkReduceSupported(op, dt);
  CommImpl* c = impl_.get();
  checkRoot(root, c->size_, "reduce");
  auto o = c->collective(OpKind::kReduce, dt, op, root, count, timeout);
  auto run = [c, dt, op, root, scale](char* buf, size_t count) { c->algos_.reduce(buf, count, dt, op, scale, root); };
  char* b8 = static_cast<char*>(buf);
  c->device_.setBody(*o, where, dt, [b8, count, run] { run(b8, count); }, [&] {
    return DevicePlan::of(c->rank_ == root ? Region::inOut(b8, count) : Region::input(b8, count),
                [run](const std::vector<char*>& h, const std::vector<size_t>& n) { run(h[0], n[0]); },
                [c, b8, count, dt, op, scale, root](const DeviceOp& dv) {
                  c->device_.runIpcReduce(dv, b8, count, dt, op, scale, root);
                });
  });
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::allgather(const void* in, size_t count, DataType dt, std::vector<void*> outs, Millis timeout,
                                   Placement where) {
  CommImpl* c = impl_.get();
  RAILCC_CHECK_ARG(static_cast<int>(outs.size()) == c->size_, "allgather: ", outs.size(),
                   " output buffers for a group of size ", c->size_);
  // The input is sent while the pieces arrive and this rank's own is copied: one that shares
  // bytes with a piece, unless it is this rank's own exactly (in place), would be overwritten
  // before it is all sent.
  const size_t bytes = count * dtypeSize(dt);
  const char* i8 = static_cast<const char*>(in);
  for (int p = 0; p < c->size_ && bytes > 0; ++p) {
    const char* q = static_cast<const char*>(outs[static_cast<size_t>(p)]);
    RAILCC_CHECK_ARG(q + bytes <= i8 || i8 + bytes <= q || (p == c->rank_ && q == i8), "allgather: the input overlaps ",
                     p == c->rank_ ? "this rank's own" : "rank " + std::to_string(p) + "'s",
                     " piece of the output without being it; pass a separate input, or exactly this rank's piece (rank ",
                     c->rank_, ") for an in-place call");
  }
  auto o = c->collective(OpKind::kAllgather, dt, ReduceOp::kSum, 0, count, timeout);
  auto run = [c, dt](const char* in, size_t count, const std::vector<char*>& outs) {
    c->algos_.allgather(in, count * dtypeSize(dt), outs);
  };
  std::vector<char*> o8;
  for (void* p : outs) o8.push_back(static_cast<char*>(p));
  char* in8 = const_cast<char*>(static_cast<const char*>(in));
  c->device_.setBody(*o, where, dt, [in8, count, o8, run] { run(in8, count, o8); }, [&] {
    DevicePlan p;
    p.regions.push_back(Region::input(in8, count));
    for (char* q : o8) p.regions.push_back(Region::output(q, count));
    p.slots = o8.size() + 1;
    p.host = [run](const std::vector<char*>& h, const std::vector<size_t>& n) {
      run(h[0], n[0], std::vector<char*>(h.begin() + 1, h.end()));
    };
    p.ipc = [c, in8, count, dt, o8](const DeviceOp& dv) { c->device_.runIpcAllgather(dv, in8, count, dt, o8); };
    return p;
  });
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::reduceScatter(std::vector<const void*> ins, void* out, size_t count, DataType dt, ReduceOp op,
                                       double scale, Millis timeout, Placement where) {
  checkReduceSupported(op, dt);
  CommImpl* c = impl_.get();
  RAILCC_CHECK_ARG(static_cast<int>(ins.size()) == c->size_, "reduce_scatter: ", ins.size(),
                   " input buffers for a group of size ", c->size_);
  auto o = c->collective(OpKind::kReduceScatter, dt, op, 0, count, timeout);
  auto run = [c, dt, op, scale](const std::vector<char*>& ins, char* out, size_t count) {
    c->algos_.reduceScatter(ins, out, count, dt, op, scale);
  };
  std::vector<char*> i8;
  for (const void* p : ins) i8.push_back(const_cast<char*>(static_cast<const char*>(p)));
  char* out8 = static_cast<char*>(out);
  c->device_.setBody(*o, where, dt, [i8, out8, count, run] { run(i8, out8, count); }, [&] {
    DevicePlan p;
    for (char* q : i8) p.regions.push_back(Region::input(q, count));
    p.regions.push_back(Region::output(out8, count));
    p.slots = i8.size() + 1;
    p.host = [run](const std::vector<char*>& h, const std::vector<size_t>& n) {
      run(std::vector<char*>(h.begin(), h.end() - 1), h.back(), n.back());
    };
    p.ipc = [c, i8, out8, count, dt, op, scale](const DeviceOp& dv) {
      c->device_.runIpcReduceScatter(dv, i8, out8, count, dt, op, scale);
    };
    return p;
  });
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::alltoall(std::vector<const void*> ins, std::vector<size_t> inCounts, std::vector<void*> outs,
                                  std::vector<size_t> outCounts, DataType dt, Millis timeout, Placement where) {
  CommImpl* c = impl_.get();
  size_t n = static_cast<size_t>(c->size_);
  RAILCC_CHECK_ARG(ins.size() == n && inCounts.size() == n, "alltoall: need ", n, " input splits, got ", inCounts.size());
  RAILCC_CHECK_ARG(outs.size() == n && outCounts.size() == n, "alltoall: need ", n, " output splits, got ", outCounts.size());
  size_t r = static_cast<size_t>(c->rank_);
  RAILCC_CHECK_ARG(inCounts[r] == outCounts[r], "alltoall: this rank sends itself ", inCounts[r],
                   " elements (input split) but expects ", outCounts[r], " (output split)");
  // Splits may differ per rank, so the fingerprint leaves count out; sizes are checked per message.
  auto o = c->collective(OpKind::kAlltoall, dt, ReduceOp::kSum, 0, 0, timeout);
  if (c->estimate_.on.load(std::memory_order_relaxed))  // costed by its largest message
    o->fp.count = *std::max_element(inCounts.begin(), inCounts.end());
  auto run = [c, dt](const std::vector<char*>& ins, const std::vector<size_t>& inCounts, const std::vector<char*>& outs,
                     const std::vector<size_t>& outCounts) { c->algos_.alltoall(ins, inCounts, outs, outCounts, dt); };
  std::vector<char*> i8, o8;
  for (const void* p : ins) i8.push_back(const_cast<char*>(static_cast<const char*>(p)));
  for (void* p : outs) o8.push_back(static_cast<char*>(p));
  c->device_.setBody(*o, where, dt, [i8, o8, inCounts, outCounts, run] { run(i8, inCounts, o8, outCounts); }, [&] {
    DevicePlan p;
    for (size_t i = 0; i < n; ++i) p.regions.push_back(Region::input(i8[i], inCounts[i]));
    for (size_t i = 0; i < n; ++i) p.regions.push_back(Region::output(o8[i], outCounts[i]));
    p.slots = 2 * n;
    p.agree = true;
    p.host = [run, n](const std::vector<char*>& h, const std::vector<size_t>& k) {
      auto half = static_cast<long>(n);
      run(std::vector<char*>(h.begin(), h.begin() + half), std::vector<size_t>(k.begin(), k.begin() + half),
          std::vector<char*>(h.begin() + half, h.end()), std::vector<size_t>(k.begin() + half, k.end()));
    };
    p.ipc = [c, i8, inCounts, o8, outCounts, dt](const DeviceOp& dv) {
      c->device_.runIpcAlltoall(dv, i8, inCounts, o8, outCounts, dt);
    };
    return p;
  });
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::gather(const void* in, size_t count, DataType dt, std::vector<void*> outs, int root, Millis timeout,
                                Placement where) {
  CommImpl* c = impl_.get();
  checkRoot(root, c->size_, "gather");
  if (c->rank_ == root)
    RAILCC_CHECK_ARG(static_cast<int>(outs.size()) == c->size_, "gather: root needs ", c->size_, " output buffers, got ", outs.size());
  auto o = c->collective(OpKind::kGather, dt, ReduceOp::kSum, root, count, timeout);
  auto run = [c, dt, root](const char* in, size_t count, const std::vector<char*>& outs) {
    c->algos_.gather(in, count * dtypeSize(dt), outs, root);
  };
  std::vector<char*> o8;
  if (c->rank_ == root)
    for (void* p : outs) o8.push_back(static_cast<char*>(p));
  char* in8 = const_cast<char*>(static_cast<const char*>(in));
  c->device_.setBody(*o, where, dt, [in8, count, o8, run] { run(in8, count, o8); }, [&] {
    DevicePlan p;
    p.regions.push_back(Region::input(in8, count));
    for (char* q : o8) p.regions.push_back(Region::output(q, count));
    p.slots = static_cast<size_t>(c->size_) + 1;
    p.host = [run](const std::vector<char*>& h, const std::vector<size_t>& n) {
      run(h[0], n[0], std::vector<char*>(h.begin() + 1, h.end()));
    };
    p.ipc = [c, in8, count, dt, o8, root](const DeviceOp& dv) { c->device_.runIpcGather(dv, in8, count, dt, o8, root); };
    return p;
  });
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt, int root, Millis timeout,
                                 Placement where) {
  CommImpl* c = impl_.get();
  checkRoot(root, c->size_, "scatter");
  if (c->rank_ == root)
    RAILCC_CHECK_ARG(static_cast<int>(ins.size()) == c->size_, "scatter: root needs ", c->size_, " input buffers, got ", ins.size());
  auto o = c->collective(OpKind::kScatter, dt, ReduceOp::kSum, root, count, timeout);
  auto run = [c, dt, root](const std::vector<char*>& ins, char* out, size_t count) {
    c->algos_.scatter(ins, out, count * dtypeSize(dt), root);
  };
  std::vector<char*> i8;
  if (c->rank_ == root)
    for (const void* p : ins) i8.push_back(const_cast<char*>(static_cast<const char*>(p)));
  char* out8 = static_cast<char*>(out);
  c->device_.setBody(*o, where, dt, [i8, out8, count, run] { run(i8, out8, count); }, [&] {
    DevicePlan p;
    for (char* q : i8) p.regions.push_back(Region::input(q, count));
    p.regions.push_back(Region::output(out8, count));
    p.slots = static_cast<size_t>(c->size_) + 1;
    p.host = [run](const std::vector<char*>& h, const std::vector<size_t>& n) {
      run(std::vector<char*>(h.begin(), h.end() - 1), h.back(), n.back());
    };
    p.ipc = [c, i8, out8, count, dt, root](const DeviceOp& dv) { c->device_.runIpcScatter(dv, i8, out8, count, dt, root); };
    return p;
  });
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::barrier(Millis timeout) {
  CommImpl* c = impl_.get();
  auto o = c->collective(OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, 0, 0, timeout);
  o->body = [c] { c->algos_.barrier(); };
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::send(const void* buf, size_t bytes, int peer, int tag, Millis timeout,
                               std::shared_ptr<DeviceSide> gpu) {
  CommImpl* c = impl_.get();
  RAILCC_CHECK_ARG(peer >= 0 && peer < c->size_, "send: destination rank ", peer, " is out of range for a group of size ", c->size_);
  RAILCC_CHECK_ARG(peer != c->rank_, "send: destination rank ", peer, " is this rank; sending to oneself is not supported");
  auto o = p2pOp(Transfer::kSend, peer, bytes, tag, timeout, std::move(gpu));
  o->xfer.landsInPlace = true;  // a receive copies: RDMA may read it from this buffer
  o->xfer.src = static_cast<const char*>(buf);
  return c->enqueue(std::move(o));
}

RequestPtr Communicator::recv(void* buf, size_t bytes, int peer, int tag, Millis timeout,
                               std::shared_ptr<DeviceSide> gpu) {
  CommImpl* c = impl_.get();
  RAILCC_CHECK_ARG(peer == -1 || (peer >= 0 && peer < c->size_), "recv: source rank ", peer,
                   " is out of range for a group of size ", c->size_);
  RAILCC_CHECK_ARG(peer != c->rank_, "recv: source rank ", peer, " is this rank; receiving from oneself is not supported");
  auto o = p2pOp(Transfer::kRecv, peer, bytes, tag, timeout, std::move(gpu));
  o->anySource = peer == -1;
  o->xfer.dst = static_cast<char*>(buf);
  auto req = c->enqueue(std::move(o));
  if (peer >= 0) req->setSourceRank(peer);
  return req;
}

}  // namespace railcc::engine
