// The tensor-core decode kernel's launcher half (decode_tc_launch.h): what the kernel
// takes (DecodeTensorCoresApply), its split count and the dispatch over padded head size
// (64 / 128 / 256) x n8 tiles of query heads (1 for groups up to 8, else 2) x activation
// type: twelve instantiations, which take fp8 caches too (converted while staging); plus,
// at padded head size 128 with one n8 tile, the fp8-only instantiation that converts K's
// and V's fragments in registers (DecodeFp8Staging::kInRegisters, one per activation
// type), which kAuto takes for fp8 caches there (launchers.h says by how much it is faster).
//
// Split count. As for the CUDA-core kernel (decode_attention.cu: DecodeSplitLimit,
// ChooseDecodeSplits, DecodeMinFullWaves), with the CTAs per SM the kernel is built for
// (3 / 4 / 2 for padded head sizes 64 / 128 / 256; 3 at 128 with two n8 tiles).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "kvstream/common/int_math.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cuda/decode_tc_attention.cuh"
#include "cuda/decode_tc_launch.h"
#include "cuda/kernel_params.h"
#include "cuda/launchers.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/dtype.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {
namespace {

namespace tc = decode_tc;



// n8 tiles of query heads per CTA for a group of `group` heads: 1 or 2.
int NTiles(int group) { return tc::DecodeTcHeadTileRows(group) / 8; }

template <int kNT>
int SmemBytesFor(int padded, bool fp8) {
  switch (padded) {
    case 64: return tc::DecodeTcTraits<64, kNT>::SmemBytes(fp8);
    case 128: return tc::DecodeTcTraits<128, kNT>::SmemBytes(fp8);
    default: return tc::DecodeTcTraits<256, kNT>::SmemBytes(fp8);
  }
}
int SmemBytes(int padded, int n_tiles, bool fp8) {
  return n_tiles == 1 ? SmemBytesFor<1>(padded, fp8) : SmemBytesFor<2>(padded, fp8);
}

template <int kNT>
int CtasPerSmFor(int padded) {
  switch (padded) {
    case 64: return tc::DecodeTcTraits<64, kNT>::kMinBlocksPerSm;
    case 128: return tc::DecodeTcTraits<128, kNT>::kMinBlocksPerSm;
    default: return tc::DecodeTcTraits<256, kNT>::kMinBlocksPerSm;
  }
}
int CtasPerSm(int padded, int n_tiles) {
  return n_tiles == 1 ? CtasPerSmFor<1>(padded) : CtasPerSmFor<2>(padded);
}

using TcKernel = void (*)(PagedKernelParams, tc::DecodeTcArgs);

// DecodeFp8Staging::kInRegisters: the fp8-only instantiation, built at padded head size
// 128 with one n8 tile only.
using InRegistersTraits = tc::DecodeTcTraits<128, 1, /*kFp8InRegisters=*/true>;
static_assert(InRegistersTraits::kMinBlocksPerSm == tc::DecodeTcTraits<128, 1>::kMinBlocksPerSm,
              "the split choice assumes the default's CTAs per SM for both stagings");
template <typename T>
TcKernel InRegistersKernel() {
  return &tc::DecodeTcKernel<128, 1, T, /*kFp8InRegisters=*/true>;
}

// Whether DecodeFp8Staging::kInRegisters is built for this shape.
bool InRegistersBuilt(DType cache_dtype, int padded, int n_tiles) {
  return IsFp8(cache_dtype) && padded == 128 && n_tiles == 1;
}

// `requested` for a cache of `cache_dtype` at padded head size `padded` with `group` query
// heads per KV head: kAuto becomes kInRegisters where that is built, else kShared; a
// kInRegisters that is not built is InvalidArgument.
absl::StatusOr<DecodeFp8Staging> ResolveFp8Staging(DecodeFp8Staging requested, DType cache_dtype,
                                                   int padded, int group) {
  const bool built = InRegistersBuilt(cache_dtype, padded, NTiles(group));
  switch (requested) {
    case DecodeFp8Staging::kAuto:
      return built ? DecodeFp8Staging::kInRegisters : DecodeFp8Staging::kShared;
    case DecodeFp8Staging::kShared: return DecodeFp8Staging::kShared;
    case DecodeFp8Staging::kInRegisters:
      if (!built) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cuda decode attention (tensor cores): the in-registers fp8 staging exists for fp8 "
            "caches at padded head size 128 with up to 8 query heads per KV head; got ",
            "cache dtype ", DTypeName(cache_dtype), ", padded head size ", padded, ", ", group,
            " query heads per KV head"));
      }
      return DecodeFp8Staging::kInRegisters;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "cuda decode attention (tensor cores): unknown fp8 staging ", static_cast<int>(requested)));
}

