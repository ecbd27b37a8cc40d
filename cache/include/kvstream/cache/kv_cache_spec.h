// What one layer's paged KV cache looks like: KvCacheSpec (block size, heads, head sizes,
// dtype, quantisation mode), the cache dtype names users write ("auto", "fp8", ...), and the
// two layouts (NHD, HND) as explicit element strides.
//
// Logically K is [num_blocks, block_size, num_kv_heads, head_size] and V is
// [num_blocks, block_size, num_kv_heads, head_size_v]. K and V are separate buffers. The
// layout only decides the physical order inside a block:
//   NHD: [num_blocks, block_size, num_kv_heads, head_size]   (token-major, vLLM's flash layout)
//   HND: [num_blocks, num_kv_heads, block_size, head_size]   (head-major, FlashInfer's HND)
// Code addresses elements through CacheStrides only, so borrowed caches with other
// strides (an engine's tensors) work too.
//
//   ASSIGN_OR_RETURN(KvCacheDType d, ParseKvCacheDType("fp8"));     // -> kFp8E4M3
//   KvCacheSpec spec;
//   spec.num_kv_heads = 8; spec.head_size = spec.head_size_v = 128;
//   spec.dtype = ResolveKvCacheDType(d, DType::kBFloat16);   // block_size defaults to 16
//   RETURN_IF_ERROR(spec.Validate());
#ifndef KVSTREAM_CACHE_KV_CACHE_SPEC_H_
#define KVSTREAM_CACHE_KV_CACHE_SPEC_H_

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvstream/common/dtype.h"

namespace kvstream {

// The cache dtype as configured. kAuto means "the model's dtype".
enum class KvCacheDType { kAuto, kBFloat16, kFloat16, kFloat32, kFp8E4M3, kFp8E5M2 };

// Accepts "auto", "bfloat16", "float16", "float32", "fp8" (= e4m3), "fp8_e4m3", "fp8_e5m2"
// (case-insensitive). Anything else is an InvalidArgument naming the value and the choices.
absl::StatusOr<KvCacheDType> ParseKvCacheDType(absl::string_view name);
absl::string_view KvCacheDTypeName(KvCacheDType dtype);
// kAuto becomes `model_dtype`; the others their storage DType.
DType ResolveKvCacheDType(KvCacheDType dtype, DType model_dtype);

// How fp8 caches are scaled: one scale per tensor (K and V each) or one per KV head.
// kNone for 16/32-bit caches.
enum class KvQuantMode { kNone, kPerTensor, kPerHead };
absl::string_view KvQuantModeName(KvQuantMode mode);

enum class KvLayout { kNHD, kHND };
absl::StatusOr<KvLayout> ParseKvLayout(absl::string_view name);  // "NHD" / "HND", any case
absl::string_view KvLayoutName(KvLayout layout);

struct KvCacheSpec {
  int block_size = 16;
  int num_kv_heads = 0;
  int head_size = 0;
  int head_size_v = 0;  // 0 in a spec being built means "same as head_size"; Validate() rejects 0
  DType dtype = DType::kBFloat16;
  KvQuantMode quant_mode = KvQuantMode::kNone;

  // OK when all sizes are positive, the dtype is a floating-point storage type and the
  // quant mode fits the dtype (fp8 needs kPerTensor or kPerHead; 16/32-bit need kNone).
  absl::Status Validate() const;

  // Bytes of K plus V for one token of one layer.
  int64_t BytesPerToken() const;
  // Bytes of K plus V for one block of one layer (BytesPerToken() * block_size).
  int64_t BytesPerBlock() const;
  // Bytes of K (or V) alone for one block.
  int64_t KBytesPerBlock() const;
  int64_t VBytesPerBlock() const;

  std::string DebugString() const;
  friend bool operator==(const KvCacheSpec& a, const KvCacheSpec& b) {
    return a.block_size == b.block_size && a.num_kv_heads == b.num_kv_heads &&
           a.head_size == b.head_size && a.head_size_v == b.head_size_v && a.dtype == b.dtype &&
           a.quant_mode == b.quant_mode;
  }
  friend bool operator!=(const KvCacheSpec& a, const KvCacheSpec& b) { return !(a == b); }
};

// Element strides of one of the cache tensors, indexed logically (block, token in block,
// KV head, element of the head). offset = block*block + token*token + head*head + d*dim.
struct CacheStrides {
  int64_t block = 0;
  int64_t token = 0;
  int64_t head = 0;
  int64_t dim = 1;

  int64_t Offset(int64_t b, int64_t t, int64_t h, int64_t d) const {
    return b * block + t * token + h * head + d * dim;
  }
  friend bool operator==(const CacheStrides& a, const CacheStrides& b) {
    return a.block == b.block && a.token == b.token && a.head == b.head && a.dim == b.dim;
  }
};

// Dense strides of the K cache (head_size) or the V cache (head_size_v) in `layout`.
CacheStrides MakeCacheStrides(const KvCacheSpec& spec, KvLayout layout, bool is_value);

}  // namespace kvstream

#endif  // KVSTREAM_CACHE_KV_CACHE_SPEC_H_
