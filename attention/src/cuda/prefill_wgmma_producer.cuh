// The producer warpgroup of the wgmma prefill kernel (prefill_wgmma.cuh): the loop that
// fills the ring of K and V tiles, either by TMA boxes of whole pages (one warp) or by
// cp.async gathers of 16-byte chunks (the whole warpgroup), each tile behind the `empty`
// barrier of its slot and announced on its `full` barrier (prefill_wgmma.cuh says how).
#ifndef KVSTREAM_ATTENTION_CUDA_PREFILL_WGMMA_PRODUCER_CUH_
#define KVSTREAM_ATTENTION_CUDA_PREFILL_WGMMA_PRODUCER_CUH_

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernel_params.h"
#include "cuda/mma_ptx.cuh"
#include "cuda/prefill_wgmma_config.cuh"
#include "cuda/tma_ptx.cuh"
#include "cuda/wgmma_ptx.cuh"

namespace kvstream {
namespace internal {
namespace prefill_wgmma {

// The shared-memory addresses of the ring's barriers: full_k, full_v, empty_k, empty_v,
// kStages each, from `base`.
template <int kStages>
struct RingBarriers {
  uint32_t base;
  __device__ __forceinline__ uint32_t full_k(int s) const { return base + 8 * s; }
  __device__ __forceinline__ uint32_t full_v(int s) const { return base + 8 * (kStages + s); }
  __device__ __forceinline__ uint32_t empty_k(int s) const {
    return base + 8 * (2 * kStages + s);
  }
  __device__ __forceinline__ uint32_t empty_v(int s) const {
    return base + 8 * (3 * kStages + s);
  }
};

// The key tiles [n_begin, n_end) of one (sequence, KV head) that the CTA walks.
struct ProducerTiles {
  int seq;
  int kv_head;
  int seq_len;
  int n_begin;
  int n_end;
};

// Both run after the warpgroup lowered its registers (kProducerRegs).
//
// TMA: lane `lane` of warp 0 of the producer warpgroup (every lane of that warp calls it).
// One box per (page, 64-column panel) of 16-bit rows, per page of whole raw fp8 rows.
template <int D, bool kFp8, typename Traits>
__device__ __forceinline__ void ProduceByTma(const PagedKernelParams& p, const CUtensorMap& k_map,
                                             const CUtensorMap& v_map,
                                             const PrefillWgmmaArgs& a, const ProducerTiles& t,
                                             uint32_t k_base, uint32_t v_base,
                                             const RingBarriers<Traits::kStages>& bars,
                                             int lane) {
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kPanels = Traits::kPanels;
  const int seq = t.seq;
  const int kv_head = t.kv_head;
  const int seq_len = t.seq_len;
  const int n_begin = t.n_begin;
  const int n_end = t.n_end;
  const int32_t* const block_row =
      p.block_table + static_cast<int64_t>(seq) * p.block_table_stride;
  // One box per (page, 64-column panel) of 16-bit rows; per page of whole raw fp8 rows.
  constexpr int kBoxPanels = kFp8 ? 1 : kPanels;
  const int pages = kBlockN / a.box_tokens;
  const int boxes = pages * kBoxPanels;  // at most 16 (8 x 2, 4 x 4): one lane each
  const int page = lane / kBoxPanels;
  const int panel = lane % kBoxPanels;
  const uint32_t box_offset =
      kFp8 ? static_cast<uint32_t>(page * a.box_tokens * D)
           : static_cast<uint32_t>(panel * Traits::kKvPanelBytes + page * a.box_tokens * 128);
  // The block coordinate and token offset of lane's box in tile n: past the sequence's
  // end, or a block id outside the cache, the coordinate num_blocks (read as zeros).
  auto box_of = [&](int n, int* token) {
    const int j = n * kBlockN + page * a.box_tokens;
    *token = j & ((1 << a.block_shift) - 1);
    if (lane >= boxes || j >= seq_len) return static_cast<int>(p.num_blocks);
    const int32_t block = block_row[j >> a.block_shift];
    return block < 0 || block >= p.num_blocks ? static_cast<int>(p.num_blocks) : block;
  };
  int token = 0;
  int block = n_begin < n_end ? box_of(n_begin, &token) : 0;
  for (int n = n_begin, it = 0; n < n_end; ++n, ++it) {
    const int stage = it % kStages;
    const uint32_t parity = ((it / kStages) & 1) ^ 1;
    const int this_block = block;
    const int this_token = token;
    if (n + 1 < n_end) block = box_of(n + 1, &token);  // in flight during the waits
    if (lane == 0) {
      tma_ptx::BarrierWait(bars.empty_k(stage), parity);
      tma_ptx::BarrierArriveExpect(bars.full_k(stage), Traits::kRingTileBytes);
    }
    __syncwarp();
    if (lane < boxes) {
      tma_ptx::TmaLoad5(k_base + stage * Traits::kRingTileBytes + box_offset, &k_map,
                        bars.full_k(stage), 0, this_token, panel, kv_head, this_block);
    }
    if (lane == 0) {
      tma_ptx::BarrierWait(bars.empty_v(stage), parity);
      tma_ptx::BarrierArriveExpect(bars.full_v(stage), Traits::kRingTileBytes);
    }
    __syncwarp();
    if (lane < boxes) {
      tma_ptx::TmaLoad5(v_base + stage * Traits::kRingTileBytes + box_offset, &v_map,
                        bars.full_v(stage), 0, this_token, panel, kv_head, this_block);
    }
  }
}

// Gathers: thread `tid` (0..127) of the producer warpgroup (all of them call it). Every
// thread copies 16-byte chunks of the tile's rows (chunk tid % kChunks of every
// kRowsPerPass-th row) through the row offsets of the tile in shared memory (at
// Traits::kLocOffset of `smem`), which thread r < kBlockN looks up one tile ahead; its
// arrival on `full` comes once its copies have landed (rows past the end or of a block
// outside the cache are zero-filled).
template <int D, typename T, typename Traits>
__device__ __forceinline__ void ProduceByGathers(const PagedKernelParams& p,
                                                 const PrefillWgmmaArgs& a,
                                                 const ProducerTiles& t, uint8_t* smem,
                                                 uint32_t k_base, uint32_t v_base,
                                                 const RingBarriers<Traits::kStages>& bars,
                                                 int tid) {
  using ptx::CpAsync16;
  using ptx::CpAsyncCommit;
  using ptx::CpAsyncWaitGroup;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  const int seq = t.seq;
  const int kv_head = t.kv_head;
  const int seq_len = t.seq_len;
  const int n_begin = t.n_begin;
  const int n_end = t.n_end;
  ptx::RowOffsets* const loc = reinterpret_cast<ptx::RowOffsets*>(smem + Traits::kLocOffset);
  const int32_t* const block_row =
      p.block_table + static_cast<int64_t>(seq) * p.block_table_stride;
  const int64_t k_head_offset = static_cast<int64_t>(kv_head) * p.k_head_stride;
  const int64_t v_head_offset = static_cast<int64_t>(kv_head) * p.v_head_stride;
  auto lookup = [&](int n) -> ptx::RowOffsets {
    const int j = n * kBlockN + tid;
    if (j >= seq_len) return ptx::RowOffsets{-1, 0};
    const int b = a.block_shift >= 0 ? j >> a.block_shift : j / p.block_size;
    const int64_t block = block_row[b];
    if (block < 0 || block >= p.num_blocks) return ptx::RowOffsets{-1, 0};
    const int64_t offset = j - b * p.block_size;
    return ptx::RowOffsets{block * p.k_block_stride + offset * p.k_token_stride + k_head_offset,
                           block * p.v_block_stride + offset * p.v_token_stride + v_head_offset};
  };
  constexpr int kChunks = D / 8;
  constexpr int kRowsPerPass = 128 / kChunks;
  const int chunk = tid % kChunks;
  const int row0 = tid / kChunks;
  const uint32_t chunk_offset = static_cast<uint32_t>((chunk >> 3) * Traits::kKvPanelBytes);
  const T* const k_cache = static_cast<const T*>(p.k_cache) + chunk * 8;
  const T* const v_cache = static_cast<const T*>(p.v_cache) + chunk * 8;
  if (tid < kBlockN && n_begin < n_end) loc[tid] = lookup(n_begin);
  wgmma::NamedBarrierSync(7, 128);
  for (int n = n_begin, it = 0; n < n_end; ++n, ++it) {
    const int stage = it % kStages;
    const uint32_t parity = ((it / kStages) & 1) ^ 1;
    ptx::RowOffsets next{-1, 0};
    if (tid < kBlockN && n + 1 < n_end) next = lookup(n + 1);  // lands during the copies
    const ptx::RowOffsets* const rows = loc + (it & 1) * kBlockN;
    tma_ptx::BarrierWait(bars.empty_k(stage), parity);
    const uint32_t k_tile = k_base + stage * Traits::kTileBytes + chunk_offset;
#pragma unroll 4
    for (int i = 0; i < kBlockN / kRowsPerPass; ++i) {
      const int r = row0 + i * kRowsPerPass;
      const int64_t k = rows[r].k;
      CpAsync16(k_tile + wgmma::SwizzledOffset128(r, (chunk & 7) * 8), k_cache + (k >= 0 ? k : 0),
                k >= 0);
    }
    tma_ptx::CpAsyncArriveNoinc(bars.full_k(stage));
    tma_ptx::BarrierWait(bars.empty_v(stage), parity);
    const uint32_t v_tile = v_base + stage * Traits::kTileBytes + chunk_offset;
#pragma unroll 4
    for (int i = 0; i < kBlockN / kRowsPerPass; ++i) {
      const int r = row0 + i * kRowsPerPass;
      const ptx::RowOffsets o = rows[r];
      CpAsync16(v_tile + wgmma::SwizzledOffset128(r, (chunk & 7) * 8),
                v_cache + (o.k >= 0 ? o.v : 0), o.k >= 0);
    }
    tma_ptx::CpAsyncArriveNoinc(bars.full_v(stage));
    // Every thread is past its reads of the other half of loc (tile n - 1's barrier).
    if (tid < kBlockN) loc[((it + 1) & 1) * kBlockN + tid] = next;
    wgmma::NamedBarrierSync(7, 128);
  }
  CpAsyncCommit();
  CpAsyncWaitGroup<0>();
}

}  // namespace prefill_wgmma
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_PREFILL_WGMMA_PRODUCER_CUH_
