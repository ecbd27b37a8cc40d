// Paged decode attention on tensor cores fed by the Tensor Memory Accelerator (sm_90): the
// kernel behind LaunchDecodeAttention's TMA path (decode_tma_attention.cu). Header-only
// template over the 16-bit activation type T, taking PagedKernelParams (kernel_params.h),
// the K and V caches' tensor maps and a DecodeTmaArgs by value.
//
// Why a second tensor-core kernel. The cp.async kernel (decode_tc_attention.cuh) runs one
// CTA per KV head: each copies 256-byte rows that sit 2 KiB apart in an NHD block, with
// per-row address arithmetic in the warps that also compute. Here one CTA takes four KV
// heads of a sequence, and one TMA instruction copies a whole 16-token block of their K (or
// V): 16 KiB, one contiguous kilobyte per token in NHD, with no address arithmetic in the
// compute warps at all. On the H200 that read alone runs about 1% faster than the
// per-head one, and the decode as a whole 1.5-2% faster (docs/benchmarks.md).
//
// Work split. One CTA per (sequence, group of kHeads KV heads, split):
//   grid = (num_kv_heads / kHeads, num_seqs, num_splits), block = (kHeads + 1) warps
// A split is a run of whole 16-token blocks of the sequence's visible keys.
//   warp kHeads (the producer): its lane 0 copies block after block, K then V, into a ring
//     of kRing slots, each slot one block's K or V of the CTA's kHeads heads; it waits until
//     a slot is free (`empty`, one arrival per compute warp) and has the slot's `full`
//     barrier count the bytes (mbarrier expect_tx / complete_tx). The block ids come from
//     the block table 32 at a time, one per lane, handed to lane 0 by shuffles.
//   warp w < kHeads (compute): KV head kv_group * kHeads + w, its query heads (up to 8) as
//     the N columns of m16n8k16 mmas, the block's 16 keys as the M rows (the S^T = K Q^T
//     layout of decode_tc_attention.cuh): waits for the block's K, S^T, base-2 online
//     softmax with a running max that may trail by 2^8, P^T by movmatrix.trans, waits for
//     its V, O^T += V^T P^T. Each warp sees every key of its head in the split, so the CTA
//     needs no merge of its own; the warps never wait for each other.
//
// Shared memory (1024-byte aligned for the 128-byte swizzle):
//   ring [kRing][kHeads][2][16][64] T: slot s, head w, column half c (64 elements, 128
//     bytes), token r. The tensor map's box is {64 elements, 16 tokens, 2 halves, kHeads
//     heads, 1 block} over the cache viewed as [block][head][half][token][64] (strides from
//     params, any NHD / HND layout with 16-byte aligned rows), and the 128-byte swizzle
//     XORs each row's 16-byte chunk index with its token % 8, so that ldmatrix of 8 tokens
//     hits 8 different bank groups.
//   q [kHeads][8][128] T (swizzled as SwizzledChunk<128>), full [kRing], empty [kRing].
//
// Keys outside the split's visible range inside its first and last blocks (a sliding
// window's start, the sequence's end) are masked: their scores are -inf and their V rows
// are zeroed in shared memory before use, so that whatever the cache holds there (a
// reused block's stale values, NaN) cannot reach the output through 0 * NaN. Block ids
// outside [0, num_blocks) read as zeros: the tensor map fills what lies outside the cache
// with zeros.
//
// Output: num_splits == 1: out [num_tokens, num_heads, 128] directly (V scale applied);
// else partial_out / partial_ml as decode_attention.cuh lays them out, merged by its
// DecodeMergeKernel or, given arrival counters and at most kMaxMergeSplits splits, by the
// last split of each (sequence, KV head) to finish (LastSplitToArrive, MergeSplits), which
// saves the merge kernel's launch and its reads after the split kernel's end.
#ifndef KVSTREAM_ATTENTION_CUDA_DECODE_TMA_ATTENTION_CUH_
#define KVSTREAM_ATTENTION_CUDA_DECODE_TMA_ATTENTION_CUH_

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/cuda_common.cuh"
#include "cuda/decode_softmax.cuh"
#include "cuda/kernel_params.h"
#include "cuda/mma_ptx.cuh"
#include "cuda/sequence_bounds.cuh"
#include "cuda/tma_ptx.cuh"

