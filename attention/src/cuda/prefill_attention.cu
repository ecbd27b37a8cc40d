// LaunchPrefillAttention: checks the limits of the prefill kernel (prefill_attention.cuh),
// chooses how key/value tiles are loaded from the alignment of the cache, and launches one
// of ten instantiations (padded head size 64 / 128 / 256 x float16 / bfloat16 queries for
// the baseline variant, 64 / 128 x float16 / bfloat16 for the fast one), or hands the call
// to the Hopper kernel (prefill_wgmma.cu) where the options allow it and it applies.
// Everything else (causal, window, ALiBi, soft cap, head sizes, GQA, the cache dtype and its
// layout) is a runtime value, so that the CUDA build stays small.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cuda/kernel_params.h"
#include "cuda/launchers.h"
#include "cuda/prefill_attention.cuh"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/dtype.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {
namespace {

absl::Status Unsupported(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("cuda prefill attention: ", what));
}

template <int D, typename T, int Variant>
absl::Status LaunchTyped(const PagedKernelParams& params, const cuda::PrefillOptions& options,
                         cudaStream_t stream) {
  using Traits = cuda::PrefillTraits<D, Variant>;
  const bool fp8_async = options.load_mode == cuda::kPrefillAsyncFp8;
  const int smem = Traits::SmemBytes(fp8_async);
  auto* kernel = &cuda::PrefillAttentionKernel<D, T, Variant>;
  // The largest of both modes, so that one change of the attribute serves every launch.
  const int max_smem = std::max(Traits::SmemBytes(true), Traits::SmemBytes(false));
  RETURN_IF_ERROR(AllowDynamicSharedMemory(reinterpret_cast<const void*>(kernel), max_smem,
                                           /*max_carveout=*/false,
                                           absl::StrCat("prefill attention (head dim ", D, ")")));
  const dim3 grid(static_cast<unsigned>(params.num_kv_heads * options.num_m_tiles),
                  static_cast<unsigned>(params.num_seqs));
  kernel<<<grid, Traits::kThreads, smem, stream>>>(params, options);
  return CudaErrorToStatus(cudaGetLastError(),
                           absl::StrCat("prefill attention launch (head dim ", D,
                                        Variant == cuda::kPrefillFast ? ", fast" : "", ")"));
}

template <int D>
absl::Status LaunchForDim(const PagedKernelParams& params, DType q_dtype,
                          const cuda::PrefillOptions& options, bool fast, cudaStream_t stream) {
  if constexpr (D <= 128) {
    if (fast) {
      if (q_dtype == DType::kBFloat16) {
        return LaunchTyped<D, __nv_bfloat16, cuda::kPrefillFast>(params, options, stream);
      }
      return LaunchTyped<D, __half, cuda::kPrefillFast>(params, options, stream);
    }
  }
  if (q_dtype == DType::kBFloat16) {
    return LaunchTyped<D, __nv_bfloat16, cuda::kPrefillBaseline>(params, options, stream);
  }
  return LaunchTyped<D, __half, cuda::kPrefillBaseline>(params, options, stream);
}

}  // namespace

bool PrefillFastVariantApplies(const PagedKernelParams& params, DType q_dtype,
                               DType cache_dtype) {
  if ((q_dtype != DType::kFloat16 && q_dtype != DType::kBFloat16) || cache_dtype != q_dtype ||
      params.head_size <= 0 || params.head_size_v <= 0 || params.head_size > 256 ||
      params.head_size_v > 256 || params.num_kv_heads <= 0) {
    return false;
  }
  return cuda::PrefillFastApplies(params, cuda::ChoosePrefillOptions(params, cache_dtype));
}

absl::Status LaunchPrefillAttention(const PagedKernelParams& params, DType q_dtype,
                                    DType out_dtype, DType cache_dtype, cudaStream_t stream) {
  return LaunchPrefillAttention(params, q_dtype, out_dtype, cache_dtype, PrefillLaunchOptions{},
                                stream);
}

