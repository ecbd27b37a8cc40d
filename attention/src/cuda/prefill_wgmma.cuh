// The prefill attention kernel for Hopper (sm_90a): warpgroup matrix products (wgmma) fed
// by the Tensor Memory Accelerator, one producer and two consumer warpgroups. Header-only;
// prefill_wgmma.cu says which calls it takes (PrefillWgmmaApplies), encodes the caches'
// tensor maps and launches it; its configuration (schedules, arguments, tile shape and
// shared-memory layout) is prefill_wgmma_config.cuh. The semantics are
// prefill_attention.cuh's (varlen, chunked prefill against cached keys, causal
// bottom-right, GQA packed into the rows, sliding window, ALiBi, soft cap, fp8 caches with
// per-tensor or per-head scales), for head sizes 64, 128 or (16-bit caches) 256, K and V
// alike, block sizes 16 to 256 (powers of two); everything else runs on
// prefill_attention.cuh.
//
// Why a second prefill kernel. mma.sync runs a warp's m16n8k16 products from registers
// that ldmatrix filled from shared memory; on the H200 that kernel stops at about 340
// TFLOP/s, about 0.56 of cuDNN's, because every operand passes through the register file.
// wgmma reads both operands of S = Q K^T and the B operand of O = P V from shared memory
// itself, for 64 rows of a warpgroup at once, asynchronously, while the warps go on; and
// TMA copies a page of K or V without a single address computed by the warps that compute.
//
// Work split (prefill_wgmma_units.cuh): a unit is 128 packed rows of one (sequence, KV
// head), the last tiles of a sequence first; the KV heads inner, as in prefill_attention.cuh,
// or outer, so that the CTAs running together read one head's K and V and share them in L2.
// A CTA computes one unit (grid = (num_kv_heads * num_m_tiles, num_seqs)) or, persistent,
// unit after unit (grid = (CTAs the device holds, 1)); block = 384 threads.
//   warpgroup 0 (producer; its registers lowered to kProducerRegs): warp 0 copies the key
//     tiles of the CTA's visible range, K then V, into a ring of kStages slots: per tile of
//     kBlockN keys one TMA box per (page, 64-column half), the block ids read through the
//     block table by one lane per box; a slot is reused once both consumers released it
//     (`empty`, one arrival per consumer warp), and its `full` barrier counts the bytes.
//   warpgroups 1 and 2 (consumers; registers raised to kConsumerRegs): 64 packed rows
//     each. Per tile: wait for K; S = Q K^T (D / 16 wgmma m64nNk16, N = kBlockN, from shared memory);
//     release K; scores in base 2 (soft cap, ALiBi, mask), online softmax in registers;
//     P to A fragments in registers; wait for V; O += P V (kBlockN / 16 wgmma with A from
//     registers, V MN-major); release V. A consumer whose rows see none of a tile's keys
//     only waits and releases. Three schedules (PrefillWgmmaSchedule, chosen per launch):
//     serial, as just said; overlap, where S of tile n and P V of tile n - 1 are issued
//     together (FlashAttention-3's intra-warpgroup overlap, except that ptxas waits for both
//     before the softmax of tile n: see the loop); ping-pong, the overlap with the two
//     consumers issuing their products in turns, so that one's softmax runs while the
//     other's products do.
//
// Pairs (kPair; PrefillWgmmaCluster::kPair): clusters of two CTAs of the same (sequence, KV
// head) and adjacent row tiles walk the same key tiles (the union of their visible ranges;
// a tile one CTA's rows do not see is waited for and released, as for a warpgroup) and
// share their loads: rank 0 copies K and rank 1 V, each box multicast into both CTAs'
// rings (prefill_wgmma_producer.cuh), so that each tile is read from L2 once per pair and
// each producer issues half the boxes. Every consumer warp releases a slot on both CTAs'
// `empty` barriers; the pair meets on cluster barriers after the barriers' initialisation
// and before either exits (the other's arrivals and copies may still target it). The grid
// then holds an even number of row tiles per KV head (the last pair of a short sequence
// may have one CTA without rows: it still loads and releases its half).
//
// Shared memory (1024-byte aligned; every panel is [rows][64] 16-bit values in the
// 128-byte swizzle of wgmma_ptx.cuh, 8 rows per 1024-byte atom):
//   q:  [2 consumers][D / 64 panels][64 rows][64]   reused to stage the output rows
//   k:  [kStages][D / 64 panels][kBlockN keys][64]  a page of box_tokens keys lands at
//   v:  [kStages][D / 64 panels][kBlockN keys][64]  key row page * box_tokens of each panel
//   barriers: full_k, full_v, empty_k, empty_v [kStages]
//
// fp8 caches (kFp8): TMA copies raw byte rows ([kBlockN][D], unswizzled) into the ring;
// both consumers convert a tile together, each its 64 rows, into one of two alternating
// 16-bit K and V tiles in the panel layout, meet on a hardware barrier of both warpgroups
// (5 for K, 6 for V) and release the raw slot at once; the products then read the
// converted tile. Two converted tiles suffice: a consumer converts tile n only after the
// barrier of tile n - 1, which the other reaches only once its products of tile n - 2 are
// done. These calls run the serial schedule. The K scale is folded into the softmax
// scale, the V scale into the output.
//
// Keys past the sequence's end inside its last page hold whatever the block holds there
// (a reused block's stale values, NaN): their scores are masked to -inf, and the consumers
// zero those V rows in shared memory before O += P V (fp8: the conversion writes them as
// zeros), so that 0 * NaN cannot reach the output. Block ids outside [0, num_blocks) read
// as zeros (the tensor map's bounds).
//
// Layouts the kernel reads (PagedKernelParams, element strides, dim stride 1):
//   q:       [num_tokens, num_heads, D]     rows 16-byte aligned
//   out:     [num_tokens, num_heads, D]     rows 16-byte aligned
//   k_cache: [num_blocks, block_size, num_kv_heads, D]   (NHD or HND; via the tensor map)
//   v_cache: [num_blocks, block_size, num_kv_heads, D]
#ifndef KVSTREAM_ATTENTION_CUDA_PREFILL_WGMMA_CUH_
#define KVSTREAM_ATTENTION_CUDA_PREFILL_WGMMA_CUH_

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/cuda_common.cuh"
#include "cuda/kernel_params.h"
#include "cuda/mma_ptx.cuh"
#include "cuda/prefill_helpers.cuh"
#include "cuda/prefill_wgmma_config.cuh"
#include "cuda/prefill_wgmma_producer.cuh"
#include "cuda/prefill_wgmma_units.cuh"
#include "cuda/sequence_bounds.cuh"
#include "cuda/tma_ptx.cuh"
#include "cuda/wgmma_ptx.cuh"

