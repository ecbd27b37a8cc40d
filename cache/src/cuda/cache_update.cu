// CacheUpdateCuda: validates (ValidateCacheUpdate, through the host copy of the slot
// mapping), flattens the params for the kernel, picks the vector or scalar variant from
// the sizes, strides and alignment, dispatches on input dtype x cache dtype, and enqueues.
// fp8 caches take the fastest exact quotient that applies (cache_update.cuh: a multiply
// for power-of-two scales, FastQuotient, or the division).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cuda/cache_update.cuh"
#include "kvstream/cache/cache_update.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/dtype.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

namespace cu = internal::cache_update;

bool Aligned(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

bool MultipleOf8(int64_t x) { return x % cu::kVecElems == 0; }

// Whether every chunk of 8 elements the vector path touches is one aligned access.
bool CanVectorize(const cu::KernelParams& p, size_t in_bytes, size_t out_bytes) {
  const size_t in_align = in_bytes * cu::kVecElems >= 16 ? 16 : in_bytes * cu::kVecElems;
  const size_t out_align = out_bytes * cu::kVecElems >= 16 ? 16 : out_bytes * cu::kVecElems;
  return MultipleOf8(p.head_size) && MultipleOf8(p.head_size_v) &&
         MultipleOf8(p.key_token_stride) && MultipleOf8(p.key_head_stride) &&
         MultipleOf8(p.value_token_stride) && MultipleOf8(p.value_head_stride) &&
         MultipleOf8(p.k_block_stride) && MultipleOf8(p.k_token_stride) &&
         MultipleOf8(p.k_head_stride) && MultipleOf8(p.v_block_stride) &&
         MultipleOf8(p.v_token_stride) && MultipleOf8(p.v_head_stride) && p.k_dim_stride == 1 &&
         p.v_dim_stride == 1 && Aligned(p.key, in_align) && Aligned(p.value, in_align) &&
         Aligned(p.k_cache, out_align) && Aligned(p.v_cache, out_align);
}

// Whether every K and V scale passes `pred`.
template <typename Pred>
bool AllScales(const cu::KernelParams& p, Pred pred) {
  for (int i = 0; i < p.num_scales; ++i) {
    if (!pred(p.fp8_scale[i].scale) || !pred(p.fp8_scale[cu::kMaxScales + i].scale)) {
      return false;
    }
  }
  return true;
}

// FastQuotient's proof covers scales in [2^-30, 2^30].
bool InReciprocalRange(float s) { return s >= 0x1p-30f && s <= 0x1p30f; }

// The vector paths add offsets within a token's row in 32 bits, and mark V's destination
// offsets in bit 31 (ChunkDst): every offset must stay below 2^31.
bool HeadOffsetsFitInt32(const cu::KernelParams& p) {
  const int64_t heads = p.num_kv_heads;
  const int64_t d = p.head_size > p.head_size_v ? p.head_size : p.head_size_v;
  for (const int64_t stride :
       {p.key_head_stride, p.value_head_stride, p.k_head_stride, p.v_head_stride}) {
    if (stride < 0 || stride > int64_t{0x7fffffff} ||
        (heads - 1) * stride + d > int64_t{0x7fffffff}) {
      return false;
    }
  }
  return true;
}

// The vector paths' walk (cache_update.cuh, LaneWalk): a step of 32 chunks = 32 * 8
// elements is step_head whole heads plus step_first elements, in K and in V; and magic
// numbers for dividing by K's and V's chunks per head. REQUIRES: head sizes multiples of 8.
void SetWalkSteps(cu::KernelParams& p) {
  const int32_t step = 32 * cu::kVecElems;
  p.k_step_head = step / p.head_size;
  p.k_step_first = step % p.head_size;
  p.v_step_head = step / p.head_size_v;
  p.v_step_first = step % p.head_size_v;
  p.k_chunks_per_head = internal::MakeDivMagic(static_cast<uint32_t>(p.head_size / cu::kVecElems));
  p.v_chunks_per_head =
      internal::MakeDivMagic(static_cast<uint32_t>(p.head_size_v / cu::kVecElems));
}

// The regular walk (cache_update.cuh, WalkTokenRegular) with runs of `adjacent` chunks and
// groups of `group` steps: where the shape qualifies, sets its params and returns true.
// REQUIRES: head sizes multiples of 8.
bool SetRegularWalk(cu::KernelParams& p, int adjacent, int group) {
  const int chunks = p.head_size / cu::kVecElems;
  const int runs = chunks / adjacent;
  if (p.head_size != p.head_size_v || p.key_head_stride != p.value_head_stride ||
      p.k_head_stride != p.v_head_stride || chunks % adjacent != 0 || runs > 32 ||
      (runs & (runs - 1)) != 0) {
    return false;
  }
  const int64_t k_runs = int64_t{p.num_kv_heads} * runs;
  if (k_runs % (32 * group) != 0) return false;
  int shift = 0;
  while ((1 << shift) < runs) ++shift;
  p.run_shift = shift;
  p.regular_k_groups = static_cast<int32_t>(k_runs / (32 * group));
  // 32 / R heads; offsets wrap modulo 2^32 only past the last head (HeadOffsetsFitInt32).
  const uint32_t heads_per_step = static_cast<uint32_t>(32 / runs);
  p.step_in = heads_per_step * static_cast<uint32_t>(p.key_head_stride);
  p.step_out = heads_per_step * static_cast<uint32_t>(p.k_head_stride);
  return true;
}

// A vector kernel, with the regular walk or the general one.
template <typename In, typename Out, bool kFastFp8,
          cu::Fp8Quotient kQuotient = cu::Fp8Quotient::kReciprocal>
void LaunchVector(const cu::KernelParams& p, bool regular, dim3 grid, cudaStream_t stream) {
  if (regular) {
    cu::CacheUpdateKernel<In, Out, true, true, kFastFp8, kQuotient>
        <<<grid, cu::kThreadsPerCta, 0, stream>>>(p);
  } else {
    cu::CacheUpdateKernel<In, Out, true, false, kFastFp8, kQuotient>
        <<<grid, cu::kThreadsPerCta, 0, stream>>>(p);
  }
}

bool IsOne(float scale) { return scale == 1.0f; }

// 1 / s by IEEE division on the host, RN(1 / s), and its bracket and split where the kernel
// uses them (scales in FastQuotient's range; zeros elsewhere).
cu::Fp8ScaleConsts MakeScaleConsts(float scale) {
  cu::Fp8ScaleConsts c{scale, 1.0f / scale, 0.0f, 0.0f, 0.0f};
  if (InReciprocalRange(scale)) {
    internal::Fp8ReciprocalBracket(scale, &c.recip_down, &c.recip_up);
    c.recip_low = internal::Fp8SplitReciprocalLow(scale, c.recip_down);
  }
  return c;
}

// Fp8SplitReciprocalExact for a scale's constants, remembered per thread for the last
// scales seen (a check is 128 or 1024 multiply-adds and divisions; a model's scales are a
// handful, the same at every call). REQUIRES: c from MakeScaleConsts, scale in range.
bool SplitExact(const cu::Fp8ScaleConsts& c, int significand_bits) {
  struct Entry {
    uint32_t scale_bits = 0;
    int significand_bits = 0;  // 0: empty
    bool exact = false;
  };
  thread_local Entry memo[64];
  uint32_t bits;
  std::memcpy(&bits, &c.scale, sizeof(bits));
  Entry& e = memo[(bits ^ (bits >> 11) ^ static_cast<uint32_t>(significand_bits)) % 64];
  if (e.significand_bits != significand_bits || e.scale_bits != bits) {
    e.scale_bits = bits;
    e.significand_bits = significand_bits;
    e.exact = internal::Fp8SplitReciprocalExact(c.scale, c.recip_down, c.recip_low,
                                                significand_bits);
  }
  return e.exact;
}

// The vector kernels' way to an fp8 quotient, fastest first: none when every scale is 1,
// one multiply by 1 / scale when every scale is a power of two (exact, cache_update.cuh),
// the split reciprocal for inputs of at most 11 significand bits when every scale is in
// range and passes its check (kReciprocal only), the reciprocal bracket when every scale
// is in FastQuotient's range; nullopt for the division (then, and for kDivision).
std::optional<cu::Fp8Quotient> PickFp8Quotient(const cu::KernelParams& p,
                                               internal::CacheUpdateFp8Method method,
                                               int input_significand_bits) {
  if (method == internal::CacheUpdateFp8Method::kDivision) return std::nullopt;
  if (AllScales(p, IsOne)) return cu::Fp8Quotient::kUnit;
  if (AllScales(p, internal::Fp8ScaleIsPowerOfTwo)) return cu::Fp8Quotient::kPowerOfTwo;
  if (!AllScales(p, InReciprocalRange)) return std::nullopt;
  if (method == internal::CacheUpdateFp8Method::kReciprocal && input_significand_bits <= 11) {
    bool exact = true;
    for (int i = 0; i < p.num_scales && exact; ++i) {
      exact = SplitExact(p.fp8_scale[i], input_significand_bits) &&
              SplitExact(p.fp8_scale[cu::kMaxScales + i], input_significand_bits);
    }
    if (exact) return cu::Fp8Quotient::kSplit;
  }
  return cu::Fp8Quotient::kReciprocal;
}

absl::Status LaunchStatus() {
  return CudaErrorToStatus(static_cast<int>(cudaGetLastError()), "cache update kernel launch");
}

template <typename In, typename Out>
absl::Status Launch(const cu::KernelParams& p, size_t in_bytes, size_t out_bytes,
                    internal::CacheUpdateFp8Method method, cudaStream_t stream) {
  const int64_t ctas = (p.num_tokens + cu::kWarpsPerCta - 1) / cu::kWarpsPerCta;
  if (ctas > int64_t{0x7fffffff}) {
    return absl::InvalidArgumentError(
        absl::StrCat("CacheUpdateCuda: ", p.num_tokens, " tokens exceed one launch"));
  }
  const dim3 grid(static_cast<unsigned>(ctas));
  if (!CanVectorize(p, in_bytes, out_bytes) || !HeadOffsetsFitInt32(p)) {
    cu::CacheUpdateKernel<In, Out, false><<<grid, cu::kThreadsPerCta, 0, stream>>>(p);
    return LaunchStatus();
  }
  cu::KernelParams vec = p;
  SetWalkSteps(vec);
  using InBits = typename In::Bits;
  if constexpr (Out::kFp8) {
    if (const std::optional<cu::Fp8Quotient> quotient =
            PickFp8Quotient(p, method, In::kSignificandBits)) {
      const bool regular = SetRegularWalk(vec, cu::kRegularAdjacent<InBits, /*kHalves=*/true>,
                                          cu::kRegularGroup<InBits, /*kHalves=*/true>);
      switch (*quotient) {
        case cu::Fp8Quotient::kUnit:
          LaunchVector<In, Out, true, cu::Fp8Quotient::kUnit>(vec, regular, grid, stream);
          break;
        case cu::Fp8Quotient::kPowerOfTwo:
          LaunchVector<In, Out, true, cu::Fp8Quotient::kPowerOfTwo>(vec, regular, grid, stream);
          break;
        case cu::Fp8Quotient::kReciprocal:
          LaunchVector<In, Out, true, cu::Fp8Quotient::kReciprocal>(vec, regular, grid, stream);
          break;
        case cu::Fp8Quotient::kSplit:
          if constexpr (In::kSignificandBits <= 11) {
            LaunchVector<In, Out, true, cu::Fp8Quotient::kSplit>(vec, regular, grid, stream);
          }
          break;
      }
      return LaunchStatus();
    }
  }
  const bool regular = SetRegularWalk(vec, cu::kRegularAdjacent<InBits, /*kHalves=*/false>,
                                      cu::kRegularGroup<InBits, /*kHalves=*/false>);
  LaunchVector<In, Out, false>(vec, regular, grid, stream);
  return LaunchStatus();
}

template <typename In>
absl::Status DispatchCache(DType cache_dtype, const cu::KernelParams& p, size_t in_bytes,
                           internal::CacheUpdateFp8Method method, cudaStream_t stream) {
  const size_t out_bytes = DTypeSize(cache_dtype);
  switch (cache_dtype) {
    case DType::kFloat32: return Launch<In, cu::ElemF32>(p, in_bytes, out_bytes, method, stream);
    case DType::kFloat16: return Launch<In, cu::ElemF16>(p, in_bytes, out_bytes, method, stream);
    case DType::kBFloat16: return Launch<In, cu::ElemBF16>(p, in_bytes, out_bytes, method, stream);
    case DType::kFloat8E4M3:
      return Launch<In, cu::ElemE4M3>(p, in_bytes, out_bytes, method, stream);
    case DType::kFloat8E5M2:
      return Launch<In, cu::ElemE5M2>(p, in_bytes, out_bytes, method, stream);
    default: break;
  }
  return absl::InternalError(
      absl::StrCat("CacheUpdateCuda: no kernel for cache dtype ", DTypeName(cache_dtype)));
}

}  // namespace

