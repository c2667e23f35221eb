#include "c10d_store.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "common/error.h"
#include "engine/store_watch.h"

namespace railcc {

namespace {

using Millis = std::chrono::milliseconds;

// The first line of a c10d error: its what() goes on with a C++ backtrace.
std::string firstLine(const std::exception& e) {
  std::string w = e.what();
  return w.substr(0, w.find('\n'));
}

class C10dStore : public engine::Store {
 public:
  explicit C10dStore(c10::intrusive_ptr<c10d::Store> s) : s_(std::move(s)) {
    c10::intrusive_ptr<c10d::Store> base = s_;
    if (auto* p = dynamic_cast<c10d::PrefixStore*>(base.get())) base = p->getUnderlyingNonPrefixStore();
    if (auto* tcp = dynamic_cast<c10d::TCPStore*>(base.get())) {
      watchHost_ = tcp->getHost();
      watchPort_ = tcp->getPort();
    }
  }
  void set(const std::string& k, const std::string& v) override {
    try {
      s_->set(k, std::vector<uint8_t>(v.begin(), v.end()));
    } catch (const c10::DistNetworkError& e) {
      lost_.store(true);
      RAILCC_THROW(kPeerFailure, "the c10d store is unreachable: ", firstLine(e));
    }
  }
  std::string get(const std::string& k, Millis timeout) override { return getAll({k}, timeout).front(); }
  int64_t add(const std::string& k, int64_t d) override { return s_->add(k, d); }
  // Waits by asking whether every key exists, napping between asks (0.1 ms doubling to 10 ms),
  // never by a c10d wait that can expire: an expired TCPStore wait prints a warning and formats
  // the socket's address with getnameinfo, a reverse DNS lookup that blocks for the resolver's
  // timeout (5 s) where DNS is slow, and every rank waiting on this one with it. Then one
  // multi_get: two round trips for a whole group's records instead of two per rank.
  std::vector<std::string> getAll(const std::vector<std::string>& keys, Millis timeout) override {
    if (keys.empty()) return {};
    auto until = std::chrono::steady_clock::now() + timeout;
    auto nap = std::chrono::microseconds(100);
    std::vector<std::vector<uint8_t>> vals;
    try {
      while (!checkKeys(keys)) {
        auto now = std::chrono::steady_clock::now();
        if (now >= until) {
          for (const std::string& k : keys)
            if (!checkKeys({k}))
              RAILCC_THROW(kTimeout, "store key '", k, "' did not appear within ", timeout.count(), " ms");
          break;  // all there now
        }
        std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(nap, until - now));
        nap = std::min(nap * 2, std::chrono::microseconds(10000));
      }
      vals = s_->multiGet(keys);
    } catch (const c10::DistNetworkError& e) {
      lost_.store(true);
      RAILCC_THROW(kPeerFailure, "the c10d store is unreachable: ", firstLine(e));
    } catch (const railcc::Error&) {
      throw;
    } catch (const std::exception& e) {
      RAILCC_THROW(kTimeout, "store keys '", keys.front(), "' ... did not appear within ", timeout.count(), " ms (",
                   firstLine(e), ")");
    }
    std::vector<std::string> out;
    out.reserve(vals.size());
    for (auto& v : vals) out.emplace_back(v.begin(), v.end());
    return out;
  }
  // The store is watched (engine/store_watch.h) through torch's own client socket, never a
  // connection of railcc's: a TCPStore server looks up the name of every connection it accepts
  // (reverse DNS, in its one thread), and here 1 connection in 51 stalled every rank's store
  // calls for the resolver's 5 s timeout (a 64-rank init took 6.8 s instead of 1.6 s when one
  // rank's watch connected while another still set up). Found at the first ask, from the
  // watchdog thread.
  bool lost() override {
    if (lost_.load()) return true;
    std::call_once(watchOnce_, [&] {
      if (!watchHost_.empty()) watch_ = engine::StoreWatch::of(watchHost_, watchPort_);
    });
    return watch_ && watch_->gone();
  }

 private:
  // Whether the keys exist. A store without check() (a Python store may lack it) is asked with a
  // short wait instead, as before.
  bool checkKeys(const std::vector<std::string>& keys) {
    if (!noCheck_) {
      try {
        return s_->check(keys);
      } catch (const c10::DistNetworkError&) {
        throw;
      } catch (const std::exception&) {
        noCheck_ = true;
      }
    }
    try {
      s_->wait(keys, Millis(10));
      return true;
    } catch (const c10::DistNetworkError&) {
      throw;
    } catch (const std::exception&) {
      return false;
    }
  }

  c10::intrusive_ptr<c10d::Store> s_;
  std::string watchHost_;
  uint16_t watchPort_ = 0;
  std::once_flag watchOnce_;
  std::shared_ptr<engine::StoreWatch> watch_;
  std::atomic<bool> lost_{false};
  std::atomic<bool> noCheck_{false};
};

}  // namespace

std::shared_ptr<engine::Store> makeC10dStore(c10::intrusive_ptr<c10d::Store> s) {
  return std::make_shared<C10dStore>(std::move(s));
}

}  // namespace railcc