namespace kvstream {
namespace internal {
namespace prefill_wgmma {

using cuda::ScaleOfHead;
using cuda::VisibleHi;
using cuda::VisibleLo;
using ptx::CpAsync16;
using ptx::CpAsyncCommit;
using ptx::CpAsyncWaitGroup;
using ptx::FastExp2;
using ptx::PackPair;
using ptx::SmemAddress;

// REQUIRES: PrefillWgmmaApplies (prefill_wgmma.cu) for p; a device of compute capability
// 9.0 and a build for sm_90a (elsewhere the kernel traps). kFp8: the cache is fp8 (e4m3
// when a.e4m3), its maps raw byte rows. kPair: launched in clusters of 2 along x, with
// a.num_m_tiles even.
template <int D, typename T, bool kFp8 = false, bool kPair = false>
__global__ void __launch_bounds__(PrefillWgmmaTraits<D, kFp8, kPair>::kThreads, 1)
    PrefillWgmmaKernel(const __grid_constant__ PagedKernelParams p,
                       const __grid_constant__ CUtensorMap k_map,
                       const __grid_constant__ CUtensorMap v_map, const PrefillWgmmaArgs a) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Traits = PrefillWgmmaTraits<D, kFp8, kPair>;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kPanels = Traits::kPanels;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kNegInf = -INFINITY;

