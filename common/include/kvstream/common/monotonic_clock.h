// The host clock kvstream's timings share: nanoseconds of CLOCK_MONOTONIC (steady_clock).
// One host's processes read the same clock, so a producer's and a consumer's times on one
// host compare; across hosts they do not.
#ifndef KVSTREAM_COMMON_MONOTONIC_CLOCK_H_
#define KVSTREAM_COMMON_MONOTONIC_CLOCK_H_

#include <chrono>
#include <cstdint>

namespace kvstream {

inline uint64_t MonotonicNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace kvstream

#endif  // KVSTREAM_COMMON_MONOTONIC_CLOCK_H_
