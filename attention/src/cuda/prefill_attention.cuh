// The prefill (and chunked-prefill, and any query length) flash-attention kernel over the
// paged KV cache, on tensor cores (mma.sync m16n8k16, fp32 accumulation). Header-only;
// prefill_attention.cu validates, picks the template and launches.
// Its launch configuration (PrefillOptions, PrefillVariant, PrefillTraits) is
// prefill_config.cuh, its small device helpers prefill_helpers.cuh.
//
// Work decomposition. The query heads of one KV head are packed into the rows of a tile
// ("packed GQA"): for sequence s with query_len tokens and group = num_heads / num_kv_heads,
// packed row r = t * group + h_in_group is query token t of head kv_head * group + h_in_group.
// One CTA owns kBlockM = 128 packed rows of one (sequence, KV head) and walks the keys in
// tiles of kBlockN = 64, so K/V tiles are loaded once for every head of the group, and a
// decode row (query_len 1) fills `group` rows instead of one.
//
//   grid  = (num_kv_heads * num_m_tiles, num_seqs); blockIdx.x = kv_head + num_kv_heads *
//           (num_m_tiles - 1 - m_tile): the heads of one tile run together, and the last
//           tiles (the most keys under a causal mask) are scheduled first.
//   block = kWarps warps; warp w owns packed rows [w * 16 * kRowBlocks, +16 * kRowBlocks).
//           D <= 128: 4 warps x 32 rows (two m16 blocks share every K/V fragment), in both
//           variants; D == 256: 8 warps x 16 rows (the fp32 output accumulators need the
//           registers).
//
// Shared memory (16-bit rows of D elements, 16-byte chunks XOR-swizzled by row % 8 so that
// ldmatrix and cp.async are free of bank conflicts):
//   q:     [kBlockM][D]            query tile; reused to stage the output tile
//   loc:   [2][kBlockN] RowOffsets element offsets of each key row's K and V data
//   kv:    [stages][2][kBlockN][D] K and V tiles in the query's 16-bit type
//   stage: [2][kBlockN][D] bytes   fp8 only: raw K and V tiles, converted into kv[0]
//
// Pipeline, per key tile n: wait for tile n's copies and __syncthreads; (fp8: convert the raw
// tile into kv[0], __syncthreads); issue tile n+1's copies (cp.async, 16 bytes, zero fill
// past the sequence) through the page table; compute S = Q K^T, mask, online softmax in
// base 2 with the scale * log2(e) folded in, O += P V. The page-table lookups of tile n+2
// are read from global memory one iteration ahead of use.
//
// Layouts the kernel reads (all through PagedKernelParams, element strides, dim stride 1):
//   q:       [num_tokens, num_heads, head_size]
//   out:     [num_tokens, num_heads, head_size_v]
//   k_cache: [num_blocks, block_size, num_kv_heads, head_size]     (any of NHD / HND)
//   v_cache: [num_blocks, block_size, num_kv_heads, head_size_v]
#ifndef KVSTREAM_ATTENTION_CUDA_PREFILL_ATTENTION_CUH_
#define KVSTREAM_ATTENTION_CUDA_PREFILL_ATTENTION_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "cuda/cuda_common.cuh"
#include "cuda/kernel_params.h"
#include "cuda/mma_ptx.cuh"
#include "cuda/prefill_config.cuh"
#include "cuda/prefill_helpers.cuh"
#include "cuda/sequence_bounds.cuh"
#include "kvstream/common/dtype.h"

