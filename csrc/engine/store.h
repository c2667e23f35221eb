#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>
#include <algorithm>

namespace railcc::engine {

/// The rendezvous the engine bootstraps through. The c10d glue adapts c10d::Store to it;
/// tests use MemoryStore. Implementations must be thread-safe.
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  /// Blocks until `key` exists or `timeout` passes; then throws Error(kTimeout) naming it.
  virtual std::string get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  /// Blocks until every key exists or `timeout` passes (then throws Error(kTimeout)), and
  /// returns their values in order. A store that can should do it in one batched call rather
  /// than a round trip per key: set-up reads every rank's record this way.
  virtual std::vector<std::string> getAll(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
    auto until = std::chrono::steady_clock::now() + timeout;
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const std::string& k : keys) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      out.push_back(get(k, std::max(left, std::chrono::milliseconds(0))));
    }
    return out;
  }
  /// True once the store is known to be unreachable for good (its host exited): background
  /// traffic (progress records, failure reports) then stops instead of failing again and
  /// again. Never blocks; false when unknown.
  virtual bool lost() { return false; }
};

/// An in-process store: ranks as threads share one instance.
class MemoryStore : public Store {
 public:
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> data_;
};

/// Prepends a prefix to every key (one communicator's namespace in a shared store).
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, Store& base) : prefix_(std::move(prefix)), base_(base) {}
  void set(const std::string& k, const std::string& v) override { base_.set(prefix_ + k, v); }
  std::string get(const std::string& k, std::chrono::milliseconds t) override { return base_.get(prefix_ + k, t); }
  int64_t add(const std::string& k, int64_t d) override { return base_.add(prefix_ + k, d); }
  std::vector<std::string> getAll(const std::vector<std::string>& keys, std::chrono::milliseconds t) override {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const std::string& k : keys) full.push_back(prefix_ + k);
    return base_.getAll(full, t);
  }

 private:
  std::string prefix_;
  Store& base_;
};

}  // namespace railcc::engine
