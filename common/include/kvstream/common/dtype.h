// Element types of tensors and caches, and the memory kinds buffers live in.
//
// fp8 means the OCP formats: kFloat8E4M3 is "e4m3fn" (bias 7, finite range +-448, no
// infinities, NaN = S.1111.111) and kFloat8E5M2 is IEEE-like (bias 15, +-57344, infinities).
#ifndef KVSTREAM_COMMON_DTYPE_H_
#define KVSTREAM_COMMON_DTYPE_H_

#include <cstddef>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace kvstream {

enum class DType {
  kFloat32,
  kFloat16,
  kBFloat16,
  kFloat8E4M3,
  kFloat8E5M2,
  kInt32,
  kInt64,
  kUInt8,
};

// Bytes per element.
size_t DTypeSize(DType dtype);

// Canonical lower-case name: "float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2",
// "int32", "int64", "uint8".
absl::string_view DTypeName(DType dtype);

// Parses a canonical name (also "float", "half", "bf16", "fp32", "fp16"). An unknown name
// is an InvalidArgument error that names it.
absl::StatusOr<DType> ParseDType(absl::string_view name);

inline bool IsFp8(DType dtype) {
  return dtype == DType::kFloat8E4M3 || dtype == DType::kFloat8E5M2;
}
inline bool IsFloatingPoint(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16 ||
         IsFp8(dtype);
}

// Where a buffer lives. Device and pinned memory need a CUDA build.
enum class MemoryKind { kHost, kPinned, kDevice };
absl::string_view MemoryKindName(MemoryKind kind);

}  // namespace kvstream

#endif  // KVSTREAM_COMMON_DTYPE_H_