  extern __shared__ __align__(1024) uint8_t raw_smem[];
  uint8_t* const smem =
      raw_smem + ((1024 - (SmemAddress(raw_smem) & 1023)) & 1023);
  const uint32_t smem_base = SmemAddress(smem);
  const uint32_t k_base = smem_base + Traits::kKOffset;
  const uint32_t v_base = smem_base + Traits::kVOffset;
  const uint32_t bar_base = smem_base + Traits::kBarrierOffset;
  const RingBarriers<kStages> bars{bar_base};
  auto full_k = [&](int s) { return bars.full_k(s); };
  auto full_v = [&](int s) { return bars.full_v(s); };
  auto empty_k = [&](int s) { return bars.empty_k(s); };
  auto empty_v = [&](int s) { return bars.empty_v(s); };

  const int tid = static_cast<int>(threadIdx.x);
  // Broadcast from lane 0 so that the compiler knows it is the same in every lane of a warp:
  // what derives from it (the consumer's Q panels and its products' descriptors) can then
  // live in uniform registers.
  const int warpgroup = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int lane = tid & 31;

  // ---- The units this CTA computes (prefill_wgmma_units.cuh): one, or (persistent) one
  // per round; the ring and its barriers carry over from unit to unit.
  const int num_kv_heads = p.num_kv_heads;
  const int group = p.num_heads / num_kv_heads;
  const uint32_t cta_rank = kPair ? tma_ptx::ClusterCtaRank() : 0;
  const UnitWalk walk =
      MakeUnitWalk<kPair>(p, a, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x),
                          static_cast<int>(blockIdx.y));

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      // One arrival that expects the bytes; the releases of every consumer warp of the CTA
      // (of the pair).
      tma_ptx::BarrierInit(full_k(s), 1);
      tma_ptx::BarrierInit(full_v(s), 1);
      tma_ptx::BarrierInit(empty_k(s), Traits::kConsumers * 4 * (kPair ? 2 : 1));
      tma_ptx::BarrierInit(empty_v(s), Traits::kConsumers * 4 * (kPair ? 2 : 1));
    }
    tma_ptx::FenceBarrierInit();
  }
  if constexpr (kPair) {
    tma_ptx::ClusterSync();  // the other CTA's barriers exist before anything targets them
  } else {
    __syncthreads();
  }

  if (warpgroup == 0) {
    // ---- Producer (prefill_wgmma_producer.cuh).
    wgmma::SetMaxRegisters<Traits::kProducerRegs, false>();
    if (tid < 32) {
      int ring = 0;  // tiles put into the ring so far, over every unit
      int u;
      for (int round = 0; walk.At(round, &u); ++round) {
        if (u < 0) continue;
        const Unit unit = LoadUnit<kBlockM, kBlockN, kPair>(p, a, walk, u, cta_rank);
        if (!unit.loads) continue;
        const ProducerTiles tiles{unit.seq, unit.kv_head, unit.bounds.seq_len, unit.n_begin,
                                  unit.n_end};
        ProduceByTma<D, kFp8, kPair, Traits>(p, k_map, v_map, a, tiles, k_base, v_base, bars,
                                             cta_rank, lane, ring);
      }
    }
    if constexpr (kPair) tma_ptx::ClusterSync();
    return;
  }

  // ---- Consumers.
  wgmma::SetMaxRegisters<Traits::kConsumerRegs, true>();
  const int consumer = warpgroup - 1;
  const int wtid = tid - 128 * warpgroup;  // thread in the warpgroup
  const int warp_in_group = wtid / 32;
  const uint32_t q_base = smem_base + consumer * Traits::kQWarpgroupBytes;
  uint8_t* const q_smem = smem + consumer * Traits::kQWarpgroupBytes;
  int ring = 0;  // tiles taken from the ring so far, over every unit
  int u;
  for (int round = 0; walk.At(round, &u); ++round) {
    if (u < 0) continue;
    const Unit unit = LoadUnit<kBlockM, kBlockN, kPair>(p, a, walk, u, cta_rank);
    if (!unit.loads) continue;
    const int kv_head = unit.kv_head;
    const SequenceBounds bounds = unit.bounds;
    const int rows_total = unit.rows_total;
    const int seq_len = bounds.seq_len;
    const int context = seq_len - bounds.query_len;
    const int n_begin = unit.n_begin;
    const int n_end = unit.n_end;
    const int wg_row0 = unit.row0 + consumer * 64;  // first packed row of this warpgroup
    const bool wg_active = wg_row0 < rows_total;

    // Q rows of this warpgroup into its panels (rows past the end zero).
    {
      const T* const q = static_cast<const T*>(p.q);
      constexpr int kChunks = D / 8;
      for (int i = wtid; i < 64 * kChunks; i += 128) {
        const int m = i / kChunks;
        const int c = i % kChunks;
        const int r = wg_row0 + m;
        const bool valid = r < rows_total;
        const T* src = q;
        if (valid) {
          const int t = r / group;
          const int h = kv_head * group + (r - t * group);
          src = q + (static_cast<int64_t>(bounds.q_start) + t) * p.q_token_stride +
                static_cast<int64_t>(h) * p.q_head_stride + c * 8;
        }
        CpAsync16(q_base + (c >> 3) * Traits::kQPanelBytes +
                      wgmma::SwizzledOffset128(static_cast<uint32_t>(m), (c & 7) * 8),
                  src, valid);
      }
      CpAsyncCommit();
      CpAsyncWaitGroup<0>();
      wgmma::FenceSharedForAsyncProxy();
      wgmma::NamedBarrierSync(1 + consumer, 128);
    }

    // Thread rows: rr = 16 warp + lane / 4 + 8 half of the warpgroup's 64.
    const int wg_last = min(rows_total - 1, wg_row0 + 63);
    const int wg_qp_first = context + wg_row0 / group;
    const int wg_qp_last = context + wg_last / group;
    const int wg_lo_min = VisibleLo(p, wg_qp_first);
    const int wg_lo_max = VisibleLo(p, wg_qp_last);
    const int wg_hi_min = VisibleHi(p, wg_qp_first, seq_len);
    const int wg_hi_max = VisibleHi(p, wg_qp_last, seq_len);
    auto row_of = [&](int half) {
      return min(rows_total - 1, wg_row0 + 16 * warp_in_group + (lane >> 2) + 8 * half);
    };
    int row_qp[2];
    float row_slope2[2];
    const bool alibi = p.alibi_slopes != nullptr;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row_of(half);
      row_qp[half] = context + r / group;
      row_slope2[half] =
          alibi ? p.alibi_slopes[kv_head * group + (r - (r / group) * group)] * kLog2e : 0.0f;
    }
    const float k_scale = ScaleOfHead(p.k_scale, p.num_scales, kv_head);
    const bool soft_cap = p.logits_soft_cap > 0.0f;
    const float scale2 = p.scale * k_scale * kLog2e;
    const float cap2 = soft_cap ? p.logits_soft_cap * kLog2e : 0.0f;
    const float inv_cap = soft_cap ? p.scale * k_scale / p.logits_soft_cap : 0.0f;
    const float exp_scale = soft_cap || alibi ? 1.0f : scale2;
    const int quad_col = 2 * (lane & 3);

    float acc_o[D / 2];
