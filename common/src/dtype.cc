#include "kvstream/common/dtype.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace kvstream {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat8E4M3: return 1;
    case DType::kFloat8E5M2: return 1;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  return 0;
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat8E4M3: return "fp8_e4m3";
    case DType::kFloat8E5M2: return "fp8_e5m2";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "float32" || n == "float" || n == "fp32") return DType::kFloat32;
  if (n == "float16" || n == "half" || n == "fp16") return DType::kFloat16;
  if (n == "bfloat16" || n == "bf16") return DType::kBFloat16;
  if (n == "fp8_e4m3") return DType::kFloat8E4M3;
  if (n == "fp8_e5m2") return DType::kFloat8E5M2;
  if (n == "int32") return DType::kInt32;
  if (n == "int64") return DType::kInt64;
  if (n == "uint8") return DType::kUInt8;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown dtype '", name,
      "' (expected float32, float16, bfloat16, fp8_e4m3, fp8_e5m2, int32, int64 or uint8)"));
}

absl::string_view MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost: return "host";
    case MemoryKind::kPinned: return "pinned";
    case MemoryKind::kDevice: return "device";
  }
  return "unknown";
}

}  // namespace kvstream
