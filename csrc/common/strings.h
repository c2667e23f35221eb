#pragma once
// Small string helpers every layer uses: splitting the text records that travel through the
// store, and hex for the binary fields inside them.

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace railcc {

/// The fields of `s` between `sep`s ("a;b" -> {"a", "b"}; a trailing separator adds nothing).
inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream is(s);
  while (std::getline(is, cur, sep)) out.push_back(cur);
  return out;
}

/// `s` as a whole decimal integer in [lo, hi]: false (and `out` untouched) for anything else
/// (empty, signs or junk around the digits, out of range). For fields of records that other
/// processes wrote: never throws.
inline bool parseInt(const std::string& s, long long lo, long long hi, long long& out) {
  if (s.empty() || s.size() > 20) return false;
  for (size_t i = 0; i < s.size(); ++i)
    if (!(s[i] >= '0' && s[i] <= '9') && !(i == 0 && s[i] == '-' && s.size() > 1)) return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size() || v < lo || v > hi) return false;
  out = v;
  return true;
}

/// The same for unsigned 64-bit fields (addresses, sizes).
inline bool parseUint(const std::string& s, unsigned long long hi, unsigned long long& out) {
  if (s.empty() || s.size() > 20) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  errno = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size() || v > hi) return false;
  out = v;
  return true;
}

/// Ascending ranks as spans: {1, 2, 3, 5, 7, 8} -> "1-3, 5, 7-8"; empty for none. A line that
/// names thousands of peers of a job laid out in blocks stays a few spans long.
inline std::string rankSpans(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(ranks[i]);
    if (j > i) out += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

/// Lower-case hex of n bytes.
inline std::string toHex(const uint8_t* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  s.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    s += digits[p[i] >> 4];
    s += digits[p[i] & 15];
  }
  return s;
}

/// The bytes of a hex string; false (and `out` unspecified) when it is not 2 * `out.size()`
/// hex digits.
inline bool fromHex(const std::string& s, uint8_t* out, size_t n) {
  auto val = [](char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
  };
  if (s.size() != 2 * n) return false;
  for (size_t i = 0; i < n; ++i) {
    int hi = val(s[2 * i]), lo = val(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return true;
}

}  // namespace railcc
