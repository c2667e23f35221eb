#include "transport/verbs/verbs_connection.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include "common/error.h"
#include "common/log.h"
#include "transport/stats.h"
#include "transport/verbs/gpu_registration.h"

namespace railcc::transport::verbs {
namespace {

constexpr int kRecvDepth = 512;        // receives posted; each write-with-immediate takes one
constexpr uint64_t kMaxDataMsgs = 256;  // data writes in flight, so credits always find a receive
constexpr int kSendDepth = 512;
constexpr int kCtrlReserve = 32;       // send slots kept for credits and notices
constexpr int kSignalEvery = 64;
constexpr size_t kMaxChunk = 512 << 10;  // a write's size: the receiver sees bytes per write
constexpr uint64_t kRecvTag = ~uint64_t(0);

// The immediate's top two bits say what a write carries; the rest is a count.
constexpr uint32_t kKindShift = 30;
constexpr uint32_t kCountMask = (1u << kKindShift) - 1;
enum ImmKind : uint32_t { kData = 0, kNotice = 1, kCreditBytes = 2, kCreditMsgs = 3 };
constexpr uint32_t kNoticeFailed = 1;
constexpr uint32_t kNoticeRead = 2;  // done reading the oldest buffer passed by address
constexpr size_t kBounceBytes = kRndvBounceBytes;

std::string memlockHint(size_t bytes, int err) {
  rlimit rl{};
  getrlimit(RLIMIT_MEMLOCK, &rl);
  std::string lim = rl.rlim_cur == RLIM_INFINITY ? "unlimited" : std::to_string(rl.rlim_cur >> 10) + " KiB";
  std::string s = "registering " + std::to_string(bytes >> 10) + " KiB with the NIC failed (" + strerror(err) +
                  "); the locked-memory limit (ulimit -l) is " + lim;
  if (rl.rlim_cur != RLIM_INFINITY)
    s += ": raise it (ulimit -l unlimited; Docker: --ulimit memlock=-1:-1; systemd: LimitMEMLOCK=infinity; "
         "/etc/security/limits.conf: * - memlock unlimited), or lower RAILCC_BUFFSIZE";
  return s;
}

const char* hintFor(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_RETRY_EXC_ERR:
      return "the peer's NIC stopped acknowledging: its process died or its host is unreachable; on RoCE also a "
             "GID index that does not route (RAILCC_IB_GID_INDEX/NCCL_IB_GID_INDEX; `railcc doctor` shows the table) "
             "or a lossy fabric (PFC/ECN not configured)";
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return "the peer posted no receive in time: it stopped making progress";
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_LOC_ACCESS_ERR:
      return "a memory registration was refused or is stale: with GPU memory check the IOMMU and PCIe ACS "
             "(`railcc doctor`), otherwise report a railcc bug";
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_REM_OP_ERR:
      return "the peer's queue pair refused the request (it was torn down or reset)";
    case IBV_WC_WR_FLUSH_ERR:
      return "the queue pair was already in the error state";
    default:
      return "see the NIC's counters (ethtool -S, /sys/class/infiniband/*/ports/*/hw_counters)";
  }
}

}  // namespace

int VerbsConnection::completionsPerQp() { return kSendDepth + kRecvDepth + 2 * kCtrlReserve; }

