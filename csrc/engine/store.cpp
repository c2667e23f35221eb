#include "engine/store.h"

#include "common/error.h"

namespace railcc::engine {

void MemoryStore::set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> g(mu_);
    data_[key] = value;
  }
  cv_.notify_all();
}

std::string MemoryStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> g(mu_);
  if (!cv_.wait_for(g, timeout, [&] { return data_.count(key) > 0; }))
    RAILCC_THROW(kTimeout, "store key '", key, "' did not appear within ", timeout.count(), " ms");
  return data_[key];
}

int64_t MemoryStore::add(const std::string& key, int64_t delta) {
  int64_t v;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto& s = data_[key];
    v = (s.empty() ? 0 : std::stoll(s)) + delta;
    s = std::to_string(v);
  }
  cv_.notify_all();
  return v;
}

}  // namespace railcc::engine