namespace kvstream {
namespace internal {
namespace decode_tma {

// Runtime choices the launcher makes once per call.
struct DecodeTmaArgs {
  int32_t group_size;  // num_heads / num_kv_heads, 1..8
  int32_t num_splits;  // 1 .. 256
  float* partial_out;  // num_splits > 1: the workspace (decode_attention.cuh's layout)
  float* partial_ml;
  // Not null only where 2 <= num_splits <= kMaxMergeSplits: [num_seqs][num_kv_heads]
  // arrival counters, zero at the launch and left zero; the last split of each (sequence,
  // KV head) merges them all and writes out (no merge kernel). Null: every split writes
  // its partial result.
  uint32_t* arrivals;
};

struct DecodeTmaTraits {
  static constexpr int kHeads = 4;        // KV heads per CTA, one compute warp each
  static constexpr int kD = 128;          // head size (K and V)
  static constexpr int kBlockTokens = 16;  // cache block size
  static constexpr int kThreads = (kHeads + 1) * 32;
  static constexpr int kHeadBytes = kBlockTokens * kD * 2;  // one head's K or V of a block
  static constexpr int kSlotBytes = kHeads * kHeadBytes;    // one TMA box
  // 8 slots of 16 KiB: seven blocks' K or V in flight while one is used (on the H200, 12
  // slots measured 0.5% slower at 64 x 4096 and the same at 16 x 32768).
  static constexpr int kRing = 8;
  static constexpr int kQOffset = kRing * kSlotBytes;
  static constexpr int kQBytes = kHeads * 8 * kD * 2;
  static constexpr int kBarrierOffset = kQOffset + kQBytes;
  // + 1024: the dynamic shared memory base is aligned up to 1024 bytes inside the kernel.
  static constexpr int kSmemBytes = kBarrierOffset + 2 * kRing * 8 + 1024;
  // The in-kernel merge (DecodeTmaArgs::arrivals) takes up to kMaxMergeSplits splits: the
  // last split loads the others' results of its 2 heads per lane at once (2 x 3 x 18
  // floats in registers).
  static constexpr int kMaxMergeSplits = 4;
  // A compute warp reads its arrival counter this many blocks before its split ends, so
  // that the answer is back when it is done (a load waits behind the stream of K and V).
  static constexpr int kPeekBlocks = 8;
};

using ptx::FastExp2;
using ptx::LdMatrixX4;
using ptx::LdMatrixX4Trans;
using ptx::Mma16816;
using ptx::MovMatrixTrans;
using ptx::PackPair;
using ptx::SmemAddress;
using ptx::SwizzledChunk;
using cuda::FromFloat;
using decode_tc::MakeScoreParams;
using decode_tc::OnlineSoftmaxStep;
using decode_tc::ScoreParams;
using decode_tc::ToBase2Logits;

using tma_ptx::BarrierArrive;
using tma_ptx::BarrierArriveExpect;
using tma_ptx::BarrierInit;
using tma_ptx::BarrierWait;
using tma_ptx::TmaLoad5;

// ---------------------------------------------------------------------------------------
// The splits' merge in the split kernel (DecodeTmaArgs::arrivals).

// A GPU-scope relaxed load of an arrival counter (made an acquire by a fence after it).
__device__ __forceinline__ uint32_t LoadRelaxed(const uint32_t* counter) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
  return v;
}

// Whether the calling warp is the last of the `num_splits` splits of its (sequence, KV
// head) to finish, after `write_partial` (which writes this split's partial result when
// called by every lane) where it is not. On return true every other split's partial
// result is visible to the warp and the counter is zero again; false: this split's result
// is published and the counter counts it. `peeked`: lane 0's relaxed read of the counter a
// few blocks before the split's end (kNotPeeked if none). A split that finds every other
// one already counted, then or now, is last without publishing its own; otherwise it
// publishes, then counts itself with an atomicInc that wraps at num_splits - 1, so that
// the last increment both tells the last split and leaves the counter zero.
constexpr uint32_t kNotPeeked = 0xffffffffu;
__device__ __forceinline__ void FenceAcqRelGpu() {
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
}
template <typename WritePartial>
__device__ __forceinline__ bool LastSplitToArrive(uint32_t* counter, int num_splits, int lane,
                                                  uint32_t peeked,
                                                  WritePartial&& write_partial) {
  const uint32_t all_others = static_cast<uint32_t>(num_splits - 1);
  uint32_t seen = __shfl_sync(0xffffffffu, peeked, 0);
  if (seen != all_others) {
    if (lane == 0) seen = LoadRelaxed(counter);
    seen = __shfl_sync(0xffffffffu, seen, 0);
  }
  if (seen == all_others) {
    // Every other split has counted itself (the fence makes the read an acquire), so none
    // touches the counter again in this launch: reset it for the next.
    if (lane == 0) {
      FenceAcqRelGpu();
      *reinterpret_cast<volatile uint32_t*>(counter) = 0u;
    }
    __syncwarp();
    return true;
  }
  write_partial();
  __threadfence();  // this lane's partial writes before the count (release)
  __syncwarp();
  uint32_t before = 0;
  if (lane == 0) before = atomicInc(counter, all_others);
  before = __shfl_sync(0xffffffffu, before, 0);
  if (before != all_others) return false;
  if (lane == 0) FenceAcqRelGpu();  // the other splits' writes before the reads that follow
  __syncwarp();
  return true;
}

// The last split's merge of every split's results for the query heads quad_col + j of its
// warp, written to out. All the other splits' values are loaded first, at once (one trip
// to L2 where several would add up at the kernel's end); then DecodeMergeKernel's
// arithmetic in its order (splits in index order, this split's values from registers), so
// that the output is the same to the bit. head_slot0: the slot index (sequence, query head
// first_head) of decode_attention.cuh's partial layout, before the split.
template <typename Traits, typename T>
__device__ __forceinline__ void MergeSplits(const PagedKernelParams& p, const DecodeTmaArgs& a,
                                            int64_t head_slot0, int first_head, int split,
                                            int g, int quad_col, float v_scale,
                                            const float (&head_max)[1][2],
                                            const float (&head_total)[2],
                                            const float (&acc_o)[Traits::kD / 16][1][4],
                                            int q_start) {
  constexpr int kDSteps = Traits::kD / 16;
  constexpr int kS = Traits::kMaxMergeSplits;
  const int S = a.num_splits;
  float m_in[2][kS];
  float l_in[2][kS];
  float o_in[2][kS][2 * kDSteps];
KVSTREAM_CUDA_UNROLL
  for (int j = 0; j < 2; ++j) {
KVSTREAM_CUDA_UNROLL
    for (int i = 0; i < kS; ++i) {
      m_in[j][i] = 0.0f;
      l_in[j][i] = 0.0f;
KVSTREAM_CUDA_UNROLL
      for (int k = 0; k < 2 * kDSteps; ++k) o_in[j][i][k] = 0.0f;
      if (i < S && i != split && quad_col + j < a.group_size) {
        const int64_t slot = (head_slot0 + quad_col + j) * S + i;
        m_in[j][i] = __ldcg(a.partial_ml + slot * 2);
        l_in[j][i] = __ldcg(a.partial_ml + slot * 2 + 1);
        const float* const row = a.partial_out + slot * Traits::kD;
KVSTREAM_CUDA_UNROLL
        for (int dd = 0; dd < kDSteps; ++dd) {
          o_in[j][i][2 * dd] = __ldcg(row + 16 * dd + g);
          o_in[j][i][2 * dd + 1] = __ldcg(row + 16 * dd + g + 8);
        }
      }
    }
  }
  T* const out = static_cast<T*>(p.out);
KVSTREAM_CUDA_UNROLL
  for (int j = 0; j < 2; ++j) {
    const int m = quad_col + j;
    if (m >= a.group_size) continue;
    float big = -INFINITY;
KVSTREAM_CUDA_UNROLL
    for (int i = 0; i < kS; ++i) {
      if (i < S) big = fmaxf(big, i == split ? head_max[0][j] : m_in[j][i]);
    }
    float sum = 0.0f;
    float o[2 * kDSteps];
KVSTREAM_CUDA_UNROLL
    for (int k = 0; k < 2 * kDSteps; ++k) o[k] = 0.0f;
KVSTREAM_CUDA_UNROLL
    for (int i = 0; i < kS; ++i) {
      if (i >= S) continue;
      const bool own = i == split;
      const float mi = own ? head_max[0][j] : m_in[j][i];
      const float w = mi == -INFINITY ? 0.0f : exp2f(mi - big);
      sum = fmaf(own ? head_total[j] : l_in[j][i], w, sum);
KVSTREAM_CUDA_UNROLL
      for (int dd = 0; dd < kDSteps; ++dd) {
        o[2 * dd] = fmaf(own ? acc_o[dd][0][j] : o_in[j][i][2 * dd], w, o[2 * dd]);
        o[2 * dd + 1] =
            fmaf(own ? acc_o[dd][0][j + 2] : o_in[j][i][2 * dd + 1], w, o[2 * dd + 1]);
      }
    }
    const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
    T* const row = out + static_cast<int64_t>(q_start) * p.o_token_stride +
                   static_cast<int64_t>(first_head + m) * p.o_head_stride;
KVSTREAM_CUDA_UNROLL
    for (int dd = 0; dd < kDSteps; ++dd) {
      row[16 * dd + g] = FromFloat<T>(o[2 * dd] * inv_sum * v_scale);
      row[16 * dd + g + 8] = FromFloat<T>(o[2 * dd + 1] * inv_sum * v_scale);
    }
  }
}

// ---------------------------------------------------------------------------------------
// The kernel.

template <typename T>
__global__ void __launch_bounds__(DecodeTmaTraits::kThreads, 1)
    DecodeTmaKernel(const __grid_constant__ PagedKernelParams p,
                    const __grid_constant__ CUtensorMap k_map,
                    const __grid_constant__ CUtensorMap v_map,
                    const __grid_constant__ DecodeTmaArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Traits = DecodeTmaTraits;
  constexpr int kHeads = Traits::kHeads;
  constexpr int kD = Traits::kD;
  constexpr int kRing = Traits::kRing;
  constexpr int kSlotBytes = Traits::kSlotBytes;
  constexpr int kDSteps = kD / 16;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kNegInf = -INFINITY;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* const smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  uint8_t* const q_smem = smem + Traits::kQOffset;
  uint64_t* const full = reinterpret_cast<uint64_t*>(smem + Traits::kBarrierOffset);
  uint64_t* const empty = full + kRing;
  const uint32_t ring_base = SmemAddress(smem);

  cuda::AllowDependentLaunch();  // the merge kernel waits for this grid's end itself
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int kv_group = static_cast<int>(blockIdx.x);
  const int seq = static_cast<int>(blockIdx.y);
  const int split = static_cast<int>(blockIdx.z);
  const SequenceBounds bounds = LoadSequenceBounds(p, seq);
  if (bounds.query_len <= 0) return;  // no query: nothing to write (the whole CTA leaves)
  const int seq_len = bounds.seq_len;

  // The visible keys [kv_begin, seq_len) in whole blocks [first_block, end_block); this
  // split's share [b_begin, b_end).
  const int kv_begin = p.sliding_window > 0 ? max(0, seq_len - p.sliding_window) : 0;
  const int first_block = kv_begin / Traits::kBlockTokens;
  const int end_block = (seq_len + Traits::kBlockTokens - 1) / Traits::kBlockTokens;
  const int per_split = (end_block - first_block + a.num_splits - 1) / a.num_splits;
  const int b_begin = min(end_block, first_block + split * per_split);
  const int b_end = min(end_block, b_begin + per_split);
  const int num_blocks = b_end - b_begin;

  if (tid == 0) {
    for (int i = 0; i < kRing; ++i) {
      BarrierInit(SmemAddress(full + i), 1);
      BarrierInit(SmemAddress(empty + i), kHeads);
    }
    tma_ptx::FenceBarrierInit();
  }
  __syncthreads();

  if (warp == kHeads) {
    // ---- Producer. Lane i holds the id of block b0 + i of the current 32; the next 32
    // are loaded while these are copied.
    const int32_t* const ids =
        p.block_table + static_cast<int64_t>(seq) * p.block_table_stride + b_begin;
    uint64_t policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    int next = lane < num_blocks ? ids[lane] : 0;
    for (int b0 = 0; b0 < num_blocks; b0 += 32) {
      const int mine = next;
      if (b0 + 32 + lane < num_blocks) next = ids[b0 + 32 + lane];
      const int count = min(32, num_blocks - b0);
      for (int i = 0; i < count; ++i) {
        const int block = __shfl_sync(0xffffffffu, mine, i);
KVSTREAM_CUDA_UNROLL
        for (int kv = 0; kv < 2; ++kv) {
          const int h = 2 * (b0 + i) + kv;  // K of block b0 + i, then its V
          const int slot = h % kRing;
          // The slot's previous use (h - kRing) has been read by every compute warp; the
          // first round waits on the phase before the barrier's first, which has completed.
          BarrierWait(SmemAddress(empty + slot), ((h / kRing) & 1) ^ 1);
          if (lane == 0) {
            const uint32_t bar = SmemAddress(full + slot);
            BarrierArriveExpect(bar, kSlotBytes);
            TmaLoad5(ring_base + slot * kSlotBytes, kv == 0 ? &k_map : &v_map, bar, 0, 0, 0,
                     kv_group * kHeads, block, policy);
          }
        }
      }
    }
    return;
  }

  // ---- Compute warp: KV head kv_head, query heads first_head + m for m < group_size.
  const int kv_head = kv_group * kHeads + warp;
  const int first_head = kv_head * a.group_size;
  {
    // Q rows 0..group_size-1 of this warp's 8-row tile, the rest zero. Element loads (any
    // alignment), all issued before the first store: the stores go through a generic
    // pointer that could alias q, so interleaved they would wait for one load at a time.
    constexpr int kPerLane = 8 * kD / 32;  // element i = lane + 32 k: row k / 4
    const T* const q = static_cast<const T*>(p.q) +
                       static_cast<int64_t>(bounds.q_start) * p.q_token_stride +
                       static_cast<int64_t>(first_head) * p.q_head_stride;
    uint8_t* const q_warp = q_smem + warp * 8 * kD * 2;
    T values[kPerLane];
KVSTREAM_CUDA_UNROLL
    for (int k = 0; k < kPerLane; ++k) {
      const int m = k / (kD / 32);
      const int d = lane + 32 * (k % (kD / 32));
      values[k] = m < a.group_size ? q[static_cast<int64_t>(m) * p.q_head_stride + d]
                                   : FromFloat<T>(0.0f);
    }
KVSTREAM_CUDA_UNROLL
    for (int k = 0; k < kPerLane; ++k) {
      const int m = k / (kD / 32);
      const int d = lane + 32 * (k % (kD / 32));
      *reinterpret_cast<T*>(q_warp + SwizzledChunk<kD>(m, d >> 3) + (d & 7) * 2) = values[k];
    }
    __syncwarp();
  }
  // Q^T fragments (B operand, d x heads): rows lane % 8, chunks 2 kk + lane / 8 (two k16
  // steps per ldmatrix.x4).
  uint32_t q_frag[kDSteps][2];
  {
    const uint32_t q_lane = SmemAddress(q_smem + warp * 8 * kD * 2) + (lane & 7) * kD * 2;
KVSTREAM_CUDA_UNROLL
    for (int kk = 0; kk < kDSteps; kk += 2) {
      uint32_t r[4];
      LdMatrixX4(r, q_lane + static_cast<uint32_t>(((2 * kk + (lane >> 3)) ^ (lane & 7)) << 4));
      q_frag[kk][0] = r[0];
      q_frag[kk][1] = r[1];
      q_frag[kk + 1][0] = r[2];
      q_frag[kk + 1][1] = r[3];
    }
  }

  // g = lane / 4: keys g and g + 8 of the block (S^T elements {0, 1} and {2, 3}); heads
  // 2 t and 2 t + 1 (t = lane % 4; elements e % 2); in the O^T accumulators d = 16 dd + g
  // (+ 8) of the same heads.
  const int g = lane >> 2;
  const int quad_col = 2 * (lane & 3);
  const float k_scale = p.k_scale[p.num_scales == 1 ? 0 : kv_head];
  const float v_scale = p.v_scale[p.num_scales == 1 ? 0 : kv_head];
  const ScoreParams score_params = MakeScoreParams(p, k_scale, seq_len - 1);
  // One n8 block of heads: the [1] dimension is decode_softmax.cuh's nt.
  float head_slope2[1][2];
  float head_max[1][2];
  float head_sum[1][2];
  float acc_o[kDSteps][1][4];
KVSTREAM_CUDA_UNROLL
  for (int j = 0; j < 2; ++j) {
    const int m = quad_col + j;
    head_slope2[0][j] = score_params.alibi && m < a.group_size
                            ? p.alibi_slopes[first_head + m] * kLog2e
                            : 0.0f;
    head_max[0][j] = kNegInf;
    head_sum[0][j] = 0.0f;
  }
KVSTREAM_CUDA_UNROLL
  for (int dd = 0; dd < kDSteps; ++dd) {
KVSTREAM_CUDA_UNROLL
    for (int e = 0; e < 4; ++e) acc_o[dd][0][e] = 0.0f;
  }

  // ldmatrix addresses in this warp's [2][16][64] region of a slot (a column half is a
  // 2 KiB [16][64] piece; chunk c of token r sits at r * 128 + ((c % 8) ^ (r % 8)) * 16):
  //   K (A operand, keys x d): token lane % 16, chunk 2 kk + lane / 16.
  //   V (A operand V^T via ldmatrix.trans): token lane % 8 + 8 (lane / 16), chunk 2 dd +
  //   (lane / 8) % 2.
  const uint32_t swz_k = static_cast<uint32_t>(((lane & 7) ^ (lane >> 4)) << 4);
  const uint32_t swz_v = static_cast<uint32_t>(((lane & 7) ^ ((lane >> 3) & 1)) << 4);
  const uint32_t head_off = static_cast<uint32_t>(warp * Traits::kHeadBytes);
  const uint32_t k_lane_off = head_off + static_cast<uint32_t>((lane & 15) * 128);
  const uint32_t v_lane_off =
      head_off + static_cast<uint32_t>(((lane & 7) + ((lane >> 4) << 3)) * 128);

  // The in-kernel merge's early look at this warp's arrival counter (LastSplitToArrive).
  uint32_t* const counter =
      a.arrivals != nullptr ? a.arrivals + static_cast<int64_t>(seq) * p.num_kv_heads + kv_head
                            : nullptr;
  const int peek_at = counter != nullptr ? max(0, num_blocks - Traits::kPeekBlocks) : -1;
  uint32_t peeked = kNotPeeked;

  for (int b = 0; b < num_blocks; ++b) {
    if (b == peek_at && lane == 0) peeked = LoadRelaxed(counter);
    const int hk = 2 * b;
    const int hv = hk + 1;
    const int slot_k = hk % kRing;
    const int slot_v = hv % kRing;
    const int key_base = (b_begin + b) * Traits::kBlockTokens;
    // Keys of this block outside [kv_begin, seq_len): only in a split's first or last block.
    const bool partial = key_base < kv_begin || key_base + Traits::kBlockTokens > seq_len;

    // S^T = K Q^T for the block's 16 keys, even and odd k16 steps in two chains.
    BarrierWait(SmemAddress(full + slot_k), (hk / kRing) & 1);
    const uint32_t k_base = ring_base + slot_k * kSlotBytes + k_lane_off;
    float acc_s[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
    float acc_s_odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
KVSTREAM_CUDA_UNROLL
    for (int k0 = 0; k0 < kDSteps; k0 += 4) {
      uint32_t ka[4][4];
KVSTREAM_CUDA_UNROLL
      for (int i = 0; i < 4; ++i) {
        const int kk = k0 + i;
        LdMatrixX4(ka[i], k_base + (kk >> 2) * 2048 + (swz_k ^ ((kk & 3) << 5)));
      }
KVSTREAM_CUDA_UNROLL
      for (int i = 0; i < 4; ++i) {
        const int kk = k0 + i;
        Mma16816<T>((kk & 1) != 0 ? acc_s_odd : acc_s[0], ka[i], q_frag[kk][0], q_frag[kk][1]);
      }
    }
    __syncwarp();
    if (lane == 0) BarrierArrive(SmemAddress(empty + slot_k));

    // Logits in base 2 (soft cap, ALiBi, the mask), then the online softmax
    // (decode_softmax.cuh).
KVSTREAM_CUDA_UNROLL
    for (int e = 0; e < 4; ++e) acc_s[0][e] += acc_s_odd[e];
    ToBase2Logits<1>(acc_s, score_params, head_slope2, key_base + g, kv_begin, seq_len);
    OnlineSoftmaxStep<1, kDSteps>(acc_s, head_max, head_sum, acc_o);
    const uint32_t pb0 = MovMatrixTrans(PackPair<T>(acc_s[0][0], acc_s[0][1]));
    const uint32_t pb1 = MovMatrixTrans(PackPair<T>(acc_s[0][2], acc_s[0][3]));

    // O^T += V^T P^T.
    BarrierWait(SmemAddress(full + slot_v), (hv / kRing) & 1);
    if (partial) {
      // Zero this head's V rows of masked keys (P is 0 there, V may be anything); then
      // order these writes before the slot's next TMA fill (another proxy).
      uint8_t* const v_head = smem + slot_v * kSlotBytes + warp * Traits::kHeadBytes;
      for (int i = lane; i < 2 * Traits::kBlockTokens * 8; i += 32) {
        const int half = i >> 7;
        const int r = (i >> 3) & 15;
        const int key = key_base + r;
        if (key < kv_begin || key >= seq_len) {
          *reinterpret_cast<uint4*>(v_head + half * 2048 + r * 128 + (i & 7) * 16) =
              make_uint4(0u, 0u, 0u, 0u);
        }
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncwarp();
    }
    const uint32_t v_base = ring_base + slot_v * kSlotBytes + v_lane_off;
KVSTREAM_CUDA_UNROLL
    for (int d0 = 0; d0 < kDSteps; d0 += 4) {
      uint32_t va[4][4];
KVSTREAM_CUDA_UNROLL
      for (int i = 0; i < 4; ++i) {
        const int dd = d0 + i;
        LdMatrixX4Trans(va[i], v_base + (dd >> 2) * 2048 + (swz_v ^ ((dd & 3) << 5)));
      }
KVSTREAM_CUDA_UNROLL
      for (int i = 0; i < 4; ++i) Mma16816<T>(acc_o[d0 + i][0], va[i], pb0, pb1);
    }
    __syncwarp();
    if (lane == 0) BarrierArrive(SmemAddress(empty + slot_v));
  }

  // ---- Output: heads quad_col + j of this warp that exist.
  float head_total[2];  // the split's softmax denominators (sums over the warp's lanes)
KVSTREAM_CUDA_UNROLL
  for (int j = 0; j < 2; ++j) {
    float sum = head_sum[0][j];
    sum += __shfl_xor_sync(0xffffffffu, sum, 4);
    sum += __shfl_xor_sync(0xffffffffu, sum, 8);
    sum += __shfl_xor_sync(0xffffffffu, sum, 16);
    head_total[j] = sum;
  }
  T* const out = static_cast<T*>(p.out);
  auto out_row = [&](int h) {
    return out + static_cast<int64_t>(bounds.q_start) * p.o_token_stride +
           static_cast<int64_t>(h) * p.o_head_stride;
  };
  if (a.num_splits == 1) {
KVSTREAM_CUDA_UNROLL
    for (int j = 0; j < 2; ++j) {
      const int m = quad_col + j;
      if (m >= a.group_size) continue;
      const float sum = head_total[j];
      const float f = sum > 0.0f ? v_scale / sum : 0.0f;
      T* const row = out_row(first_head + m);
KVSTREAM_CUDA_UNROLL
      for (int dd = 0; dd < kDSteps; ++dd) {
        row[16 * dd + g] = FromFloat<T>(acc_o[dd][0][j] * f);
        row[16 * dd + g + 8] = FromFloat<T>(acc_o[dd][0][j + 2] * f);
      }
    }
    return;
  }
  // Split: slot (seq, head, split) of decode_attention.cuh's partial layout.
  const int64_t head_slot0 = static_cast<int64_t>(seq) * p.num_heads + first_head;
  auto write_partial = [&] {
KVSTREAM_CUDA_UNROLL
    for (int j = 0; j < 2; ++j) {
      const int m = quad_col + j;
      if (m >= a.group_size) continue;
      const int64_t slot = (head_slot0 + m) * a.num_splits + split;
      float* const row = a.partial_out + slot * kD;
KVSTREAM_CUDA_UNROLL
      for (int dd = 0; dd < kDSteps; ++dd) {
        row[16 * dd + g] = acc_o[dd][0][j];
        row[16 * dd + g + 8] = acc_o[dd][0][j + 2];
      }
      if (g == 0) {
        a.partial_ml[slot * 2] = head_max[0][j];
        a.partial_ml[slot * 2 + 1] = head_total[j];
      }
    }
  };
  if (a.arrivals == nullptr) {
    write_partial();  // DecodeMergeKernel combines the splits
    return;
  }
  if (!LastSplitToArrive(counter, a.num_splits, lane, peeked, write_partial)) return;
  MergeSplits<Traits, T>(p, a, head_slot0, first_head, split, g, quad_col, v_scale, head_max,
                         head_total, acc_o, bounds.q_start);
#else
  __trap();  // launched only on compute capability 9.0 and newer (DecodeTmaApplies)
#endif
}

}  // namespace decode_tma
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_DECODE_TMA_ATTENTION_CUH_
