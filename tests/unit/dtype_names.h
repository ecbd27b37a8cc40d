// Short dtype names for test names and traces, shared by the cache and attention tests.
#ifndef KVSTREAM_TESTS_UNIT_DTYPE_NAMES_H_
#define KVSTREAM_TESTS_UNIT_DTYPE_NAMES_H_

#include "kvstream/common/dtype.h"

namespace kvstream {
namespace testing_util {

// A dtype's short name: f32, f16, bf16, e4m3, e5m2 ("other" for anything else).
inline const char* ShortDType(DType d) {
  switch (d) {
    case DType::kFloat32: return "f32";
    case DType::kFloat16: return "f16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat8E4M3: return "e4m3";
    case DType::kFloat8E5M2: return "e5m2";
    default: return "other";
  }
}

}  // namespace testing_util
}  // namespace kvstream

#endif  // KVSTREAM_TESTS_UNIT_DTYPE_NAMES_H_
