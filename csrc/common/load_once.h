#pragma once
// A library loaded with dlopen at run time (libibverbs, hwloc), once per process and name: the
// first caller loads it, later callers get the same handle; a failure is said each time.

#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace railcc {

/// `load(name, &why)` returns the loaded library or null with `why` set. Thread-safe.
template <typename Lib>
const Lib* loadOnce(const std::string& name, std::unique_ptr<Lib> (*load)(const std::string&, std::string*),
                    std::string* whyNot) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<Lib>> loaded;  // handles stay open for the process's life
  std::lock_guard<std::mutex> g(mu);
  auto it = loaded.find(name);
  if (it != loaded.end()) return it->second.get();
  std::string why;
  auto lib = load(name, &why);
  if (!lib) {
    if (whyNot) *whyNot = why;
    return nullptr;
  }
  return (loaded[name] = std::move(lib)).get();
}

}  // namespace railcc