absl::Status CacheUpdateCuda(const CacheUpdateParams& params, void* cuda_stream) {
  return internal::CacheUpdateCudaWithMethod(params, cuda_stream,
                                             internal::CacheUpdateFp8Method::kReciprocal);
}

namespace internal {

absl::Status CacheUpdateCudaWithMethod(const CacheUpdateParams& params, void* cuda_stream,
                                       CacheUpdateFp8Method method) {
  const KvCacheView& cache = params.cache;
  if (cache.memory != MemoryKind::kDevice) {
    return absl::FailedPreconditionError(
        absl::StrCat("CacheUpdateCuda: the cache is in ", MemoryKindName(cache.memory),
                     " memory; the CUDA path writes device caches (use CacheUpdateCpu)"));
  }
  RETURN_IF_ERROR(ValidateCacheUpdate(params));
  if (params.num_tokens == 0) return absl::OkStatus();
  const KvCacheSpec& spec = cache.spec;
  // The kernels count a token's elements in 32-bit integers (lanes step by up to 256).
  const int64_t token_elements =
      int64_t{spec.num_kv_heads} * (int64_t{spec.head_size} + int64_t{spec.head_size_v});
  if (token_elements > int64_t{std::numeric_limits<int32_t>::max()} - 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CacheUpdateCuda: ", spec.num_kv_heads, " KV heads x (", spec.head_size, " + ",
        spec.head_size_v, ") elements per token is more than the kernel can count"));
  }
  cu::KernelParams p{};
  p.key = params.key;
  p.value = params.value;
  p.key_token_stride = params.key_token_stride;
  p.key_head_stride = params.key_head_stride;
  p.value_token_stride = params.value_token_stride;
  p.value_head_stride = params.value_head_stride;
  p.slot_mapping = params.slot_mapping;
  p.num_tokens = params.num_tokens;
  p.num_slots = cache.num_blocks * spec.block_size;
  p.k_cache = cache.k;
  p.v_cache = cache.v;
  p.k_block_stride = cache.k_strides.block;
  p.k_token_stride = cache.k_strides.token;
  p.k_head_stride = cache.k_strides.head;
  p.k_dim_stride = cache.k_strides.dim;
  p.v_block_stride = cache.v_strides.block;
  p.v_token_stride = cache.v_strides.token;
  p.v_head_stride = cache.v_strides.head;
  p.v_dim_stride = cache.v_strides.dim;
  p.block_size = spec.block_size;
  p.num_kv_heads = spec.num_kv_heads;
  p.head_size = spec.head_size;
  p.head_size_v = spec.head_size_v;
  p.num_scales = 0;
  if (IsFp8(spec.dtype)) {
    // Validation checked the count (1 or num_kv_heads) and the values.
    if (cache.num_scales > cu::kMaxScales) {
      return absl::InvalidArgumentError(
          absl::StrCat("CacheUpdateCuda: at most ", cu::kMaxScales, " per-head fp8 scales, got ",
                       cache.num_scales));
    }
    p.num_scales = cache.num_scales;
    for (int i = 0; i < cache.num_scales; ++i) {
      p.fp8_scale[i] = MakeScaleConsts(cache.k_scale[i]);
      p.fp8_scale[cu::kMaxScales + i] = MakeScaleConsts(cache.v_scale[i]);
    }
  }
  const cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  const size_t in_bytes = DTypeSize(params.input_dtype);
  switch (params.input_dtype) {
    case DType::kFloat32:
      return DispatchCache<cu::ElemF32>(spec.dtype, p, in_bytes, method, stream);
    case DType::kFloat16:
      return DispatchCache<cu::ElemF16>(spec.dtype, p, in_bytes, method, stream);
    case DType::kBFloat16:
      return DispatchCache<cu::ElemBF16>(spec.dtype, p, in_bytes, method, stream);
    default: break;
  }
  return absl::InternalError(absl::StrCat("CacheUpdateCuda: no kernel for input dtype ",
                                          DTypeName(params.input_dtype)));
}

}  // namespace internal
}  // namespace kvstream
