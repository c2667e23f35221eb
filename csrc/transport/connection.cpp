// Connection's defaults: memory registration and requests carried on the byte stream, and no
// single copy.
#include <algorithm>

#include "common/error.h"
#include "transport/connection.h"

namespace railcc::transport {

bool Connection::readRemote(void*, uint64_t, uint64_t, size_t) {
  RAILCC_THROW(kInternal, "transport ", describe(), " cannot read a peer's memory (a message passed by address)");
}

MemRegion Connection::regMr(void* p, size_t n, MemoryKind kind) {
  if (kind != MemoryKind::kHost)
    RAILCC_THROW(kInvalidUsage, "transport ", describe(), " cannot register device memory; stage it through host memory");
  MemRegion mr;
  mr.addr = p;
  mr.bytes = n;
  mr.kind = kind;
  return mr;
}

static void checkInside(const MemRegion* mr, const void* p, size_t n, const char* what) {
  if (!mr) return;
  auto* b = static_cast<const char*>(mr->addr);
  auto* q = static_cast<const char*>(p);
  if (q < b || q + n > b + mr->bytes)
    RAILCC_THROW(kInvalidUsage, what, " of ", n, " bytes lies outside its registered region of ", mr->bytes, " bytes");
}

int Connection::isend(const void* p, size_t n, const MemRegion* mr) {
  checkInside(mr, p, n, "isend");
  StreamRequest r{nextReq_++, true, static_cast<char*>(const_cast<void*>(p)), n, n};
  sendReqs_.push_back(r);
  progressRequests();
  return r.id;
}

int Connection::irecv(void* p, size_t n, const MemRegion* mr) {
  checkInside(mr, p, n, "irecv");
  StreamRequest r{nextReq_++, false, static_cast<char*>(p), n, 0};
  recvReqs_.push_back(r);
  progressRequests();
  return r.id;
}

void Connection::progressRequests() {
  while (!sendReqs_.empty()) {
    StreamRequest& r = sendReqs_.front();
    while (r.lenDone < sizeof(r.len)) {
      size_t k = send(reinterpret_cast<const char*>(&r.len) + r.lenDone, sizeof(r.len) - r.lenDone);
      if (k == 0) return;
      r.lenDone += k;
    }
    while (r.done < r.len) {
      size_t k = send(r.p + r.done, r.len - r.done);
      if (k == 0) break;
      r.done += k;
    }
    if (r.done < r.len) break;
    r.finished = true;
    doneReqs_.push_back(r);
    sendReqs_.pop_front();
  }
  while (!recvReqs_.empty()) {
    StreamRequest& r = recvReqs_.front();
    while (r.lenDone < sizeof(r.len)) {
      size_t k = recv(reinterpret_cast<char*>(&r.len) + r.lenDone, sizeof(r.len) - r.lenDone);
      if (k == 0) return;
      r.lenDone += k;
      if (r.lenDone == sizeof(r.len) && r.len > r.n)
        RAILCC_THROW(kInvalidUsage, "irecv of at most ", r.n, " bytes met a message of ", r.len, " bytes from ",
                     describe());
    }
    while (r.done < r.len) {
      size_t k = recv(r.p + r.done, r.len - r.done);
      if (k == 0) return;
      r.done += k;
    }
    r.finished = true;
    doneReqs_.push_back(r);
    recvReqs_.pop_front();
  }
}

bool Connection::test(int id, size_t* bytes) {
  progressRequests();
  auto it = std::find_if(doneReqs_.begin(), doneReqs_.end(), [id](const StreamRequest& r) { return r.id == id; });
  if (it == doneReqs_.end()) {
    bool known = std::any_of(sendReqs_.begin(), sendReqs_.end(), [id](auto& r) { return r.id == id; }) ||
                 std::any_of(recvReqs_.begin(), recvReqs_.end(), [id](auto& r) { return r.id == id; });
    if (!known) RAILCC_THROW(kInvalidUsage, "test() of request ", id, ", which is not pending on ", describe());
    return false;
  }
  if (bytes) *bytes = it->len;
  doneReqs_.erase(it);
  return true;
}

}  // namespace railcc::transport