namespace kvstream {
namespace internal {
namespace cuda {

// ---------------------------------------------------------------------------------------
// The kernel.

// REQUIRES for Variant == kPrefillFast: PrefillFastApplies(p, opt).
template <int D, typename T, int Variant = kPrefillBaseline>
__global__ void __launch_bounds__(PrefillTraits<D, Variant>::kThreads,
                                  PrefillTraits<D, Variant>::kMinBlocksPerSm)
    PrefillAttentionKernel(const __grid_constant__ PagedKernelParams p,
                           const PrefillOptions opt) {
  using Traits = PrefillTraits<D, Variant>;
  constexpr bool kFast = Traits::kFast;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kThreads = Traits::kThreads;
  constexpr int kRowBlocks = Traits::kRowBlocks;
  constexpr int kChunks = Traits::kChunks;
  constexpr int kNBlocks = kBlockN / 8;  // n8 blocks of S per m16 block
  constexpr int kDBlocks = D / 8;        // n8 blocks of O per m16 block
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kNegInf = -INFINITY;

  KVSTREAM_CUDA_SHARED_MEMORY(smem);
  uint8_t* const q_smem = smem;
  RowOffsets* const loc_smem = reinterpret_cast<RowOffsets*>(smem + Traits::kQBytes);
  uint8_t* const kv_smem = smem + Traits::kKvOffset;
  uint8_t* const raw_smem = kv_smem + Traits::kStageBytes;  // fp8 async mode only
  const uint32_t q_base = SmemAddress(q_smem);
  const uint32_t kv_base = SmemAddress(kv_smem);

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;

  // ---- Which rows and keys this CTA owns.
  const int num_kv_heads = p.num_kv_heads;
  const int kv_head = static_cast<int>(blockIdx.x) % num_kv_heads;
  const int m_tile = opt.num_m_tiles - 1 - static_cast<int>(blockIdx.x) / num_kv_heads;
  const int seq = static_cast<int>(blockIdx.y);
  const int group = p.num_heads / num_kv_heads;
  const SequenceBounds bounds = LoadSequenceBounds(p, seq);
  const int q_start = bounds.q_start;
  const int query_len = bounds.query_len;
  const int rows_total = query_len * group;
  const int row0 = m_tile * kBlockM;
  if (row0 >= rows_total) return;
  const int seq_len = bounds.seq_len;
  const int context = seq_len - query_len;
  const int last_row = min(rows_total, row0 + kBlockM) - 1;
  const int kv_lo = VisibleLo(p, context + row0 / group);
  const int kv_hi = VisibleHi(p, context + last_row / group, seq_len);  // inclusive
  const int n_begin = kv_lo / kBlockN;
  const int n_end = kv_hi / kBlockN + 1;

  // The fast variant's preconditions as constants, so that the other paths compile away.
  const int cache_kind = kFast ? static_cast<int>(kPrefillCache16) : opt.cache_kind;
  const int load_mode = kFast ? static_cast<int>(kPrefillAsync16) : opt.load_mode;
  const int head_size = kFast ? D : p.head_size;
  const int head_size_v = kFast ? D : p.head_size_v;
  const int32_t* const block_row = p.block_table + static_cast<int64_t>(seq) * p.block_table_stride;

  // Page-table lookup of key row `r` of tile `n`: the row's element offsets (KV head
  // included); k = -1 past the end, or for a block id outside the cache (validation checked
  // the host mirror; a device table that disagrees leaves the row zero, not read out of
  // bounds).
  const int64_t k_head_offset = static_cast<int64_t>(kv_head) * p.k_head_stride;
  const int64_t v_head_offset = static_cast<int64_t>(kv_head) * p.v_head_stride;
  const int block_shift = Log2IfPowerOfTwo(p.block_size);
  auto lookup = [&](int n, int r) -> RowOffsets {
    const int j = n * kBlockN + r;
    if (j >= seq_len) return RowOffsets{-1, 0};
    const int b = block_shift >= 0 ? j >> block_shift : j / p.block_size;
    const int64_t block = block_row[b];
    if (block < 0 || block >= p.num_blocks) return RowOffsets{-1, 0};
    const int64_t offset = j - b * p.block_size;
    return RowOffsets{block * p.k_block_stride + offset * p.k_token_stride + k_head_offset,
                      block * p.v_block_stride + offset * p.v_token_stride + v_head_offset};
  };

  // ---- Prologue: page table of the first two tiles, zero padding, Q and tile n_begin.
  RowOffsets loc_ahead{-1, 0};  // lookup of tile n+2, held by threads tid < kBlockN
  if (tid < kBlockN) {
    loc_smem[(n_begin & 1) * kBlockN + tid] = lookup(n_begin, tid);
    if (n_begin + 1 < n_end) loc_smem[((n_begin + 1) & 1) * kBlockN + tid] = lookup(n_begin + 1, tid);
    if (n_begin + 2 < n_end) loc_ahead = lookup(n_begin + 2, tid);
  }
  if (!kFast && opt.zero_fill) {
    const int kv_bytes = load_mode == kPrefillAsyncFp8 ? Traits::kStageBytes : 2 * Traits::kStageBytes;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int i = tid; i < Traits::kQBytes / 16; i += kThreads) {
      reinterpret_cast<uint4*>(q_smem)[i] = zero;
    }
    for (int i = tid; i < kv_bytes / 16; i += kThreads) {
      reinterpret_cast<uint4*>(kv_smem)[i] = zero;
    }
  }
  __syncthreads();

