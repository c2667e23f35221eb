// torch 2.14's reconfigure API (C10D_BACKEND_HAS_RECONFIGURE): a railcc group takes a new
// membership in place, as torchft and torchcomms ask of a backend. Every member gets a handle
// (get_reconfigure_handle), the members exchange them out of band, and each calls reconfigure
// with all of them and one fresh uuid: the old communicator finishes what is queued and closes,
// and a new one forms among the handles' processes, its rank this process's position among the
// handles (sorted, where they come as a set). They meet in the c10d store of the first handle's
// process (a TCPStore, as under torchrun: its address is in the handle), under a prefix of the
// uuid. Compiled only against a torch whose headers have the API; the Python side needs nothing.

#include "backend.h"

#ifdef C10D_BACKEND_HAS_RECONFIGURE

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <algorithm>
#include <random>
#include <set>
#include <sstream>

#include "c10d_store.h"

namespace railcc {

namespace {

constexpr const char* kHandleTag = "railcc1";

[[noreturn]] void refuse(const std::string& msg) { C10_THROW_ERROR(ValueError, "railcc reconfigure: " + msg); }

// The TCPStore under `s` (PrefixStores peeled off), or null.
c10::intrusive_ptr<c10d::Store> tcpStoreUnder(c10::intrusive_ptr<c10d::Store> s) {
  while (auto* p = dynamic_cast<c10d::PrefixStore*>(s.get())) s = p->getUnderlyingStore();
  return dynamic_cast<c10d::TCPStore*>(s.get()) ? s : c10::intrusive_ptr<c10d::Store>();
}

struct Handle {
  std::string host;
  int port = 0;
  std::string id;
};

// "railcc1 <store host>:<store port> <id>"; what a handle of another backend, or a damaged one,
// is refused with names it.
Handle parse(const std::string& h, size_t index) {
  std::istringstream in(h);
  std::string tag, where, id, extra;
  in >> tag >> where >> id;
  const size_t colon = where.rfind(':');
  Handle out;
  if (tag == kHandleTag && colon != std::string::npos && !id.empty() && !(in >> extra)) {
    out.host = where.substr(0, colon);
    try {
      out.port = std::stoi(where.substr(colon + 1));
    } catch (const std::exception&) {
      out.port = 0;
    }
  }
  if (out.host.empty() || out.port <= 0 || out.port > 65535)
    refuse("handle " + std::to_string(index) + " ('" + quoteBytes(h, 200) +
           "') is not a railcc handle: get_reconfigure_handle() of a railcc group makes them");
  out.id = id;
  return out;
}

}  // namespace

c10d::ReconfigureHandle ProcessGroupRailcc::get_reconfigure_handle() const {
  const auto tcp = tcpStoreUnder(c10dStore_);
  if (!tcp)
    refuse("group '" + groupName_ + "' was not made with a TCPStore (env:// or tcp://, as under torchrun): its "
           "handle must name a store the other members can reach");
  std::call_once(handleOnce_, [this] {
    std::random_device rd;
    std::ostringstream id;
    id << std::hex << getpid() << "-" << rd() << rd();
    handleId_ = id.str();
  });
  auto* t = static_cast<c10d::TCPStore*>(tcp.get());
  return std::string(kHandleTag) + " " + t->getHost() + ":" + std::to_string(t->getPort()) + " " + handleId_;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRailcc::reconfigure(const c10d::ReconfigureOptions& opts) {
  std::vector<std::string> handles;
  if (const auto* v = std::get_if<std::vector<c10d::ReconfigureHandle>>(&opts.handles)) {
    handles = *v;
  } else {  // a set: every member sorts it alike
    const auto& s = std::get<std::unordered_set<c10d::ReconfigureHandle>>(opts.handles);
    handles.assign(s.begin(), s.end());
    std::sort(handles.begin(), handles.end());
  }
  if (handles.empty()) refuse("no handles: pass every member's get_reconfigure_handle(), this one's included");
  std::vector<Handle> parsed;
  for (size_t i = 0; i < handles.size(); ++i) parsed.push_back(parse(handles[i], i));
  if (std::set<std::string>(handles.begin(), handles.end()).size() != handles.size())
    refuse("a handle is passed twice among the " + std::to_string(handles.size()) + ": each member's once");
  const std::string mine = get_reconfigure_handle();
  const auto at = std::find(handles.begin(), handles.end(), mine);
  if (at == handles.end())
    refuse("this process's own handle ('" + mine + "') is not among the " + std::to_string(handles.size()) +
           " passed: every member passes all members' handles, its own included");
  if (std::find(uuids_.begin(), uuids_.end(), opts.uuid) != uuids_.end())
    refuse("uuid " + std::to_string(opts.uuid) + " was used before on group '" + groupName_ + "': pass a fresh one");
  const int rank = static_cast<int>(at - handles.begin()), size = static_cast<int>(handles.size());
  const std::chrono::milliseconds timeout = opts.timeout ? groupTimeout(*opts.timeout) : timeout_;

  // The first handle's store: this process's own where it is that one, else a client of it.
  const Handle& lead = parsed.front();
  c10::intrusive_ptr<c10d::Store> base = tcpStoreUnder(c10dStore_);
  auto* own = static_cast<c10d::TCPStore*>(base.get());
  if (own->getHost() != lead.host || static_cast<int>(own->getPort()) != lead.port) {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(lead.port);
    so.isServer = false;
    so.waitWorkers = false;
    so.timeout = timeout;
    try {
      base = c10::make_intrusive<c10d::TCPStore>(lead.host, so);
    } catch (const std::exception& e) {
      refuse("cannot reach the store of the first handle's process at " + lead.host + ":" +
             std::to_string(lead.port) + ": " + e.what());
    }
  }
  auto store = c10::make_intrusive<c10d::PrefixStore>("railcc-reconfigure/" + std::to_string(opts.uuid), base);

  // The old communicator finishes what is queued and closes; it is kept, since a Work of it may
  // still ask it, and so is its store adapter.
  timeout_ = timeout;
  comm_->shutdown();
  retired_.push_back(std::move(comm_));
  retiredStores_.push_back(store_);
  store_ = makeC10dStore(store, size);
  c10dStore_ = store;
  globalRanks_.clear();
  for (int r = 0; r < size; ++r) globalRanks_.push_back(r);
  uuids_.push_back(opts.uuid);
  windows_ = 0;  // the new membership numbers its windows afresh (a member that joined made none)
  rank_ = rank;
  size_ = size;
  comm_ = connect("reconfigure", rank, size, groupName_ + ":reconfigure" + std::to_string(opts.uuid), {});
  return makeWork(c10d::OpType::UNKNOWN, "reconfigure", {}, {});
}

}  // namespace railcc

#endif  // C10D_BACKEND_HAS_RECONFIGURE