#pragma unroll
    for (int j = 0; j < D / 2; ++j) acc_o[j] = 0.0f;
    float row_max[2] = {kNegInf, kNegInf};
    float row_sum[2] = {0.0f, 0.0f};

    // The tiles this warpgroup's rows see: [u_begin, u_end) (contiguous: the keys some row
    // sees are [wg_lo_min, wg_hi_max]).
    const int u_begin = wg_active ? max(n_begin, wg_lo_min / kBlockN) : n_begin;
    const int u_end = wg_active ? max(u_begin, min(n_end, wg_hi_max / kBlockN + 1)) : n_begin;
    // Tile n's place in the ring's sequence (every unit's tiles before this unit's counted).
    auto ring_pos = [&](int n) { return ring + n - n_begin; };
    auto stage_of = [&](int n) { return ring_pos(n) % kStages; };
    auto parity_of = [&](int n) { return static_cast<uint32_t>((ring_pos(n) / kStages) & 1); };
    // The 16-bit tiles the products read: the ring's slot, or (fp8) the converted tile.
    auto k_tile_of = [&](int n) {
      return kFp8 ? smem_base + Traits::kConvKOffset + (ring_pos(n) & 1) * Traits::kTileBytes
                  : k_base + stage_of(n) * Traits::kTileBytes;
    };
    auto v_tile_of = [&](int n) {
      return kFp8 ? smem_base + Traits::kConvVOffset + (ring_pos(n) & 1) * Traits::kTileBytes
                  : v_base + stage_of(n) * Traits::kTileBytes;
    };
    // One arrival per warp on an `empty` barrier (pairs: on both CTAs'), once the warp's
    // products reading it are done.
    auto release = [&](uint32_t bar) {
      __syncwarp();
      if (lane == 0) {
        tma_ptx::BarrierArrive(bar);
        if constexpr (kPair) tma_ptx::BarrierArriveCluster(bar, cta_rank ^ 1);
      }
    };
    // fp8: this warpgroup's 64 rows of the raw tile at `raw` (ring offset) converted to T into
    // the tile at `tile`; rows past the sequence's end become zeros (they may hold NaN).
    auto convert = [&](uint32_t raw, uint32_t tile, int n) {
      constexpr int kRawChunks = D / 16;
      const int tile_lo = n * kBlockN;
      const bool e4m3 = a.e4m3 != 0;
      for (int i = wtid; i < 64 * kRawChunks; i += 128) {
        const int r = 64 * consumer + i / kRawChunks;
        const int c = i % kRawChunks;
        uint32_t out[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (tile_lo + r < seq_len) {
          const uint4 codes =
              *reinterpret_cast<const uint4*>(smem + (raw - smem_base) + r * D + c * 16);
          ptx::Fp8ChunkTo<T>(codes, e4m3, out);
        }
        const int col = 16 * c;
        uint8_t* const dst = smem + (tile - smem_base) + (col >> 6) * Traits::kKvPanelBytes;
        *reinterpret_cast<uint4*>(dst + wgmma::SwizzledOffset128(r, col & 63)) =
            make_uint4(out[0], out[1], out[2], out[3]);
        *reinterpret_cast<uint4*>(dst + wgmma::SwizzledOffset128(r, (col & 63) + 8)) =
            make_uint4(out[4], out[5], out[6], out[7]);
      }
      wgmma::FenceSharedForAsyncProxy();
    };
    // K (V) of tile n ready for the products: its copy has landed; fp8: both consumers have
    // converted their halves (hardware barrier 5 for K, 6 for V, of both warpgroups) and the
    // raw slot is released at once.
    auto ready_k = [&](int n) {
      tma_ptx::BarrierWait(full_k(stage_of(n)), parity_of(n));
      if constexpr (kFp8) {
        convert(k_base + stage_of(n) * Traits::kRingTileBytes, k_tile_of(n), n);
        wgmma::NamedBarrierSync(5, 256);
        release(empty_k(stage_of(n)));
      }
    };
    auto ready_v = [&](int n) {
      tma_ptx::BarrierWait(full_v(stage_of(n)), parity_of(n));
      if constexpr (kFp8) {
        convert(v_base + stage_of(n) * Traits::kRingTileBytes, v_tile_of(n), n);
        wgmma::NamedBarrierSync(6, 256);
        release(empty_v(stage_of(n)));
      }
    };
    // The ring slot of K (V) of tile n free again once the products that read it are done
    // (fp8: already released when converted).
    auto release_k = [&](int n) {
      if constexpr (!kFp8) release(empty_k(stage_of(n)));
    };
    auto release_v = [&](int n) {
      if constexpr (!kFp8) release(empty_v(stage_of(n)));
    };
    // A tile no row of this warpgroup sees: waited for (fp8: converted) and released, so
    // that the producer's ring keeps its order.
    auto pass = [&](int n) {
      ready_k(n);
      release_k(n);
      ready_v(n);
      release_v(n);
    };

    float acc_s[kBlockN / 2];
    uint32_t pa[kBlockN / 16][4];
    // The products' shared-memory descriptors: built once (Q) or once per tile (K, V), each
    // k16 step a constant added to the start address (DescriptorPlus).
    const uint64_t q_desc = wgmma::KMajorDescriptor(q_base);
    // S = Q K^T of tile n, issued and committed (not waited for).
    auto issue_s = [&](int n) {
      ready_k(n);
      const uint64_t k_desc = wgmma::KMajorDescriptor(k_tile_of(n));
      wgmma::Fence();
#pragma unroll
      for (int k = 0; k < D / 16; ++k) {
        wgmma::WgmmaSS<kBlockN, T>(
            acc_s, wgmma::DescriptorPlus(q_desc, wgmma::KMajorStepBytes(Traits::kQPanelBytes, k)),
            wgmma::DescriptorPlus(k_desc, wgmma::KMajorStepBytes(Traits::kKvPanelBytes, k)), k > 0);
      }
      wgmma::Commit();
    };
    // O += P V of tile n (P in pa), issued and committed. V rows past the sequence's end are
    // zeroed first (they may hold NaN; their P is 0).
    auto issue_pv = [&](int n) {
      ready_v(n);
      const int tile_lo = n * kBlockN;
      if (!kFp8 && tile_lo + kBlockN > seq_len) {
        const int first = seq_len - tile_lo;
        uint8_t* const tile = smem + (v_tile_of(n) - smem_base);
        for (int i = wtid; i < (kBlockN - first) * kPanels * 8; i += 128) {
          const int r = first + i / (kPanels * 8);
          const int c = i % (kPanels * 8);
          *reinterpret_cast<uint4*>(tile + (c >> 3) * Traits::kKvPanelBytes + r * 128 +
                                    (((c & 7) ^ (r & 7)) << 4)) = make_uint4(0, 0, 0, 0);
        }
        wgmma::FenceSharedForAsyncProxy();
        wgmma::NamedBarrierSync(1 + consumer, 128);
      }
      const uint64_t v_desc = wgmma::MnMajorDescriptor(v_tile_of(n), Traits::kKvPanelBytes);
      wgmma::Fence();
#pragma unroll
      for (int kc = 0; kc < kBlockN / 16; ++kc) {
        wgmma::WgmmaRS<D, T, true>(
            acc_o, pa[kc], wgmma::DescriptorPlus(v_desc, wgmma::MnMajorStepBytes(kc)), true);
      }
      wgmma::Commit();
    };
    // The online softmax of tile n in two steps. scores_max: the scores in acc_s to base 2
    // (soft cap, ALiBi, mask, as prefill_attention.cuh), the rows' new running max, and
    // alpha, the factor O and the sums must be rescaled by; returns whether any row of the
    // warp has alpha != 1. scores_exp: acc_s becomes P (not yet rounded) and the sums move
    // on.
    float neg_max_scaled[2];
    auto scores_max = [&](int n, float(&alpha)[2]) {
      const int tile_lo = n * kBlockN;
      if (soft_cap) {
#pragma unroll
        for (int j = 0; j < kBlockN / 2; ++j) {
          const float x = acc_s[j] * inv_cap;
          const float t = 1.0f - __fdividef(2.0f, FastExp2(x * (2.0f * kLog2e)) + 1.0f);
          acc_s[j] = cap2 * t;
        }
      } else if (alibi) {
#pragma unroll
        for (int j = 0; j < kBlockN / 2; ++j) acc_s[j] *= scale2;
      }
      if (alibi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float base = static_cast<float>(tile_lo + quad_col - row_qp[half]);
#pragma unroll
          for (int nb = 0; nb < kBlockN / 8; ++nb) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              acc_s[4 * nb + 2 * half + e] +=
                  row_slope2[half] * (base + static_cast<float>(nb * 8 + e));
            }
          }
        }
      }
      if (tile_lo < wg_lo_max || tile_lo + kBlockN - 1 > wg_hi_min) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int lo = VisibleLo(p, row_qp[half]) - tile_lo - quad_col;
          const int hi = VisibleHi(p, row_qp[half], seq_len) - tile_lo - quad_col;
