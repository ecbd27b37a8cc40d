// The TMA decode kernel's launcher half (decode_tc_launch.h): what the kernel takes
// (DecodeTmaApplies), its split count, the K and V caches' tensor maps and the launch of
// its split kernel (decode_tma_attention.cuh). The merge kernel it shares with the other
// decode kernels is launched by decode_attention.cu.
//
// Split count. One CTA per SM (the kernel's ring takes 136 KiB of shared memory). The CTAs
// of one split, num_seqs * num_kv_heads / 4, are split as the other kernels' are
// (ChooseDecodeSplits: two full waves first where the sequences' lengths differ), but into
// the fewest parts whose last wave is at least 94% full, not 80%: 64 x 4096 keys with 8 KV
// heads run unsplit as 128 CTAs on 132 SMs, 16 x 32768 as 4 splits, 8 x 4096 as 8. A
// missing CTA here is a missing SM's worth of reads: on the H200 the TMA reads of 116 CTAs,
// one per SM, ran at 0.966 of a streaming read, of 124 at 0.985-0.997 and of 128 at 1.0
// (and 8 x 4096 at 7 splits, 112 CTAs, 3% slower than at 8).
//
// Tensor maps: tensor_map.h, encoded per launch.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cuda/decode_tc_launch.h"
#include "cuda/decode_tma_attention.cuh"
#include "cuda/kernel_params.h"
#include "cuda/launchers.h"
#include "cuda/tensor_map.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/dtype.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {
namespace {

namespace tma = decode_tma;
using Traits = tma::DecodeTmaTraits;
static_assert(Traits::kMaxMergeSplits == kDecodeTmaInKernelMergeSplits,
              "one limit for the launcher and the kernel");
constexpr double kTmaMinLastWaveFill = 0.94;

absl::Status Error(absl::string_view what) {
  return absl::InternalError(absl::StrCat("cuda decode attention (TMA): ", what));
}

// The tensor map of one cache: boxes of one block's 16 tokens x 128 elements for
// Traits::kHeads heads.
absl::StatusOr<CUtensorMap> EncodeCacheMap(const PagedKernelParams& p, const void* cache,
                                           int64_t block_stride, int64_t token_stride,
                                           int64_t head_stride, DType dtype) {
  CacheMapShape shape{};
  shape.block_size = Traits::kBlockTokens;
  shape.halves = 2;
  shape.num_kv_heads = p.num_kv_heads;
  shape.num_blocks = p.num_blocks;
  shape.block_stride = block_stride;
  shape.token_stride = token_stride;
  shape.head_stride = head_stride;
  shape.box_tokens = Traits::kBlockTokens;
  shape.box_halves = 2;
  shape.box_heads = Traits::kHeads;
  return EncodeCacheTensorMap(cache, dtype, shape, "cuda decode attention (TMA)");
}

using TmaKernel = void (*)(PagedKernelParams, CUtensorMap, CUtensorMap, tma::DecodeTmaArgs);

TmaKernel PickKernel(DType q_dtype) {
  return q_dtype == DType::kBFloat16 ? &tma::DecodeTmaKernel<__nv_bfloat16>
                                     : &tma::DecodeTmaKernel<__half>;
}

}  // namespace

