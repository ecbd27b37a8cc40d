// Paged decode attention with split-KV (flash decoding): the kernels behind
// LaunchDecodeAttention (decode_attention.cu). Header-only templates over PagedKernelParams
// (kernel_params.h) and a DecodeGeometry, both passed by value.
//
// Work split. One CTA of kThreads threads per (sequence, KV head, head tile, split):
//   grid = (num_kv_heads * head_tiles, num_seqs, num_splits)
// The KV heads of a sequence are the fastest-moving index, so CTAs that run at the same time
// read neighbouring rows of the same blocks (a token's heads are adjacent in NHD caches):
// DRAM sees long runs instead of one head-sized piece per page.
// A head tile is up to kG query heads of one KV head (GQA/MQA), so every K and V byte a CTA
// loads serves all of them. A split is a contiguous range of the sequence's visible keys.
//
// Data flow inside a CTA:
//   k_cache: [num_blocks, block_size, num_kv_heads, head_size]    (strides from params)
//   v_cache: [num_blocks, block_size, num_kv_heads, head_size_v]
//   -> kStages-deep cp.async pipeline of tiles of tile_tokens keys in shared memory:
//      K tile [tile_tokens, k_row] and V tile [tile_tokens, v_row] of the cache dtype,
//      rows padded to 16 bytes with zeros
//   -> "token groups" of T lanes (T = lanes_per_token, a power of two): lane j of a group
//      owns elements [c * kR, c * kR + kR) of the head for c = j, j + T, ... (kChunks of
//      them); a group walks kTokensPerGroup keys of each tile with an online softmax
//      (scores in log2 units), keeping q, the output accumulator, max and sum in registers
//   -> groups merged through warp shuffles, warps through shared memory
//   -> num_splits == 1: out [num_tokens, num_heads, head_size_v] written directly;
//      else partial_out [num_seqs, num_heads, num_splits, head_size_v] (unnormalised) and
//      partial_ml [num_seqs, num_heads, num_splits, 2] (max, sum), merged by
//      DecodeMergeKernel.
//
// fp8 caches are read as codes: the K scale is folded into q, the V scale into the output.
#ifndef KVSTREAM_ATTENTION_CUDA_DECODE_ATTENTION_CUH_
#define KVSTREAM_ATTENTION_CUDA_DECODE_ATTENTION_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_common.cuh"
#include "cuda/kernel_params.h"
#include "cuda/mma_ptx.cuh"
#include "cuda/sequence_bounds.cuh"

