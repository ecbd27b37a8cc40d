// The softmax step both tensor-core decode kernels take per 16 keys of a warp
// (decode_tc_attention.cuh, decode_tma_attention.cuh): raw scores q.k to base-2 logits (scale,
// soft cap, ALiBi, mask), then the online softmax with a running max that may trail.
//
// Fragment layout (S^T = K Q^T, m16n8k16): in n8 block nt a thread (g = lane / 4, t = lane
// % 4) holds keys key0 and key0 + 8 (elements {0, 1} and {2, 3}) of heads 8 nt + 2 t and
// + 1 (elements e % 2); in the O^T accumulators acc_o[dd][nt], d = 16 dd + g (+ 8) of the
// same heads. Per-head values (slope, max, sum) are kept as [nt][e % 2].
//
// Header-only; included by the kernels' headers, also in the warp-emulator host build
// (KVSTREAM_CUDA_EMULATION), which provides the shuffles and FastExp2.
#ifndef KVSTREAM_ATTENTION_CUDA_DECODE_SOFTMAX_CUH_
#define KVSTREAM_ATTENTION_CUDA_DECODE_SOFTMAX_CUH_

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/kernel_params.h"
#include "cuda/mma_ptx.cuh"

namespace kvstream {
namespace internal {
namespace decode_tc {

// How raw scores become base-2 logits: s2 = scale2 * qk, or cap2 * tanh(qk * inv_cap) with
// a soft cap; plus slope2 * (key - q_pos) with ALiBi.
struct ScoreParams {
  float scale2;
  float cap2;
  float inv_cap;
  bool soft_cap;
  bool alibi;
  int q_pos;
};

__device__ __forceinline__ ScoreParams MakeScoreParams(const PagedKernelParams& p,
                                                       float k_scale, int q_pos) {
  constexpr float kLog2e = 1.4426950408889634f;
  ScoreParams sp;
  sp.soft_cap = p.logits_soft_cap > 0.0f;
  sp.alibi = p.alibi_slopes != nullptr;
  sp.scale2 = p.scale * k_scale * kLog2e;
  sp.cap2 = sp.soft_cap ? p.logits_soft_cap * kLog2e : 0.0f;
  sp.inv_cap = sp.soft_cap ? p.scale * k_scale / p.logits_soft_cap : 0.0f;
  sp.q_pos = q_pos;
  return sp;
}

// s (raw q.k) -> base-2 logits in place; keys outside [key_lo, key_hi) get -inf.
template <int kNT>
__device__ __forceinline__ void ToBase2Logits(float (&s)[kNT][4], const ScoreParams& sp,
                                              const float (&slope2)[kNT][2], int key0,
                                              int key_lo, int key_hi) {
  constexpr float kLog2e = 1.4426950408889634f;
KVSTREAM_CUDA_UNROLL
  for (int nt = 0; nt < kNT; ++nt) {
KVSTREAM_CUDA_UNROLL
    for (int e = 0; e < 4; ++e) {
      float x = s[nt][e];
      if (sp.soft_cap) {
        // tanh(y) = 1 - 2 / (exp(2y) + 1): exact limits at +-inf, absolute error ~1e-7.
        const float y = x * sp.inv_cap;
        x = sp.cap2 * (1.0f - __fdividef(2.0f, ptx::FastExp2(y * (2.0f * kLog2e)) + 1.0f));
      } else {
        x *= sp.scale2;
      }
      const int key = key0 + 8 * (e >> 1);
      // slope * (key - q_pos), with key - q_pos formed exactly in integers.
      if (sp.alibi) x += slope2[nt][e & 1] * static_cast<float>(key - sp.q_pos);
      s[nt][e] = key >= key_lo && key < key_hi ? x : -INFINITY;
    }
  }
}

// The online softmax over one warp's 16 keys: s (base-2 logits) becomes P, head_sum (a
// per-thread partial sum) and head_max move, acc_o is rescaled where a max moved. A head's
// 16 keys are spread over its thread's two elements and the 8 lanes of equal t. The
// running max may trail the logits by up to kMaxLag: while no logit of the warp's 16 keys
// exceeds its head's max by more, the max stays as it is, with no shuffles and no rescale,
// and P stays at most 2^kMaxLag (far inside bf16's and fp16's range; the sums are fp32,
// and the merges take any consistent (max, sum, O)). Otherwise the max moves to the
// keys', and the output accumulators are rescaled when some head of the warp needs it.
template <int kNT, int kDSteps>
__device__ __forceinline__ void OnlineSoftmaxStep(float (&s)[kNT][4], float (&head_max)[kNT][2],
                                                  float (&head_sum)[kNT][2],
                                                  float (&acc_o)[kDSteps][kNT][4]) {
  constexpr float kMaxLag = 8.0f;
  constexpr float kNegInf = -INFINITY;
  bool over = false;
KVSTREAM_CUDA_UNROLL
  for (int nt = 0; nt < kNT; ++nt) {
KVSTREAM_CUDA_UNROLL
    for (int j = 0; j < 2; ++j) {
      // A head with max -inf (no visible key yet) is over for any visible logit.
      over = over || fmaxf(s[nt][j], s[nt][j + 2]) > head_max[nt][j] + kMaxLag;
    }
  }
  if (__any_sync(0xffffffffu, over)) {
    float alpha[kNT][2];
    bool moved = false;
KVSTREAM_CUDA_UNROLL
    for (int nt = 0; nt < kNT; ++nt) {
KVSTREAM_CUDA_UNROLL
      for (int j = 0; j < 2; ++j) {
        float tile_max = fmaxf(s[nt][j], s[nt][j + 2]);
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 4));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 8));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 16));
        const float new_max = fmaxf(head_max[nt][j], tile_max);
        // A head with no visible key so far keeps max -inf; subtract 0 so that exp2 gives 0.
        const float use_max = new_max == kNegInf ? 0.0f : new_max;
        alpha[nt][j] = ptx::FastExp2(head_max[nt][j] - use_max);
        moved = moved || alpha[nt][j] != 1.0f;
        head_max[nt][j] = new_max;
        const float p0 = ptx::FastExp2(s[nt][j] - use_max);
        const float p1 = ptx::FastExp2(s[nt][j + 2] - use_max);
        s[nt][j] = p0;
        s[nt][j + 2] = p1;
        head_sum[nt][j] = head_sum[nt][j] * alpha[nt][j] + (p0 + p1);
      }
    }
    if (__any_sync(0xffffffffu, moved)) {
KVSTREAM_CUDA_UNROLL
      for (int dd = 0; dd < kDSteps; ++dd) {
KVSTREAM_CUDA_UNROLL
        for (int nt = 0; nt < kNT; ++nt) {
KVSTREAM_CUDA_UNROLL
          for (int e = 0; e < 4; ++e) acc_o[dd][nt][e] *= alpha[nt][e & 1];
        }
      }
    }
  } else {
KVSTREAM_CUDA_UNROLL
    for (int nt = 0; nt < kNT; ++nt) {
KVSTREAM_CUDA_UNROLL
      for (int j = 0; j < 2; ++j) {
        // Max -inf here means every logit of the head is -inf too: P = 0.
        const float use_max = head_max[nt][j] == kNegInf ? 0.0f : head_max[nt][j];
        const float p0 = ptx::FastExp2(s[nt][j] - use_max);
        const float p1 = ptx::FastExp2(s[nt][j + 2] - use_max);
        s[nt][j] = p0;
        s[nt][j + 2] = p1;
        head_sum[nt][j] += p0 + p1;
      }
    }
  }
}

}  // namespace decode_tc
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_DECODE_SOFTMAX_CUH_
