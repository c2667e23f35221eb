#include "backend.h"

#include <cstdlib>
#include <cstring>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <sstream>
#include <thread>

#include "common/error.h"
#include "common/log.h"
#include "common/waits.h"
#include "allocator_trace.h"
#include "c10d_store.h"
#include "tensor_memory.h"
#include "work.h"

namespace railcc {

using c10d::OpType;
using engine::Millis;
using engine::RequestPtr;

RailccError::RailccError(const ::railcc::Error& e, const std::string& context)
    : c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                            context + std::string(e.what())),
      code(e.code()),
      ranks(e.ranks),
      hosts(e.hosts),
      seq(e.seq),
      op(e.op),
      ranksDead(e.ranksDead) {}

std::exception_ptr toTorchError(std::exception_ptr err, const std::string& context) {
  try {
    std::rethrow_exception(err);
  } catch (const RailccError&) {
    return err;
  } catch (const Error& e) {
    return std::make_exception_ptr(RailccError(e, context));
  } catch (...) {
    return err;
  }
}

namespace {

// ------------------------------------------------------------------ argument checks
[[noreturn]] void invalid(const std::string& msg) { C10_THROW_ERROR(ValueError, "railcc: " + msg); }

DataType toDtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kChar: return DataType::kInt8;
    case at::kByte: return DataType::kUInt8;
    case at::kShort: return DataType::kInt16;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    case at::kBool: return DataType::kBool;
    default:
      invalid(std::string(what) + ": railcc cannot reduce dtype " + std::string(c10::toString(t.scalar_type())) +
              " (reductions run on float32, float64, float16, bfloat16, int8, uint8, int16, int32, int64 and bool; "
              "ops that only move data, such as all_gather, broadcast and all_to_all, take every dtype)");
  }
}

bool nativeDtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16: case at::kChar: case at::kByte:
    case at::kShort: case at::kInt: case at::kLong: case at::kBool:
      return true;
    default:
      return false;
  }
}

// Ops that only move data take every dtype (float8 variants, complex, uint16/32/64, ...): a
// dtype the engine has no name for travels as its bytes.
DataType moveDtype(const at::Tensor& t) { return nativeDtype(t) ? toDtype(t, "") : DataType::kUInt8; }
size_t moveScale(const at::Tensor& t) { return nativeDtype(t) ? 1 : static_cast<size_t>(t.element_size()); }
size_t moveCount(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * moveScale(t); }

bool reducing(const char* what) {
  for (const char* r : {"allreduce", "allreduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                        "reduce_scatter_tensor_coalesced"})
    if (std::strcmp(what, r) == 0) return true;
  return false;
}

void checkTensor(const at::Tensor& t, const char* what) {
  if (!t.defined()) invalid(std::string(what) + ": tensor is undefined");
  if (t.is_sparse()) invalid(std::string(what) + ": sparse tensors are not supported");
  if (!t.device().is_cpu() && !t.device().is_cuda())
    invalid(std::string(what) + ": tensor is on " + t.device().str() + "; railcc serves CPU and CUDA tensors");
  if (!t.is_contiguous())
    invalid(std::string(what) + ": tensor must be contiguous (got sizes " + c10::str(t.sizes()) + ", strides " +
            c10::str(t.strides()) + "); call .contiguous() first");
  if (reducing(what)) toDtype(t, what);
}

const at::Tensor& single(std::vector<at::Tensor>& ts, const char* what) {
  if (ts.size() != 1)
    invalid(std::string(what) + ": expects exactly one tensor per call, got " + std::to_string(ts.size()));
  checkTensor(ts[0], what);
  return ts[0];
}

void sameShape(const at::Tensor& a, const at::Tensor& b, const char* what, const std::string& which) {
  if (a.scalar_type() != b.scalar_type())
    invalid(std::string(what) + ": " + which + " has dtype " + std::string(c10::toString(b.scalar_type())) +
            " but the input has " + std::string(c10::toString(a.scalar_type())));
  if (a.numel() != b.numel())
    invalid(std::string(what) + ": " + which + " has " + std::to_string(b.numel()) + " elements but the input has " +
            std::to_string(a.numel()));
}

ReduceOp toReduceOp(const c10d::ReduceOp& op, double& scale, const char* what) {
  scale = 1.0;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return ReduceOp::kSum;
    case c10d::ReduceOp::AVG: return ReduceOp::kAvg;
    case c10d::ReduceOp::PRODUCT: return ReduceOp::kProduct;
    case c10d::ReduceOp::MIN: return ReduceOp::kMin;
    case c10d::ReduceOp::MAX: return ReduceOp::kMax;
    case c10d::ReduceOp::BAND: return ReduceOp::kBand;
    case c10d::ReduceOp::BOR: return ReduceOp::kBor;
    case c10d::ReduceOp::BXOR: return ReduceOp::kBxor;
    case c10d::ReduceOp::PREMUL_SUM: {
      auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      if (sup == nullptr) invalid(std::string(what) + ": PREMUL_SUM without a factor");
      if (sup->tensor_factor.defined()) {
        if (sup->tensor_factor.numel() != 1)
          invalid(std::string(what) + ": PREMUL_SUM tensor factor must have one element");
        scale = sup->tensor_factor.to(at::kCPU).to(at::kDouble).item<double>();
      } else {
        scale = sup->double_factor;
      }
      return ReduceOp::kPremulSum;
    }
    default:
      invalid(std::string(what) + ": unsupported reduce op " + std::to_string(static_cast<int>(op.op_)));
  }
}

void checkRank(int r, int size, const char* what, const char* arg) {
  if (r < 0 || r >= size)
    invalid(std::string(what) + ": " + arg + " " + std::to_string(r) + " is out of range for a group of size " +
            std::to_string(size));
}

engine::Placement placed(const DeviceCallPtr& dev) { return dev ? dev->where() : engine::Placement{}; }

Config configFromEnv() {
  log::reinit();
  return Config::fromEnv();
}

}  // namespace

// The group's timeout as the engine keeps it. torch hands timedelta.max over as a negative count
// (its conversion to milliseconds overflows), which would fail every op at once: refused by name.
std::chrono::milliseconds groupTimeout(std::chrono::milliseconds t) {
  if (t.count() <= 0)
    invalid("a process group timeout of " + std::to_string(t.count()) +
            " ms; give a positive one (timedelta.max overflows torch's conversion to milliseconds: "
            "for no practical limit, give timedelta(days=3650))");
  return boundedWait(t);
}