bool DecodeTmaApplies(const PagedKernelParams& p, DType q_dtype, DType out_dtype,
                      DType cache_dtype, std::string* why) {
  auto no = [&](std::string reason) {
    if (why != nullptr) *why = std::move(reason);
    return false;
  };
  std::string tc_why;
  if (!DecodeTensorCoresApply(p, q_dtype, out_dtype, cache_dtype, &tc_why)) return no(tc_why);
  if (cache_dtype != q_dtype) return no("the cache is fp8");
  if (p.head_size != Traits::kD || p.head_size_v != Traits::kD) {
    return no(absl::StrCat("head sizes ", p.head_size, "/", p.head_size_v, " are not 128/128"));
  }
  if (p.block_size != Traits::kBlockTokens) {
    return no(absl::StrCat("block size ", p.block_size, " is not 16"));
  }
  if (p.num_kv_heads % Traits::kHeads != 0) {
    return no(absl::StrCat("num_kv_heads ", p.num_kv_heads, " is not a multiple of ",
                           Traits::kHeads));
  }
  if (p.num_heads / p.num_kv_heads > 8) return no("more than 8 query heads per KV head");
  if (p.num_blocks < 1 || p.num_blocks > INT32_MAX) return no("block count out of range");
  constexpr int64_t kMaxStride = int64_t{1} << 39;  // tensor-map strides < 2^40 bytes
  for (int64_t s : {p.k_block_stride, p.k_token_stride, p.k_head_stride, p.v_block_stride,
                    p.v_token_stride, p.v_head_stride}) {
    if (s <= 0 || s >= kMaxStride) return no("a cache stride is out of a tensor map's range");
  }
  return true;
}

absl::StatusOr<DecodeTcPlan> PlanDecodeTma(const PagedKernelParams& p,
                                           const DecodeLaunchOptions& options) {
  if (options.num_sms <= 0 || options.num_splits < 0 || options.num_splits > kMaxDecodeSplits) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda decode attention (TMA): bad num_sms ", options.num_sms,
                     " or num_splits ", options.num_splits));
  }
  const int64_t base_ctas = int64_t{p.num_seqs} * (p.num_kv_heads / Traits::kHeads);
  const int64_t splits =
      options.num_splits > 0
          ? options.num_splits
          : ChooseDecodeSplits(base_ctas, options.num_sms, DecodeSplitLimit(p),
                               DecodeMinFullWaves(p), kTmaMinLastWaveFill);
  return DecodeSplitPlan(p, static_cast<int>(splits));
}

absl::StatusOr<DecodeTmaMaps> PrepareDecodeTma(const PagedKernelParams& p, DType q_dtype) {
  DecodeTmaMaps maps;
  ASSIGN_OR_RETURN(maps.k, EncodeCacheMap(p, p.k_cache, p.k_block_stride, p.k_token_stride,
                                          p.k_head_stride, q_dtype));
  ASSIGN_OR_RETURN(maps.v, EncodeCacheMap(p, p.v_cache, p.v_block_stride, p.v_token_stride,
                                          p.v_head_stride, q_dtype));
  RETURN_IF_ERROR(AllowDynamicSharedMemory(reinterpret_cast<const void*>(PickKernel(q_dtype)),
                                           Traits::kSmemBytes, /*max_carveout=*/true,
                                           "cuda decode attention (TMA)"));
  return maps;
}

absl::Status LaunchDecodeTmaSplit(const PagedKernelParams& p, DType q_dtype,
                                  const DecodeTmaMaps& maps, const DecodeTcPlan& plan,
                                  float* partial_out, float* partial_ml, uint32_t* arrivals,
                                  cudaStream_t stream) {
  if (arrivals != nullptr &&
      (plan.num_splits < 2 || plan.num_splits > kDecodeTmaInKernelMergeSplits)) {
    return Error(absl::StrCat("arrival counters given for ", plan.num_splits, " splits"));
  }
  tma::DecodeTmaArgs args{};
  args.arrivals = arrivals;
  args.group_size = p.num_heads / p.num_kv_heads;
  args.num_splits = plan.num_splits;
  args.partial_out = partial_out;
  args.partial_ml = partial_ml;
  const dim3 grid(static_cast<unsigned>(p.num_kv_heads / Traits::kHeads),
                  static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(plan.num_splits));
  PickKernel(q_dtype)<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(p, maps.k, maps.v,
                                                                             args);
  return CudaErrorToStatus(static_cast<int>(cudaGetLastError()),
                           "cuda decode attention (TMA): split kernel launch");
}

}  // namespace internal
}  // namespace kvstream
