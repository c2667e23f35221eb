#include "common/config.h"

#include <cstdlib>
#include <string>

#include "common/error.h"
#include "common/log.h"

namespace railcc {
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

// Checks `v` against the table's `allowed` column; returns why it is refused, or "".
std::string outOfRange(int64_t v, const std::string& allowed) {
  size_t dots = allowed.find("..");
  if (dots == std::string::npos) return "";
  long long lo = std::stoll(allowed.substr(0, dots)), hi = std::stoll(allowed.substr(dots + 2));
  if (v >= lo && v <= hi) return "";
  return "out of range: allowed " + std::to_string(lo) + " to " + std::to_string(hi);
}
std::string outOfRange(const std::string& v, const std::string& allowed) {
  if (allowed.empty()) return "";
  std::string choices = "|" + allowed + "|";
  if (choices.find("|" + v + "|") != std::string::npos) return "";
  std::string list = allowed;
  for (auto& c : list)
    if (c == '|') c = ',';
  return "not one of " + list;
}
std::string outOfRange(bool, const std::string&) { return ""; }

const char* describeType(const int64_t&) { return "an integer"; }
const char* describeType(const bool&) { return "0 or 1"; }
const char* describeType(const std::string&) { return "a string"; }

// Reads one parameter into `out`. Returns the variable that set it ("default" when none did);
// `problem` says why a set value is refused (then `out` keeps the default).
template <typename T>
std::string readParam(T& out, const char* env, const char* fallback, const char* def, const std::string& allowed,
                      std::string& problem) {
  parse(def, out);
  std::string raw;
  const char* src = lookup(env, fallback, raw);
  if (src[0] == '\0') return "default";
  T v{};
  if (!parse(raw, v)) {
    problem = std::string(src) + "='" + raw + "' is not " + describeType(v) +
              (allowed.empty() ? std::string() : " (allowed: " + allowed + ")");
    return src;
  }
  std::string why = outOfRange(v, allowed);
  if (!why.empty()) {
    problem = std::string(src) + "=" + raw + " is " + why;
    return src;
  }
  out = v;
  return src;
}

}  // namespace

Config Config::defaults() {
  Config c;
#define RAILCC_CONFIG_DEFAULT(name, T, env, fallback, def, allowed, desc) parse(def, c.name);
  RAILCC_PARAMS(RAILCC_CONFIG_DEFAULT)
#undef RAILCC_CONFIG_DEFAULT
  return c;
}

Config Config::fromEnv() {
  Config c;
  std::string problems;
#define RAILCC_CONFIG_READ(name, T, env, fallback, def, allowed, desc)             \
  {                                                                                 \
    std::string problem;                                                            \
    std::string src = readParam(c.name, env, fallback, def, allowed, problem);      \
    if (!problem.empty()) problems += (problems.empty() ? "" : "; ") + problem;     \
    else if (src != "default") RAILCC_INFO(ENV, env, "=", show(c.name), " (from ", src, ")"); \
  }
  RAILCC_PARAMS(RAILCC_CONFIG_READ)
#undef RAILCC_CONFIG_READ
  // Refused, not clamped or defaulted: a size or timeout the user did not ask for would only
  // surface later as a crash, a hang or a slow job (`python -m railcc env` lists the ranges).
  if (!problems.empty()) RAILCC_THROW(kInvalidUsage, "invalid railcc configuration: ", problems);
  return c;
}

std::vector<ParamInfo> describeParams() {
  std::vector<ParamInfo> rows;
  Config c;
#define RAILCC_CONFIG_ROW(name, T, env, fallback, def, allowed, desc)              \
  {                                                                                 \
    ParamInfo p{#name, env, fallback, #T, def, allowed, desc, "", "", ""};         \
    p.source = readParam(c.name, env, fallback, def, allowed, p.problem);           \
    p.value = show(c.name);                                                         \
    if (p.type == "int64_t") p.type = "int";                                        \
    if (p.type == "std::string") p.type = "string";                                 \
    rows.push_back(p);                                                              \
  }
  RAILCC_PARAMS(RAILCC_CONFIG_ROW)
#undef RAILCC_CONFIG_ROW
  return rows;
}

}  // namespace railcc
