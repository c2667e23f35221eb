// The transport registry. Adding a transport: its folder, plus one line in builtIns().
#include <algorithm>
#include <map>
#include <mutex>

#include "transport/net.h"
#include "transport/shm/shm_transport.h"
#include "transport/socket/socket_transport.h"
#include "transport/verbs/verbs_transport.h"

namespace railcc::transport {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, Registered> byName;
  Registry() {
    // name, preference (lower first), factory
    add({"shm", 10, shm::makeTransport});
    add({"verbs", 50, verbs::makeTransport});
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