  // Q tile: packed row m -> token q_start + (row0 + m) / group, head kv_head * group + rest.
  {
    const T* const q = static_cast<const T*>(p.q);
    if (opt.q_vectorized) {
      const int chunks = head_size / 8;
      for (int i = tid; i < kBlockM * kChunks; i += kThreads) {
        const int m = i / kChunks;
        const int c = i % kChunks;
        if (c >= chunks) continue;
        const int r = row0 + m;
        const bool valid = r < rows_total;
        const T* src = q;
        if (valid) {
          const int t = r / group;
          const int h = kv_head * group + (r - t * group);
          src = q + (static_cast<int64_t>(q_start) + t) * p.q_token_stride +
                static_cast<int64_t>(h) * p.q_head_stride + c * 8;
        }
        CpAsync16(q_base + SwizzledChunk<D>(m, c), src, valid);
      }
    } else {
      for (int i = tid; i < kBlockM * D; i += kThreads) {
        const int m = i / D;
        const int d = i % D;
        const int r = row0 + m;
        T value = FromFloat<T>(0.0f);
        if (r < rows_total && d < head_size) {
          const int t = r / group;
          const int h = kv_head * group + (r - t * group);
          value = q[(static_cast<int64_t>(q_start) + t) * p.q_token_stride +
                    static_cast<int64_t>(h) * p.q_head_stride + d];
        }
        *reinterpret_cast<T*>(q_smem + SwizzledElement<D>(m, d)) = value;
      }
    }
  }

  // Issues the copies of key tile n into kv stage `stage` (or the raw fp8 area).
  // Loader mapping: 8 threads per key row, 16-byte chunks lcol, lcol + 8, ...; rows
  // lrow + pass * kRowsPerPass. Rows differ by multiples of 8, so one swizzled offset plus
  // compile-time steps addresses every chunk (chunk c = lcol + 8 i -> (lcol ^ row % 8) + 8 i).
  constexpr int kRowsPerPass = kThreads / 8;
  const int lrow = tid >> 3;
  const int lcol = tid & 7;
  const uint32_t load_dst0 =
      static_cast<uint32_t>(lrow * D * 2 + ((lcol ^ (lrow & 7)) << 4));
  auto issue_tile = [&](int n, int stage) {
    const RowOffsets* const locs = loc_smem + (n & 1) * kBlockN;
    uint8_t* const k_tile = kv_smem + stage * Traits::kStageBytes;
    uint8_t* const v_tile = k_tile + Traits::kTileBytes;
KVSTREAM_CUDA_UNROLL
    for (int pass = 0; pass < kBlockN / kRowsPerPass; ++pass) {
      const int r = lrow + pass * kRowsPerPass;
      const RowOffsets loc = locs[r];
      const bool valid = loc.k >= 0;
      const int64_t k_row = valid ? loc.k : 0;
      const int64_t v_row = valid ? loc.v : 0;
      if (load_mode == kPrefillAsync16) {
        const T* const k = static_cast<const T*>(p.k_cache);
        const T* const v = static_cast<const T*>(p.v_cache);
        const uint32_t k_dst =
            SmemAddress(k_tile) + load_dst0 + pass * kRowsPerPass * D * 2;
        const uint32_t v_dst = k_dst + Traits::kTileBytes;
KVSTREAM_CUDA_UNROLL
        for (int i = 0; i < (kChunks + 7) / 8; ++i) {
          const int c = lcol + i * 8;
          if (c < head_size / 8) CpAsync16(k_dst + i * 128, k + k_row + c * 8, valid);
          if (c < head_size_v / 8) CpAsync16(v_dst + i * 128, v + v_row + c * 8, valid);
        }
      } else if (load_mode == kPrefillAsyncFp8) {
        const uint8_t* const k = static_cast<const uint8_t*>(p.k_cache);
        const uint8_t* const v = static_cast<const uint8_t*>(p.v_cache);
        const uint32_t k_dst = SmemAddress(raw_smem) + r * D;
        const uint32_t v_dst = SmemAddress(raw_smem + kBlockN * D) + r * D;
KVSTREAM_CUDA_UNROLL
        for (int i = 0; i < (D / 16 + 7) / 8; ++i) {
          const int c = lcol + i * 8;
          if (c < D / 16 && c < head_size / 16) {
            CpAsync16(k_dst + c * 16, k + k_row + c * 16, valid);
          }
          if (c < D / 16 && c < head_size_v / 16) {
            CpAsync16(v_dst + c * 16, v + v_row + c * 16, valid);
          }
        }
      } else {
        for (int d = lcol; d < head_size; d += 8) {
          const T x = valid ? CacheElementAs<T>(p.k_cache, k_row + d, cache_kind)
                            : FromFloat<T>(0.0f);
          *reinterpret_cast<T*>(k_tile + SwizzledElement<D>(r, d)) = x;
        }
        for (int d = lcol; d < head_size_v; d += 8) {
          const T x = valid ? CacheElementAs<T>(p.v_cache, v_row + d, cache_kind)
                            : FromFloat<T>(0.0f);
          *reinterpret_cast<T*>(v_tile + SwizzledElement<D>(r, d)) = x;
        }
      }
    }
  };

