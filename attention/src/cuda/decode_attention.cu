// LaunchDecodeAttention: plans the launch (lanes per key, head tile, shared-memory tiles,
// copy width, split count), dispatches on cache dtype x head tile x chunks per lane, and
// enqueues the split kernel and, when the keys are split, the merge kernel. Where the
// tensor-core kernel applies (DecodeTensorCoresApply) and options.kernel allows it, its
// split kernel (decode_tc_attention.cu) replaces the CUDA-core one; both write the same
// partial-result layout, so the merge kernel here serves both.
//
// Split count. A CTA streams one KV head's keys of one split; with few sequences or KV heads
// there are too few CTAs to keep 132 SMs busy, and with CTAs of equal work a last partial
// wave idles most of the GPU. So the keys are split into the fewest parts that give one
// mostly full wave of CTAs (sequences of about equal length) or a few waves with a mostly
// full last one (ChooseDecodeSplits, DecodeMinFullWaves), but never into splits shorter than
// kMinTokensPerSplit keys (the pipeline's start-up and the merge would then cost more than
// they save).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "kvstream/common/int_math.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cuda/decode_attention.cuh"
#include "cuda/decode_tc_launch.h"
#include "cuda/kernel_params.h"
#include "cuda/launchers.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/dtype.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {
namespace {

namespace dec = decode;

constexpr int64_t kMaxWaves = 16;
// Sequences whose visible keys average at least this fraction of the longest one's count
// as equal for DecodeMinFullWaves: one wave then loses at most 5% to the spread.
constexpr double kBalancedKeys = 0.95;
constexpr int kMinTokensPerSplit = 256;
constexpr int kMaxDynamicSmem = 227 * 1024;  // H100/H200 per-block opt-in limit
constexpr int kSmemPerSm = 228 * 1024;

using SplitKernel = void (*)(PagedKernelParams, dec::DecodeGeometry);

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("cuda decode attention: ", what));
}

int NextPow2(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}


int ActivationCode(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return dec::kActFloat32;
    case DType::kFloat16: return dec::kActFloat16;
    default: return dec::kActBFloat16;
  }
}

template <typename CacheT>
SplitKernel PickKernel(int g, int chunks) {
  if (chunks == 1) {
    switch (g) {
      case 1: return &dec::DecodeSplitKernel<CacheT, 1, 1>;
      case 2: return &dec::DecodeSplitKernel<CacheT, 2, 1>;
      case 4: return &dec::DecodeSplitKernel<CacheT, 4, 1>;
      case 8: return &dec::DecodeSplitKernel<CacheT, 8, 1>;
      default: return nullptr;
    }
  }
  switch (g) {
    case 1: return &dec::DecodeSplitKernel<CacheT, 1, 2>;
    case 2: return &dec::DecodeSplitKernel<CacheT, 2, 2>;
    case 4: return &dec::DecodeSplitKernel<CacheT, 4, 2>;
    default: return nullptr;
  }
}

SplitKernel PickKernel(DType cache_dtype, int g, int chunks) {
  switch (cache_dtype) {
    case DType::kFloat32: return PickKernel<float>(g, chunks);
    case DType::kFloat16: return PickKernel<__half>(g, chunks);
    case DType::kBFloat16: return PickKernel<__nv_bfloat16>(g, chunks);
    case DType::kFloat8E4M3: return PickKernel<__nv_fp8_e4m3>(g, chunks);
    case DType::kFloat8E5M2: return PickKernel<__nv_fp8_e5m2>(g, chunks);
    default: return nullptr;
  }
}


// Everything about one launch that does not depend on the workspace address.
struct DecodePlan {
  dec::DecodeGeometry geo;
  SplitKernel kernel;
  size_t smem_bytes;
  dim3 split_grid;
  dim3 merge_grid;
  size_t workspace_bytes;  // 0 when num_splits == 1
  size_t partial_out_bytes;
};

bool Aligned(const void* p, int64_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(alignment) == 0;
}

