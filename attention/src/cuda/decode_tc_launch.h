// The tensor-core decode kernels' half of LaunchDecodeAttention (decode_tc_attention.cu,
// decode_tma_attention.cu): their plans (split count, workspace) and the launches of their
// split kernels. The merge kernel they share with the CUDA-core kernel is launched by
// decode_attention.cu. Private to the CUDA backend.
#ifndef KVSTREAM_ATTENTION_CUDA_DECODE_TC_LAUNCH_H_
#define KVSTREAM_ATTENTION_CUDA_DECODE_TC_LAUNCH_H_

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cuda/kernel_params.h"
#include "cuda/launchers.h"
#include "kvstream/common/dtype.h"

namespace kvstream {
namespace internal {

// Shared by both decode kernels (decode_attention.cu):
// The most splits a launch may take: kMaxDecodeSplits (the merge kernel's limit), and none
// shorter than 256 of the keys the longest sequence sees.
inline constexpr int kMaxDecodeSplits = 256;
int64_t DecodeSplitLimit(const PagedKernelParams& params);
// The full waves of CTAs a launch needs before the split choice looks at how full the
// last wave is: 0 when the sequences see about the same number of keys (CTAs of equal work
// finish together, so one mostly full wave is best), 2 otherwise or when that is unknown
// (total_visible_keys 0), so that short sequences' CTAs leave room for the long ones'.
int64_t DecodeMinFullWaves(const PagedKernelParams& params);
// The split count for `base_ctas` CTAs per split on a GPU that runs `slots` CTAs at once:
// at least `min_full_waves` full waves where the keys allow, at most `max_splits` (>= 1),
// the fewest whose last wave is at least `min_last_wave_fill` full (0.8 unless a kernel
// says otherwise).
inline constexpr double kDefaultMinLastWaveFill = 0.8;
int64_t ChooseDecodeSplits(int64_t base_ctas, int64_t slots, int64_t max_splits,
                           int64_t min_full_waves,
                           double min_last_wave_fill = kDefaultMinLastWaveFill);

struct DecodeTcPlan {
  int num_splits = 1;
  size_t workspace_bytes = 0;    // 0 when num_splits == 1
  size_t partial_out_bytes = 0;  // partial_ml follows at this offset
  // The tensor-core kernel's, resolved (never kAuto); kShared for 16-bit caches.
  DecodeFp8Staging fp8_staging = DecodeFp8Staging::kShared;
};
// The plan of `num_splits` splits, whichever kernel runs them: the workspace holds the
// partial outputs [num_seqs, num_heads, num_splits, head_size_v] floats (rounded up to 256
// bytes), then their (max, sum) pairs (decode_attention.cuh's layout); none for one split.
DecodeTcPlan DecodeSplitPlan(const PagedKernelParams& params, int num_splits);

// The split count, workspace and fp8 staging of the tensor-core kernel (options.num_sms,
// num_splits, fp8_staging; kAuto resolved to kInRegisters where that exists: an fp8 cache,
// padded head size 128, groups up to 8; else to kShared). REQUIRES:
// DecodeTensorCoresApply(params, ...) for some 16-bit q dtype, or it returns
// InvalidArgument; so does a kInRegisters where it does not exist (a cache that is not fp8,
// another padded head size than 128, groups above 8).
absl::StatusOr<DecodeTcPlan> PlanDecodeTc(const PagedKernelParams& params, DType cache_dtype,
                                          const DecodeLaunchOptions& options);

// Enqueues the tensor-core split kernel. `partial_out` / `partial_ml` point into the
// workspace when plan.num_splits > 1 (then the caller launches the merge kernel).
// REQUIRES: DecodeTensorCoresApply(params, q_dtype, q_dtype, cache_dtype).
absl::Status LaunchDecodeTcSplit(const PagedKernelParams& params, DType q_dtype,
                                 DType cache_dtype, const DecodeTcPlan& plan, float* partial_out,
                                 float* partial_ml, cudaStream_t stream);

// The TMA kernel (decode_tma_attention.cu): its split count and workspace (one CTA per SM);
// what its launch needs before anything is enqueued (the driver's tensor-map encoder, the
// caches' tensor maps, the kernel's shared memory: an error there means the kernel cannot
// run here, and kAuto takes the tensor-core kernel instead); and the launch of its split
// kernel, whose partial results are laid out as the others'.
// REQUIRES: DecodeTmaApplies(params, q_dtype, q_dtype, q_dtype) and a device of compute
// capability 9.0 or newer.
struct DecodeTmaMaps {
  CUtensorMap k;
  CUtensorMap v;
};
absl::StatusOr<DecodeTcPlan> PlanDecodeTma(const PagedKernelParams& params,
                                           const DecodeLaunchOptions& options);
absl::StatusOr<DecodeTmaMaps> PrepareDecodeTma(const PagedKernelParams& params, DType q_dtype);
// `arrivals`: null, or (2 <= plan.num_splits <= kDecodeTmaInKernelMergeSplits, else
// InternalError) zeroed counters, one per (sequence, KV head), with which the kernel merges
// the splits itself (DecodeLaunchOptions::arrival_counters).
inline constexpr int kDecodeTmaInKernelMergeSplits = 4;
absl::Status LaunchDecodeTmaSplit(const PagedKernelParams& params, DType q_dtype,
                                  const DecodeTmaMaps& maps, const DecodeTcPlan& plan,
                                  float* partial_out, float* partial_ml, uint32_t* arrivals,
                                  cudaStream_t stream);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_DECODE_TC_LAUNCH_H_