absl::Status LaunchPrefillAttention(const PagedKernelParams& params, DType q_dtype,
                                    DType out_dtype, DType cache_dtype,
                                    const PrefillLaunchOptions& launch_options,
                                    cudaStream_t stream) {
  if (q_dtype != DType::kFloat16 && q_dtype != DType::kBFloat16) {
    return Unsupported(
        absl::StrCat("q dtype must be float16 or bfloat16, got ", DTypeName(q_dtype)));
  }
  if (out_dtype != q_dtype) {
    return Unsupported(absl::StrCat("out dtype must equal q dtype ", DTypeName(q_dtype),
                                    ", got ", DTypeName(out_dtype)));
  }
  if (cache_dtype != q_dtype && !IsFp8(cache_dtype)) {
    return Unsupported(absl::StrCat("cache dtype must be ", DTypeName(q_dtype),
                                    " (as q) or fp8_e4m3 / fp8_e5m2, got ",
                                    DTypeName(cache_dtype)));
  }
  if (params.head_size <= 0 || params.head_size > 256 || params.head_size_v <= 0 ||
      params.head_size_v > 256) {
    return Unsupported(absl::StrCat("head sizes up to 256 are supported, got head_size=",
                                    params.head_size, " head_size_v=", params.head_size_v));
  }
  if (params.num_kv_heads <= 0 || params.num_heads % params.num_kv_heads != 0) {
    return Unsupported(absl::StrCat("num_heads ", params.num_heads,
                                    " is not a multiple of num_kv_heads ", params.num_kv_heads));
  }
  if (params.num_seqs <= 0 || params.max_query_len <= 0) return absl::OkStatus();  // no rows
  if (params.num_seqs > 65535) {
    return Unsupported(absl::StrCat("at most 65535 sequences per call, got ", params.num_seqs));
  }
  const int64_t group = params.num_heads / params.num_kv_heads;
  const int64_t rows = static_cast<int64_t>(params.max_query_len) * group;
  constexpr int kBlockM = cuda::PrefillTraits<128>::kBlockM;
  const int64_t m_tiles = (rows + kBlockM - 1) / kBlockM;
  if (rows + kBlockM > std::numeric_limits<int32_t>::max() ||
      m_tiles * params.num_kv_heads > std::numeric_limits<int32_t>::max()) {
    return Unsupported(absl::StrCat("max_query_len ", params.max_query_len, " x ", group,
                                    " heads per KV head is too many rows"));
  }

  if (launch_options.variant == PrefillVariant::kWgmma ||
      (launch_options.variant == PrefillVariant::kAuto && launch_options.wgmma)) {
    std::string why;
    const bool applies =
        launch_options.wgmma &&
        PrefillWgmmaApplies(params, q_dtype, out_dtype, cache_dtype, &why);
    if (applies) {
      return LaunchPrefillWgmma(params, q_dtype, cache_dtype, launch_options, stream);
    }
    if (launch_options.variant == PrefillVariant::kWgmma) {
      return Unsupported(absl::StrCat(
          "the wgmma kernel does not apply: ",
          launch_options.wgmma ? why : "the device is not compute capability 9.0 or the build "
                                       "has no sm_90a code"));
    }
  }
  const cuda::PrefillOptions options = cuda::ChoosePrefillOptions(params, cache_dtype);
  const bool fast_applies = cuda::PrefillFastApplies(params, options);
  if (launch_options.variant == PrefillVariant::kFast && !fast_applies) {
    return Unsupported(absl::StrCat(
        "the fast variant needs a 16-bit cache with 16-byte aligned rows and head_size == "
        "head_size_v == 64 or 128; got cache ",
        DTypeName(cache_dtype), " head_size=", params.head_size,
        " head_size_v=", params.head_size_v));
  }
  // kAuto runs the fast variant wherever it applies (see PrefillVariant in launchers.h).
  const bool fast = fast_applies && (launch_options.variant == PrefillVariant::kAuto ||
                                     launch_options.variant == PrefillVariant::kFast);
  const int padded = PaddedHeadDim(params.head_size, params.head_size_v);
  switch (padded) {
    case 64: return LaunchForDim<64>(params, q_dtype, options, fast, stream);
    case 128: return LaunchForDim<128>(params, q_dtype, options, fast, stream);
    default: return LaunchForDim<256>(params, q_dtype, options, false, stream);
  }
}

}  // namespace internal
}  // namespace kvstream
