// The producer warpgroup of the wgmma prefill kernel (prefill_wgmma.cuh): the loop that
// fills the ring of K and V tiles by TMA boxes of whole pages (one warp), each tile behind
// the `empty` barrier of its slot and announced on its `full` barrier (prefill_wgmma.cuh
// says how), alone or shared by a pair of CTAs through multicast.
#ifndef KVSTREAM_ATTENTION_CUDA_PREFILL_WGMMA_PRODUCER_CUH_
#define KVSTREAM_ATTENTION_CUDA_PREFILL_WGMMA_PRODUCER_CUH_

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernel_params.h"
#include "cuda/prefill_wgmma_config.cuh"
#include "cuda/tma_ptx.cuh"

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

// The byte offset, in a V slot of the ring, of key row `row` of the tile, 64-column panel
// `panel` (16-bit; fp8 raw rows: the row's first byte, `panel` 0). 16-bit V lands a page per
// TMA box with every panel of it, [page][panel][box_tokens keys][64]; with whole-tile pages
// (box_tokens == kBlockN) that is [panel][kBlockN][64], K's layout. P V's k16 steps (16
// keys) each lie inside one page: its panels box_tokens x 128 bytes apart (the
// descriptor's leading byte offset), its 8-key groups 1024.
template <int D, bool kFp8, typename Traits>
__device__ __forceinline__ uint32_t VTileOffset(int row, int panel, int box_tokens) {
  if constexpr (kFp8) {
    return static_cast<uint32_t>(row * D);
  } else {
    const int page_row0 = row & ~(box_tokens - 1);  // box_tokens: a power of two
    return static_cast<uint32_t>(
        (page_row0 * Traits::kPanels + panel * box_tokens + (row - page_row0)) * 128);
  }
}

// The key tiles [n_begin, n_end) of one (sequence, KV head) that the CTA walks.
struct ProducerTiles {
  int seq;
  int kv_head;
  int seq_len;
  int n_begin;
  int n_end;
};

// Lane `lane` of warp 0 of the producer warpgroup (every lane of that warp calls it), after
// the warpgroup lowered its registers (kProducerRegs), for one unit; `ring` counts the
// tiles put into the ring before it (the slot and its barriers' phase) and moves on by the
// unit's. A tile's boxes: for K one per (page, 64-column panel) of 16-bit rows (a panel
// holds the tile's keys in order, as S = Q K^T reads them), for V one per page with every
// panel of it ([page][panel][key][64], VTileOffset; P V steps through keys 16 at a time,
// each step inside one page); fp8 raw rows one box per page for each. One lane per box:
// up to 24 (8 pages x (2 K panels + 1)).
//
// kPair (a cluster of two CTAs whose rows share the key tiles [n_begin, n_end)): the tile's
// boxes, K's then V's, are dealt out alternately, CTA rank r copying those of index r, r +
// 2, ... (with 16-key pages and head size 128: one K panel and every other V page each),
// each box multicast into the same slot of both CTAs and completing on both CTAs' `full`
// barriers; each producer still announces its own CTA's tiles (the expect_tx arrival),
// after its `empty` barrier, which counts the releases of both CTAs' consumers, so that a
// slot is rewritten only once neither CTA reads it.
template <int D, bool kFp8, bool kPair, typename Traits>
__device__ __forceinline__ void ProduceByTma(const PagedKernelParams& p, const CUtensorMap& k_map,
                                             const CUtensorMap& v_map, const PrefillWgmmaArgs& a,
                                             const ProducerTiles& t, uint32_t k_base,
                                             uint32_t v_base,
                                             const RingBarriers<Traits::kStages>& bars,
                                             uint32_t cta_rank, int lane, int& ring) {
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
  constexpr int kKBoxPanels = kFp8 ? 1 : kPanels;
  const int pages = kBlockN / a.box_tokens;
  const int k_boxes = pages * kKBoxPanels;
  const int boxes = k_boxes + pages;
  // This lane's box of each tile: K's (page, panel) or V's page.
  const int box = kPair ? 2 * lane + static_cast<int>(cta_rank) : lane;
  const bool has_box = box < boxes;
  const bool k_box = box < k_boxes;
  const int page = k_box ? box / kKBoxPanels : box - k_boxes;
  const int panel = k_box ? box % kKBoxPanels : 0;
  const uint32_t box_offset =
      !k_box ? VTileOffset<D, kFp8, Traits>(page * a.box_tokens, 0, a.box_tokens)
      : kFp8 ? static_cast<uint32_t>(page * a.box_tokens * D)
             : static_cast<uint32_t>(panel * Traits::kKvPanelBytes + page * a.box_tokens * 128);
  constexpr uint16_t kBothCtas = 0x3;
  auto load = [&](uint32_t dst, const CUtensorMap* map, uint32_t bar, int token, int block) {
    if constexpr (kPair) {
      tma_ptx::TmaLoad5Multicast(dst, map, bar, kBothCtas, 0, token, panel, kv_head, block);
    } else {
      tma_ptx::TmaLoad5(dst, map, bar, 0, token, panel, kv_head, block);
    }
  };
  // The block coordinate and token offset of lane's box in tile n: past the sequence's
  // end, or a block id outside the cache, the coordinate num_blocks (read as zeros).
  auto box_of = [&](int n, int* token) {
    const int j = n * kBlockN + page * a.box_tokens;
    *token = j & ((1 << a.block_shift) - 1);
    if (!has_box || j >= seq_len) return static_cast<int>(p.num_blocks);
    const int32_t block = block_row[j >> a.block_shift];
    return block < 0 || block >= p.num_blocks ? static_cast<int>(p.num_blocks) : block;
  };
  int token = 0;
  int block = n_begin < n_end ? box_of(n_begin, &token) : 0;
  for (int n = n_begin; n < n_end; ++n, ++ring) {
    const int stage = ring % kStages;
    const uint32_t parity = ((ring / kStages) & 1) ^ 1;
    const int this_block = block;
    const int this_token = token;
    if (n + 1 < n_end) block = box_of(n + 1, &token);  // in flight during the waits
    if (lane == 0) {
      tma_ptx::BarrierWait(bars.empty_k(stage), parity);
      tma_ptx::BarrierArriveExpect(bars.full_k(stage), Traits::kRingTileBytes);
    }
    __syncwarp();
    if (has_box && k_box) {
      load(k_base + stage * Traits::kRingTileBytes + box_offset, &k_map, bars.full_k(stage),
           this_token, this_block);
    }
    if (lane == 0) {
      tma_ptx::BarrierWait(bars.empty_v(stage), parity);
      tma_ptx::BarrierArriveExpect(bars.full_v(stage), Traits::kRingTileBytes);
    }
    __syncwarp();
    if (has_box && !k_box) {
      load(v_base + stage * Traits::kRingTileBytes + box_offset, &v_map, bars.full_v(stage),
           this_token, this_block);
    }
  }
}

}  // namespace prefill_wgmma
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_PREFILL_WGMMA_PRODUCER_CUH_