// ------------------------------------------------------------------ ProcessGroupRailcc

// torchrun --max-restarts keeps its store across attempts, with the failed attempt's keys in it
// (torch 2.13; gloo then dials dead ranks): a restarted rank would read its predecessors'
// endpoints. Each attempt's railcc keys get a prefix of their own.
static c10::intrusive_ptr<c10d::Store> perAttempt(const c10::intrusive_ptr<c10d::Store>& s) {
  const char* a = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (!a || !*a) return s;
  return c10::make_intrusive<c10d::PrefixStore>(std::string("railcc-attempt-") + a, s);
}

ProcessGroupRailcc::ProcessGroupRailcc(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                       std::chrono::milliseconds timeout, std::string groupName,
                                       std::vector<int> globalRanks)
    : c10d::Backend(rank, size), store_(makeC10dStore(perAttempt(store), size)), timeout_(groupTimeout(timeout)),
      c10dStore_(perAttempt(store)),
      groupName_(groupName), globalRanks_(static_cast<int>(globalRanks.size()) == size ? globalRanks : std::vector<int>{}) {
  for (int r = static_cast<int>(globalRanks_.size()); r < size; ++r) globalRanks_.push_back(r);
  comm_ = connect("init", rank, size, std::move(groupName),
                  static_cast<int>(globalRanks.size()) == size ? std::move(globalRanks) : std::vector<int>{});
  init();
}

std::unique_ptr<engine::Communicator> ProcessGroupRailcc::connect(const char* what, int rank, int size, std::string name,
                                                                  std::vector<int> globalRanks) {
  engine::CommOptions o;
  o.rank = rank;
  o.size = size;
  o.name = std::move(name);
  o.globalRanks = std::move(globalRanks);
  o.timeout = timeout_;
  o.storeKeepAlive = store_;
  o.onFailure = [hooks = abortHooks_](std::exception_ptr err) { hooks->runFor(err); };
  o.config = configFromEnv();
  // One-kernel ops read tensors of torch's allocator in place once it tells us what it frees
  // (the hook is attached at the first CUDA call: torch's allocator exists from then on).
  if (o.config.cudaShots && o.config.cudaIpc) watchSegments_ = true;
  if (const char* l = std::getenv("LOCAL_WORLD_SIZE")) {  // torchrun's ranks per host: a hint, ignored unless sane
    char* end = nullptr;
    const long v = std::strtol(l, &end, 10);
    if (end != l && *end == '\0' && v > 0 && v <= (1 << 20)) o.ranksPerHostHint = static_cast<int>(v);
  }
  return guard(what, [&] { return std::make_unique<engine::Communicator>(*store_, o); });
}

void ProcessGroupRailcc::setTimeout(std::chrono::milliseconds timeout) { timeout_ = groupTimeout(timeout); }

ProcessGroupRailcc::~ProcessGroupRailcc() {
  if (comm_) comm_->shutdown();
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupRailcc::getBackendOptions() {
  auto o = c10::make_intrusive<Options>(getBackendName(), timeout_);
  o->group_name = groupName_;
  for (int g : globalRanks_) o->global_ranks_in_group.push_back(static_cast<uint64_t>(g));
  return o;
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupRailcc::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                            const std::vector<int>& ranks,
                                                            const c10::intrusive_ptr<Options>& opts) {
  const std::string what = "split_group of group '" + groupName_ + "' (size " + std::to_string(getSize()) + ")";
  if (ranks.empty()) invalid(what + ": no ranks given");
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (sorted[i] < 0 || sorted[i] >= getSize())
      invalid(what + ": rank " + std::to_string(sorted[i]) + " is not a rank of it (ranks of the group being split, 0-" +
              std::to_string(getSize() - 1) + ")");
    if (i > 0 && sorted[i] == sorted[i - 1]) invalid(what + ": rank " + std::to_string(sorted[i]) + " given twice");
  }
  auto me = std::find(sorted.begin(), sorted.end(), getRank());
  if (me == sorted.end()) return nullptr;
  std::vector<int> global;
  for (int r : sorted) global.push_back(globalRanks_[static_cast<size_t>(r)]);
  std::chrono::milliseconds timeout = opts && opts->timeout != c10d::kUnsetTimeout ? opts->timeout : timeout_;
  if (timeout.count() <= 0)
    invalid(what + ": a timeout of " + std::to_string(timeout.count()) + " ms; give a positive timeout (or none, for the group's " +
            std::to_string(timeout_.count()) + " ms)");
  std::string name = opts && !opts->group_name.empty() ? opts->group_name : groupName_ + ":split";
  std::lock_guard<std::mutex> g(splitMu_);
  for (auto it = splits_.begin(); it != splits_.end();) it = it->second.expired() ? splits_.erase(it) : std::next(it);
  auto known = splits_.find(name);
  if (known != splits_.end()) {
    auto child = known->second.lock();
    if (child && child->getSize() == static_cast<int>(sorted.size())) return child;
  }
  c10::intrusive_ptr<c10d::Backend> child = c10::make_intrusive<ProcessGroupRailcc>(
      store, static_cast<int>(me - sorted.begin()), static_cast<int>(sorted.size()), timeout, name, std::move(global));
  splits_.insert_or_assign(name, c10::weak_intrusive_ptr<c10d::Backend>(child));
  return child;
}

void ProcessGroupRailcc::abort() {
  abortHooks_->run();  // torch 2.14's abort hooks (backend.h), before the group ends
  comm_->abort("abort() was called on the process group");
}

void ProcessGroupRailcc::shutdown() { comm_->shutdown(); }

c10d::ErrorType ProcessGroupRailcc::getError() {
  auto err = comm_->brokenError();
  if (!err) return c10d::ErrorType::SUCCESS;
  try {
    std::rethrow_exception(err);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kTimeout) return c10d::ErrorType::TIMEOUT;
    if (e.code() == ErrorCode::kPeerFailure) return c10d::ErrorType::REMOTE_ERROR;
  } catch (...) {
  }
  return c10d::ErrorType::COMM_ERROR;
}

std::vector<std::string> ProcessGroupRailcc::peerTransports() const {
  std::vector<std::string> out;
  for (int r = 0; r < comm_->size(); ++r) out.push_back(comm_->transportTo(r));
  return out;
}

