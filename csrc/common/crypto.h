#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

// Hashes and randomness every layer may need: SHA-256, HMAC-SHA256 (the TCP handshake, the
// auth key), and unguessable names and secrets from the kernel.

namespace railcc {

using Digest = std::array<uint8_t, 32>;

/// SHA-256 (FIPS 180-4) of `n` bytes.
Digest sha256(const void* data, size_t n);

/// HMAC-SHA256 (RFC 2104) of `msg` under `key`.
Digest hmacSha256(const std::vector<uint8_t>& key, const std::vector<uint8_t>& msg);

/// Compares two digests in time independent of where they differ.
bool equalConstantTime(const Digest& a, const Digest& b);

/// `n` bytes from the kernel's random source (getrandom). Throws kSystem if it has none.
std::vector<uint8_t> randomBytes(size_t n);

/// Lower-case hex of `n` random bytes: names and tokens that must not be guessable.
std::string randomHex(size_t n);

/// A secret key's file (`setting` names where its path came from, for errors): a regular file
/// of 16 bytes to 64 KiB, read whole. Throws kInvalidUsage naming the problem; warns where
/// other users may read it.
std::vector<uint8_t> readKeyFile(const std::string& path, const char* setting);

}  // namespace railcc
