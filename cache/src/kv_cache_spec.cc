// KvCacheSpec, the cache dtype and layout names, and the dense strides of the two layouts.
#include "kvstream/cache/kv_cache_spec.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace kvstream {
namespace {

// A spec being built may leave head_size_v at 0 ("same as head_size"); the byte and stride
// helpers honour that so they agree with what the spec will be once completed.
int64_t EffectiveHeadSizeV(const KvCacheSpec& spec) {
  return spec.head_size_v > 0 ? spec.head_size_v : spec.head_size;
}

}  // namespace

absl::StatusOr<KvCacheDType> ParseKvCacheDType(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "auto") return KvCacheDType::kAuto;
  if (n == "bfloat16") return KvCacheDType::kBFloat16;
  if (n == "float16") return KvCacheDType::kFloat16;
  if (n == "float32") return KvCacheDType::kFloat32;
  if (n == "fp8" || n == "fp8_e4m3") return KvCacheDType::kFp8E4M3;
  if (n == "fp8_e5m2") return KvCacheDType::kFp8E5M2;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown KV cache dtype '", name,
                   "' (choices: auto, bfloat16, float16, float32, fp8, fp8_e4m3, fp8_e5m2)"));
}

absl::string_view KvCacheDTypeName(KvCacheDType dtype) {
  switch (dtype) {
    case KvCacheDType::kAuto: return "auto";
    case KvCacheDType::kBFloat16: return "bfloat16";
    case KvCacheDType::kFloat16: return "float16";
    case KvCacheDType::kFloat32: return "float32";
    case KvCacheDType::kFp8E4M3: return "fp8_e4m3";
    case KvCacheDType::kFp8E5M2: return "fp8_e5m2";
  }
  return "unknown";
}

DType ResolveKvCacheDType(KvCacheDType dtype, DType model_dtype) {
  switch (dtype) {
    case KvCacheDType::kAuto: return model_dtype;
    case KvCacheDType::kBFloat16: return DType::kBFloat16;
    case KvCacheDType::kFloat16: return DType::kFloat16;
    case KvCacheDType::kFloat32: return DType::kFloat32;
    case KvCacheDType::kFp8E4M3: return DType::kFloat8E4M3;
    case KvCacheDType::kFp8E5M2: return DType::kFloat8E5M2;
  }
  return model_dtype;
}

absl::string_view KvQuantModeName(KvQuantMode mode) {
  switch (mode) {
    case KvQuantMode::kNone: return "none";
    case KvQuantMode::kPerTensor: return "per_tensor";
    case KvQuantMode::kPerHead: return "per_head";
  }
  return "unknown";
}

absl::StatusOr<KvLayout> ParseKvLayout(absl::string_view name) {
  const std::string n = absl::AsciiStrToUpper(name);
  if (n == "NHD") return KvLayout::kNHD;
  if (n == "HND") return KvLayout::kHND;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown KV cache layout '", name, "' (choices: NHD, HND)"));
}

absl::string_view KvLayoutName(KvLayout layout) {
  switch (layout) {
    case KvLayout::kNHD: return "NHD";
    case KvLayout::kHND: return "HND";
  }
  return "unknown";
}

absl::Status KvCacheSpec::Validate() const {
  if (head_size_v == 0 && head_size > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache spec has head_size_v=0; set it (to head_size when K and V heads "
                     "have the same size): ",
                     DebugString()));
  }
  if (block_size <= 0 || num_kv_heads <= 0 || head_size <= 0 || head_size_v <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache spec needs positive block_size, num_kv_heads, head_size and "
                     "head_size_v: ",
                     DebugString()));
  }
  if (!IsFloatingPoint(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache dtype must be floating point (float32, float16, bfloat16, "
                     "fp8_e4m3 or fp8_e5m2), got ",
                     DTypeName(dtype)));
  }
  if (IsFp8(dtype) && quant_mode == KvQuantMode::kNone) {
    return absl::InvalidArgumentError(absl::StrCat("fp8 KV cache (", DTypeName(dtype),
                                                   ") needs quant mode per_tensor or per_head"));
  }
  if (!IsFp8(dtype) && quant_mode != KvQuantMode::kNone) {
    return absl::InvalidArgumentError(
        absl::StrCat("quant mode ", KvQuantModeName(quant_mode), " needs an fp8 cache, got ",
                     DTypeName(dtype), " (use quant mode none)"));
  }
  return absl::OkStatus();
}

int64_t KvCacheSpec::BytesPerToken() const {
  return int64_t{num_kv_heads} * (head_size + EffectiveHeadSizeV(*this)) *
         static_cast<int64_t>(DTypeSize(dtype));
}

int64_t KvCacheSpec::BytesPerBlock() const { return BytesPerToken() * block_size; }

int64_t KvCacheSpec::KBytesPerBlock() const {
  return int64_t{block_size} * num_kv_heads * head_size * static_cast<int64_t>(DTypeSize(dtype));
}

int64_t KvCacheSpec::VBytesPerBlock() const {
  return int64_t{block_size} * num_kv_heads * EffectiveHeadSizeV(*this) *
         static_cast<int64_t>(DTypeSize(dtype));
}

std::string KvCacheSpec::DebugString() const {
  return absl::StrCat("KvCacheSpec{block_size=", block_size, ", num_kv_heads=", num_kv_heads,
                      ", head_size=", head_size, ", head_size_v=", head_size_v,
                      ", dtype=", DTypeName(dtype), ", quant_mode=", KvQuantModeName(quant_mode),
                      "}");
}

CacheStrides MakeCacheStrides(const KvCacheSpec& spec, KvLayout layout, bool is_value) {
  const int64_t head_size = is_value ? EffectiveHeadSizeV(spec) : spec.head_size;
  const int64_t block_size = spec.block_size;
  const int64_t heads = spec.num_kv_heads;
  CacheStrides s;
  s.dim = 1;
  switch (layout) {
    case KvLayout::kNHD:  // [num_blocks, block_size, num_kv_heads, head_size]
      s.head = head_size;
      s.token = heads * head_size;
      s.block = block_size * heads * head_size;
      break;
    case KvLayout::kHND:  // [num_blocks, num_kv_heads, block_size, head_size]
      s.token = head_size;
      s.head = block_size * head_size;
      s.block = heads * block_size * head_size;
      break;
  }
  return s;
}

}  // namespace kvstream