namespace kvstream {
namespace internal {
namespace decode {

inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kStages = 4;
inline constexpr int kTokensPerGroup = 4;  // keys per token group per tile
inline constexpr int kMaxSplits = 256;
inline constexpr float kLog2e = 1.4426950408889634f;

// Activation dtypes as the kernels see them (a runtime switch: read once per element).
inline constexpr int kActFloat32 = 0;
inline constexpr int kActFloat16 = 1;
inline constexpr int kActBFloat16 = 2;

// Elements a lane reads from one shared-memory row at a time: 16 bytes of 16- and 32-bit
// types, 8 bytes of fp8 (so that the register footprint matches 16-bit caches).
template <typename T>
struct ChunkElems {
  static constexpr int value = sizeof(T) == 4 ? 4 : 8;
};

// Sizes and pointers decided on the host for one launch (LaunchDecodeAttention).
struct DecodeGeometry {
  int32_t group_size;       // num_heads / num_kv_heads
  int32_t head_tiles;       // ceil(group_size / kG)
  int32_t num_splits;       // 1 .. kMaxSplits
  int32_t lanes_per_token;  // T: power of two in [1, 32]
  int32_t tile_tokens;      // (kThreads / T) * kTokensPerGroup
  int32_t k_row;            // shared-memory row lengths in elements (16-byte multiples)
  int32_t v_row;
  int32_t stage_bytes;      // one pipeline stage: K tile then V tile
  int32_t copy_bytes;       // 16, 8 or 4: cp.async size; 0: element-wise copies
  int32_t copy_lanes;       // lanes that copy one row (power of two in [1, 32])
  int32_t block_shift;      // log2(block_size) when it is a power of two, else -1
  int32_t q_dtype;          // kAct*
  int32_t out_dtype;        // kAct*
  // Workspace (num_splits > 1), device memory; see the file comment.
  float* partial_out;
  float* partial_ml;
};

// ---- Small device helpers ----

__device__ __forceinline__ float LoadActivation(const void* base, int64_t index, int dtype) {
  switch (dtype) {
    case kActFloat32: return static_cast<const float*>(base)[index];
    case kActFloat16: return __half2float(static_cast<const __half*>(base)[index]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
  }
}

__device__ __forceinline__ void StoreActivation(void* base, int64_t index, int dtype, float x) {
  switch (dtype) {
    case kActFloat32: static_cast<float*>(base)[index] = x; break;
    case kActFloat16: static_cast<__half*>(base)[index] = __float2half_rn(x); break;
    default: static_cast<__nv_bfloat16*>(base)[index] = __float2bfloat16_rn(x); break;
  }
}

using ptx::FastExp2;  // mma_ptx.cuh

__device__ __forceinline__ void CpAsync(void* smem, const void* gmem, int bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if (bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
  } else if (bytes == 8) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
  }
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}
__device__ __forceinline__ void CpAsyncWaitAll() { asm volatile("cp.async.wait_all;\n" ::); }

// Converts kR consecutive cache elements at `p` (shared memory, aligned to the access) to
// float.
__device__ __forceinline__ void LoadChunk(const float* p, float (&out)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
}
__device__ __forceinline__ void LoadChunk(const __half* p, float (&out)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2_raw h;
    h.x = static_cast<unsigned short>(w[i] & 0xffffu);
    h.y = static_cast<unsigned short>(w[i] >> 16);
    const float2 f = __half22float2(__half2(h));
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void LoadChunk(const __nv_bfloat16* p, float (&out)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ void LoadFp8Chunk(const void* p, float (&out)[8]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const uint32_t w[2] = {raw.x, raw.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(w[i] >> (16 * j));
      const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, kFormat)));
      out[4 * i + 2 * j] = f.x;
      out[4 * i + 2 * j + 1] = f.y;
    }
  }
}
__device__ __forceinline__ void LoadChunk(const __nv_fp8_e4m3* p, float (&out)[8]) {
  LoadFp8Chunk<__NV_E4M3>(p, out);
}
__device__ __forceinline__ void LoadChunk(const __nv_fp8_e5m2* p, float (&out)[8]) {
  LoadFp8Chunk<__NV_E5M2>(p, out);
}

// Copies `bytes` (a multiple of `unit`) from global to shared memory, `unit` bytes per lane
// step over `lanes` lanes starting at lane `first`: cp.async of 16/8/4 bytes, or element by
// element (unit == sizeof(T), copy_bytes == 0) with ordinary loads and stores.
template <typename T>
__device__ __forceinline__ void CopyRow(unsigned char* dst, const unsigned char* src, int bytes,
                                        int copy_bytes, int first, int lanes) {
  if (copy_bytes != 0) {
    for (int off = first * copy_bytes; off < bytes; off += lanes * copy_bytes) {
      CpAsync(dst + off, src + off, copy_bytes);
    }
  } else {
    T* d = reinterpret_cast<T*>(dst);
    const T* s = reinterpret_cast<const T*>(src);
    const int n = bytes / static_cast<int>(sizeof(T));
    for (int e = first; e < n; e += lanes) d[e] = s[e];
  }
}

// ---- The split kernel ----

// Up to three CTAs per SM for the small register footprints (shared memory allows no more
// for 16-bit caches at head size 128), so that the compiler does not squeeze registers to
// fit a fourth.
template <typename CacheT, int kG, int kChunks>
__global__ void __launch_bounds__(kThreads, kG * kChunks >= 8 ? 1 : 3)
    DecodeSplitKernel(const __grid_constant__ PagedKernelParams p,
                      const __grid_constant__ DecodeGeometry geo) {
  constexpr int kR = ChunkElems<CacheT>::value;
  constexpr int kEs = static_cast<int>(sizeof(CacheT));
  extern __shared__ __align__(16) unsigned char smem[];
  cuda::AllowDependentLaunch();  // the merge kernel waits for this grid's end itself

  const int seq = static_cast<int>(blockIdx.y);
  const int kv_head = static_cast<int>(blockIdx.x) / geo.head_tiles;
  const int head_tile = static_cast<int>(blockIdx.x) - kv_head * geo.head_tiles;
  const int split = static_cast<int>(blockIdx.z);
  const SequenceBounds bounds = LoadSequenceBounds(p, seq);
  if (bounds.query_len <= 0) return;  // no query: nothing to write
  const int q_row = bounds.q_start;
  const int seq_len = bounds.seq_len;
  const int first_head = kv_head * geo.group_size + head_tile * kG;
  const int heads_here = min(kG, geo.group_size - head_tile * kG);

  // The decode query sits at position seq_len - 1: every key before it is visible (the
  // causal mask removes nothing), a window keeps the last sliding_window keys.
  const int kv_begin = p.sliding_window > 0 ? max(0, seq_len - p.sliding_window) : 0;
  const int kv_len = seq_len - kv_begin;
  const int per_split = (kv_len + geo.num_splits - 1) / geo.num_splits;
  const int s_begin = kv_begin + min(kv_len, split * per_split);
  const int s_end = kv_begin + min(kv_len, (split + 1) * per_split);
  const int n_tokens = s_end - s_begin;
  const int tile_tokens = geo.tile_tokens;
  const int num_tiles = (n_tokens + tile_tokens - 1) / tile_tokens;

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int T = geo.lanes_per_token;
  const int group = tid / T;  // token groups never straddle warps: T divides 32
  const int lane_in_group = tid & (T - 1);
  const int num_groups = kThreads / T;
  const int D = p.head_size;
  const int Dv = p.head_size_v;
  const int kv_scale_index = p.num_scales == 1 ? 0 : kv_head;
  const float k_scale = p.k_scale[kv_scale_index];
  const float v_scale = p.v_scale[kv_scale_index];

  // Scores come out in log2 units. Without soft cap or ALiBi every factor folds into q;
  // otherwise q carries scale * k_scale and the rest is applied per score.
  const bool has_cap = p.logits_soft_cap > 0.0f;
  const bool has_alibi = p.alibi_slopes != nullptr;
  const bool fold_log2e = !has_cap && !has_alibi;
  const float q_scale = p.scale * k_scale * (fold_log2e ? kLog2e : 1.0f);

  float q[kG][kChunks][kR];
  float slope[kG];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    const int h = first_head + g;
    slope[g] = (has_alibi && g < heads_here) ? p.alibi_slopes[h] : 0.0f;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int c = lane_in_group + k * T;
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        const int d = c * kR + r;
        q[g][k][r] = (g < heads_here && d < D)
                         ? LoadActivation(p.q,
                                          static_cast<int64_t>(q_row) * p.q_token_stride +
                                              static_cast<int64_t>(h) * p.q_head_stride + d,
                                          geo.q_dtype) *
                               q_scale
                         : 0.0f;
      }
    }
  }

  // Zero the row padding of every stage once; the copies below never write it.
  const int k_row_bytes = geo.k_row * kEs;
  const int v_row_bytes = geo.v_row * kEs;
  const int k_data_bytes = D * kEs;
  const int v_data_bytes = Dv * kEs;
  const int v_tile_offset = tile_tokens * k_row_bytes;
  if (k_row_bytes > k_data_bytes || v_row_bytes > v_data_bytes) {
    const int k_pad = k_row_bytes - k_data_bytes;
    const int v_pad = v_row_bytes - v_data_bytes;
    const int rows = kStages * tile_tokens;
    for (int i = tid; i < rows * (k_pad + v_pad); i += kThreads) {
      const int row = i / (k_pad + v_pad);
      const int b = i - row * (k_pad + v_pad);
      const int stage = row / tile_tokens;
      const int r = row - stage * tile_tokens;
      unsigned char* stage_base = smem + stage * geo.stage_bytes;
      if (b < k_pad) {
        stage_base[r * k_row_bytes + k_data_bytes + b] = 0;
      } else {
        stage_base[v_tile_offset + r * v_row_bytes + v_data_bytes + (b - k_pad)] = 0;
      }
    }
  }

  // Issues the copies of tile `t` into stage `stage`. Rows past the split's end are not
  // loaded (and never read).
  const unsigned char* const k_cache = static_cast<const unsigned char*>(p.k_cache) +
                                      static_cast<int64_t>(kv_head) * p.k_head_stride * kEs;
  const unsigned char* const v_cache = static_cast<const unsigned char*>(p.v_cache) +
                                      static_cast<int64_t>(kv_head) * p.v_head_stride * kEs;
  const int block_shift = geo.block_shift;
  const int32_t* const table_row = p.block_table + static_cast<int64_t>(seq) * p.block_table_stride;
  const int copy_lanes = geo.copy_lanes;
  const int rows_per_step = 32 / copy_lanes;
  const int copy_row_in_step = lane / copy_lanes;
  const int copy_first = lane & (copy_lanes - 1);
  auto issue = [&](int t, int stage) {
    const int tile_begin = s_begin + t * tile_tokens;
    const int n = min(tile_tokens, s_end - tile_begin);
    unsigned char* stage_base = smem + stage * geo.stage_bytes;
    for (int i = warp * rows_per_step + copy_row_in_step; i < n; i += kWarps * rows_per_step) {
      const int pos = tile_begin + i;
      const int block_index = block_shift >= 0 ? pos >> block_shift : pos / p.block_size;
      const int offset = pos - block_index * p.block_size;
      const int64_t block = table_row[block_index];
      // Validation checked every id on the host; a device table that disagrees with its
      // host copy leaves the row unloaded rather than reading outside the cache.
      if (block < 0 || block >= p.num_blocks) continue;
      const unsigned char* k_src =
          k_cache + (block * p.k_block_stride + offset * p.k_token_stride) * kEs;
      const unsigned char* v_src =
          v_cache + (block * p.v_block_stride + offset * p.v_token_stride) * kEs;
      CopyRow<CacheT>(stage_base + i * k_row_bytes, k_src, k_data_bytes, geo.copy_bytes,
                      copy_first, copy_lanes);
      CopyRow<CacheT>(stage_base + v_tile_offset + i * v_row_bytes, v_src, v_data_bytes,
                      geo.copy_bytes, copy_first, copy_lanes);
    }
  };

  float m[kG];
  float l[kG];
  float acc[kG][kChunks][kR];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
