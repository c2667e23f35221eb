// The transport registry. Adding a transport: its folder, plus one line in builtIns().
#include <algorithm>
#include <map>
#include <mutex>

#include "transport/transport.h"
#include "transport/shm/shm_segment.h"
#include "transport/socket/socket_transport.h"
#ifdef RAILCC_HAVE_VERBS
#include "transport/verbs/verbs_connection.h"
#endif

namespace railcc::transport {
namespace {

#ifndef RAILCC_HAVE_VERBS
// Built without rdma-core's header: the transport is listed, and says why it never opens.
struct NoVerbs : Transport {
  std::string name() const override { return "verbs"; }
  bool interHost() const override { return true; }
  std::unique_ptr<Setup> open(const SetupContext&, std::string& whyNot) override {
    whyNot = "this railcc was built without rdma-core's headers (libibverbs-dev), so it has no verbs transport";
    return nullptr;
  }
};
#endif

struct Registry {
  std::mutex mu;
  std::map<std::string, Registered> byName;
  Registry() {
    // name, preference (lower first), factory
    add({"shm", 10, shm::makeTransport});
#ifdef RAILCC_HAVE_VERBS
    add({"verbs", 50, verbs::makeTransport});
#else
    add({"verbs", 50, [] { return std::unique_ptr<Transport>(new NoVerbs); }});
#endif
    add({"socket", 100, socket::makeTransport});
  }
  void add(Registered r) { byName[r.name] = std::move(r); }
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void registerTransport(const std::string& name, int preference, TransportFactory factory) {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  r.add({name, preference, std::move(factory)});
}

void unregisterTransport(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  r.byName.erase(name);
}

std::vector<Registered> registeredTransports() {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  std::vector<Registered> out;
  for (auto& [n, reg] : r.byName) out.push_back(reg);
  std::stable_sort(out.begin(), out.end(), [](const Registered& a, const Registered& b) { return a.preference < b.preference; });
  return out;
}

}  // namespace railcc::transport