  // fp8 async mode: converts the raw tiles into kv stage 0.
  auto convert_raw = [&]() {
    constexpr int kRawChunks = D / 16;  // 16-byte chunks of an fp8 row
    uint8_t* const k_tile = kv_smem;
    uint8_t* const v_tile = kv_smem + Traits::kTileBytes;
    for (int i = tid; i < 2 * kBlockN * kRawChunks; i += kThreads) {
      const bool is_v = i >= kBlockN * kRawChunks;
      const int rest = is_v ? i - kBlockN * kRawChunks : i;
      const int r = rest / kRawChunks;
      const int c = rest % kRawChunks;
      if (c >= (is_v ? head_size_v : head_size) / 16) continue;
      const uint4 raw =
          *reinterpret_cast<const uint4*>(raw_smem + (is_v ? kBlockN * D : 0) + r * D + c * 16);
      uint32_t out[8];
      Fp8ChunkTo<T>(raw, cache_kind == kPrefillCacheE4M3, out);
      uint8_t* const tile = is_v ? v_tile : k_tile;
      *reinterpret_cast<uint4*>(tile + SwizzledChunk<D>(r, 2 * c)) =
          make_uint4(out[0], out[1], out[2], out[3]);
      *reinterpret_cast<uint4*>(tile + SwizzledChunk<D>(r, 2 * c + 1)) =
          make_uint4(out[4], out[5], out[6], out[7]);
    }
  };

  if (n_begin < n_end) issue_tile(n_begin, 0);
  CpAsyncCommit();

  // ---- Per-thread row state. Thread rows: warp_row + mb * 16 + (lane / 4) + 8 * half.
  const int warp_row = warp * 16 * kRowBlocks;
  const bool warp_active = row0 + warp_row < rows_total;
  const int warp_last = min(rows_total - 1, row0 + warp_row + 16 * kRowBlocks - 1);
  const int warp_qp_first = context + (row0 + warp_row) / group;
  const int warp_qp_last = context + warp_last / group;
  const int warp_lo_min = VisibleLo(p, warp_qp_first);
  const int warp_lo_max = VisibleLo(p, warp_qp_last);
  const int warp_hi_min = VisibleHi(p, warp_qp_first, seq_len);
  const int warp_hi_max = VisibleHi(p, warp_qp_last, seq_len);

  const float k_scale = ScaleOfHead(p.k_scale, p.num_scales, kv_head);
  const bool soft_cap = p.logits_soft_cap > 0.0f;
  const bool alibi = p.alibi_slopes != nullptr;
  // Scores in base 2: s2 = scale2 * qk, or cap2 * tanh(qk * inv_cap) with a soft cap.
  const float scale2 = p.scale * k_scale * kLog2e;
  const float cap2 = soft_cap ? p.logits_soft_cap * kLog2e : 0.0f;
  const float inv_cap = soft_cap ? p.scale * k_scale / p.logits_soft_cap : 0.0f;

  // The query position and ALiBi slope (base 2) of each thread row. The fast variant
  // recomputes them where used (edge tiles, ALiBi) rather than holding 4 registers across
  // the loop, where its 128-register budget is tight.
  auto row_of = [&](int mb, int hf) {
    return min(rows_total - 1, row0 + warp_row + mb * 16 + (lane >> 2) + 8 * hf);
  };
  auto qp_of_row = [&](int r) { return context + r / group; };
  auto slope2_of_row = [&](int r) {
    return alibi ? p.alibi_slopes[kv_head * group + (r - (r / group) * group)] * kLog2e : 0.0f;
  };
  int row_qp[kRowBlocks][2];
  float row_slope2[kRowBlocks][2];
KVSTREAM_CUDA_UNROLL
  for (int mb = 0; mb < kRowBlocks; ++mb) {
KVSTREAM_CUDA_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int r = row_of(mb, half);
      row_qp[mb][half] = qp_of_row(r);
      row_slope2[mb][half] = slope2_of_row(r);
    }
  }