template <int kNT, typename T>
TcKernel PickKernelFor(int padded) {
  switch (padded) {
    case 64: return &tc::DecodeTcKernel<64, kNT, T>;
    case 128: return &tc::DecodeTcKernel<128, kNT, T>;
    default: return &tc::DecodeTcKernel<256, kNT, T>;
  }
}
template <typename T>
TcKernel PickKernel(int padded, int n_tiles) {
  return n_tiles == 1 ? PickKernelFor<1, T>(padded) : PickKernelFor<2, T>(padded);
}

}  // namespace

bool DecodeTensorCoresApply(const PagedKernelParams& p, DType q_dtype, DType out_dtype,
                            DType cache_dtype, std::string* why) {
  auto no = [&](std::string reason) {
    if (why != nullptr) *why = std::move(reason);
    return false;
  };
  if (q_dtype != DType::kFloat16 && q_dtype != DType::kBFloat16) {
    return no(absl::StrCat("q dtype ", DTypeName(q_dtype), " is not float16 or bfloat16"));
  }
  if (out_dtype != q_dtype) return no("out dtype differs from q dtype");
  const bool fp8 = IsFp8(cache_dtype);
  if (cache_dtype != q_dtype && !fp8) {
    return no(absl::StrCat("cache dtype ", DTypeName(cache_dtype), " is neither q's nor fp8"));
  }
  if (p.max_query_len > 1) return no("max_query_len > 1");
  if (p.head_size <= 0 || p.head_size_v <= 0 || p.head_size > 256 || p.head_size_v > 256) {
    return no("head sizes above 256");
  }
  const int64_t es = fp8 ? 1 : 2;
  if (!RowsAligned16(p.k_cache, es, p.head_size,
                     {p.k_block_stride, p.k_token_stride, p.k_head_stride}) ||
      !RowsAligned16(p.v_cache, es, p.head_size_v,
                     {p.v_block_stride, p.v_token_stride, p.v_head_stride})) {
    return no("cache rows are not 16-byte aligned");
  }
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) {
    return no("num_heads is not a multiple of num_kv_heads");
  }
  if (p.num_seqs > 65535 || p.num_heads > 65535) {
    return no("more than 65535 sequences or heads in one launch");
  }
  return true;
}

absl::StatusOr<DecodeTcPlan> PlanDecodeTc(const PagedKernelParams& p, DType cache_dtype,
                                          const DecodeLaunchOptions& options) {
  if (p.head_size > 256 || p.head_size_v > 256 || p.head_size <= 0 || p.head_size_v <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda decode attention (tensor cores): head sizes up to 256, got ",
                     p.head_size, "/", p.head_size_v));
  }
  if (options.num_sms <= 0 || options.num_splits < 0 || options.num_splits > kMaxDecodeSplits) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda decode attention (tensor cores): bad num_sms ", options.num_sms,
                     " or num_splits ", options.num_splits));
  }
  const int padded = PaddedHeadDim(p.head_size, p.head_size_v);
  const int group = p.num_heads / p.num_kv_heads;
  ASSIGN_OR_RETURN(const DecodeFp8Staging staging,
                   ResolveFp8Staging(options.fp8_staging, cache_dtype, padded, group));
  const int64_t base_ctas =
      int64_t{p.num_seqs} * p.num_kv_heads * CeilDiv(group, tc::DecodeTcHeadTileRows(group));
  const int64_t splits =
      options.num_splits > 0
          ? options.num_splits
          : ChooseDecodeSplits(base_ctas,
                               int64_t{options.num_sms} * CtasPerSm(padded, NTiles(group)),
                               DecodeSplitLimit(p), DecodeMinFullWaves(p));
  DecodeTcPlan plan = DecodeSplitPlan(p, static_cast<int>(splits));
  plan.fp8_staging = staging;
  return plan;
}

