// How a call of the prefill attention kernel (prefill_attention.cuh) is configured: the
// load path of key/value tiles and the cache kind (PrefillOptions, chosen on the host by
// ChoosePrefillOptions), the kernel's two variants (PrefillVariant, PrefillFastApplies),
// and the compile-time tile shape and shared-memory sizes (PrefillTraits). Plain C++, used
// by the launcher (prefill_attention.cu) and the kernel alike.
#ifndef KVSTREAM_ATTENTION_CUDA_PREFILL_CONFIG_CUH_
#define KVSTREAM_ATTENTION_CUDA_PREFILL_CONFIG_CUH_

#include <cstdint>
#include <initializer_list>

#include "cuda/kernel_params.h"
#include "kvstream/common/dtype.h"

namespace kvstream {
namespace internal {
namespace cuda {

// How key/value tiles reach shared memory (chosen by the launcher from alignments).
enum PrefillLoadMode : int {
  kPrefillAsync16 = 0,   // 16-bit cache, 16-byte aligned rows: cp.async straight into kv
  kPrefillAsyncFp8 = 1,  // fp8 cache, 16-byte aligned rows: cp.async raw, then convert
  kPrefillSync = 2,      // anything else: element loads (and conversion) by every thread
};

enum PrefillCacheKind : int { kPrefillCache16 = 0, kPrefillCacheE4M3 = 1, kPrefillCacheE5M2 = 2 };

// Runtime choices the launcher makes once per call.
struct PrefillOptions {
  int load_mode;     // PrefillLoadMode
  int cache_kind;    // PrefillCacheKind
  int q_vectorized;  // q rows can be read in 16-byte chunks
  int o_vectorized;  // out rows can be written in 16-byte chunks
  int zero_fill;     // head sizes below D: shared-memory padding columns must be zeroed
  int num_m_tiles;   // ceil(max_query_len * group / kBlockM)
};

// The kernel's two configurations (template argument). kPrefillBaseline runs every
// supported call; kPrefillFast runs only where PrefillFastApplies (16-bit cache with
// 16-byte aligned rows, head_size == head_size_v == D, D 64 or 128) and drops the code for
// everything else at compile time:
//   - the same 4 warps x 32 rows per 128-row tile as the baseline: each K/V fragment read
//     from shared memory serves two m16 blocks. (8 warps x 16 rows, tried first, halves
//     the registers but reads every fragment twice as often; shared memory then bounds it:
//     L1 78% busy, 305 TFLOP/s on the H200 against 334 for 4 x 32.)
//   - every k16 / d16 step and every 16-key block is a compile-time constant, so the
//     fragment loads of a whole step are batched ahead of its mma chain (ldmatrix.x4)
//     and tiles that need no mask run without any per-block branch; on diagonal and
//     window-edge tiles the blocks no row sees are masked instead of skipped.
enum PrefillVariant : int { kPrefillBaseline = 0, kPrefillFast = 1 };

template <int D, int Variant = kPrefillBaseline>
struct PrefillTraits {
  static_assert(D == 64 || D == 128 || D == 256, "padded head sizes 64, 128 and 256");
  static_assert(Variant == kPrefillBaseline || D <= 128, "the fast variant: D 64 or 128");
  static constexpr bool kFast = Variant == kPrefillFast;
  static constexpr int kHeadDim = D;
  static constexpr int kWarps = D <= 128 ? 4 : 8;
  static constexpr int kRowBlocks = D <= 128 ? 2 : 1;  // m16 row blocks per warp
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = kWarps * 16 * kRowBlocks;
  static constexpr int kBlockN = 64;
  static constexpr int kMinBlocksPerSm = D <= 128 ? 2 : 1;
  static constexpr int kChunks = D / 8;  // 16-byte chunks in a 16-bit row
  static constexpr int kQBytes = kBlockM * D * 2;
  static constexpr int kLocBytes = 2 * kBlockN * 16;  // ptx::RowOffsets per key row
  static constexpr int kTileBytes = kBlockN * D * 2;  // one 16-bit K or V tile
  static constexpr int kStageBytes = 2 * kTileBytes;  // K and V
  static constexpr int kRawBytes = 2 * kBlockN * D;   // fp8 K and V tiles
  static constexpr int kKvOffset = kQBytes + kLocBytes;
  static constexpr int SmemBytes(bool fp8_async) {
    return kKvOffset + (fp8_async ? kStageBytes + kRawBytes : 2 * kStageBytes);
  }
  static_assert(kBlockM == 128, "the launcher sizes the grid for 128-row tiles");
};

// ---------------------------------------------------------------------------------------
// Host side: the template's head dimension and the runtime options of one call.


// The options of one launch: the load path from the alignment of the cache, q and out, and
// the grid's tile count. REQUIRES: the launcher's limits hold (q dtype 16-bit, cache dtype
// q's or fp8, head sizes in (0, 256], num_heads a multiple of num_kv_heads).
inline PrefillOptions ChoosePrefillOptions(const PagedKernelParams& params, DType cache_dtype) {
  const int padded = PaddedHeadDim(params.head_size, params.head_size_v);
  const bool fp8 = IsFp8(cache_dtype);
  const int64_t elem = fp8 ? 1 : 2;
  const bool kv_aligned =
      RowsAligned16(params.k_cache, elem, params.head_size,
                           {params.k_block_stride, params.k_token_stride, params.k_head_stride}) &&
      RowsAligned16(params.v_cache, elem, params.head_size_v,
                           {params.v_block_stride, params.v_token_stride, params.v_head_stride});
  PrefillOptions options{};
  options.load_mode = !kv_aligned ? kPrefillSync : fp8 ? kPrefillAsyncFp8 : kPrefillAsync16;
  options.cache_kind = cache_dtype == DType::kFloat8E4M3   ? kPrefillCacheE4M3
                       : cache_dtype == DType::kFloat8E5M2 ? kPrefillCacheE5M2
                                                           : kPrefillCache16;
  options.q_vectorized = RowsAligned16(params.q, 2, params.head_size,
                                              {params.q_token_stride, params.q_head_stride});
  options.o_vectorized = RowsAligned16(params.out, 2, params.head_size_v,
                                              {params.o_token_stride, params.o_head_stride});
  options.zero_fill = params.head_size < padded || params.head_size_v < padded;
  const int64_t group = params.num_heads / params.num_kv_heads;
  const int64_t rows = static_cast<int64_t>(params.max_query_len) * group;
  options.num_m_tiles = static_cast<int>((rows + 127) / 128);
  return options;
}

// Whether the fast variant can run a call with these options and head sizes (see
// PrefillVariant).
inline bool PrefillFastApplies(const PagedKernelParams& params, const PrefillOptions& options) {
  const int padded = PaddedHeadDim(params.head_size, params.head_size_v);
  return options.load_mode == kPrefillAsync16 && padded <= 128 &&
         params.head_size == padded && params.head_size_v == padded;
}

}  // namespace cuda
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_PREFILL_CONFIG_CUH_
