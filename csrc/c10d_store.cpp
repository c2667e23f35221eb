#include "c10d_store.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <c10/util/Exception.h>

#include <algorithm>
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
  C10dStore(c10::intrusive_ptr<c10d::Store> s, int askers)
      : s_(std::move(s)), napCap_(std::clamp(std::chrono::microseconds(150) * std::max(askers, 1), kNapMin, kNapMax)) {
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
      unreachable(e);
    }
  }
  std::string get(const std::string& k, Millis timeout) override { return getAll({k}, timeout).front(); }
  int64_t add(const std::string& k, int64_t d) override {
    try {
      return s_->add(k, d);
    } catch (const c10::DistNetworkError& e) {
      unreachable(e);
    }
  }
  // Waits by asking whether the keys exist, napping between asks (0.1 ms doubling to napCap_),
  // never by a c10d wait that can expire: an expired TCPStore wait prints a warning and formats
  // the socket's address with getnameinfo, a reverse DNS lookup that blocks for the resolver's
  // timeout (5 s) where DNS is slow, and every rank waiting on this one with it.
  // A few keys (a set-up step's, a peer's endpoint or record) are read one at a time, each ask
  // also the read (readNow): one round trip per ask where check, wait and get are three. More
  // keys (a whole host's records) are asked for together and read in one multi_get.
  std::vector<std::string> getAll(const std::vector<std::string>& keys, Millis timeout) override {
    if (keys.empty()) return {};
    auto until = std::chrono::steady_clock::now() + timeout;
    auto nap = std::chrono::microseconds(100);
    std::vector<std::string> out(keys.size());
    const bool oneByOne = keys.size() <= kReadEach;
    size_t have = 0;  // keys[0, have) are read into out
    auto there = [&] {
      if (!oneByOne || noCompareSet_) return checkKeys(std::vector<std::string>(keys.begin() + static_cast<long>(have), keys.end()));
      while (have < keys.size() && readNow(keys[have], out[have])) ++have;
      return have == keys.size();
    };
    try {
      while (!there()) {
        auto now = std::chrono::steady_clock::now();
        if (now >= until) {
          for (size_t i = have; i < keys.size(); ++i)
            if (!checkKeys({keys[i]}))
              RAILCC_THROW(kTimeout, "store key '", keys[i], "' did not appear within ", timeout.count(), " ms");
          break;  // all there now
        }
        std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(nap, until - now));
        nap = std::min(nap * 2, napCap_);
      }
      if (have < keys.size()) {  // asked with check: read what is left in one multi_get
        auto vals = s_->multiGet(std::vector<std::string>(keys.begin() + static_cast<long>(have), keys.end()));
        for (size_t i = have; i < keys.size(); ++i) out[i].assign(vals[i - have].begin(), vals[i - have].end());
      }
    } catch (const c10::DistNetworkError& e) {
      unreachable(e);
    } catch (const railcc::Error&) {
      throw;
    } catch (const std::exception& e) {
      RAILCC_THROW(kTimeout, "store keys '", keys.front(), "' ... did not appear within ", timeout.count(), " ms (",
                   firstLine(e), ")");
    }
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
  static constexpr size_t kReadEach = 3;  // up to this many keys, read one at a time (getAll)
  // The longest nap between asks grows with the group: its ranks wait together (for the last
  // one to arrive, at set-up), so the store hears from each less often the more they are: 10 ms
  // up to 66 ranks, 150 us per rank above, at most 50 ms (a wait then overshoots by that much).
  // 128 ranks on fake hosts here asked ~17 times each for rank 0's placement record with 10 ms.
  static constexpr std::chrono::microseconds kNapMin{10000}, kNapMax{50000};

  // The key's value, or false while it is missing, in one round trip that never waits: a
  // compare-and-set expecting a value no record holds (NULs inside) is answered with the stored
  // value, or, for a missing key, with that expected value and nothing stored (TCPStore, its
  // prefix, file and hash stores alike). The libuv TCPStore server also wakes the key's waiters
  // on such a miss: harmless, as railcc waits on no key it has not seen exist. A store without
  // compare_set (a Python store may lack it) is asked by check() and read by multi_get instead.
  bool readNow(const std::string& k, std::string& out) {
    static constexpr char kAbsent[] = "\0railcc: no such key\0";
    static const std::vector<uint8_t> absent(kAbsent, kAbsent + sizeof(kAbsent) - 1);
    if (noCompareSet_) return false;
    std::vector<uint8_t> v;
    try {
      v = s_->compareSet(k, absent, absent);
    } catch (const c10::DistNetworkError&) {
      throw;
    } catch (const std::exception&) {
      noCompareSet_ = true;
      return false;
    }
    if (v == absent) return false;
    out.assign(v.begin(), v.end());
    return true;
  }

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

  // The store's host is gone for good: said once as railcc's error, and background traffic stops.
  [[noreturn]] void unreachable(const c10::DistNetworkError& e) {
    lost_.store(true);
    RAILCC_THROW(kPeerFailure, "the c10d store is unreachable: ", firstLine(e));
  }

  c10::intrusive_ptr<c10d::Store> s_;
  std::string watchHost_;
  uint16_t watchPort_ = 0;
  std::once_flag watchOnce_;
  std::shared_ptr<engine::StoreWatch> watch_;
  std::atomic<bool> lost_{false};
  std::atomic<bool> noCheck_{false};
  std::atomic<bool> noCompareSet_{false};
  const std::chrono::microseconds napCap_;
};

}  // namespace

std::shared_ptr<engine::Store> makeC10dStore(c10::intrusive_ptr<c10d::Store> s, int askers) {
  return std::make_shared<C10dStore>(std::move(s), askers);
}

}  // namespace railcc
