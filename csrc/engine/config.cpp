#include "engine/config.h"

#include <cstdlib>
#include <string>

#include "engine/log.h"

namespace railcc::engine {
namespace {

bool parse(const std::string& s, std::string& out) {
  out = s;
  return true;
}

bool parse(const std::string& s, int64_t& out) {
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 0);
  if (s.empty() || end == nullptr || *end != '\0') return false;
  out = v;
  return true;
}

bool parse(const std::string& s, bool& out) {
  if (s == "1" || s == "true" || s == "TRUE" || s == "yes") {
    out = true;
    return true;
  }
  if (s == "0" || s == "false" || s == "FALSE" || s == "no") {
    out = false;
    return true;
  }
  return false;
}

std::string show(const std::string& v) { return v; }
std::string show(int64_t v) { return std::to_string(v); }
std::string show(bool v) { return v ? "1" : "0"; }

// Looks the parameter up: primary name first, then the NCCL fallback. Returns the name of
// the variable that was used, or "" when neither is set.
const char* lookup(const char* env, const char* fallback, std::string& raw) {
  if (const char* v = std::getenv(env)) {
    raw = v;
    return env;
  }
  if (fallback[0] != '\0') {
    if (const char* v = std::getenv(fallback)) {
      raw = v;
      return fallback;
    }
  }
  return "";
}

template <typename T>
std::string readParam(T& out, const char* env, const char* fallback, const char* def) {
  parse(def, out);
  std::string raw;
  const char* src = lookup(env, fallback, raw);
  if (src[0] == '\0') return "default";
  T v{};
  if (!parse(raw, v)) {
    RAILCC_WARN(ENV, "ignoring ", src, "=", raw, ": not a valid value; using the default ", def);
    return "default";
  }
  out = v;
  return src;
}

}  // namespace

Config Config::defaults() {
  Config c;
#define RAILCC_CONFIG_DEFAULT(name, T, env, fallback, def, desc) parse(def, c.name);
  RAILCC_PARAMS(RAILCC_CONFIG_DEFAULT)
#undef RAILCC_CONFIG_DEFAULT
  return c;
}

Config Config::fromEnv() {
  Config c;
#define RAILCC_CONFIG_READ(name, T, env, fallback, def, desc)              \
  {                                                                           \
    std::string src = readParam(c.name, env, fallback, def);                  \
    if (src != "default") RAILCC_INFO(ENV, env, "=", show(c.name), " (from ", src, ")"); \
  }
  RAILCC_PARAMS(RAILCC_CONFIG_READ)
#undef RAILCC_CONFIG_READ
  return c;
}

std::vector<ParamInfo> describeParams() {
  std::vector<ParamInfo> rows;
  Config c;
#define RAILCC_CONFIG_ROW(name, T, env, fallback, def, desc)                        \
  {                                                                                    \
    ParamInfo p{#name, env, fallback, #T, def, desc, "", ""};                       \
    p.source = readParam(c.name, env, fallback, def);                                  \
    p.value = show(c.name);                                                            \
    if (p.type == "int64_t") p.type = "int";                                           \
    if (p.type == "std::string") p.type = "string";                                   \
    rows.push_back(p);                                                                 \
  }
  RAILCC_PARAMS(RAILCC_CONFIG_ROW)
#undef RAILCC_CONFIG_ROW
  return rows;
}

}  // namespace railcc::engine