  float acc_o[kRowBlocks][kDBlocks][4];
  float row_max[kRowBlocks][2];
  float row_sum[kRowBlocks][2];
KVSTREAM_CUDA_UNROLL
  for (int mb = 0; mb < kRowBlocks; ++mb) {
KVSTREAM_CUDA_UNROLL
    for (int nb = 0; nb < kDBlocks; ++nb) {
KVSTREAM_CUDA_UNROLL
      for (int e = 0; e < 4; ++e) acc_o[mb][nb][e] = 0.0f;
    }
KVSTREAM_CUDA_UNROLL
    for (int half = 0; half < 2; ++half) {
      row_max[mb][half] = kNegInf;
      row_sum[mb][half] = 0.0f;
    }
  }

  // ldmatrix addresses. Every row a lane addresses is lane % 8 modulo 8, so the swizzled
  // offset of logical chunk 2 kk + s is (kk / 4) * 128 + ((kk % 4) * 32 ^ ((lane % 8 ^ s) * 16)):
  // one XOR with a constant per load, and no per-(kk, row) address registers.
  //   Q (A operand) and V (B operand, transposed): row lane % 16, chunk 2 kk + lane / 16.
  //   K (B operand): row lane % 8 + 8 (lane / 16), chunk 2 kk + (lane / 8) % 2.
  const uint32_t swz_qv = static_cast<uint32_t>(((lane & 7) ^ (lane >> 4)) << 4);
  const uint32_t swz_k = static_cast<uint32_t>(((lane & 7) ^ ((lane >> 3) & 1)) << 4);
  const uint32_t q_lane_addr = q_base + static_cast<uint32_t>((warp_row + (lane & 15)) * D * 2);
  const uint32_t k_lane_off = static_cast<uint32_t>(((lane & 7) + ((lane >> 4) << 3)) * D * 2);
  const uint32_t v_lane_off = static_cast<uint32_t>((lane & 15) * D * 2);
  const int k_steps = (head_size + 15) / 16;    // k16 steps of Q K^T that are not padding
  const int dv_steps = (head_size_v + 15) / 16;  // d16 steps of P V that are not padding
  const int quad_col = 2 * (lane & 3);
  // K and V fragments loaded ahead of their mma chains, as registers permit: at D = 128 the
  // two m16 blocks' accumulators (192 registers) leave no room in the baseline (ptxas
  // spills with batches of 2); the fast variant's constant masks free enough for 2; at
  // D = 64 and 256 batches of 4 fit without spills.
  constexpr int kKBatch = D == 128 ? (kFast ? 2 : 1) : 4;
  constexpr int kVBatch = D == 128 ? (kFast ? 2 : 1) : 4;

