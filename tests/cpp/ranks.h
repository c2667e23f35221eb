#pragma once

// Shared by the engine test files: every rank is a thread with its own Communicator over one
// MemoryStore, so the real shm and socket transports run without Python or torch.

#include <gtest/gtest.h>

#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "engine/communicator.h"
#include "engine/store.h"

namespace railcc::engine::testing_util {

/// Runs body(comm) on `size` threads, each with its own communicator; an exception on any
/// rank fails the test, naming the rank.
inline void runRanks(int size, const Config& cfg, const std::string& name,
                     const std::function<void(Communicator&)>& body,
                     const std::function<void(int rank, Config&)>& perRank = nullptr) {
  static int group = 0;
  MemoryStore store;
  PrefixStore prefixed("g" + std::to_string(group++) + "/", store);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        CommOptions o;
        o.rank = r;
        o.size = size;
        o.name = name;
        o.timeout = Millis(60000);
        o.config = cfg;
        if (perRank) perRank(r, o.config);
        Communicator c(prefixed, o);
        body(c);
        c.shutdown();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < size; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

/// Makes a communicator on `size` threads, each rank its own host ("h<rank>"), and returns
/// what each one's set-up threw ("" where it did not): for tests of init errors.
inline std::vector<std::string> initErrors(int size, const Config& cfg) {
  std::vector<std::string> errs(static_cast<size_t>(size));
  MemoryStore store;
  std::vector<std::thread> ts;
  for (int r = 0; r < size; ++r)
    ts.emplace_back([&, r] {
      CommOptions o;
      o.rank = r;
      o.size = size;
      o.config = cfg;
      o.config.hostId = "h" + std::to_string(r);
      try {
        Communicator c(store, o);
      } catch (const std::exception& e) {
        errs[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  return errs;
}

/// The railcc Error `req` ended in; nullopt where it did not end within `timeout`, ended
/// without an error, or with an exception that is not an Error (each a test failure).
inline std::optional<railcc::Error> failureOf(const RequestPtr& req, Millis timeout = Millis(20000)) {
  if (!req->wait(timeout) || !req->error()) return std::nullopt;
  try {
    std::rethrow_exception(req->error());
  } catch (const railcc::Error& e) {
    return e;
  } catch (...) {
  }
  return std::nullopt;
}

inline void waitOk(const RequestPtr& req) {
  ASSERT_TRUE(req->wait(Millis(60000)));
  if (req->error()) std::rethrow_exception(req->error());
}

}  // namespace railcc::engine::testing_util
