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
// unit's. One TMA box per (page, 64-column panel) of 16-bit rows, per page of whole raw
// fp8 rows.
//
// kPair (a cluster of two CTAs whose rows share the key tiles [n_begin, n_end)): CTA rank 0
// copies every K tile and rank 1 every V tile, each box multicast into the same slot of
// both CTAs and completing on both CTAs' `full` barriers; each producer still announces
// its own CTA's tiles (the expect_tx arrival), after its `empty` barrier, which counts the
// releases of both CTAs' consumers, so that a slot is rewritten only once neither CTA
// reads it.
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
  // One box per (page, 64-column panel) of 16-bit rows; per page of whole raw fp8 rows.
  constexpr int kBoxPanels = kFp8 ? 1 : kPanels;
  const int pages = kBlockN / a.box_tokens;
  const int boxes = pages * kBoxPanels;  // at most 16 (8 x 2, 4 x 4): one lane each
  const int page = lane / kBoxPanels;
  const int panel = lane % kBoxPanels;
  const uint32_t box_offset =
      kFp8 ? static_cast<uint32_t>(page * a.box_tokens * D)
           : static_cast<uint32_t>(panel * Traits::kKvPanelBytes + page * a.box_tokens * 128);
  // Which of K and V this CTA copies: both alone, one of them in a pair.
  const bool copies_k = !kPair || cta_rank == 0;
  const bool copies_v = !kPair || cta_rank == 1;
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
    if (lane >= boxes || j >= seq_len) return static_cast<int>(p.num_blocks);
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
    if (copies_k && lane < boxes) {
      load(k_base + stage * Traits::kRingTileBytes + box_offset, &k_map, bars.full_k(stage),
           this_token, this_block);
    }
    if (lane == 0) {
      tma_ptx::BarrierWait(bars.empty_v(stage), parity);
      tma_ptx::BarrierArriveExpect(bars.full_v(stage), Traits::kRingTileBytes);
    }
    __syncwarp();
    if (copies_v && lane < boxes) {
      load(v_base + stage * Traits::kRingTileBytes + box_offset, &v_map, bars.full_v(stage),
           this_token, this_block);
    }
  }
}

}  // namespace prefill_wgmma
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_PREFILL_WGMMA_PRODUCER_CUH_