#pragma unroll
          for (int nb = 0; nb < kBlockN / 8; ++nb) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = nb * 8 + e;
              if (col < lo || col > hi) acc_s[4 * nb + 2 * half + e] = kNegInf;
            }
          }
        }
      }
      bool rescale = false;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // Four chains of maxima, not one of kBlockN / 4 dependent steps (fmaxf is exact: the
        // order does not change the result).
        float m[4] = {kNegInf, kNegInf, kNegInf, kNegInf};
#pragma unroll
        for (int nb = 0; nb < kBlockN / 8; ++nb) {
          m[nb & 3] =
              fmaxf(m[nb & 3], fmaxf(acc_s[4 * nb + 2 * half], acc_s[4 * nb + 2 * half + 1]));
        }
        float tile_max = fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3]));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        const float new_max = fmaxf(row_max[half], tile_max);
        // A row with no visible key so far keeps max -inf; subtract 0 so that exp2 gives 0.
        const float use_max = new_max == kNegInf ? 0.0f : new_max;
        alpha[half] = FastExp2((row_max[half] - use_max) * exp_scale);
        rescale = rescale || alpha[half] != 1.0f;
        row_max[half] = new_max;
        neg_max_scaled[half] = -use_max * exp_scale;
      }
      return __any_sync(0xffffffffu, rescale);
    };
    auto scores_exp = [&](const float(&alpha)[2]) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float sum = 0.0f;