// The widest cp.async size (16, 8, 4) that every row start and length of both caches is
// a multiple of; 0 when none is (element-wise copies).
int PickCopyBytes(const PagedKernelParams& p, int es) {
  for (int cb : {16, 8, 4}) {
    if (cb < es) break;
    const int64_t strides[] = {p.k_block_stride, p.k_token_stride, p.k_head_stride,
                               p.v_block_stride, p.v_token_stride, p.v_head_stride,
                               int64_t{p.head_size}, int64_t{p.head_size_v}};
    bool ok = Aligned(p.k_cache, cb) && Aligned(p.v_cache, cb);
    for (int64_t s : strides) ok = ok && (s * es) % cb == 0;
    if (ok) return cb;
  }
  return 0;
}

absl::StatusOr<DecodePlan> Plan(const PagedKernelParams& p, DType cache_dtype,
                                const DecodeLaunchOptions& options) {
  if (p.max_query_len > 1) {
    return Invalid(absl::StrCat("the decode kernel needs max_query_len <= 1, got ",
                                p.max_query_len));
  }
  const int num_sms = options.num_sms;
  if (num_sms <= 0) return Invalid(absl::StrCat("num_sms must be positive, got ", num_sms));
  if (options.num_splits < 0 || options.num_splits > dec::kMaxSplits) {
    return Invalid(absl::StrCat("num_splits must be in [0, ", dec::kMaxSplits, "], got ",
                                options.num_splits));
  }
  if (!IsFloatingPoint(cache_dtype)) {
    return Invalid(absl::StrCat("unsupported cache dtype ", DTypeName(cache_dtype)));
  }
  const int es = static_cast<int>(DTypeSize(cache_dtype));
  const int chunk_elems = es == 4 ? 4 : 8;
  const int ck = static_cast<int>(CeilDiv(p.head_size, chunk_elems));
  const int cv = static_cast<int>(CeilDiv(p.head_size_v, chunk_elems));
  const int c = std::max(ck, cv);
  const int lanes = std::min(32, NextPow2(c));
  const int chunks = static_cast<int>(CeilDiv(c, lanes));
  if (chunks > 2) {
    return Invalid(absl::StrCat("head sizes up to ", 64 * chunk_elems, " elements for ",
                                DTypeName(cache_dtype), " caches, got head_size ", p.head_size,
                                " and head_size_v ", p.head_size_v));
  }
  const int group = p.num_heads / p.num_kv_heads;
  const int g = std::min(NextPow2(group), chunks == 1 ? 8 : 4);

  DecodePlan plan{};
  dec::DecodeGeometry& geo = plan.geo;
  geo.group_size = group;
  geo.head_tiles = static_cast<int32_t>(CeilDiv(group, g));
  geo.lanes_per_token = lanes;
  geo.tile_tokens = (dec::kThreads / lanes) * dec::kTokensPerGroup;
  const int row_align = 16 / es;  // elements per 16 bytes
  geo.k_row = static_cast<int32_t>(CeilDiv(p.head_size, row_align) * row_align);
  geo.v_row = static_cast<int32_t>(CeilDiv(p.head_size_v, row_align) * row_align);
  const int64_t stage_bytes = int64_t{geo.tile_tokens} * (geo.k_row + geo.v_row) * es;
  const int64_t red_bytes =
      int64_t{dec::kWarps} * g * (int64_t{lanes} * chunks * chunk_elems + 2) * 4;
  const int64_t smem = std::max<int64_t>(dec::kStages * stage_bytes, red_bytes);
  if (smem > kMaxDynamicSmem) {
    return Invalid(absl::StrCat("head sizes ", p.head_size, "/", p.head_size_v,
                                " need ", smem, " bytes of shared memory"));
  }
  geo.stage_bytes = static_cast<int32_t>(stage_bytes);
  geo.copy_bytes = PickCopyBytes(p, es);
  const int64_t unit = geo.copy_bytes != 0 ? geo.copy_bytes : es;
  const int64_t units = std::max(CeilDiv(int64_t{p.head_size} * es, unit),
                                 CeilDiv(int64_t{p.head_size_v} * es, unit));
  geo.copy_lanes = std::min(32, NextPow2(static_cast<int>(std::min<int64_t>(units, 32))));
  geo.block_shift = -1;
  for (int shift = 0; shift < 31; ++shift) {
    if ((1 << shift) == p.block_size) geo.block_shift = shift;
  }

  // Split count, from the CTAs one split per (sequence, KV head, head tile) gives.
  const int64_t base_ctas = int64_t{p.num_seqs} * p.num_kv_heads * geo.head_tiles;
  const int ctas_per_sm = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(g * chunks >= 8 ? 2 : 3, kSmemPerSm / (smem + 1024))));
  const int64_t splits =
      options.num_splits > 0
          ? options.num_splits
          : ChooseDecodeSplits(base_ctas, int64_t{num_sms} * ctas_per_sm, DecodeSplitLimit(p),
                               DecodeMinFullWaves(p));
  geo.num_splits = static_cast<int32_t>(splits);

  const int64_t grid_x = int64_t{p.num_kv_heads} * geo.head_tiles;
  if (p.num_seqs > 65535) {
    return Invalid(absl::StrCat("at most 65535 sequences per launch, got ", p.num_seqs));
  }
  if (p.num_heads > 65535) {
    return Invalid(absl::StrCat("too many heads for one launch (", p.num_heads, ")"));
  }
  plan.split_grid = dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(p.num_seqs),
                         static_cast<unsigned>(splits));
  plan.merge_grid = dim3(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.num_heads));
  plan.smem_bytes = static_cast<size_t>(smem);
  const DecodeTcPlan workspace = DecodeSplitPlan(p, static_cast<int>(splits));
  plan.partial_out_bytes = workspace.partial_out_bytes;
  plan.workspace_bytes = workspace.workspace_bytes;
  plan.kernel = PickKernel(cache_dtype, g, chunks);
  if (plan.kernel == nullptr) {
    return absl::InternalError(absl::StrCat("cuda decode attention: no kernel for ",
                                            DTypeName(cache_dtype), " with ", g, " heads x ",
                                            chunks, " chunks"));
  }
  return plan;
}