absl::Status LaunchDecodeTcSplit(const PagedKernelParams& p, DType q_dtype, DType cache_dtype,
                                 const DecodeTcPlan& plan, float* partial_out, float* partial_ml,
                                 cudaStream_t stream) {
  const int padded = PaddedHeadDim(p.head_size, p.head_size_v);
  const bool fp8 = IsFp8(cache_dtype);
  tc::DecodeTcArgs args{};
  args.group_size = p.num_heads / p.num_kv_heads;
  const int n_tiles = NTiles(args.group_size);
  args.head_tiles =
      static_cast<int32_t>(CeilDiv(args.group_size, tc::DecodeTcHeadTileRows(args.group_size)));
  args.num_splits = plan.num_splits;
  args.cache_kind = cache_dtype == DType::kFloat8E4M3   ? tc::kCacheE4M3
                    : cache_dtype == DType::kFloat8E5M2 ? tc::kCacheE5M2
                                                        : tc::kCache16;
  args.partial_out = partial_out;
  args.partial_ml = partial_ml;
  const bool bf16 = q_dtype == DType::kBFloat16;
  const bool in_registers = plan.fp8_staging == DecodeFp8Staging::kInRegisters;
  if (plan.fp8_staging == DecodeFp8Staging::kAuto ||
      (in_registers && !InRegistersBuilt(cache_dtype, padded, n_tiles))) {
    return absl::InvalidArgumentError(
        "cuda decode attention (tensor cores): the plan's fp8 staging is unresolved or does "
        "not fit this launch");
  }
  const TcKernel kernel =
      in_registers ? (bf16 ? InRegistersKernel<__nv_bfloat16>() : InRegistersKernel<__half>())
                   : (bf16 ? PickKernel<__nv_bfloat16>(padded, n_tiles)
                           : PickKernel<__half>(padded, n_tiles));
  const int smem =
      in_registers ? InRegistersTraits::SmemBytes(true) : SmemBytes(padded, n_tiles, fp8);
  // 16-bit and fp8 caches share the default instantiations: allow the larger once. All of
  // the unified L1 as shared memory: the tiles bypass L1 (cp.async.cg), and kMinBlocksPerSm
  // CTAs per SM need it.
  const int max_smem =
      in_registers ? smem
                   : std::max(SmemBytes(padded, n_tiles, false), SmemBytes(padded, n_tiles, true));
  RETURN_IF_ERROR(AllowDynamicSharedMemory(reinterpret_cast<const void*>(kernel), max_smem,
                                           /*max_carveout=*/true,
                                           "cuda decode attention (tensor cores)"));
  const dim3 grid(static_cast<unsigned>(p.num_kv_heads * args.head_tiles),
                  static_cast<unsigned>(p.num_seqs),
                  static_cast<unsigned>(plan.num_splits));
  kernel<<<grid, tc::DecodeTcTraits<64, 1>::kThreads, static_cast<size_t>(smem), stream>>>(p, args);
  return CudaErrorToStatus(static_cast<int>(cudaGetLastError()),
                           "cuda decode attention (tensor cores): split kernel launch");
}

const char* DecodeFp8StagingName(DecodeFp8Staging staging) {
  switch (staging) {
    case DecodeFp8Staging::kAuto: return "auto";
    case DecodeFp8Staging::kShared: return "shared";
    case DecodeFp8Staging::kInRegisters: return "in_registers";
  }
  return "unknown";
}

}  // namespace internal
}  // namespace kvstream