#pragma unroll
      for (int r = 0; r < kR; ++r) acc[g][k][r] = 0.0f;
    }
  }

  const int q_pos = seq_len - 1;
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < num_tiles) issue(st, st);
    CpAsyncCommit();
  }
  for (int t = 0; t < num_tiles; ++t) {
    const int next = t + kStages - 1;
    if (next < num_tiles) issue(next, next % kStages);
    CpAsyncCommit();
    CpAsyncWait<kStages - 1>();
    __syncthreads();

    const unsigned char* stage_base = smem + (t % kStages) * geo.stage_bytes;
    const CacheT* k_tile = reinterpret_cast<const CacheT*>(stage_base);
    const CacheT* v_tile = reinterpret_cast<const CacheT*>(stage_base + v_tile_offset);
    const int tile_begin = s_begin + t * tile_tokens;
    const int n = min(tile_tokens, s_end - tile_begin);

    // Scores of this group's keys, every head of the tile.
    float s[kTokensPerGroup][kG];
#pragma unroll
    for (int u = 0; u < kTokensPerGroup; ++u) {
      const int i = u * num_groups + group;
      const bool valid = i < n;
      float part[kG];
#pragma unroll
      for (int g = 0; g < kG; ++g) part[g] = 0.0f;
      if (valid) {
#pragma unroll
        for (int k = 0; k < kChunks; ++k) {
          const int c = lane_in_group + k * T;
          if (c * kR < D) {
            float kv[kR];
            LoadChunk(k_tile + i * geo.k_row + c * kR, kv);
#pragma unroll
            for (int g = 0; g < kG; ++g) {
#pragma unroll
              for (int r = 0; r < kR; ++r) part[g] = fmaf(q[g][k][r], kv[r], part[g]);
            }
          }
        }
      }
      for (int off = T >> 1; off > 0; off >>= 1) {
#pragma unroll
        for (int g = 0; g < kG; ++g) part[g] += __shfl_xor_sync(0xffffffffu, part[g], off);
      }
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        float x = part[g];
        if (!fold_log2e) {
          if (has_cap) x = p.logits_soft_cap * tanhf(x / p.logits_soft_cap);
          if (has_alibi) x += slope[g] * static_cast<float>(tile_begin + i - q_pos);
          x *= kLog2e;
        }
        s[u][g] = valid ? x : -INFINITY;
      }
    }

    // One rescale per tile: the new running max over this tile's keys.
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      float tile_max = s[0][g];
#pragma unroll
      for (int u = 1; u < kTokensPerGroup; ++u) tile_max = fmaxf(tile_max, s[u][g]);
      const float m_new = fmaxf(m[g], tile_max);
      const float corr = m_new == -INFINITY ? 1.0f : FastExp2(m[g] - m_new);
      m[g] = m_new;
      l[g] *= corr;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
