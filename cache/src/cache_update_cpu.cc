// The CPU cache update (vLLM's reshape_and_cache_flash) and the validation every
// implementation shares. The row routine (copy or convert one head of one token) is chosen
// once per call from the dtype pair, so the token loop holds no dtype switch.
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvstream/cache/cache_update.h"
#include "kvstream/cache/slot_mapping.h"
#include "kvstream/common/numeric.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

// Writes `n` elements from the contiguous row `src` into `dst`, element i going to
// dst[i * dst_stride]. `scale` divides the value before fp8 encoding; other dtypes ignore it.
using RowFn = void (*)(const void* src, void* dst, int64_t dst_stride, int64_t n, float scale);

template <size_t kBytes>
void MemcpyRow(const void* src, void* dst, int64_t /*dst_stride*/, int64_t n, float /*scale*/) {
  std::memcpy(dst, src, static_cast<size_t>(n) * kBytes);
}

template <typename T>
void StridedCopyRow(const void* src, void* dst, int64_t dst_stride, int64_t n, float /*scale*/) {
  const T* in = static_cast<const T*>(src);
  T* out = static_cast<T*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i * dst_stride] = in[i];
}

struct LoadF32 {
  using T = float;
  static float Get(T x) { return x; }
};
struct LoadF16 {
  using T = uint16_t;
  static float Get(T x) { return HalfToFloat(x); }
};
struct LoadBF16 {
  using T = uint16_t;
  static float Get(T x) { return BFloat16ToFloat(x); }
};

struct StoreF32 {
  using T = float;
  static T Put(float x, float /*scale*/) { return x; }
};
struct StoreF16 {
  using T = uint16_t;
  static T Put(float x, float /*scale*/) { return FloatToHalf(x); }
};
struct StoreBF16 {
  using T = uint16_t;
  static T Put(float x, float /*scale*/) { return FloatToBFloat16(x); }
};
// fp8(x / scale): a true division, not a multiply by 1/scale, so that the result matches
// the reference formula bit for bit.
struct StoreE4M3 {
  using T = uint8_t;
  static T Put(float x, float scale) { return FloatToFp8E4M3(x / scale); }
};
struct StoreE5M2 {
  using T = uint8_t;
  static T Put(float x, float scale) { return FloatToFp8E5M2(x / scale); }
};

template <typename Load, typename Store>
void ConvertRow(const void* src, void* dst, int64_t dst_stride, int64_t n, float scale) {
  const auto* in = static_cast<const typename Load::T*>(src);
  auto* out = static_cast<typename Store::T*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i * dst_stride] = Store::Put(Load::Get(in[i]), scale);
}

template <typename Load>
RowFn PickConvert(DType cache_dtype) {
  switch (cache_dtype) {
    case DType::kFloat32: return &ConvertRow<Load, StoreF32>;
    case DType::kFloat16: return &ConvertRow<Load, StoreF16>;
    case DType::kBFloat16: return &ConvertRow<Load, StoreBF16>;
    case DType::kFloat8E4M3: return &ConvertRow<Load, StoreE4M3>;
    case DType::kFloat8E5M2: return &ConvertRow<Load, StoreE5M2>;
    default: return nullptr;
  }
}

// Same dtype: copy bits (NaN payloads included); otherwise convert. nullptr for pairs that
// validation rejects.
RowFn PickRowFn(DType input_dtype, DType cache_dtype, int64_t dst_stride) {
  if (input_dtype == cache_dtype) {
    switch (DTypeSize(input_dtype)) {
      case 4: return dst_stride == 1 ? &MemcpyRow<4> : &StridedCopyRow<uint32_t>;
      case 2: return dst_stride == 1 ? &MemcpyRow<2> : &StridedCopyRow<uint16_t>;
      default: return nullptr;
    }
  }
  switch (input_dtype) {
    case DType::kFloat32: return PickConvert<LoadF32>(cache_dtype);
    case DType::kFloat16: return PickConvert<LoadF16>(cache_dtype);
    case DType::kBFloat16: return PickConvert<LoadBF16>(cache_dtype);
    default: return nullptr;
  }
}

