#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

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

 private:
  std::string prefix_;
  Store& base_;
};

}  // namespace railcc::engine