#pragma unroll
        for (int r = 0; r < kR; ++r) acc[g][k][r] *= corr;
      }
    }

#pragma unroll
    for (int u = 0; u < kTokensPerGroup; ++u) {
      const int i = u * num_groups + group;
      if (i < n) {
        float pr[kG];
#pragma unroll
        for (int g = 0; g < kG; ++g) {
          pr[g] = FastExp2(s[u][g] - m[g]);
          l[g] += pr[g];
        }
#pragma unroll
        for (int k = 0; k < kChunks; ++k) {
          const int c = lane_in_group + k * T;
          if (c * kR < Dv) {
            float vv[kR];
            LoadChunk(v_tile + i * geo.v_row + c * kR, vv);
#pragma unroll
            for (int g = 0; g < kG; ++g) {
#pragma unroll
              for (int r = 0; r < kR; ++r) acc[g][k][r] = fmaf(pr[g], vv[r], acc[g][k][r]);
            }
          }
        }
      }
    }
    __syncthreads();  // the stage is free for the copies of a later tile
  }
  CpAsyncWaitAll();  // nothing is pending (only empty groups), but make it explicit
  __syncthreads();    // shared memory is reused below

  // Merge the token groups of each warp: common max, rescale, sum.
  if (T < 32) {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      float mw = m[g];
      for (int off = T; off < 32; off <<= 1) mw = fmaxf(mw, __shfl_xor_sync(0xffffffffu, mw, off));
      const float f = m[g] == -INFINITY ? 0.0f : exp2f(m[g] - mw);
      m[g] = mw;
      l[g] *= f;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
#pragma unroll
        for (int r = 0; r < kR; ++r) acc[g][k][r] *= f;
      }
      for (int off = T; off < 32; off <<= 1) {
        l[g] += __shfl_xor_sync(0xffffffffu, l[g], off);
#pragma unroll
        for (int k = 0; k < kChunks; ++k) {
#pragma unroll
          for (int r = 0; r < kR; ++r) {
            acc[g][k][r] += __shfl_xor_sync(0xffffffffu, acc[g][k][r], off);
          }
        }
      }
    }
  }

  // Then the warps, through shared memory: red [kWarps][kG][red_row], ml [kWarps][kG][2].
  const int red_row = T * kChunks * kR;
  float* red = reinterpret_cast<float*>(smem);
  float* ml = red + kWarps * kG * red_row;
  if (lane < T) {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        const int c = lane + k * T;
#pragma unroll
        for (int r = 0; r < kR; ++r) red[(warp * kG + g) * red_row + c * kR + r] = acc[g][k][r];
      }
      if (lane == 0) {
        ml[(warp * kG + g) * 2] = m[g];
        ml[(warp * kG + g) * 2 + 1] = l[g];
      }
    }
  }
  __syncthreads();

  for (int idx = tid; idx < heads_here * Dv; idx += kThreads) {
    const int g = idx / Dv;
    const int d = idx - g * Dv;
    float big = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) big = fmaxf(big, ml[(w * kG + g) * 2]);
    float sum = 0.0f;
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = ml[(w * kG + g) * 2];
      if (mw != -INFINITY) {
        const float f = exp2f(mw - big);
        sum = fmaf(ml[(w * kG + g) * 2 + 1], f, sum);
        o = fmaf(red[(w * kG + g) * red_row + d], f, o);
      }
    }
    const int h = first_head + g;
    if (geo.num_splits == 1) {
      const float value = sum > 0.0f ? o / sum * v_scale : 0.0f;
      StoreActivation(p.out,
                      static_cast<int64_t>(q_row) * p.o_token_stride +
                          static_cast<int64_t>(h) * p.o_head_stride + d,
                      geo.out_dtype, value);
    } else {
      const int64_t slot =
          (static_cast<int64_t>(seq) * p.num_heads + h) * geo.num_splits + split;
      geo.partial_out[slot * Dv + d] = o;
      if (d == 0) {
        geo.partial_ml[slot * 2] = big;
        geo.partial_ml[slot * 2 + 1] = sum;
      }
    }
  }
}