std::chrono::milliseconds ProcessGroupRailcc::opTimeout(std::chrono::milliseconds requested) const {
  return requested.count() > 0 && requested != c10d::kUnsetTimeout ? requested : timeout_;  // bounded at enqueue
}

void ProcessGroupRailcc::startCoalescing() {
  coalescing_ = true;
  coalescedReqs_.clear();
  coalescedOutputs_.clear();
  coalescedDev_ = nullptr;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::endCoalescing() {
  coalescing_ = false;
  auto reqs = std::move(coalescedReqs_);
  auto outs = std::move(coalescedOutputs_);
  auto dev = std::move(coalescedDev_);
  coalescedReqs_.clear();
  coalescedOutputs_.clear();
  coalescedDev_ = nullptr;
  if (dev) {
    // The group's stream is ordered, so the last op's end event covers them all.
    auto last = std::make_shared<DeviceCall>(*dev);
    last->start = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
    last->end = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
    dev = last;
  }
  return makeWork(OpType::COALESCED, "coalesced", std::move(reqs), std::move(outs), {}, dev);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::makeWork(OpType type, const char* name, std::vector<RequestPtr> reqs,
                                                            std::vector<at::Tensor> outputs, std::vector<at::Tensor> keep,
                                                            DeviceCallPtr dev, std::function<void()> after) {
  if (type != OpType::SEND && type != OpType::RECV && type != OpType::RECVANYSOURCE && type != OpType::COALESCED) ++seq_;
  if (coalescing_) {
    coalescedReqs_.insert(coalescedReqs_.end(), reqs.begin(), reqs.end());
    coalescedOutputs_.insert(coalescedOutputs_.end(), outputs.begin(), outputs.end());
    if (dev) coalescedDev_ = dev;
  }
  auto w = c10::make_intrusive<WorkRailcc>(getRank(), type, name, seq_, std::move(reqs), std::move(outputs),
                                           std::move(keep), comm_.get(), std::move(dev), std::move(after));
  w->arm();
  return w;
}

DeviceCallPtr ProcessGroupRailcc::deviceCall(const char* what, const std::vector<at::Tensor>& tensors) {
  noteTensorOwners(tensors);
  const at::Tensor* first = nullptr;
  for (auto& t : tensors) {
    if (!t.defined()) continue;
    if (!first) first = &t;
    else if (t.device() != first->device())
      invalid(std::string(what) + ": tensors of one call must be on one device; got " + first->device().str() +
              " and " + t.device().str());
  }
  if (!first || !first->device().is_cuda()) return nullptr;
  std::string why;
  if (!engine::deviceApiAvailable(&why)) invalid(std::string(what) + ": " + first->device().str() + " tensor: " + why);
  if (watchSegments_) watchAllocatorSegments();
  auto dev = std::make_shared<DeviceCall>();
  dev->device = first->device();
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  {
    std::lock_guard<std::mutex> g(streamsMu_);
    if (boundDevice_ < 0) boundDevice_ = dev->device.index();
    if (boundDevice_ != dev->device.index())
      invalid(std::string(what) + ": this group serves cuda:" + std::to_string(boundDevice_) + " (its first CUDA call); " +
              "got a tensor on " + dev->device.str() + ". Use one group per device, as with NCCL");
    auto it = std::find_if(commStreams_.begin(), commStreams_.end(),
                           [&](const auto& p) { return p.first == dev->device.index(); });
    if (it == commStreams_.end()) {
      commStreams_.emplace_back(dev->device.index(), impl.getStreamFromGlobalPool(dev->device, /*isHighPriority=*/false));
      it = commStreams_.end() - 1;
    }
    dev->comm = it->second;
  }
  dev->start = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
  dev->end = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
  dev->start->record(impl.getStream(dev->device));
  // The Work holds the tensors until the op ends; if it ends in an error while copies are
  // still queued on the group's stream, the caching allocator must not hand their memory
  // to anyone before that stream is past them.
  for (auto& t : tensors)
    if (t.defined() && t.device().is_cuda() && t.has_storage())
      impl.recordDataPtrOnStream(t.storage().data_ptr(), dev->comm);
  return dev;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  engine::CallerWaits callerWaits(!opts.asyncOp && !coalescing_);
  const at::Tensor& t = single(tensors, "broadcast");
  checkRank(static_cast<int>(opts.rootRank), getSize(), "broadcast", "root");
  auto dev = deviceCall("broadcast", tensors);
  auto req = guard("broadcast", [&] {
    return comm_->broadcast(t.data_ptr(), moveCount(t), moveDtype(t),
                            static_cast<int>(opts.rootRank), opTimeout(opts.timeout), placed(dev));
  });
  return makeWork(OpType::BROADCAST, "broadcast", {req}, tensors, {}, dev);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) return sparseAllreduce(tensors, opts);
  engine::CallerWaits callerWaits(!opts.asyncOp && !coalescing_);
  const at::Tensor& t = single(tensors, "allreduce");
  double scale;
  ReduceOp op = toReduceOp(opts.reduceOp, scale, "allreduce");
  auto dev = deviceCall("allreduce", tensors);
  auto req = guard("allreduce", [&] {
    return comm_->allreduce(t.data_ptr(), static_cast<size_t>(t.numel()), toDtype(t, "allreduce"), op, scale,
                            opTimeout(opts.timeout), placed(dev));
  });
  return makeWork(OpType::ALLREDUCE, "allreduce", {req}, tensors, {}, dev);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                       const c10d::AllreduceCoalescedOptions& opts) {
  engine::CallerWaits callerWaits(!opts.asyncOp && !coalescing_);
  if (tensors.empty()) invalid("allreduce_coalesced: needs at least one tensor");
  std::vector<void*> bufs;
  std::vector<size_t> counts;
  for (size_t i = 0; i < tensors.size(); ++i) {
    checkTensor(tensors[i], "allreduce_coalesced");
    if (tensors[i].scalar_type() != tensors[0].scalar_type())
      invalid("allreduce_coalesced: all tensors must have one dtype; tensor " + std::to_string(i) + " is " +
              std::string(c10::toString(tensors[i].scalar_type())) + ", tensor 0 is " +
              std::string(c10::toString(tensors[0].scalar_type())));
    bufs.push_back(tensors[i].data_ptr());
    counts.push_back(static_cast<size_t>(tensors[i].numel()));
  }
  double scale;
  ReduceOp op = toReduceOp(opts.reduceOp, scale, "allreduce_coalesced");
  auto dev = deviceCall("allreduce_coalesced", tensors);
  auto req = guard("allreduce_coalesced", [&] {
    return comm_->allreduceCoalesced(bufs, counts, toDtype(tensors[0], "allreduce_coalesced"), op, scale,
                                     opTimeout(opts.timeout), placed(dev));
  });
  return makeWork(OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", {req}, tensors, {}, dev);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
  engine::CallerWaits callerWaits(!opts.asyncOp && !coalescing_);
  const at::Tensor& t = single(tensors, "reduce");
  checkRank(static_cast<int>(opts.rootRank), getSize(), "reduce", "root");
  double scale;
  ReduceOp op = toReduceOp(opts.reduceOp, scale, "reduce");
  auto dev = deviceCall("reduce", tensors);
  auto req = guard("reduce", [&] {
    return comm_->reduce(t.data_ptr(), static_cast<size_t>(t.numel()), toDtype(t, "reduce"), op,
                         static_cast<int>(opts.rootRank), scale, opTimeout(opts.timeout), placed(dev));
  });
  return makeWork(OpType::REDUCE, "reduce", {req}, tensors, {}, dev);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllgatherOptions& opts) {
  engine::CallerWaits callerWaits(!opts.asyncOp && !coalescing_);
  const at::Tensor& in = single(inputs, "allgather");
  if (outputs.size() != 1) invalid("allgather: expects one output list, got " + std::to_string(outputs.size()));
  auto& outs = outputs[0];
  if (static_cast<int>(outs.size()) != getSize())
    invalid("allgather: output list has " + std::to_string(outs.size()) + " tensors; it needs one per rank (" +
            std::to_string(getSize()) + ")");
  std::vector<void*> ptrs;
  for (size_t i = 0; i < outs.size(); ++i) {
    checkTensor(outs[i], "allgather");
    sameShape(in, outs[i], "allgather", "output tensor " + std::to_string(i));
    ptrs.push_back(outs[i].data_ptr());
  }
  std::vector<at::Tensor> all(outs);
  all.push_back(in);
  auto dev = deviceCall("allgather", all);
  auto req = guard("allgather", [&] {
    return comm_->allgather(in.data_ptr(), moveCount(in), moveDtype(in), ptrs,
                            opTimeout(opts.timeout), placed(dev));
  });
  return makeWork(OpType::ALLGATHER, "allgather", {req}, outs, inputs, dev);
}

namespace {
std::vector<void*> slices(const at::Tensor& t, int n) {
  std::vector<void*> out;
  size_t bytes = static_cast<size_t>(t.numel()) * t.element_size() / static_cast<size_t>(n);
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char*>(t.data_ptr()) + bytes * static_cast<size_t>(i));
  return out;
}
}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                   const c10d::AllgatherOptions& opts) {
  engine::CallerWaits callerWaits(!opts.asyncOp && !coalescing_);
  checkTensor(input, "all_gather_into_tensor");
  checkTensor(output, "all_gather_into_tensor");
  if (output.scalar_type() != input.scalar_type()) invalid("all_gather_into_tensor: output and input dtypes differ");
  if (output.numel() != input.numel() * getSize())
    invalid("all_gather_into_tensor: output has " + std::to_string(output.numel()) + " elements; it needs input (" +
            std::to_string(input.numel()) + ") x world size (" + std::to_string(getSize()) + ")");
  auto dev = deviceCall("all_gather_into_tensor", {output, input});
  auto req = guard("all_gather_into_tensor", [&] {
    return comm_->allgather(input.data_ptr(), moveCount(input), moveDtype(input),
                            slices(output, getSize()), opTimeout(opts.timeout), placed(dev));
  });
  return makeWork(OpType::_ALLGATHER_BASE, "all_gather_into_tensor", {req}, {output}, {input}, dev);
}