// Enqueues the CUDA-core split kernel of `plan`.
absl::Status LaunchCudaCoreSplit(const PagedKernelParams& params, const DecodePlan& plan,
                                 cudaStream_t stream) {
  RETURN_IF_ERROR(AllowDynamicSharedMemory(reinterpret_cast<const void*>(plan.kernel),
                                           static_cast<int>(plan.smem_bytes),
                                           /*max_carveout=*/false, "cuda decode attention"));
  plan.kernel<<<plan.split_grid, dec::kThreads, plan.smem_bytes, stream>>>(params, plan.geo);
  RETURN_IF_ERROR(CudaErrorToStatus(static_cast<int>(cudaGetLastError()),
                                    "cuda decode attention: split kernel launch"));
  return absl::OkStatus();
}

}  // namespace

static_assert(kMaxDecodeSplits == dec::kMaxSplits, "one limit for the launchers and the merge");

DecodeTcPlan DecodeSplitPlan(const PagedKernelParams& p, int num_splits) {
  DecodeTcPlan plan;
  plan.num_splits = num_splits;
  if (num_splits > 1) {
    const size_t slots = static_cast<size_t>(p.num_seqs) * p.num_heads * num_splits;
    plan.partial_out_bytes = (slots * p.head_size_v * sizeof(float) + 255) / 256 * 256;
    plan.workspace_bytes = plan.partial_out_bytes + slots * 2 * sizeof(float);
  }
  return plan;
}

int64_t DecodeSplitLimit(const PagedKernelParams& p) {
  const int64_t visible =
      p.sliding_window > 0 ? std::min<int64_t>(p.max_seq_len, p.sliding_window) : p.max_seq_len;
  return std::max<int64_t>(
      1, std::min<int64_t>(kMaxDecodeSplits,
                           CeilDiv(std::max<int64_t>(visible, 1), kMinTokensPerSplit)));
}

int64_t DecodeMinFullWaves(const PagedKernelParams& p) {
  const int64_t longest =
      p.sliding_window > 0 ? std::min<int64_t>(p.max_seq_len, p.sliding_window) : p.max_seq_len;
  const double all_longest = static_cast<double>(longest) * static_cast<double>(p.num_seqs);
  const bool balanced = p.total_visible_keys > 0 &&
                        static_cast<double>(p.total_visible_keys) >= kBalancedKeys * all_longest;
  return balanced ? 0 : 2;
}

