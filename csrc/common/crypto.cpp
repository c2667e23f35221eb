#include "common/crypto.h"

#include <sys/random.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "common/error.h"
#include "common/log.h"
#include "common/strings.h"

namespace railcc {
namespace {

constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void compress(uint32_t h[8], const uint8_t block[64]) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i)
    w[i] = uint32_t(block[4 * i]) << 24 | uint32_t(block[4 * i + 1]) << 16 | uint32_t(block[4 * i + 2]) << 8 |
           uint32_t(block[4 * i + 3]);
  for (int i = 16; i < 64; ++i) {
    uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
  for (int i = 0; i < 64; ++i) {
    uint32_t t1 = k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[i] + w[i];
    uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    k = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h[0] += a;
  h[1] += b;
  h[2] += c;
  h[3] += d;
  h[4] += e;
  h[5] += f;
  h[6] += g;
  h[7] += k;
}

}  // namespace

Digest sha256(const void* data, size_t n) {
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  const auto* p = static_cast<const uint8_t*>(data);
  size_t full = n / 64 * 64;
  for (size_t i = 0; i < full; i += 64) compress(h, p + i);
  // The tail, a 0x80 byte, zeros, and the length in bits: one or two more blocks.
  uint8_t tail[128] = {0};
  size_t rest = n - full;
  std::memcpy(tail, p + full, rest);
  tail[rest] = 0x80;
  size_t blocks = rest + 1 + 8 <= 64 ? 1 : 2;
  uint64_t bits = static_cast<uint64_t>(n) * 8;
  for (int i = 0; i < 8; ++i) tail[blocks * 64 - 1 - i] = static_cast<uint8_t>(bits >> (8 * i));
  for (size_t b = 0; b < blocks; ++b) compress(h, tail + 64 * b);
  Digest out;
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<uint8_t>(h[i] >> (24 - 8 * j));
  return out;
}

Digest hmacSha256(const std::vector<uint8_t>& key, const std::vector<uint8_t>& msg) {
  uint8_t k[64] = {0};
  if (key.size() > 64) {
    Digest d = sha256(key.data(), key.size());
    std::memcpy(k, d.data(), d.size());
  } else if (!key.empty()) {
    std::memcpy(k, key.data(), key.size());
  }
  std::vector<uint8_t> inner(64 + msg.size());
  for (int i = 0; i < 64; ++i) inner[i] = k[i] ^ 0x36;
  if (!msg.empty()) std::memcpy(inner.data() + 64, msg.data(), msg.size());
  Digest ih = sha256(inner.data(), inner.size());
  uint8_t outer[64 + 32];
  for (int i = 0; i < 64; ++i) outer[i] = k[i] ^ 0x5c;
  std::memcpy(outer + 64, ih.data(), ih.size());
  return sha256(outer, sizeof(outer));
}

bool equalConstantTime(const Digest& a, const Digest& b) {
  uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<uint8_t>(a[i] ^ b[i]);
  return diff == 0;
}

std::vector<uint8_t> randomBytes(size_t n) {
  std::vector<uint8_t> out(n);
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(out.data() + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      RAILCC_THROW(kSystem, "getrandom: ", detail::errnoString());
    }
    got += static_cast<size_t>(r);
  }
  return out;
}

std::string randomHex(size_t n) {
  std::vector<uint8_t> b = randomBytes(n);
  return toHex(b.data(), b.size());
}

std::vector<uint8_t> readKeyFile(const std::string& path, const char* setting) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0)
    RAILCC_THROW(kInvalidUsage, setting, "=", path, ": ", detail::errnoString());
  if (!S_ISREG(st.st_mode)) RAILCC_THROW(kInvalidUsage, setting, "=", path, " is not a regular file");
  if (st.st_size < 16 || st.st_size > (64 << 10))
    RAILCC_THROW(kInvalidUsage, setting, "=", path, " holds ", st.st_size,
                 " bytes; a key needs 16 to 65536 (for example: head -c 32 /dev/urandom > key)");
  if (st.st_mode & 077) {
    char mode[8];
    snprintf(mode, sizeof(mode), "%03o", static_cast<unsigned>(st.st_mode & 0777));
    RAILCC_WARN(INIT, setting, "=", path, " can be read by other users (mode ", mode, "); chmod 600 it");
  }
  std::ifstream f(path, std::ios::binary);
  std::vector<uint8_t> key(static_cast<size_t>(st.st_size));
  if (!f.read(reinterpret_cast<char*>(key.data()), static_cast<std::streamsize>(key.size())))
    RAILCC_THROW(kInvalidUsage, setting, "=", path, ": cannot read it");
  return key;
}

}  // namespace railcc
