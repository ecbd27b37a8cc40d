// Integer helpers shared by host code (and usable in device code: constexpr, no CUDA
// include).
#ifndef KVSTREAM_COMMON_INT_MATH_H_
#define KVSTREAM_COMMON_INT_MATH_H_

#include <cstdint>

namespace kvstream {

// ceil(a / b) for a >= 0, b > 0.
constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace kvstream

#endif  // KVSTREAM_COMMON_INT_MATH_H_