// At least `min_full_waves` full waves of CTAs where the keys allow (with 2, sequences of
// different lengths balance out across SMs), at most kMaxWaves; among those the fewest
// splits whose last wave is at least min_last_wave_fill full (CTAs of one call do about equal
// work, so a last wave one-tenth full leaves nine-tenths of the GPU idle for a CTA's
// duration), or the fullest when none is. Fewer splits are better otherwise: each costs a
// partial result, a share of the merge, and a CTA's pipeline start-up (on the H200,
// tensor-core kernel with four CTAs per SM, 64 x 4096 keys: 1 split (one wave) 0.97 of the
// streaming read, 2 splits 0.93, 4 splits 0.92; 16 x 32768: 4 splits (one wave) 0.965, 8
// splits 0.95).
int64_t ChooseDecodeSplits(int64_t base_ctas, int64_t slots, int64_t max_splits,
                           int64_t min_full_waves, double min_last_wave_fill) {
  base_ctas = std::max<int64_t>(base_ctas, 1);
  slots = std::max<int64_t>(slots, 1);
  max_splits = std::max<int64_t>(max_splits, 1);
  min_full_waves = std::max<int64_t>(min_full_waves, 0);
  auto fill = [&](int64_t s) {
    const double waves = static_cast<double>(base_ctas * s) / static_cast<double>(slots);
    return waves / std::ceil(waves);
  };
  const int64_t lo =
      std::min(max_splits, std::max<int64_t>(1, CeilDiv(min_full_waves * slots, base_ctas)));
  const int64_t hi =
      std::min(max_splits, std::max<int64_t>(lo, (kMaxWaves * slots) / base_ctas));
  int64_t best = lo;
  double best_fill = fill(lo);
  for (int64_t s = lo; s <= hi; ++s) {
    const double f = fill(s);
    if (f >= min_last_wave_fill) return s;
    if (f > best_fill) {
      best = s;
      best_fill = f;
    }
  }
  return best;
}

absl::StatusOr<uint32_t*> ZeroedArrivalCounters(DeviceBuffer& counters, size_t count,
                                                size_t allocate_count, cudaStream_t stream) {
  if (count * sizeof(uint32_t) > counters.size()) {
    ASSIGN_OR_RETURN(DeviceBuffer fresh,
                     DeviceBuffer::CreateAsync(std::max(count, allocate_count) * sizeof(uint32_t),
                                               stream));
    RETURN_IF_ERROR(CudaErrorToStatus(
        static_cast<int>(cudaMemsetAsync(fresh.data(), 0, fresh.size(), stream)),
        "cuda decode attention: zeroing the arrival counters"));
    counters = std::move(fresh);
  }
  return counters.data_as<uint32_t>();
}