VerbsConnection::VerbsConnection(std::shared_ptr<Device> dev, size_t ringBytes, const Config& cfg, std::string peer,
                                 std::shared_ptr<CqHub> hub)
    : dev_(std::move(dev)), ibv_(dev_->ibv()), cfg_(cfg), peer_(std::move(peer)), ring_(ringBytes), hub_(std::move(hub)) {
  void* m = mmap(nullptr, 2 * ring_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) RAILCC_THROW(kSystem, "cannot map ", 2 * ring_, " bytes for an RDMA connection: ", detail::errnoString());
  mem_ = static_cast<char*>(m);
  try {
    recvMr_ = ibv_->regMr(dev_->pd(), mem_, ring_, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (recvMr_ == nullptr) RAILCC_THROW(kSystem, dev_->name(), ": ", memlockHint(ring_, errno));
    sendMr_ = ibv_->regMr(dev_->pd(), mem_ + ring_, ring_, IBV_ACCESS_LOCAL_WRITE);
    if (sendMr_ == nullptr) RAILCC_THROW(kSystem, dev_->name(), ": ", memlockHint(2 * ring_, errno));
    if (!hub_) hub_ = std::make_shared<CqHub>(dev_, completionsPerQp());
    ibv_cq* cq = hub_->nextCq();
    ibv_qp_init_attr ia{};
    ia.send_cq = cq;
    ia.recv_cq = cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = kSendDepth + kCtrlReserve;
    ia.cap.max_recv_wr = kRecvDepth;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    qp_ = ibv_->createQp(dev_->pd(), &ia);
    if (qp_ == nullptr) RAILCC_THROW(kSystem, "cannot create a queue pair on ", dev_->name(), ": ", detail::errnoString());
    hub_->attach(qp_->qp_num, this);
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = static_cast<uint16_t>(cfg_.ibPkey);
    a.port_num = static_cast<uint8_t>(dev_->port());
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    if (int rc = ibv_->modifyQp(qp_, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
      RAILCC_THROW(kSystem, "queue pair to INIT on ", dev_->name(), " failed: ", strerror(rc),
                   " (RAILCC_IB_PKEY/NCCL_IB_PKEY=", cfg_.ibPkey, ")");
    postRecvs(kRecvDepth);
    psn_ = std::random_device{}() & 0xffffff;
    if (cfg_.ibRndvBytes > 0) {
      rndvMin_ = std::max<size_t>(static_cast<size_t>(cfg_.ibRndvBytes), 4096);
      // Registered now: a read whose destination cannot be registered lands here, and by then
      // the sender waits on it (no other way back).
      void* m = mmap(nullptr, kBounceBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) RAILCC_THROW(kSystem, "cannot map a bounce buffer for RDMA reads: ", detail::errnoString());
      bounce_ = static_cast<char*>(m);
      bounceMr_ = ibv_->regMr(dev_->pd(), bounce_, kBounceBytes, IBV_ACCESS_LOCAL_WRITE);
      if (!bounceMr_) RAILCC_THROW(kSystem, dev_->name(), ": ", memlockHint(kBounceBytes, errno));
    }
  } catch (...) {
    release();
    throw;
  }
}

VerbsConnection::~VerbsConnection() { release(); }

void VerbsConnection::release() noexcept {
  if (qp_) hub_->detach(qp_->qp_num);
  if (qp_ && ibv_->destroyQp(qp_) != 0) RAILCC_WARN(IB, "destroying a queue pair on ", dev_->name(), " failed");
  // No request is in flight once the queue pair is gone: registrations may go.
  for (auto& l : exposed_) dev_->mrCache().release(l);
  exposed_.clear();
  dev_->mrCache().release(readLease_);
  dev_->mrCache().release(deviceRead_);
  deviceKeep_.reset();  // the queue pair is gone: nothing writes that memory any more
  if (bounceMr_) ibv_->deregMr(bounceMr_);
  if (bounce_) munmap(bounce_, kBounceBytes);
  bounceMr_ = nullptr;
  bounce_ = nullptr;
  if (sendMr_) ibv_->deregMr(sendMr_);
  if (recvMr_) ibv_->deregMr(recvMr_);
  if (mem_) munmap(mem_, 2 * ring_);
  qp_ = nullptr;
  sendMr_ = recvMr_ = nullptr;
  mem_ = nullptr;
}

QpInfo VerbsConnection::local() const {
  QpInfo q;
  q.qpn = qp_->qp_num;
  q.psn = psn_;
  q.ringAddr = reinterpret_cast<uint64_t>(mem_);
  q.rkey = recvMr_->rkey;
  q.ringBytes = ring_;
  q.lid = dev_->lid();
  memcpy(q.gid, dev_->gid().raw, 16);
  q.mtu = dev_->mtu();
  q.roce = dev_->roce();
  q.dev = dev_->name() + ":" + std::to_string(dev_->port());
  return q;
}

void VerbsConnection::connectTo(const QpInfo& r) {
  remote_ = r;
  if (r.ringBytes != ring_)
    RAILCC_THROW(kInvalidUsage, "RDMA rings differ: ", ring_, " bytes here, ", r.ringBytes, " at ", peer_,
                 ": set RAILCC_BUFFSIZE alike on every rank");
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = static_cast<ibv_mtu>(std::min<int>(dev_->mtu(), r.mtu));
  a.dest_qp_num = r.qpn;
  a.rq_psn = r.psn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.port_num = static_cast<uint8_t>(dev_->port());
  a.ah_attr.sl = static_cast<uint8_t>(cfg_.ibSl);
  if (dev_->roce() || dev_->gidIndex() >= 0) {
    a.ah_attr.is_global = 1;
    memcpy(a.ah_attr.grh.dgid.raw, r.gid, 16);
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(std::max(dev_->gidIndex(), 0));
    a.ah_attr.grh.hop_limit = 255;
    a.ah_attr.grh.traffic_class = static_cast<uint8_t>(cfg_.ibTc);
  } else {
    a.ah_attr.dlid = r.lid;
  }
  if (int rc = ibv_->modifyQp(qp_, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                         IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    RAILCC_THROW(kSystem, "queue pair to RTR on ", dev_->name(), " towards ", peer_, " (", r.dev, ", GID ",
                 formatGid(r.gid), ") failed: ", strerror(rc));
  a = ibv_qp_attr{};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = static_cast<uint8_t>(cfg_.ibTimeout);
  a.retry_cnt = static_cast<uint8_t>(cfg_.ibRetryCnt);
  a.rnr_retry = 7;  // forever: a receiver that is slow to repost is waited for, not failed
  a.sq_psn = psn_;
  a.max_rd_atomic = 1;
  if (int rc = ibv_->modifyQp(qp_, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                         IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
    RAILCC_THROW(kSystem, "queue pair to RTS on ", dev_->name(), " towards ", peer_, " failed: ", strerror(rc),
                 " (RAILCC_IB_TIMEOUT=", cfg_.ibTimeout, ", RAILCC_IB_RETRY_CNT=", cfg_.ibRetryCnt, ")");
  connected_ = true;
  lastProbe_ = std::chrono::steady_clock::now();
}

void VerbsConnection::postRecvs(int n) {
  for (int i = 0; i < n; ++i) {
    ibv_recv_wr wr{};
    ibv_recv_wr* bad = nullptr;
    wr.wr_id = kRecvTag;
    wr.sg_list = nullptr;
    wr.num_sge = 0;  // a write with immediate lands in the ring; the receive only carries the immediate
    if (int rc = ibv_post_recv(qp_, &wr, &bad)) fail(std::string("posting a receive failed: ") + strerror(rc));
  }
}

void VerbsConnection::post(uint64_t localOff, size_t n, uint64_t remoteOff, uint32_t imm, bool withImm, bool signaled) {
  ibv_sge sge{};
  sge.addr = reinterpret_cast<uint64_t>(mem_ + ring_ + localOff);
  sge.length = static_cast<uint32_t>(n);
  sge.lkey = sendMr_->lkey;
  ibv_send_wr wr{};
  ibv_send_wr* bad = nullptr;
  wr.wr_id = ++sqPosted_;
  wr.sg_list = n > 0 ? &sge : nullptr;
  wr.num_sge = n > 0 ? 1 : 0;
  wr.opcode = withImm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
  wr.imm_data = htonl(imm);
  if (++sinceSignal_ >= kSignalEvery) signaled = true;
  if (signaled) {
    wr.send_flags = IBV_SEND_SIGNALED;
    sinceSignal_ = 0;
  }
  wr.wr.rdma.remote_addr = remote_.ringAddr + remoteOff;
  wr.wr.rdma.rkey = remote_.rkey;
  if (int rc = ibv_post_send(qp_, &wr, &bad)) fail(std::string("posting an RDMA write failed: ") + strerror(rc));
}

[[noreturn]] void VerbsConnection::fail(const std::string& why) {
  if (error_.empty())
    error_ = "RDMA connection " + dev_->name() + ":" + std::to_string(dev_->port()) + " -> " + peer_ + " (" +
             remote_.dev + ", qp " + std::to_string(qp_ ? qp_->qp_num : 0) + " -> " + std::to_string(remote_.qpn) +
             "): " + why;
  Error e(ErrorCode::kPeerFailure, error_);
  throw e;
}

void VerbsConnection::handle(const ibv_wc& wc) {
  if (wc.status != IBV_WC_SUCCESS) {
    if (wc.status == IBV_WC_WR_FLUSH_ERR && wc.wr_id == kRecvTag)
      fail("the queue pair entered the error state (" + std::string(hintFor(wc.status)) + ")");
    fail(std::string(wc.wr_id == kRecvTag ? "a receive" : wc.wr_id == readWr_ && readWr_ ? "an RDMA read" : "an RDMA write") +
         " completed with error: " +
         ibv_->wcStatusStr(wc.status) + " (status " + std::to_string(static_cast<int>(wc.status)) + ", vendor error " +
         std::to_string(wc.vendor_err) + "): " + hintFor(wc.status));
  }
  if (wc.wr_id != kRecvTag) {  // a signalled write: every request up to it is done
    if (wc.wr_id > sqPosted_) return;  // not ours: a queue pair of the same number before us
    sqDone_ = std::max<uint64_t>(sqDone_, wc.wr_id);
    probing_ = false;
    return;
  }
  uint32_t imm = ntohl(wc.imm_data);
  uint32_t count = imm & kCountMask;
  switch (imm >> kKindShift) {
    case kData:
      written_ += count;
      ++polledMsgs_;
      break;
    case kCreditBytes:
      peerConsumed_ += count;
      break;
    case kCreditMsgs:
      peerPolledMsgs_ += count;
      break;
    case kNotice:
      if (count == kNoticeFailed) peerFailed_ = true;
      if (count == kNoticeRead) {
        if (exposed_.empty()) fail("the peer acknowledged a read of a buffer this side never passed (protocol error)");
        ++acked_;
        dev_->mrCache().release(exposed_.front());
        exposed_.pop_front();
      }
      break;
  }
  postRecvs(1);
}

void VerbsConnection::onCompletion(const ibv_wc& wc) {
  news_ = true;
  try {
    handle(wc);
  } catch (const Error&) {
    // fail() kept the reason in error_: raised on this connection's next call.
  } catch (const std::exception& e) {
    if (error_.empty()) error_ = std::string("handling a completion failed: ") + e.what();
  }
}

void VerbsConnection::progressCq() {
  if (!error_.empty()) fail(error_);
  if (peerFailed_) fail("the peer reported a failure of its own and stopped");
  hub_->poll();
  if (!error_.empty()) fail(error_);
  if (peerFailed_) fail("the peer reported a failure of its own and stopped");
  maybeCredit();
  news_ = false;  // whatever came for us, our caller sees now
}

void VerbsConnection::maybeCredit() {
  auto room = [&] { return sqPosted_ - sqDone_ < static_cast<uint64_t>(kSendDepth + kCtrlReserve / 2); };
  uint64_t bytes = read_ - credited_;
  if (bytes > 0 && bytes >= ring_ / 4 && room()) {
    uint32_t k = static_cast<uint32_t>(std::min<uint64_t>(bytes, kCountMask));
    post(0, 0, 0, (kCreditBytes << kKindShift) | k, true, false);
    credited_ += k;
  }
  uint64_t msgs = polledMsgs_ - creditedMsgs_;
  if (msgs > 0 && msgs >= kMaxDataMsgs / 4 && room()) {
    post(0, 0, 0, (kCreditMsgs << kKindShift) | static_cast<uint32_t>(msgs), true, false);
    creditedMsgs_ += msgs;
  }
}

size_t VerbsConnection::sendRoom() const {
  if (sentMsgs_ - peerPolledMsgs_ >= kMaxDataMsgs) return 0;
  if (sqPosted_ - sqDone_ >= static_cast<uint64_t>(kSendDepth)) return 0;
  return ring_ - static_cast<size_t>(sent_ - peerConsumed_);
}

size_t VerbsConnection::send(const void* p, size_t n) {
  progressCq();
  const char* src = static_cast<const char*>(p);
  size_t total = 0;
  while (total < n) {
    size_t room = sendRoom();
    if (room == 0) break;
    size_t off = static_cast<size_t>(sent_ % ring_);
    size_t k = std::min({n - total, room, ring_ - off, kMaxChunk});
    copyBytes(mem_ + ring_ + off, src + total, k);
    post(off, k, off, (kData << kKindShift) | static_cast<uint32_t>(k), true, false);
    sent_ += k;
    ++sentMsgs_;
    total += k;
  }
  addStat(StatKind::kVerbs, Stat::kSendCopied, total);
  addStat(StatKind::kVerbs, Stat::kRdmaWritten, total);
  return total;
}

std::pair<const void*, size_t> VerbsConnection::peek() {
  progressCq();
  size_t off = static_cast<size_t>(read_ % ring_);
  size_t avail = static_cast<size_t>(written_ - read_);
  return {mem_ + off, std::min(avail, ring_ - off)};
}

void VerbsConnection::consume(size_t n) {
  read_ += n;
  addStat(StatKind::kVerbs, Stat::kRecvCopied, n);
  maybeCredit();
}

// --- Rendezvous -------------------------------------------------------------------------

bool VerbsConnection::exposeForRead(const void* p, size_t n, uint64_t* key) {
  MrCache::Lease l = dev_->mrCache().acquire(p, n);
  if (!l.mr) return false;
  *key = l.mr->rkey;
  exposed_.push_back(l);
  return true;
}

void VerbsConnection::postRead(void* dst, uint32_t lkey, uint64_t addr, uint32_t rkey, size_t n) {
  ibv_sge sge{};
  sge.addr = reinterpret_cast<uint64_t>(dst);
  sge.length = static_cast<uint32_t>(n);
  sge.lkey = lkey;
  ibv_send_wr wr{};
  ibv_send_wr* bad = nullptr;
  wr.wr_id = ++sqPosted_;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_READ;
  wr.send_flags = IBV_SEND_SIGNALED;
  sinceSignal_ = 0;
  wr.wr.rdma.remote_addr = addr;
  wr.wr.rdma.rkey = rkey;
  readWr_ = wr.wr_id;
  if (int rc = ibv_post_send(qp_, &wr, &bad)) fail(std::string("posting an RDMA read failed: ") + strerror(rc));
}

bool VerbsConnection::readRemote(void* dst, uint64_t addr, uint64_t key, size_t n) {
  progressCq();
  char* d = static_cast<char*>(dst);
  const auto rkey = static_cast<uint32_t>(key);
  if (!reading_) {
    if (sqPosted_ - sqDone_ >= static_cast<uint64_t>(kSendDepth)) return false;
    // GPU memory made ready by readsIntoDevice() is registered for the whole message.
    if (!deviceRead_.mr) readLease_ = dev_->mrCache().acquire(dst, n);
    readDone_ = 0;
    reading_ = true;
    if (deviceRead_.mr) postRead(d, deviceRead_.mr->lkey, addr, rkey, n);
    else if (readLease_.mr) postRead(d, readLease_.mr->lkey, addr, rkey, n);
    else postRead(bounce_, bounceMr_->lkey, addr, rkey, std::min(n, kBounceBytes));
    return false;
  }
  if (sqDone_ < readWr_) return false;
  if (deviceRead_.mr) {
    addStat(StatKind::kVerbs, Stat::kRdmaZeroCopy, n);
    addStat(StatKind::kVerbs, Stat::kGpuDirect, n);
  } else if (readLease_.mr) {
    dev_->mrCache().release(readLease_);
    addStat(StatKind::kVerbs, Stat::kRdmaZeroCopy, n);
  } else {
    size_t k = std::min(n - readDone_, kBounceBytes);
    copyBytes(d + readDone_, bounce_, k);
    addStat(StatKind::kVerbs, Stat::kRecvCopied, k);
    readDone_ += k;
    if (readDone_ < n) {
      postRead(bounce_, bounceMr_->lkey, addr + readDone_, rkey, std::min(n - readDone_, kBounceBytes));
      return false;
    }
  }
  reading_ = false;
  return true;
}

bool VerbsConnection::ackRemote() {
  progressCq();
  // The queue pair's last slots are the acknowledgements' (data and credits stop short of them).
  if (sqPosted_ - sqDone_ >= static_cast<uint64_t>(kSendDepth + kCtrlReserve - 1)) return false;
  if (deviceRead_.mr) {
    // What the NIC wrote into GPU memory is made visible to the GPU's work that follows. The
    // read is over: the registration goes whatever the flush says.
    dev_->mrCache().release(deviceRead_);
    deviceKeep_.reset();
    if (GpuMemory* gm = gpuMemory()) gm->flushWrites(deviceGpu_);
  }
  post(0, 0, 0, (kNotice << kKindShift) | kNoticeRead, true, false);
  return true;
}

// --- GPU memory (GPUDirect RDMA) ----------------------------------------------------------

MrCache::Lease VerbsConnection::gpuLease(const void* p, size_t n, int gpu) {
  GpuMemory* gm = gpuMemory();
  if (!gm || !peerReadsUs()) return {};
  GpuRegistration r = registerGpuMemory(*ibv_, dev_->pd(), *gm, p, n, dev_->gdrMode(gpu), dev_->peermem(),
                                        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
  sayGpuRegistration(dev_->name(), gpu, r);
  return MrCache::Lease{r.mr, false};  // not cached: released (deregistered) after the message
}

bool VerbsConnection::exposeDeviceForRead(const void* p, size_t n, int gpu, uint64_t* key) {
  MrCache::Lease l = gpuLease(p, n, gpu);
  if (!l.mr) return false;
  *key = l.mr->rkey;
  exposed_.push_back(l);
  addStat(StatKind::kVerbs, Stat::kGpuDirect, n);
  return true;
}

bool VerbsConnection::readsIntoDevice(void* dst, size_t n, int gpu, std::shared_ptr<void> keep) {
  if (reading_ || deviceRead_.mr) RAILCC_THROW(kInternal, "a receive into GPU memory began while the last one was still being read");
  deviceRead_ = gpuLease(dst, n, gpu);
  if (!deviceRead_.mr) return false;
  deviceGpu_ = gpu;
  deviceKeep_ = std::move(keep);
  return true;
}

uint64_t VerbsConnection::remoteAcked() {
  progressCq();
  return acked_;
}

bool VerbsConnection::canSend() {
  progressCq();
  return sendRoom() > 0;
}

int VerbsConnection::pollFd() const { return hub_->fd(); }

std::string VerbsConnection::describe() const {
  return "verbs " + dev_->name() + ":" + std::to_string(dev_->port()) + (dev_->netdev().empty() ? "" : "/" + dev_->netdev()) +
         " -> " + remote_.dev + " qp " + std::to_string(qp_->qp_num);
}

void VerbsConnection::checkAlive() {
  std::string why = dev_->broken(qp_->qp_num);
  if (!why.empty()) fail(why);
  progressCq();
  // A peer process that died leaves nothing to see until something is sent to it: a signalled
  // empty write a second is acknowledged by a live peer's NIC and fails with "retry exceeded"
  // (after RAILCC_IB_TIMEOUT x RAILCC_IB_RETRY_CNT) once nobody answers.
  auto now = std::chrono::steady_clock::now();
  if (connected_ && !probing_ && now - lastProbe_ > std::chrono::seconds(1) &&
      sqPosted_ - sqDone_ < static_cast<uint64_t>(kSendDepth)) {
    post(0, 0, 0, 0, false, true);
    probing_ = true;
    lastProbe_ = now;
  }
}

void VerbsConnection::markFailed() {
  // Best effort, from any thread: tell the peer so it fails at once instead of at its timeout.
  if (!connected_ || !error_.empty() || qp_ == nullptr) return;
  ibv_send_wr wr{};
  ibv_send_wr* bad = nullptr;
  wr.wr_id = 0;
  wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  wr.imm_data = htonl((kNotice << kKindShift) | kNoticeFailed);
  wr.wr.rdma.remote_addr = remote_.ringAddr;
  wr.wr.rdma.rkey = remote_.rkey;
  (void)ibv_post_send(qp_, &wr, &bad);
}

}  // namespace railcc::transport::verbs