// ---- The merge kernel: one CTA per (sequence, query head) ----
// grid = (num_seqs, num_heads), block = kThreads.
__global__ void __launch_bounds__(kThreads)
    DecodeMergeKernel(const __grid_constant__ PagedKernelParams p,
                      const __grid_constant__ DecodeGeometry geo) {
  __shared__ float weight[kMaxSplits];
  __shared__ float inv_sum;
  const int seq = static_cast<int>(blockIdx.x);
  const int h = static_cast<int>(blockIdx.y);
  const SequenceBounds bounds = LoadSequenceBounds(p, seq);
  if (bounds.query_len <= 0) return;  // as the split kernel: nothing was written for it
  const int q_row = bounds.q_start;
  const int S = geo.num_splits;
  const int64_t first_slot = (static_cast<int64_t>(seq) * p.num_heads + h) * S;
  const int kv_head = h / (p.num_heads / p.num_kv_heads);
  const float v_scale = p.v_scale[p.num_scales == 1 ? 0 : kv_head];
  // Launched as a dependent of the split kernel: the partial results are complete and
  // visible only past this point.
  cuda::WaitForPrerequisiteGrids();
  if (threadIdx.x == 0) {
    float big = -INFINITY;
    for (int i = 0; i < S; ++i) big = fmaxf(big, geo.partial_ml[(first_slot + i) * 2]);
    float sum = 0.0f;
    for (int i = 0; i < S; ++i) {
      const float mi = geo.partial_ml[(first_slot + i) * 2];
      const float w = mi == -INFINITY ? 0.0f : exp2f(mi - big);
      weight[i] = w;
      sum = fmaf(geo.partial_ml[(first_slot + i) * 2 + 1], w, sum);
    }
    inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
  __syncthreads();
  const int Dv = p.head_size_v;
  for (int d = static_cast<int>(threadIdx.x); d < Dv; d += kThreads) {
    float o = 0.0f;
    for (int i = 0; i < S; ++i) o = fmaf(geo.partial_out[(first_slot + i) * Dv + d], weight[i], o);
    StoreActivation(p.out,
                    static_cast<int64_t>(q_row) * p.o_token_stride +
                        static_cast<int64_t>(h) * p.o_head_stride + d,
                    geo.out_dtype, o * inv_sum * v_scale);
  }
}

}  // namespace decode
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_DECODE_ATTENTION_CUH_