absl::Status LaunchDecodeAttention(const PagedKernelParams& params, DType q_dtype,
                                   DType out_dtype, DType cache_dtype,
                                   const DecodeLaunchOptions& options, cudaStream_t stream) {
  for (DType d : {q_dtype, out_dtype}) {
    if (d != DType::kFloat32 && d != DType::kFloat16 && d != DType::kBFloat16) {
      return Invalid(absl::StrCat("q and out dtypes must be float32, float16 or bfloat16, got ",
                                  DTypeName(d)));
    }
  }
  ASSIGN_OR_RETURN(DecodePlan plan, Plan(params, cache_dtype, options));
  std::string why;
  // kAuto runs the first kernel that applies of: TMA (1.5-2% above the cp.async tensor-core
  // kernel on the H200), tensor cores (about twice the CUDA-core kernel's bandwidth), CUDA
  // cores (docs/benchmarks.md).
  bool tma =
      (options.kernel == DecodeKernel::kAuto || options.kernel == DecodeKernel::kTensorCoresTma) &&
      options.tma && DecodeTmaApplies(params, q_dtype, out_dtype, cache_dtype, &why);
  if (options.kernel == DecodeKernel::kTensorCoresTma && !tma) {
    return Invalid(absl::StrCat("the TMA kernel does not apply: ",
                                options.tma ? why : "the device has no TMA"));
  }
  DecodeTmaMaps tma_maps{};
  if (tma) {
    // Before the workspace is taken: where the TMA kernel cannot run after all (no encoder
    // in the driver, a map the driver refuses, too little shared memory on this device),
    // kAuto takes the tensor-core kernel, kTensorCoresTma returns the error.
    absl::StatusOr<DecodeTmaMaps> prepared = PrepareDecodeTma(params, q_dtype);
    if (prepared.ok()) {
      tma_maps = *prepared;
    } else if (options.kernel == DecodeKernel::kTensorCoresTma) {
      return prepared.status();
    } else {
      tma = false;
    }
  }
  const bool tensor_cores =
      !tma && options.kernel != DecodeKernel::kCudaCores &&
      DecodeTensorCoresApply(params, q_dtype, out_dtype, cache_dtype, &why);
  if (options.kernel == DecodeKernel::kTensorCores && !tensor_cores) {
    return Invalid(absl::StrCat("the tensor-core kernel does not apply: ", why));
  }
  if (options.fp8_staging == DecodeFp8Staging::kInRegisters && !tensor_cores) {
    return Invalid("the in-registers fp8 staging needs the tensor-core kernel");
  }
  DecodeTcPlan tc;
  if (tma) {
    ASSIGN_OR_RETURN(tc, PlanDecodeTma(params, options));
  } else if (tensor_cores) {
    ASSIGN_OR_RETURN(tc, PlanDecodeTc(params, cache_dtype, options));
  }
  if (tma || tensor_cores) {
    plan.geo.num_splits = tc.num_splits;
    plan.workspace_bytes = tc.workspace_bytes;
    plan.partial_out_bytes = tc.partial_out_bytes;
  }
  if (plan.workspace_bytes > 0) {
    if (!options.workspace) {
      return Invalid(absl::StrCat("needs ", plan.workspace_bytes, " bytes of workspace for ",
                                  plan.geo.num_splits, " splits and has no workspace provider"));
    }
    ASSIGN_OR_RETURN(void* const workspace, options.workspace(plan.workspace_bytes));
    if (workspace == nullptr || !Aligned(workspace, 16)) {
      return Invalid("the workspace provider returned a null or not 16-byte aligned pointer");
    }
    plan.geo.partial_out = static_cast<float*>(workspace);
    plan.geo.partial_ml =
        reinterpret_cast<float*>(static_cast<char*>(workspace) + plan.partial_out_bytes);
  }
  plan.geo.q_dtype = ActivationCode(q_dtype);
  plan.geo.out_dtype = ActivationCode(out_dtype);

  // The TMA kernel merges up to kDecodeTmaInKernelMergeSplits splits itself where the
  // caller keeps arrival counters (one warp merges a head group's splits: for more, the
  // merge kernel's one CTA per query head is faster).
  uint32_t* arrivals = nullptr;
  if (tma && plan.geo.num_splits > 1 && plan.geo.num_splits <= kDecodeTmaInKernelMergeSplits &&
      options.arrival_counters) {
    const size_t count = static_cast<size_t>(params.num_seqs) * params.num_kv_heads;
    ASSIGN_OR_RETURN(arrivals, options.arrival_counters(count));
    if (arrivals == nullptr || !Aligned(arrivals, 4)) {
      return Invalid("the arrival counter provider returned a null or not 4-byte aligned pointer");
    }
  }
  if (tma) {
    RETURN_IF_ERROR(LaunchDecodeTmaSplit(params, q_dtype, tma_maps, tc, plan.geo.partial_out,
                                         plan.geo.partial_ml, arrivals, stream));
  } else if (tensor_cores) {
    RETURN_IF_ERROR(LaunchDecodeTcSplit(params, q_dtype, cache_dtype, tc, plan.geo.partial_out,
                                        plan.geo.partial_ml, stream));
  } else {
    RETURN_IF_ERROR(LaunchCudaCoreSplit(params, plan, stream));
  }
  if (plan.geo.num_splits > 1 && arrivals == nullptr) {
    // With options.dependent_merge the merge kernel is a programmatic dependent of the split
    // kernel: its launch and CTAs start while the split kernel's last CTAs run, and it
    // waits for the partial results inside (WaitForPrerequisiteGrids).
    cudaLaunchAttribute dependent{};
    dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    dependent.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = plan.merge_grid;
    config.blockDim = dim3(dec::kThreads);
    config.dynamicSmemBytes = 0;
    config.stream = stream;
    config.attrs = &dependent;
    config.numAttrs = options.dependent_merge ? 1 : 0;
    RETURN_IF_ERROR(CudaErrorToStatus(
        static_cast<int>(cudaLaunchKernelEx(&config, dec::DecodeMergeKernel, params, plan.geo)),
        "cuda decode attention: merge kernel launch"));
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace kvstream