absl::Status CheckScales(const char* name, const float* scales, int num_scales) {
  if (scales == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache update: fp8 cache without ", name, " scales (set them with SetScales)"));
  }
  for (int i = 0; i < num_scales; ++i) {
    if (!std::isfinite(scales[i]) || !(scales[i] > 0.0f)) {
      return absl::InvalidArgumentError(absl::StrCat("cache update: ", name, " scale ", i, " is ",
                                                     scales[i], "; scales must be finite and > 0"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckCacheStrides(const char* name, const CacheStrides& s) {
  if (s.block < 0 || s.token < 0 || s.head < 0 || s.dim < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache update: ", name, " cache strides (block ", s.block, ", token ",
                     s.token, ", head ", s.head, ", dim ", s.dim,
                     ") must be non-negative with dim >= 1"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateCacheUpdate(const CacheUpdateParams& params) {
  const KvCacheView& cache = params.cache;
  const KvCacheSpec& spec = cache.spec;
  if (params.num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache update: negative num_tokens ", params.num_tokens));
  }
  RETURN_IF_ERROR(spec.Validate());
  if (cache.k == nullptr || cache.v == nullptr) {
    return absl::InvalidArgumentError("cache update: null K or V cache pointer");
  }
  if (cache.num_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache update: cache has ", cache.num_blocks, " blocks"));
  }
  RETURN_IF_ERROR(CheckCacheStrides("K", cache.k_strides));
  RETURN_IF_ERROR(CheckCacheStrides("V", cache.v_strides));
  const DType in = params.input_dtype;
  if (in != DType::kFloat32 && in != DType::kFloat16 && in != DType::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cache update: key/value dtype must be float32, float16 or bfloat16, got ",
        DTypeName(in)));
  }
  if (IsFp8(spec.dtype)) {
    const int want = spec.quant_mode == KvQuantMode::kPerHead ? spec.num_kv_heads : 1;
    if (cache.num_scales != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cache update: ", KvQuantModeName(spec.quant_mode), " fp8 cache with ",
          spec.num_kv_heads, " KV heads needs ", want, " scale(s) each for K and V, got ",
          cache.num_scales));
    }
    RETURN_IF_ERROR(CheckScales("K", cache.k_scale, cache.num_scales));
    RETURN_IF_ERROR(CheckScales("V", cache.v_scale, cache.num_scales));
  }
  if (params.num_tokens == 0) return absl::OkStatus();
  if (params.key == nullptr || params.value == nullptr || params.slot_mapping == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cache update: null ", params.key == nullptr     ? "key"
                               : params.value == nullptr ? "value"
                                                         : "slot_mapping",
        " pointer with ", params.num_tokens, " tokens"));
  }
  if (params.key_token_stride < 0 || params.key_head_stride < 0 ||
      params.value_token_stride < 0 || params.value_head_stride < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cache update: negative input strides (key ", params.key_token_stride, ", ",
        params.key_head_stride, "; value ", params.value_token_stride, ", ",
        params.value_head_stride, ")"));
  }
  // A device cache's slot mapping is in device memory: check its host copy instead.
  const int64_t* slots = params.slot_mapping;
  if (cache.memory == MemoryKind::kDevice) {
    if (params.host_slot_mapping == nullptr) {
      return absl::InvalidArgumentError(
          "cache update: a device cache needs a host copy of slot_mapping "
          "(params.host_slot_mapping)");
    }
    slots = params.host_slot_mapping;
  }
  return ValidateSlotMapping(absl::MakeConstSpan(slots, params.num_tokens), cache.num_blocks,
                             spec.block_size);
}

absl::Status CacheUpdateCpu(const CacheUpdateParams& params) {
  const KvCacheView& cache = params.cache;
  // Checked before validation: whatever else is wrong, the CPU cannot write this cache.
  if (cache.memory == MemoryKind::kDevice) {
    return absl::FailedPreconditionError(
        "CacheUpdateCpu: the cache is in device memory, which the CPU cannot write; use the "
        "CUDA backend");
  }
  RETURN_IF_ERROR(ValidateCacheUpdate(params));
  const KvCacheSpec& spec = cache.spec;
  const RowFn k_row = PickRowFn(params.input_dtype, spec.dtype, cache.k_strides.dim);
  const RowFn v_row = PickRowFn(params.input_dtype, spec.dtype, cache.v_strides.dim);
  if (k_row == nullptr || v_row == nullptr) {
    return absl::InternalError(absl::StrCat("CacheUpdateCpu: no routine for ",
                                            DTypeName(params.input_dtype), " -> ",
                                            DTypeName(spec.dtype)));
  }
  const int64_t in_bytes = static_cast<int64_t>(DTypeSize(params.input_dtype));
  const int64_t cache_bytes = static_cast<int64_t>(DTypeSize(spec.dtype));
  const char* key = static_cast<const char*>(params.key);
  const char* value = static_cast<const char*>(params.value);
  char* k_cache = static_cast<char*>(cache.k);
  char* v_cache = static_cast<char*>(cache.v);
  // Scales are read only for fp8 caches; other caches ignore whatever the view carries.
  const bool fp8 = IsFp8(spec.dtype);
  const bool per_head = cache.num_scales > 1;
  for (int64_t t = 0; t < params.num_tokens; ++t) {
    const int64_t slot = params.slot_mapping[t];
    if (slot == kPaddingSlot) continue;
    const int64_t block = slot / spec.block_size;
    const int64_t offset = slot % spec.block_size;
    for (int64_t h = 0; h < spec.num_kv_heads; ++h) {
      const int64_t scale_index = per_head ? h : 0;
      const float k_scale = fp8 ? cache.k_scale[scale_index] : 1.0f;
      const float v_scale = fp8 ? cache.v_scale[scale_index] : 1.0f;
      k_row(key + (t * params.key_token_stride + h * params.key_head_stride) * in_bytes,
            k_cache + cache.k_strides.Offset(block, offset, h, 0) * cache_bytes,
            cache.k_strides.dim, spec.head_size, k_scale);
      v_row(value + (t * params.value_token_stride + h * params.value_head_stride) * in_bytes,
            v_cache + cache.v_strides.Offset(block, offset, h, 0) * cache_bytes,
            cache.v_strides.dim, spec.head_size_v, v_scale);
    }
  }
  return absl::OkStatus();
}

absl::Status ReshapeAndCache(const TensorView& key, const TensorView& value, KvCache& cache,
                             absl::Span<const int64_t> slot_mapping) {
  const KvCacheSpec& spec = cache.spec();
  struct Input {
    const char* name;
    const TensorView& t;
    int64_t head_size;
  };
  for (const Input& input : {Input{"key", key, spec.head_size}, Input{"value", value, spec.head_size_v}}) {
    const TensorView& t = input.t;
    if (t.dim() != 3 || static_cast<int>(t.strides().size()) != 3) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ReshapeAndCache: ", input.name, " must be 3-D [num_tokens, ", spec.num_kv_heads, ", ",
          input.head_size, "], got ", t.DebugString()));
    }
    if (t.size(1) != spec.num_kv_heads || t.size(2) != input.head_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ReshapeAndCache: ", input.name, " has shape ", t.DebugString(),
          ", the cache expects [num_tokens, ", spec.num_kv_heads, ", ", input.head_size, "]"));
    }
    if (t.stride(2) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("ReshapeAndCache: ", input.name,
                       " needs a contiguous last dimension (stride 1), got strides [",
                       absl::StrJoin(t.strides(), ", "), "]"));
    }
    if (t.memory() == MemoryKind::kDevice) {
      return absl::FailedPreconditionError(absl::StrCat(
          "ReshapeAndCache: ", input.name, " is in device memory; the CPU path needs host memory"));
    }
  }
  if (key.size(0) != value.size(0)) {
    return absl::InvalidArgumentError(absl::StrCat("ReshapeAndCache: key has ", key.size(0),
                                                   " tokens but value has ", value.size(0)));
  }
  if (static_cast<int64_t>(slot_mapping.size()) != key.size(0)) {
    return absl::InvalidArgumentError(absl::StrCat("ReshapeAndCache: ", key.size(0),
                                                   " tokens but ", slot_mapping.size(),
                                                   " slots"));
  }
  if (key.dtype() != value.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("ReshapeAndCache: key is ",
                                                   DTypeName(key.dtype()), " but value is ",
                                                   DTypeName(value.dtype())));
  }
  CacheUpdateParams params;
  params.key = key.data();
  params.value = value.data();
  params.key_token_stride = key.stride(0);
  params.key_head_stride = key.stride(1);
  params.value_token_stride = value.stride(0);
  params.value_head_stride = value.stride(1);
  params.input_dtype = key.dtype();
  params.slot_mapping = slot_mapping.data();
  params.num_tokens = key.size(0);
  params.cache = cache.view();
  return CacheUpdateCpu(params);
}

}  // namespace kvstream