// outputs[r][j] receives rank r's inputs[j]: one engine all-gather per input, straight into
// the output tensors, so tensors of any shapes (and empty ones) need no packing copy.
c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                       std::vector<at::Tensor>& inputs,
                                                                       const c10d::AllgatherOptions& opts) {
  engine::CallerWaits callerWaits(!opts.asyncOp && !coalescing_);
  const char* what = "allgather_coalesced";
  if (static_cast<int>(outputs.size()) != getSize())
    invalid(std::string(what) + ": " + std::to_string(outputs.size()) +
            " output lists; it needs one per rank (" + std::to_string(getSize()) + ")");
  std::vector<at::Tensor> all(inputs), flat;
  for (size_t j = 0; j < inputs.size(); ++j) {
    checkTensor(inputs[j], what);
    if (inputs[j].scalar_type() != inputs[0].scalar_type())
      invalid(std::string(what) + ": input " + std::to_string(j) + " has another dtype than input 0");
  }
  for (size_t r = 0; r < outputs.size(); ++r) {
    if (outputs[r].size() != inputs.size())
      invalid(std::string(what) + ": output list " + std::to_string(r) + " has " + std::to_string(outputs[r].size()) +
              " tensors for " + std::to_string(inputs.size()) + " inputs");
    for (size_t j = 0; j < inputs.size(); ++j) {
      checkTensor(outputs[r][j], what);
      sameShape(inputs[j], outputs[r][j], what, "output " + std::to_string(r) + "[" + std::to_string(j) + "]");
      all.push_back(outputs[r][j]);
      flat.push_back(outputs[r][j]);
    }
  }
  auto dev = deviceCall(what, all);
  std::vector<RequestPtr> reqs;
  for (size_t j = 0; j < inputs.size(); ++j) {
    std::vector<void*> ptrs;
    for (auto& list : outputs) ptrs.push_back(list[j].data_ptr());
    reqs.push_back(guard(what, [&] {
      return comm_->allgather(inputs[j].data_ptr(), moveCount(inputs[j]), moveDtype(inputs[j]), ptrs, opTimeout(opts.timeout), placed(dev));
    }));
  }
  ++seq_;
  return makeWork(OpType::ALLGATHER_COALESCED, what, reqs, flat, inputs, dev);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                   std::vector<at::Tensor>& inputs,
                                                                                   const c10d::AllgatherOptions& opts) {
  engine::CallerWaits callerWaits(!opts.asyncOp && !coalescing_);
  if (outputs.size() != inputs.size())
    invalid("allgather_into_tensor_coalesced: " + std::to_string(outputs.size()) + " outputs for " +
            std::to_string(inputs.size()) + " inputs");
  std::vector<RequestPtr> reqs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], "allgather_into_tensor_coalesced");
    checkTensor(outputs[i], "allgather_into_tensor_coalesced");
    if (outputs[i].numel() != inputs[i].numel() * getSize() || outputs[i].scalar_type() != inputs[i].scalar_type())
      invalid("allgather_into_tensor_coalesced: output " + std::to_string(i) + " must have the input's dtype and " +
              "world size x its elements");
  }
  std::vector<at::Tensor> all(outputs);
  all.insert(all.end(), inputs.begin(), inputs.end());
  auto dev = deviceCall("allgather_into_tensor_coalesced", all);
  for (size_t i = 0; i < inputs.size(); ++i)
    reqs.push_back(guard("allgather_into_tensor_coalesced", [&] {
      return comm_->allgather(inputs[i].data_ptr(), moveCount(inputs[i]), moveDtype(inputs[i]), slices(outputs[i], getSize()), opTimeout(opts.timeout),
                              placed(dev));
    }));
  ++seq_;  // one call of its own, as reduce_scatter_tensor_coalesced
  return makeWork(OpType::COALESCED, "allgather_into_tensor_coalesced", reqs, outputs, inputs, dev);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::GatherOptions& opts) {
  engine::CallerWaits callerWaits(!opts.asyncOp && !coalescing_);
  const at::Tensor& in = single(inputs, "gather");
  int root = static_cast<int>(opts.rootRank);
  checkRank(root, getSize(), "gather", "root");
  std::vector<void*> ptrs;
  std::vector<at::Tensor> outs;
  if (getRank() == root) {
    if (outputs.size() != 1 || static_cast<int>(outputs[0].size()) != getSize())
      invalid("gather: the root needs one output list of " + std::to_string(getSize()) + " tensors");
    for (size_t i = 0; i < outputs[0].size(); ++i) {
      checkTensor(outputs[0][i], "gather");
      sameShape(in, outputs[0][i], "gather", "output tensor " + std::to_string(i));
      ptrs.push_back(outputs[0][i].data_ptr());
    }
    outs = outputs[0];
  } else if (!outputs.empty() && !outputs[0].empty()) {
    invalid("gather: only the root (rank " + std::to_string(root) + ") may pass output tensors");
  }
  std::vector<at::Tensor> all(outs);
  all.push_back(in);
  auto dev = deviceCall("gather", all);
  auto req = guard("gather", [&] {
    return comm_->gather(in.data_ptr(), moveCount(in), moveDtype(in), ptrs, root,
                         opTimeout(opts.timeout), placed(dev));
  });
  return makeWork(OpType::GATHER, "gather", {req}, outs, inputs, dev);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ScatterOptions& opts) {
  engine::CallerWaits callerWaits(!opts.asyncOp && !coalescing_);
  const at::Tensor& out = single(outputs, "scatter");
  int root = static_cast<int>(opts.rootRank);
  checkRank(root, getSize(), "scatter", "root");
  std::vector<const void*> ptrs;
  std::vector<at::Tensor> keep;
  if (getRank() == root) {
    if (inputs.size() != 1 || static_cast<int>(inputs[0].size()) != getSize())
      invalid("scatter: the root needs one input list of " + std::to_string(getSize()) + " tensors");
    for (size_t i = 0; i < inputs[0].size(); ++i) {
      checkTensor(inputs[0][i], "scatter");
      sameShape(out, inputs[0][i], "scatter", "input tensor " + std::to_string(i));
      ptrs.push_back(inputs[0][i].data_ptr());
    }
    keep = inputs[0];
  } else if (!inputs.empty() && !inputs[0].empty()) {
    invalid("scatter: only the root (rank " + std::to_string(root) + ") may pass input tensors");
  }
  std::vector<at::Tensor> all(keep);
  all.push_back(out);
  auto dev = deviceCall("scatter", all);
  auto req = guard("scatter", [&] {
    return comm_->scatter(ptrs, out.data_ptr(), moveCount(out), moveDtype(out), root,
                          opTimeout(opts.timeout), placed(dev));
  });
  return makeWork(OpType::SCATTER, "scatter", {req}, outputs, keep, dev);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                                  const c10d::ReduceScatterOptions& opts) {
  engine::CallerWaits callerWaits(!opts.asyncOp && !coalescing_);
  const at::Tensor& out = single(outputs, "reduce_scatter");
  if (inputs.size() != 1 || static_cast<int>(inputs[0].size()) != getSize())
    invalid("reduce_scatter: needs one input list of " + std::to_string(getSize()) + " tensors (one per rank)");
  std::vector<const void*> ptrs;
  for (size_t i = 0; i < inputs[0].size(); ++i) {
    checkTensor(inputs[0][i], "reduce_scatter");
    sameShape(out, inputs[0][i], "reduce_scatter", "input tensor " + std::to_string(i));
    ptrs.push_back(inputs[0][i].data_ptr());
  }
  double scale;
  ReduceOp op = toReduceOp(opts.reduceOp, scale, "reduce_scatter");
  std::vector<at::Tensor> all(inputs[0]);
  all.push_back(out);
  auto dev = deviceCall("reduce_scatter", all);
  auto req = guard("reduce_scatter", [&] {
    return comm_->reduceScatter(ptrs, out.data_ptr(), static_cast<size_t>(out.numel()), toDtype(out, "reduce_scatter"),
                                op, scale, opTimeout(opts.timeout), placed(dev));
  });
  return makeWork(OpType::REDUCE_SCATTER, "reduce_scatter", {req}, outputs, inputs[0], dev);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                        const c10d::ReduceScatterOptions& opts) {
  engine::CallerWaits callerWaits(!opts.asyncOp && !coalescing_);
  checkTensor(input, "reduce_scatter_tensor");
  checkTensor(output, "reduce_scatter_tensor");
  if (output.scalar_type() != input.scalar_type()) invalid("reduce_scatter_tensor: output and input dtypes differ");
  if (input.numel() != output.numel() * getSize())
    invalid("reduce_scatter_tensor: input has " + std::to_string(input.numel()) + " elements; it needs output (" +
            std::to_string(output.numel()) + ") x world size (" + std::to_string(getSize()) + ")");
  double scale;
  ReduceOp op = toReduceOp(opts.reduceOp, scale, "reduce_scatter_tensor");
  auto s = slices(input, getSize());
  std::vector<const void*> ins(s.begin(), s.end());
  auto dev = deviceCall("reduce_scatter_tensor", {output, input});
  auto req = guard("reduce_scatter_tensor", [&] {
    return comm_->reduceScatter(ins, output.data_ptr(), static_cast<size_t>(output.numel()),
                                toDtype(output, "reduce_scatter"), op, scale, opTimeout(opts.timeout), placed(dev));
  });
  return makeWork(OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", {req}, {output}, {input}, dev);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                   std::vector<at::Tensor>& inputs,
                                                                                   const c10d::ReduceScatterOptions& opts) {
  engine::CallerWaits callerWaits(!opts.asyncOp && !coalescing_);
  if (outputs.size() != inputs.size())
    invalid("reduce_scatter_tensor_coalesced: " + std::to_string(outputs.size()) + " outputs for " +
            std::to_string(inputs.size()) + " inputs");
  double scale;
  ReduceOp op = toReduceOp(opts.reduceOp, scale, "reduce_scatter_tensor_coalesced");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], "reduce_scatter_tensor_coalesced");
    checkTensor(outputs[i], "reduce_scatter_tensor_coalesced");
    if (inputs[i].numel() != outputs[i].numel() * getSize() || outputs[i].scalar_type() != inputs[i].scalar_type())
      invalid("reduce_scatter_tensor_coalesced: input " + std::to_string(i) +
              " must have the output's dtype and world size x its elements");
  }
  std::vector<at::Tensor> all(outputs);
  all.insert(all.end(), inputs.begin(), inputs.end());
  auto dev = deviceCall("reduce_scatter_tensor_coalesced", all);
  std::vector<RequestPtr> reqs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto s = slices(inputs[i], getSize());
    std::vector<const void*> ins(s.begin(), s.end());
    reqs.push_back(guard("reduce_scatter_tensor_coalesced", [&] {
      return comm_->reduceScatter(ins, outputs[i].data_ptr(), static_cast<size_t>(outputs[i].numel()),
                                  toDtype(outputs[i], "reduce_scatter"), op, scale, opTimeout(opts.timeout),
                                  placed(dev));
    }));
  }
  // OpType::COALESCED: torch 2.11 (the GPU machines' build) has no
  // REDUCE_SCATTER_TENSOR_COALESCED. Unlike endCoalescing's, this Work is one call of its own.
  ++seq_;
  return makeWork(OpType::COALESCED, "reduce_scatter_tensor_coalesced", reqs, outputs, inputs, dev);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                 std::vector<int64_t>& outputSplits,
                                                                 std::vector<int64_t>& inputSplits,
                                                                 const c10d::AllToAllOptions& opts) {
  engine::CallerWaits callerWaits(!opts.asyncOp && !coalescing_);
  checkTensor(input, "all_to_all_single");
  checkTensor(output, "all_to_all_single");
  if (output.scalar_type() != input.scalar_type()) invalid("all_to_all_single: output and input dtypes differ");
  int n = getSize();
  auto splitCounts = [&](const at::Tensor& t, std::vector<int64_t>& splits, const char* which) {
    std::vector<size_t> counts;
    int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    int64_t rowElems = rows == 0 ? 0 : t.numel() / rows;
    if (splits.empty()) {
      if (rows % n != 0)
        invalid(std::string("all_to_all_single: ") + which + " dim 0 (" + std::to_string(rows) +
                ") is not divisible by the world size (" + std::to_string(n) + "); pass split sizes");
      counts.assign(static_cast<size_t>(n), static_cast<size_t>(rows / n * rowElems));
      return counts;
    }
    if (static_cast<int>(splits.size()) != n)
      invalid(std::string("all_to_all_single: ") + which + "_split_sizes has " + std::to_string(splits.size()) +
              " entries; it needs one per rank (" + std::to_string(n) + ")");
    int64_t sum = 0;
    for (size_t i = 0; i < splits.size(); ++i) {
      int64_t s = splits[i];
      if (s < 0) invalid(std::string("all_to_all_single: negative entry in ") + which + "_split_sizes");
      // Checked entry by entry, so that no sum can wrap past the tensor's rows.
      if (s > rows - sum)
        invalid(std::string("all_to_all_single: ") + which + "_split_sizes[" + std::to_string(i) + "] = " +
                std::to_string(s) + " runs past the " + which + " tensor's " + std::to_string(rows) + " rows (" +
                std::to_string(sum) + " taken by the entries before it)");
      sum += s;
      counts.push_back(static_cast<size_t>(s * rowElems));
    }
    if (sum != rows)
      invalid(std::string("all_to_all_single: ") + which + "_split_sizes sum to " + std::to_string(sum) +
              " but the " + which + " tensor has " + std::to_string(rows) + " rows");
    return counts;
  };
  auto inCounts = splitCounts(input, inputSplits, "input");
  auto outCounts = splitCounts(output, outputSplits, "output");
  // Counts in the engine's elements: bytes for a dtype it has no name for.
  const size_t scale = moveScale(input);
  for (size_t& c : inCounts) c *= scale;
  for (size_t& c : outCounts) c *= scale;
  size_t es = static_cast<size_t>(input.element_size()) / scale;
  std::vector<const void*> ins;
  std::vector<void*> outs;
  size_t off = 0;
  for (size_t c : inCounts) {
    ins.push_back(static_cast<const char*>(input.data_ptr()) + off * es);
    off += c;
  }
  off = 0;
  for (size_t c : outCounts) {
    outs.push_back(static_cast<char*>(output.data_ptr()) + off * es);
    off += c;
  }
  auto dev = deviceCall("all_to_all_single", {output, input});
  auto req = guard("all_to_all_single", [&] {
    return comm_->alltoall(ins, inCounts, outs, outCounts, moveDtype(input), opTimeout(opts.timeout),
                           placed(dev));
  });
  return makeWork(OpType::ALLTOALL_BASE, "all_to_all_single", {req}, {output}, {input}, dev);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::alltoall(std::vector<at::Tensor>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllToAllOptions& opts) {
  engine::CallerWaits callerWaits(!opts.asyncOp && !coalescing_);
  int n = getSize();
  if (static_cast<int>(outputs.size()) != n || static_cast<int>(inputs.size()) != n)
    invalid("all_to_all: needs " + std::to_string(n) + " input and output tensors, got " +
            std::to_string(inputs.size()) + " and " + std::to_string(outputs.size()));
  std::vector<const void*> ins;
  std::vector<void*> outs;
  std::vector<size_t> inCounts, outCounts;
  for (int i = 0; i < n; ++i) {
    checkTensor(inputs[static_cast<size_t>(i)], "all_to_all");
    checkTensor(outputs[static_cast<size_t>(i)], "all_to_all");
    if (inputs[static_cast<size_t>(i)].scalar_type() != inputs[0].scalar_type() ||
        outputs[static_cast<size_t>(i)].scalar_type() != inputs[0].scalar_type())
      invalid("all_to_all: all tensors must have one dtype");
    ins.push_back(inputs[static_cast<size_t>(i)].data_ptr());
    outs.push_back(outputs[static_cast<size_t>(i)].data_ptr());
    inCounts.push_back(moveCount(inputs[static_cast<size_t>(i)]));
    outCounts.push_back(moveCount(outputs[static_cast<size_t>(i)]));
  }
  std::vector<at::Tensor> all(outputs);
  all.insert(all.end(), inputs.begin(), inputs.end());
  auto dev = deviceCall("all_to_all", all);
  auto req = guard("all_to_all", [&] {
    return comm_->alltoall(ins, inCounts, outs, outCounts, moveDtype(inputs[0]), opTimeout(opts.timeout),
                           placed(dev));
  });
  return makeWork(OpType::ALLTOALL, "all_to_all", {req}, outputs, inputs, dev);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  const at::Tensor& t = single(tensors, "send");
  checkRank(dstRank, getSize(), "send", "destination rank");
  auto dev = deviceCall("send", tensors);
  // A CUDA tensor goes straight from the GPU where the transport reaches its memory (GPUDirect
  // RDMA), else from a pinned copy the engine takes once the caller's stream reached this call.
  // As with NCCL, it must not change before the Work completes (the Work holds it till then).
  at::Tensor src = dev ? at::empty_like(t, t.options().device(at::kCPU).pinned_memory(true)) : t;
  auto req = guard("send", [&] {
    return comm_->send(src.data_ptr(), static_cast<size_t>(src.numel()) * src.element_size(), dstRank, tag, Millis(0),
                       dev ? dev->side(t, src) : nullptr);
  });
  return makeWork(OpType::SEND, "send", {req}, tensors, {src}, dev);
}

namespace {

// After a receive of a CUDA tensor: the bytes that landed in host memory are copied in on the
// group's stream, unless the NIC wrote them into the tensor itself (GPUDirect RDMA).
std::function<void()> copyIn(at::Tensor t, at::Tensor host, std::shared_ptr<engine::DeviceSide> gpu) {
  return [t, host, gpu]() mutable {
    if (!gpu->direct.load(std::memory_order_acquire)) t.copy_(host, /*non_blocking=*/true);
  };
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  const at::Tensor& t = single(tensors, "recv");
  checkRank(srcRank, getSize(), "recv", "source rank");
  auto dev = deviceCall("recv", tensors);
  // A CUDA tensor receives straight into the GPU where the transport reaches its memory, else
  // into a pinned buffer, copied in on the group's stream afterwards.
  at::Tensor dst = dev ? at::empty_like(t, t.options().device(at::kCPU).pinned_memory(true)) : t;
  auto gpu = dev ? dev->side(t, dst) : nullptr;
  auto req = guard("recv", [&] {
    return comm_->recv(dst.data_ptr(), static_cast<size_t>(dst.numel()) * dst.element_size(), srcRank, tag, Millis(0), gpu);
  });
  std::function<void()> after = dev ? copyIn(t, dst, gpu) : nullptr;
  return makeWork(OpType::RECV, "recv", {req}, tensors, {dst}, dev, after);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const at::Tensor& t = single(tensors, "recv");
  auto dev = deviceCall("recv", tensors);
  at::Tensor dst = dev ? at::empty_like(t, t.options().device(at::kCPU).pinned_memory(true)) : t;
  auto gpu = dev ? dev->side(t, dst) : nullptr;
  auto req = guard("recv", [&] {
    return comm_->recv(dst.data_ptr(), static_cast<size_t>(dst.numel()) * dst.element_size(), -1, tag, Millis(0), gpu);
  });
  std::function<void()> after = dev ? copyIn(t, dst, gpu) : nullptr;
  return makeWork(OpType::RECVANYSOURCE, "recv", {req}, tensors, {dst}, dev, after);
}

// A sparse COO all-reduce (SUM), as gloo does it: every rank's indices and values are
// gathered (padded to the largest count of nonzeros), and each rank sums them locally; the
// result is coalesced. For embeddings with sparse gradients (nn.Embedding(sparse=True) under
// DDP). Runs to its end on the calling thread; the returned Work is complete.
c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::sparseAllreduce(std::vector<at::Tensor>& tensors,
                                                                   const c10d::AllreduceOptions& opts) {
  at::Tensor& t = tensors[0];
  if (t.layout() != at::kSparse)
    invalid("allreduce: sparse layout " + c10::str(t.layout()) + " is not supported; railcc reduces sparse COO tensors");
  if (opts.reduceOp != c10d::ReduceOp::SUM)
    invalid("allreduce of a sparse tensor: only SUM is supported (got " + c10::str(opts.reduceOp.op_) + ")");
  if (!t.device().is_cpu() && !t.device().is_cuda())
    invalid("allreduce: tensor is on " + t.device().str() + "; railcc serves CPU and CUDA tensors");
  const int n = getSize();
  Millis timeout = opTimeout(opts.timeout);
  std::vector<RequestPtr> reqs;
  auto gather = [&](const at::Tensor& in, at::Tensor& out) {  // out: [n, *in.sizes()]
    auto req = guard("allreduce (sparse)", [&] {
      return comm_->allgather(in.data_ptr(), moveCount(in), moveDtype(in), slices(out, n), timeout);
    });
    comm_->wait(req);
    if (auto err = req->error()) std::rethrow_exception(toTorchError(err, "railcc allreduce (sparse): "));
    reqs.push_back(req);
  };
  at::Tensor in = t.to(at::kCPU).coalesce();
  at::Tensor idx = in._indices().contiguous(), vals = in._values().contiguous();
  const int64_t nnz = in._nnz();
  // What the ranks must agree on before any rank's indices are taken: the shape, its sparse
  // dims, the dtype; and each rank's own indices inside its shape (a tensor built without
  // invariant checks may hold any). Every rank sees every rank's header, so all refuse alike,
  // where a (8,) tensor once took index 2**29 from a (2**30,) one and crashed in to_dense().
  bool inRange = true;
  if (nnz > 0) {
    const at::Tensor lo = std::get<0>(idx.min(1)), hi = std::get<0>(idx.max(1));
    for (int64_t d = 0; d < in.sparse_dim(); ++d)
      inRange = inRange && lo[d].item<int64_t>() >= 0 && hi[d].item<int64_t>() < in.size(d);
  }
  constexpr int64_t kHead = 5;  // nnz, dims, sparse dims, dtype, indices in range
  at::Tensor mine = at::tensor({nnz, in.dim(), in.sparse_dim(), static_cast<int64_t>(in.scalar_type()), int64_t(inRange)},
                               at::kLong);
  at::Tensor heads = at::empty({n, kHead}, at::kLong);
  gather(mine, heads);
  for (int r = 0; r < n; ++r) {
    if (heads[r][4].item<int64_t>() == 0)
      invalid("allreduce of a sparse tensor: rank " + std::to_string(r) +
              "'s tensor has indices outside its size (a tensor built with check_invariants=False?); no rank reduced it");
    if (heads[r][1].item<int64_t>() != in.dim() || heads[r][2].item<int64_t>() != in.sparse_dim() ||
        heads[r][3].item<int64_t>() != static_cast<int64_t>(in.scalar_type()))
      invalid("allreduce of a sparse tensor: rank " + std::to_string(r) + "'s tensor has " +
              std::to_string(heads[r][1].item<int64_t>()) + " dims (" + std::to_string(heads[r][2].item<int64_t>()) +
              " sparse) of dtype " + c10::toString(static_cast<at::ScalarType>(heads[r][3].item<int64_t>())) + " where rank " +
              std::to_string(getRank()) + "'s has " + std::to_string(in.dim()) + " (" + std::to_string(in.sparse_dim()) +
              " sparse) of " + c10::toString(in.scalar_type()) + "; every rank must pass the same shape and dtype");
  }
  at::Tensor shape = at::tensor(in.sizes().vec(), at::kLong), shapes = at::empty({n, in.dim()}, at::kLong);
  gather(shape, shapes);
  for (int r = 0; r < n; ++r)
    if (!at::equal(shapes[r], shape))
      invalid("allreduce of a sparse tensor: rank " + std::to_string(r) + "'s tensor is of size " +
              c10::str(c10::IntArrayRef(shapes[r].data_ptr<int64_t>(), static_cast<size_t>(in.dim()))) + " where rank " + std::to_string(getRank()) + "'s is " + c10::str(in.sizes()) +
              "; every rank must pass the same size");
  const at::Tensor counts = heads.select(1, 0).contiguous();
  const int64_t most = counts.max().item<int64_t>();
  std::vector<int64_t> valShape = vals.sizes().vec();
  valShape[0] = most;
  at::Tensor pidx = at::zeros({idx.size(0), most}, idx.options()), pvals = at::zeros(valShape, vals.options());
  pidx.narrow(1, 0, nnz).copy_(idx);
  pvals.narrow(0, 0, nnz).copy_(vals);
  std::vector<int64_t> allIdxShape{n, idx.size(0), most}, allValShape{n};
  allValShape.insert(allValShape.end(), valShape.begin(), valShape.end());
  at::Tensor allIdx = at::empty(allIdxShape, idx.options()), allVals = at::empty(allValShape, vals.options());
  gather(pidx, allIdx);
  gather(pvals, allVals);
  std::vector<at::Tensor> idxParts, valParts;
  for (int r = 0; r < n; ++r) {
    int64_t k = counts[r].item<int64_t>();
    idxParts.push_back(allIdx[r].narrow(1, 0, k));
    valParts.push_back(allVals[r].narrow(0, 0, k));
  }
  at::Tensor sum = at::sparse_coo_tensor(at::cat(idxParts, 1), at::cat(valParts, 0), in.sizes(), in.options()).coalesce();
  t.copy_(sum.to(t.device()));
  return makeWork(OpType::ALLREDUCE, "allreduce", reqs, tensors);
}

// gloo's monitored barrier, from what railcc already knows: one barrier bounded by the given
// timeout (the group's when none), whose timeout error names the ranks that never arrived and
// why (never called, frozen, gone) from the progress records every rank publishes. Every rank
// learns them, not only rank 0; `waitAllRanks` changes nothing since every missing rank is
// named either way.
void ProcessGroupRailcc::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  Millis timeout = opTimeout(opts.timeout);
  auto req = guard("monitored_barrier", [&] { return comm_->barrier(timeout); });
  comm_->wait(req);
  std::exception_ptr err = req->error();
  if (!err) return;
  try {
    std::rethrow_exception(err);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kTimeout) throw RailccError(e, "railcc monitored_barrier: ");
    std::ostringstream os;
    os << "monitored_barrier timed out: ";
    if (e.ranks.empty()) {
      os << "a rank";
    } else {
      os << (e.ranks.size() == 1 ? "rank " : "ranks ");
      for (size_t i = 0; i < e.ranks.size(); ++i)
        os << (i ? ", " : "") << e.ranks[i] << (i < e.hosts.size() ? " (host " + e.hosts[i] + ")" : "");
    }
    os << " failed to pass monitoredBarrier in " << timeout.count() << " ms\n" << e.what();
    Error out(ErrorCode::kTimeout, os.str());
    out.ranks = e.ranks;
    out.hosts = e.hosts;
    out.seq = e.seq;
    out.op = "monitored_barrier";
    throw RailccError(out, "railcc: ");
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::barrier(const c10d::BarrierOptions& opts) {
  engine::CallerWaits callerWaits(!opts.asyncOp && !coalescing_);
  auto req = guard("barrier", [&] { return comm_->barrier(opTimeout(opts.timeout)); });
  return makeWork(OpType::BARRIER, "barrier", {req}, {});
}

}  // namespace railcc