  // ---- Main loop over key tiles.
  for (int n = n_begin; n < n_end; ++n) {
    CpAsyncWaitGroup<0>();
    __syncthreads();
    if (load_mode == kPrefillAsyncFp8) {
      convert_raw();
      __syncthreads();
    }
    const int stage = load_mode == kPrefillAsyncFp8 ? 0 : ((n - n_begin) & 1);
    if (n + 1 < n_end) {
      issue_tile(n + 1, load_mode == kPrefillAsyncFp8 ? 0 : (stage ^ 1));
    }
    CpAsyncCommit();
    if (tid < kBlockN) {
      if (n + 2 < n_end) loc_smem[(n & 1) * kBlockN + tid] = loc_ahead;
      if (n + 3 < n_end) loc_ahead = lookup(n + 3, tid);
    }

    const int tile_lo = n * kBlockN;
    if (!warp_active || tile_lo > warp_hi_max || tile_lo + kBlockN - 1 < warp_lo_min) continue;
    // Key columns [col_begin, col_end) of this tile hold keys some row of the warp may see.
    const int col_begin = max(0, warp_lo_min - tile_lo);
    const int col_end = min(kBlockN, min(warp_hi_max, seq_len - 1) - tile_lo + 1);
    const uint32_t k_base = kv_base + stage * Traits::kStageBytes;
    const uint32_t v_base = k_base + Traits::kTileBytes;

    // S = Q K^T for the warp's rows.
    float acc_s[kRowBlocks][kNBlocks][4];
KVSTREAM_CUDA_UNROLL
    for (int mb = 0; mb < kRowBlocks; ++mb) {
KVSTREAM_CUDA_UNROLL
      for (int nb = 0; nb < kNBlocks; ++nb) {
KVSTREAM_CUDA_UNROLL
        for (int e = 0; e < 4; ++e) acc_s[mb][nb][e] = 0.0f;
      }
    }
    // Which 16-key blocks of the tile hold keys the warp may see (the others stay masked).
    bool key_block_used[kBlockN / 16];
KVSTREAM_CUDA_UNROLL
    for (int kb = 0; kb < kBlockN / 16; ++kb) {
      // Fast variant: every block is computed (a constant, so no branch in the mma
      // chains); blocks no row sees lie outside every row's [lo, hi] and are masked below.
      key_block_used[kb] = kFast || (kb * 16 < col_end && kb * 16 + 16 > col_begin);
    }
    // Per k16 step: all fragments first, then the mma chain, so that the ldmatrix latency
    // is paid once per step.
KVSTREAM_CUDA_UNROLL
    for (int kk = 0; kk < D / 16; ++kk) {
      if (kk < k_steps) {
        uint32_t a[kRowBlocks][4];
KVSTREAM_CUDA_UNROLL
        for (int mb = 0; mb < kRowBlocks; ++mb) {
          LdMatrixX4(a[mb], q_lane_addr + mb * 16 * D * 2 + (kk >> 2) * 128 +
                                (swz_qv ^ ((kk & 3) << 5)));
        }
KVSTREAM_CUDA_UNROLL
        for (int k0 = 0; k0 < kBlockN / 16; k0 += kKBatch) {
          uint32_t b[kKBatch][4];
KVSTREAM_CUDA_UNROLL
          for (int i = 0; i < kKBatch; ++i) {
            if (key_block_used[k0 + i]) {
              LdMatrixX4(b[i], k_base + k_lane_off + (k0 + i) * 16 * D * 2 + (kk >> 2) * 128 +
                                   (swz_k ^ ((kk & 3) << 5)));
            }
          }
KVSTREAM_CUDA_UNROLL
          for (int i = 0; i < kKBatch; ++i) {
            if (key_block_used[k0 + i]) {
KVSTREAM_CUDA_UNROLL
              for (int mb = 0; mb < kRowBlocks; ++mb) {
                Mma16816<T>(acc_s[mb][2 * (k0 + i)], a[mb], b[i][0], b[i][1]);
                Mma16816<T>(acc_s[mb][2 * (k0 + i) + 1], a[mb], b[i][2], b[i][3]);
              }
            }
          }
        }
      }
    }

    // Scores in base 2: soft cap, then ALiBi, then the mask.
    if (soft_cap) {
KVSTREAM_CUDA_UNROLL
      for (int mb = 0; mb < kRowBlocks; ++mb) {
KVSTREAM_CUDA_UNROLL
        for (int nb = 0; nb < kNBlocks; ++nb) {
KVSTREAM_CUDA_UNROLL
          for (int e = 0; e < 4; ++e) {
            // tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf, absolute error ~1e-7.
            const float x = acc_s[mb][nb][e] * inv_cap;
            const float t = 1.0f - __fdividef(2.0f, FastExp2(x * (2.0f * kLog2e)) + 1.0f);
            acc_s[mb][nb][e] = cap2 * t;
          }
        }
      }
    } else if (alibi) {
KVSTREAM_CUDA_UNROLL
      for (int mb = 0; mb < kRowBlocks; ++mb) {
KVSTREAM_CUDA_UNROLL
        for (int nb = 0; nb < kNBlocks; ++nb) {
KVSTREAM_CUDA_UNROLL
          for (int e = 0; e < 4; ++e) acc_s[mb][nb][e] *= scale2;
        }
      }
    }  // else: raw scores; the softmax below folds scale2 into its exp2 arguments
    if (alibi) {
KVSTREAM_CUDA_UNROLL
      for (int mb = 0; mb < kRowBlocks; ++mb) {
KVSTREAM_CUDA_UNROLL
        for (int half = 0; half < 2; ++half) {
          // slope * (j - qp), with j - qp formed exactly in integers.
          const int r = row_of(mb, half);
          const float base =
              static_cast<float>(tile_lo + quad_col - (kFast ? qp_of_row(r) : row_qp[mb][half]));
          const float slope = kFast ? slope2_of_row(r) : row_slope2[mb][half];
KVSTREAM_CUDA_UNROLL
          for (int nb = 0; nb < kNBlocks; ++nb) {
KVSTREAM_CUDA_UNROLL
            for (int e = 0; e < 2; ++e) {
              acc_s[mb][nb][2 * half + e] +=
                  slope * (base + static_cast<float>(nb * 8 + e));
            }
          }
        }
      }
    }
    if (tile_lo < warp_lo_max || tile_lo + kBlockN - 1 > warp_hi_min) {
KVSTREAM_CUDA_UNROLL
      for (int mb = 0; mb < kRowBlocks; ++mb) {
KVSTREAM_CUDA_UNROLL
        for (int half = 0; half < 2; ++half) {
          const int qp = kFast ? qp_of_row(row_of(mb, half)) : row_qp[mb][half];
          const int lo = VisibleLo(p, qp) - tile_lo - quad_col;
          const int hi = VisibleHi(p, qp, seq_len) - tile_lo - quad_col;
KVSTREAM_CUDA_UNROLL
          for (int nb = 0; nb < kNBlocks; ++nb) {
KVSTREAM_CUDA_UNROLL
            for (int e = 0; e < 2; ++e) {
              const int col = nb * 8 + e;
              if (col < lo || col > hi) acc_s[mb][nb][2 * half + e] = kNegInf;
            }
          }
        }
      }
    }

    // Online softmax: running max and (per-thread partial) sum per row, O rescaled. Without
    // soft cap or ALiBi the scores are still raw q.k (scale2 > 0 keeps their order), and
    // exp2(scale2 * (s - max)) is one FFMA and one MUFU per score.
    const float exp_scale = soft_cap || alibi ? 1.0f : scale2;
    // The output rescale is skipped when no row of the warp has a new max (alpha == 1 for
    // all): most tiles of a long sequence.
    float alpha[kRowBlocks][2];
    bool rescale = false;
KVSTREAM_CUDA_UNROLL
    for (int mb = 0; mb < kRowBlocks; ++mb) {
KVSTREAM_CUDA_UNROLL
      for (int half = 0; half < 2; ++half) {
        float tile_max = kNegInf;
KVSTREAM_CUDA_UNROLL
        for (int nb = 0; nb < kNBlocks; ++nb) {
          tile_max = fmaxf(tile_max, fmaxf(acc_s[mb][nb][2 * half], acc_s[mb][nb][2 * half + 1]));
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        const float new_max = fmaxf(row_max[mb][half], tile_max);
        // A row with no visible key so far keeps max -inf; subtract 0 so that exp2 gives 0.
        const float use_max = new_max == kNegInf ? 0.0f : new_max;
        alpha[mb][half] = FastExp2((row_max[mb][half] - use_max) * exp_scale);
        rescale = rescale || alpha[mb][half] != 1.0f;
        row_max[mb][half] = new_max;
        const float neg_max_scaled = -use_max * exp_scale;
        float sum = 0.0f;
KVSTREAM_CUDA_UNROLL
        for (int nb = 0; nb < kNBlocks; ++nb) {
KVSTREAM_CUDA_UNROLL
          for (int e = 0; e < 2; ++e) {
            const float pe = FastExp2(fmaf(acc_s[mb][nb][2 * half + e], exp_scale, neg_max_scaled));
            acc_s[mb][nb][2 * half + e] = pe;
            sum += pe;
          }
        }
        row_sum[mb][half] = row_sum[mb][half] * alpha[mb][half] + sum;
      }
    }
    if (__any_sync(0xffffffffu, rescale)) {
KVSTREAM_CUDA_UNROLL
      for (int mb = 0; mb < kRowBlocks; ++mb) {
KVSTREAM_CUDA_UNROLL
        for (int half = 0; half < 2; ++half) {
KVSTREAM_CUDA_UNROLL
          for (int nb = 0; nb < kDBlocks; ++nb) {
            if (nb < 2 * dv_steps) {
              acc_o[mb][nb][2 * half] *= alpha[mb][half];
              acc_o[mb][nb][2 * half + 1] *= alpha[mb][half];
            }
          }
        }
      }
    }

    // O += P V. P's accumulator layout is the A fragment layout of the next mma. V
    // fragments are loaded four d16 steps at a time, then used.
KVSTREAM_CUDA_UNROLL
    for (int kc = 0; kc < kBlockN / 16; ++kc) {
      if (key_block_used[kc]) {
        uint32_t pa[kRowBlocks][4];
KVSTREAM_CUDA_UNROLL
        for (int mb = 0; mb < kRowBlocks; ++mb) {
          pa[mb][0] = PackPair<T>(acc_s[mb][2 * kc][0], acc_s[mb][2 * kc][1]);
          pa[mb][1] = PackPair<T>(acc_s[mb][2 * kc][2], acc_s[mb][2 * kc][3]);
          pa[mb][2] = PackPair<T>(acc_s[mb][2 * kc + 1][0], acc_s[mb][2 * kc + 1][1]);
          pa[mb][3] = PackPair<T>(acc_s[mb][2 * kc + 1][2], acc_s[mb][2 * kc + 1][3]);
        }
KVSTREAM_CUDA_UNROLL
        for (int d0 = 0; d0 < D / 16; d0 += kVBatch) {
          uint32_t b[kVBatch][4];
KVSTREAM_CUDA_UNROLL
          for (int i = 0; i < kVBatch; ++i) {
            const int dd = d0 + i;
            if (dd < dv_steps) {
              LdMatrixX4Trans(b[i], v_base + v_lane_off + kc * 16 * D * 2 + (dd >> 2) * 128 +
                                        (swz_qv ^ ((dd & 3) << 5)));
            }
          }
KVSTREAM_CUDA_UNROLL
          for (int i = 0; i < kVBatch; ++i) {
            const int dd = d0 + i;
            if (dd < dv_steps) {
KVSTREAM_CUDA_UNROLL
              for (int mb = 0; mb < kRowBlocks; ++mb) {
                Mma16816<T>(acc_o[mb][2 * dd], pa[mb], b[i][0], b[i][1]);
                Mma16816<T>(acc_o[mb][2 * dd + 1], pa[mb], b[i][2], b[i][3]);
              }
            }
          }
        }
      }
    }
  }
  CpAsyncWaitGroup<0>();

  // ---- Epilogue: normalise, fold the V scale, stage through q_smem, write the rows.
  __syncthreads();  // every warp is done with q_smem and the kv tiles
  if (!warp_active) return;
  const float v_scale = ScaleOfHead(p.v_scale, p.num_scales, kv_head);
KVSTREAM_CUDA_UNROLL
  for (int mb = 0; mb < kRowBlocks; ++mb) {
KVSTREAM_CUDA_UNROLL
    for (int half = 0; half < 2; ++half) {
      float sum = row_sum[mb][half];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv = sum > 0.0f ? v_scale / sum : 0.0f;
      const int m = warp_row + mb * 16 + (lane >> 2) + 8 * half;
KVSTREAM_CUDA_UNROLL
      for (int nb = 0; nb < kDBlocks; ++nb) {
        if (nb < 2 * dv_steps) {
          *reinterpret_cast<uint32_t*>(q_smem + SwizzledElement<D>(m, nb * 8 + quad_col)) =
              PackPair<T>(acc_o[mb][nb][2 * half] * inv, acc_o[mb][nb][2 * half + 1] * inv);
        }
      }
    }
  }
  __syncwarp();
  T* const out = static_cast<T*>(p.out);
  constexpr int kWarpRows = 16 * kRowBlocks;
  if (opt.o_vectorized) {
    const int chunks = head_size_v / 8;
    for (int i = lane; i < kWarpRows * kChunks; i += 32) {
      const int m = warp_row + i / kChunks;
      const int c = i % kChunks;
      const int r = row0 + m;
      if (c >= chunks || r >= rows_total) continue;
      const int t = r / group;
      const int h = kv_head * group + (r - t * group);
      T* const dst = out + (static_cast<int64_t>(q_start) + t) * p.o_token_stride +
                     static_cast<int64_t>(h) * p.o_head_stride + c * 8;
      *reinterpret_cast<uint4*>(dst) =
          *reinterpret_cast<const uint4*>(q_smem + SwizzledChunk<D>(m, c));
    }
  } else {
    for (int i = lane; i < kWarpRows * D; i += 32) {
      const int m = warp_row + i / D;
      const int d = i % D;
      const int r = row0 + m;
      if (d >= head_size_v || r >= rows_total) continue;
      const int t = r / group;
      const int h = kv_head * group + (r - t * group);
      out[(static_cast<int64_t>(q_start) + t) * p.o_token_stride +
          static_cast<int64_t>(h) * p.o_head_stride + d] =
          *reinterpret_cast<const T*>(q_smem + SwizzledElement<D>(m, d));
    }
  }
}

}  // namespace cuda
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_PREFILL_ATTENTION_CUH_