#pragma unroll
        for (int nb = 0; nb < kBlockN / 8; ++nb) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = 4 * nb + 2 * half + e;
            const float pe = FastExp2(fmaf(acc_s[j], exp_scale, neg_max_scaled[half]));
            acc_s[j] = pe;
            sum += pe;
          }
        }
        row_sum[half] = row_sum[half] * alpha[half] + sum;
      }
    };
    auto rescale_o = [&](const float(&alpha)[2]) {
#pragma unroll
      for (int j = 0; j < D / 2; ++j) acc_o[j] *= alpha[(j >> 1) & 1];
    };
    auto pack_p = [&]() {
#pragma unroll
      for (int kc = 0; kc < kBlockN / 16; ++kc) wgmma::PackA<T>(acc_s, kc, pa[kc]);
    };

    // Ping-pong (kPrefillWgmmaPingPong): the overlap schedule with the two consumers taking
    // turns to issue their products, on two hardware barriers of both warpgroups (3:
    // consumer 0's turn, 4: consumer 1's), so that one's softmax runs while the other's
    // products do. Every consumer takes the same number of turns, (n_end - n_begin) + 1, a
    // tile it does not see included; consumer 1 hands the first turn to consumer 0 and skips
    // the hand-over after its last, so that every arrival is matched by a wait.
    // fp8 caches run the serial schedule: both consumers convert every tile together.
    const int schedule = kFp8 ? static_cast<int>(kPrefillWgmmaSerial) : a.schedule;
    const bool ping_pong = schedule == kPrefillWgmmaPingPong;
    const int turns = n_end - n_begin + 1;
    int turn = 0;
    auto turn_begin = [&]() {
      if (ping_pong) wgmma::NamedBarrierSync(3 + consumer, 256);
    };
    auto turn_end = [&]() {
      ++turn;
      if (ping_pong && (consumer == 0 || turn < turns)) {
        wgmma::NamedBarrierArrive(4 - consumer, 256);
      }
    };
    if (ping_pong && consumer == 1) wgmma::NamedBarrierArrive(3, 256);
    auto pass_turn = [&](int n) {
      pass(n);
      turn_begin();
      turn_end();
    };

    // The tiles before this warpgroup's first, then its own, then those after its last.
    for (int n = n_begin; n < u_begin; ++n) pass_turn(n);
    if (u_begin < u_end && schedule == kPrefillWgmmaSerial) {
      // Per tile: S, softmax, O += P V, each waited for before the next.
      for (int n = u_begin; n < u_end; ++n) {
        float alpha[2];
        issue_s(n);
        wgmma::Wait<0>();
        wgmma::FenceOperands(acc_s);
        release_k(n);
        const bool rescale = scores_max(n, alpha);
        scores_exp(alpha);
        if (rescale) rescale_o(alpha);
        pack_p();
        issue_pv(n);
        wgmma::Wait<0>();
        wgmma::FenceOperands(acc_o);
        release_v(n);
      }
    } else if (u_begin < u_end) {
      // Overlap and ping-pong: per tile n, S_n = Q K_n^T and O += P_{n-1} V_{n-1} are issued
      // together, the softmax of S_n follows, and O is rescaled (by tile n's alpha) once the
      // second product is done. (FlashAttention-3 runs the softmax while P V is in flight;
      // here ptxas schedules the wait for both products at the start of the softmax, as
      // early as the code's ordering allows, so the two products are queued together but
      // the softmax does not overlap them; pinning the wait after the softmax by moving
      // K_n's release there was measured slower: docs/benchmarks.md, "The softmax between
      // the two waits".)
      float alpha[2];
      turn_begin();
      issue_s(u_begin);
      turn_end();
      wgmma::Wait<0>();
      wgmma::FenceOperands(acc_s);
      release_k(u_begin);
      scores_max(u_begin, alpha);
      scores_exp(alpha);  // O is still zero: nothing to rescale
      pack_p();
      for (int n = u_begin + 1; n < u_end; ++n) {
        turn_begin();
        issue_s(n);
        issue_pv(n - 1);
        turn_end();
        wgmma::Wait<1>();
        wgmma::FenceOperands(acc_s);
        release_k(n);
        const bool rescale = scores_max(n, alpha);
        scores_exp(alpha);
        wgmma::Wait<0>();
        wgmma::FenceOperands(acc_o);
        wgmma::FenceOperands(pa);
        release_v(n - 1);
        if (rescale) rescale_o(alpha);
        pack_p();
      }
      turn_begin();
      issue_pv(u_end - 1);
      turn_end();
      wgmma::Wait<0>();
      wgmma::FenceOperands(acc_o);
      release_v(u_end - 1);
    } else {
      // No tile of its own: the extra turn the others take.
      turn_begin();
      turn_end();
    }
    for (int n = u_end; n < n_end; ++n) pass_turn(n);

    // ---- Epilogue: normalise, fold the V scale, stage in this warpgroup's q panels, write.
    if (wg_active) {
      const float v_scale = ScaleOfHead(p.v_scale, p.num_scales, kv_head);
      float inv[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float sum = row_sum[half];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        inv[half] = sum > 0.0f ? v_scale / sum : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < D / 2; j += 2) {
        const int half = (j >> 1) & 1;
        const int m = 16 * warp_in_group + (lane >> 2) + 8 * half;
        const int col = 8 * (j >> 2) + quad_col;
        *reinterpret_cast<uint32_t*>(q_smem + (col >> 6) * Traits::kQPanelBytes +
                                     wgmma::SwizzledOffset128(m, col & 63)) =
            PackPair<T>(acc_o[j] * inv[half], acc_o[j + 1] * inv[half]);
      }
      wgmma::NamedBarrierSync(1 + consumer, 128);
      T* const out = static_cast<T*>(p.out);
      constexpr int kChunks = D / 8;
      for (int i = wtid; i < 64 * kChunks; i += 128) {
        const int m = i / kChunks;
        const int c = i % kChunks;
        const int r = wg_row0 + m;
        if (r >= rows_total) continue;
        const int t = r / group;
        const int h = kv_head * group + (r - t * group);
        T* const dst = out + (static_cast<int64_t>(bounds.q_start) + t) * p.o_token_stride +
                       static_cast<int64_t>(h) * p.o_head_stride + c * 8;
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(
            q_smem + (c >> 3) * Traits::kQPanelBytes +
            wgmma::SwizzledOffset128(static_cast<uint32_t>(m), (c & 7) * 8));
      }
    }
    ring += n_end - n_begin;
    // The q panels staged this unit's output: read by every thread of the warpgroup before
    // the next unit's Q lands there.
    wgmma::NamedBarrierSync(1 + consumer, 128);
  }
  if constexpr (kPair) tma_ptx::ClusterSync();  // the other CTA's arrivals here are done
#else
  (void)p; (void)k_map; (void)v_map; (void)a;
  __trap();
#endif
}

}  // namespace prefill_wgmma
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_PREFILL_WGMMA_CUH_
