#pragma once

#include <chrono>

namespace railcc {

/// The longest wait railcc keeps: 50 years, which no job outlives. A user's "forever"
/// (timedelta.max, a timeout of centuries) would overflow steady_clock's nanoseconds wherever a
/// deadline or an elapsed time is compared with it, and read as a timeout already past; it is
/// kept as this instead.
inline constexpr std::chrono::milliseconds kLongestWait = std::chrono::hours(24 * 365 * 50);

inline std::chrono::milliseconds boundedWait(std::chrono::milliseconds t) { return t > kLongestWait ? kLongestWait : t; }

}  // namespace railcc
