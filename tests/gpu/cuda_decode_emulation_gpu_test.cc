// The tensor-core decode kernel (attention/src/cuda/decode_tc_attention.cuh) compiled by the
// host compiler and run under the warp emulator (warp_emulator.h), against the golden CPU
// reference. Needs no GPU: it checks the kernel's index math (head rows of the m16 tile,
// the warps' key slices, page-table walks through the lookup ring, swizzled tiles, the
// ldmatrix / mma fragment layouts as the PTX ISA defines them, fp8 staging, the end of a
// split, the warps' merge) and the cp.async pipeline's commit groups: copies land only at
// the cp.async.wait_group that covers them, or (second mode) at issue with the threads run
// in reverse order, which exposes copies into a stage still being read. Split partials are
// merged on the host with the formula of DecodeMergeKernel.
#define KVSTREAM_CUDA_EMULATION 1

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attention_test_util.h"
#include "cuda/decode_tc_launch.h"
#include "cuda/kernel_params.h"
#include "cuda/launchers.h"
#include "kvstream/attention/backend.h"
#include "kvstream/attention/cpu_attention.h"
#include "kvstream/common/dtype.h"
#include "warp_emulator.h"


#include "cuda/decode_tc_attention.cuh"  // NOLINT(build/include_order): after the emulation

#undef threadIdx
#undef blockIdx

namespace kvstream {
namespace {

using ::kvstream::testing_util::AttnCase;
using ::kvstream::testing_util::AttnProblem;
using ::kvstream::testing_util::ForEachQueryOutput;
using ::kvstream::testing_util::QueryOutput;
using ::kvstream::testing_util::SeqSpec;
using ::kvstream::testing_util::TestLayout;
using EmulationMode = ::kvstream::gpu_test::emulation::Cta::Mode;
namespace tc = ::kvstream::internal::decode_tc;

using internal::DecodeFp8Staging;
using internal::DecodeFp8StagingName;
using internal::PaddedHeadDim;

// Runs every CTA of the split grid for padded head size D and activation type T (and the
// kernel's kFp8InRegisters), then merges the splits on the host as DecodeMergeKernel does.
template <int D, int kNT, typename T, bool kFp8InRegisters>
absl::Status EmulateTyped(const internal::PagedKernelParams& kp, DType cache_dtype, int num_splits,
                          EmulationMode mode) {
  using Traits = tc::DecodeTcTraits<D, kNT, kFp8InRegisters>;
  const bool fp8 = IsFp8(cache_dtype);
  if (kFp8InRegisters && !fp8) {
    return absl::InvalidArgumentError("the in-registers fp8 staging needs an fp8 cache");
  }
  const int group = kp.num_heads / kp.num_kv_heads;
  const size_t slots = static_cast<size_t>(kp.num_seqs) * kp.num_heads * num_splits;
  std::vector<float> partial_out(slots * kp.head_size_v, std::nanf(""));
  std::vector<float> partial_ml(slots * 2, std::nanf(""));
  tc::DecodeTcArgs args{};
  args.group_size = group;
  args.head_tiles = (group + Traits::kRows - 1) / Traits::kRows;
  args.num_splits = num_splits;
  args.cache_kind = cache_dtype == DType::kFloat8E4M3   ? tc::kCacheE4M3
                    : cache_dtype == DType::kFloat8E5M2 ? tc::kCacheE5M2
                                                        : tc::kCache16;
  args.partial_out = num_splits > 1 ? partial_out.data() : nullptr;
  args.partial_ml = num_splits > 1 ? partial_ml.data() : nullptr;

  gpu_test::emulation::Cta cta(Traits::kThreads, static_cast<size_t>(Traits::SmemBytes(fp8)));
  cta.set_mode(mode);
  const std::function<void()> body = [&] {
    tc::DecodeTcKernel<D, kNT, T, kFp8InRegisters>(kp, args);
  };
  for (unsigned z = 0; z < static_cast<unsigned>(num_splits); ++z) {
    for (unsigned y = 0; y < static_cast<unsigned>(kp.num_seqs); ++y) {
      for (unsigned x = 0; x < static_cast<unsigned>(kp.num_kv_heads * args.head_tiles); ++x) {
        if (!cta.Run(dim3(x, y, z), body)) {
          return absl::InternalError(
              absl::StrCat("block (", x, ", ", y, ", ", z, "): ", cta.error()));
        }
      }
    }
  }
  if (num_splits == 1) return absl::OkStatus();

  // DecodeMergeKernel on the host (it also applies the V scale).
  T* const out = static_cast<T*>(kp.out);
  for (int seq = 0; seq < kp.num_seqs; ++seq) {
    const internal::SequenceBounds bounds = internal::LoadSequenceBounds(kp, seq);
    if (bounds.query_len <= 0) continue;
    const int q_row = bounds.q_start;
    for (int h = 0; h < kp.num_heads; ++h) {
      const size_t first = (static_cast<size_t>(seq) * kp.num_heads + h) * num_splits;
      float big = -INFINITY;
      for (int i = 0; i < num_splits; ++i) big = std::max(big, partial_ml[(first + i) * 2]);
      float sum = 0.0f;
      std::vector<float> weight(static_cast<size_t>(num_splits));
      for (int i = 0; i < num_splits; ++i) {
        const float mi = partial_ml[(first + i) * 2];
        if (std::isnan(mi) || std::isnan(partial_ml[(first + i) * 2 + 1])) {
          return absl::InternalError(absl::StrCat("seq ", seq, " head ", h, " split ", i,
                                                  ": partial (max, sum) never written"));
        }
        weight[i] = mi == -INFINITY ? 0.0f : std::exp2(mi - big);
        sum += partial_ml[(first + i) * 2 + 1] * weight[i];
      }
      const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
      const float v_scale = kp.v_scale[kp.num_scales == 1 ? 0 : h / group];
      for (int d = 0; d < kp.head_size_v; ++d) {
        float o = 0.0f;
        for (int i = 0; i < num_splits; ++i) {
          const float part = partial_out[(first + i) * kp.head_size_v + d];
          if (std::isnan(part)) {
            return absl::InternalError(absl::StrCat("seq ", seq, " head ", h, " split ", i,
                                                    " d ", d, ": partial output never written"));
          }
          o += part * weight[i];
        }
        out[static_cast<int64_t>(q_row) * kp.o_token_stride +
            static_cast<int64_t>(h) * kp.o_head_stride + d] =
            internal::cuda::FromFloat<T>(o * inv_sum * v_scale);
      }
    }
  }
  return absl::OkStatus();
}

// The kernel params of `host` validated as device params, its host pointers playing the
// device's.
absl::StatusOr<internal::PagedKernelParams> HostKernelParams(const PagedAttentionParams& host) {
  PagedAttentionParams dev = host;
  dev.cache.memory = MemoryKind::kDevice;
  dev.host.query_start_loc = host.query_start_loc;
  dev.host.seq_lens = host.seq_lens;
  dev.host.block_table = host.block_table;
  dev.host.alibi_slopes = host.alibi_slopes;
  return internal::MakePagedKernelParams(dev);
}

// The launcher's dispatch, with host memory standing in for device memory. `tamper`, when
// given, changes the kernel params after validation (what the kernel reads as device
// memory). `fp8_staging`: kAuto is resolved by the launcher's PlanDecodeTc; a forced
// kInRegisters runs at every padded head size and head tile (the GPU launcher builds it at
// 128 with one n8 tile only).
absl::Status Emulate(const PagedAttentionParams& host, int num_splits, EmulationMode mode,
                     const std::function<void(internal::PagedKernelParams&)>& tamper = {},
                     DecodeFp8Staging fp8_staging = DecodeFp8Staging::kShared) {
  absl::StatusOr<internal::PagedKernelParams> kp = HostKernelParams(host);
  if (!kp.ok()) return kp.status();
  if (tamper) tamper(*kp);
  const DType cache = host.cache.spec.dtype;
  // The launcher's predicate must take every case here (host vectors are 16-byte aligned).
  std::string why;
  if (!internal::DecodeTensorCoresApply(*kp, host.q_dtype, host.out_dtype, cache, &why)) {
    return absl::FailedPreconditionError(absl::StrCat("tensor cores do not apply: ", why));
  }
  // The launcher's choices: fp8 staging, padded head size, n8 tiles of heads, activation
  // type.
  if (fp8_staging == DecodeFp8Staging::kAuto) {
    internal::DecodeLaunchOptions options;
    options.num_splits = num_splits;
    absl::StatusOr<internal::DecodeTcPlan> plan = internal::PlanDecodeTc(*kp, cache, options);
    if (!plan.ok()) return plan.status();
    fp8_staging = plan->fp8_staging;
  }
  const bool in_registers = fp8_staging == DecodeFp8Staging::kInRegisters;
  const bool bf16 = host.q_dtype == DType::kBFloat16;
  const bool two = tc::DecodeTcHeadTileRows(kp->num_heads / kp->num_kv_heads) == 16;
  auto run_staged = [&](auto d_tag, auto nt_tag, auto in_registers_tag) {
    constexpr int kD = decltype(d_tag)::value;
    constexpr int kNT = decltype(nt_tag)::value;
    constexpr bool kInRegisters = decltype(in_registers_tag)::value;
    return bf16 ? EmulateTyped<kD, kNT, __nv_bfloat16, kInRegisters>(*kp, cache, num_splits, mode)
                : EmulateTyped<kD, kNT, __half, kInRegisters>(*kp, cache, num_splits, mode);
  };
  auto run = [&](auto d_tag, auto nt_tag) -> absl::Status {
    return in_registers ? run_staged(d_tag, nt_tag, std::true_type())
                        : run_staged(d_tag, nt_tag, std::false_type());
  };
  auto run_d = [&](auto d_tag) {
    return two ? run(d_tag, std::integral_constant<int, 2>())
               : run(d_tag, std::integral_constant<int, 1>());
  };
  switch (PaddedHeadDim(kp->head_size, kp->head_size_v)) {
    case 64: return run_d(std::integral_constant<int, 64>());
    case 128: return run_d(std::integral_constant<int, 128>());
    default: return run_d(std::integral_constant<int, 256>());
  }
}

void ExpectEmulationMatchesReference(AttnProblem& pb, int num_splits, EmulationMode mode,
                                     DecodeFp8Staging fp8_staging = DecodeFp8Staging::kShared) {
  const AttnCase& c = pb.config();
  std::vector<uint8_t> ref_out = pb.NewOut();
  ASSERT_TRUE(RunAttentionReference(pb.params(ref_out)).ok());
  std::vector<uint8_t> out = pb.NewOut();
  const absl::Status st = Emulate(pb.params(out), num_splits, mode, {}, fp8_staging);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(pb.CountStrayWrites(out), 0);
  // The GPU tests' tolerances (gpu_test_util.h GpuTolerance), absolute plus as much
  // relative: P is rounded to the 16-bit type before P V, as on the GPU.
  const float tol = c.out_dtype == DType::kFloat16 ? 2.5e-3f : 1.5e-2f;
  int failures = 0;
  ForEachQueryOutput(pb, [&](const QueryOutput& o) {
    const auto [s, t, row, h, d] = o;
    const float want = pb.Out(ref_out, row, h, d);
    const float got = pb.Out(out, row, h, d);
    if (!(std::fabs(want - got) <= tol + tol * std::fabs(want)) && ++failures <= 5) {
      ADD_FAILURE() << "seq " << s << " head " << h << " d " << d << ": reference "
                    << want << " emulated kernel " << got;
    }
  });
  EXPECT_EQ(failures, 0);
}

struct EmuCase {
  const char* name;
  int head_size, head_size_v, kv_heads, group, block_size;
  DType q_dtype, cache_dtype;
  KvQuantMode quant;
  TestLayout layout;
  int window;
  bool alibi;
  float cap;
  int num_splits;
};

// The decode problem of an EmuCase: one key, a partial tile, several tiles (and, split,
// several splits of whole 64-key tiles with a short last one), a sequence without a query.
AttnCase DecodeCase(const EmuCase& ec) {
  AttnCase c;
  c.head_size = ec.head_size;
  c.head_size_v = ec.head_size_v;
  c.num_kv_heads = ec.kv_heads;
  c.group = ec.group;
  c.block_size = ec.block_size;
  c.q_dtype = ec.q_dtype;
  c.out_dtype = ec.q_dtype;
  c.cache_dtype = ec.cache_dtype;
  c.quant = ec.quant;
  c.layout = ec.layout;
  c.causal = true;
  c.sliding_window = ec.window;
  c.alibi = ec.alibi;
  c.soft_cap = ec.cap;
  c.scale = 0.3f;
  c.seqs = {{0, 1}, {26, 1}, {6, 0}, {200, 1}, {64, 1}, {700, 1}};
  c.pad_tokens = 2;
  c.seed = 11;
  return c;
}

// Both emulation modes: copies landing at their wait in thread order, and at their issue
// with the threads in reverse.
void ExpectBothModesMatchReference(const EmuCase& ec, DecodeFp8Staging fp8_staging) {
  AttnProblem pb(DecodeCase(ec));
  for (EmulationMode mode : {EmulationMode{false, false}, EmulationMode{true, true}}) {
    SCOPED_TRACE(mode.copies_land_at_issue ? "copies land at issue, reverse order"
                                           : "copies land at wait, thread order");
    ExpectEmulationMatchesReference(pb, ec.num_splits, mode, fp8_staging);
  }
}

class CudaDecodeEmulationTest : public ::testing::TestWithParam<EmuCase> {};

TEST_P(CudaDecodeEmulationTest, KernelMatchesReference) {
  ExpectBothModesMatchReference(GetParam(), DecodeFp8Staging::kShared);
}

constexpr DType kBf16 = DType::kBFloat16;
constexpr DType kF16 = DType::kFloat16;
INSTANTIATE_TEST_SUITE_P(
    Cases, CudaDecodeEmulationTest,
    ::testing::Values(
        EmuCase{"d128_bf16_gqa4_bs16_one_split", 128, 128, 2, 4, 16, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, 0, false, 0, 1},
        EmuCase{"d128_bf16_gqa4_bs16_three_splits", 128, 128, 2, 4, 16, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, 0, false, 0, 3},
        EmuCase{"d80_f16_e4m3_perhead_gqa4_hnd_bs5_two_splits", 80, 80, 2, 4, 5, kF16,
                DType::kFloat8E4M3, KvQuantMode::kPerHead, TestLayout::kHND, 0, false, 0, 2},
        EmuCase{"d64_bf16_mha_window_alibi_cap_bs1_two_splits", 64, 64, 2, 1, 1, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, 70, true, 2.0f, 2},
        EmuCase{"d192_128_f16_e5m2_group8", 192, 128, 1, 8, 16, kF16, DType::kFloat8E5M2,
                KvQuantMode::kPerTensor, TestLayout::kNHD, 0, false, 0, 1},
        EmuCase{"d64_f16_group20_two_head_tiles_four_splits", 64, 64, 1, 20, 16, kF16, kF16,
                KvQuantMode::kNone, TestLayout::kHND, 0, true, 0, 4},
        EmuCase{"d128_bf16_group12_two_n8_tiles_alibi", 128, 128, 2, 12, 16, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, 0, true, 0, 2},
        EmuCase{"d256_bf16_group16_q_from_shared_memory", 256, 256, 1, 16, 16, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, 0, false, 0, 1},
        EmuCase{"d256_f16_e4m3_gqa4_window", 256, 256, 1, 4, 16, kF16, DType::kFloat8E4M3,
                KvQuantMode::kPerTensor, TestLayout::kNHD, 40, false, 0, 1},
        // 16-bit halves narrower than the tile: their padding columns must be copied as
        // zeros, or the emulator's patterned shared memory (and, in a reused slot, the
        // wider V half's columns) would reach K Q^T.
        EmuCase{"d96_128_bf16_gqa4_two_splits", 96, 128, 2, 4, 16, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, 0, false, 0, 2},
        EmuCase{"d80_f16_mha_hnd_bs5", 80, 80, 2, 1, 5, kF16, kF16, KvQuantMode::kNone,
                TestLayout::kHND, 0, false, 0, 1}),
    [](const auto& test_info) { return std::string(test_info.param.name); });

// The fp8 stagings over fp8 cases, forced and as kAuto resolves them: kShared; kInRegisters
// (K's fragments read from the raw tile: its swizzle, the head dimension's permutation
// shared with Q; V's transposed by movmatrix: the output dims' permutation) at every padded
// head size and head tile, where the GPU launcher builds it at 128 with one n8 tile only;
// both fp8 formats, per-head scales, K narrower than the padded head size, two n8 tiles of
// heads.
class CudaDecodeFp8StagingEmulationTest
    : public ::testing::TestWithParam<std::tuple<EmuCase, DecodeFp8Staging>> {};

TEST_P(CudaDecodeFp8StagingEmulationTest, KernelMatchesReference) {
  ExpectBothModesMatchReference(std::get<0>(GetParam()), std::get<1>(GetParam()));
}

constexpr DType kE4M3 = DType::kFloat8E4M3;
constexpr DType kE5M2 = DType::kFloat8E5M2;
INSTANTIATE_TEST_SUITE_P(
    Cases, CudaDecodeFp8StagingEmulationTest,
    ::testing::Combine(
        ::testing::Values(
            EmuCase{"d128_bf16_e4m3_gqa4_bs16_two_splits", 128, 128, 2, 4, 16, kBf16, kE4M3,
                    KvQuantMode::kPerTensor, TestLayout::kNHD, 0, false, 0, 2},
            EmuCase{"d128_f16_e5m2_perhead_hnd_bs5", 128, 128, 2, 4, 5, kF16, kE5M2,
                    KvQuantMode::kPerHead, TestLayout::kHND, 0, false, 0, 1},
            EmuCase{"d96_128_bf16_e4m3_window_alibi_cap_three_splits", 96, 128, 2, 4, 16, kBf16,
                    kE4M3, KvQuantMode::kPerTensor, TestLayout::kNHD, 70, true, 2.0f, 3},
            EmuCase{"d64_bf16_e4m3_mha_bs1", 64, 64, 2, 1, 1, kBf16, kE4M3, KvQuantMode::kPerHead,
                    TestLayout::kNHD, 0, false, 0, 1},
            EmuCase{"d256_f16_e4m3_gqa4", 256, 256, 1, 4, 16, kF16, kE4M3, KvQuantMode::kPerTensor,
                    TestLayout::kNHD, 0, false, 0, 1},
            EmuCase{"d128_bf16_e5m2_group12_two_n8_tiles", 128, 128, 1, 12, 16, kBf16, kE5M2,
                    KvQuantMode::kPerTensor, TestLayout::kNHD, 0, false, 0, 2}),
        ::testing::Values(DecodeFp8Staging::kAuto, DecodeFp8Staging::kShared,
                          DecodeFp8Staging::kInRegisters)),
    [](const auto& test_info) {
      return absl::StrCat(std::get<0>(test_info.param).name, "_",
                          DecodeFp8StagingName(std::get<1>(test_info.param)));
    });

// The staging PlanDecodeTc gives each request, without a GPU: kAuto is kInRegisters exactly
// for fp8 caches (e4m3, e5m2) at padded head size 128 with up to 8 query heads per KV head,
// else kShared; kShared stays kShared; a forced kInRegisters elsewhere is InvalidArgument
// saying where it exists.
TEST(CudaDecodeFp8StagingPlanTest, AutoTakesInRegistersWhereItExists) {
  struct Case {
    const char* name;
    int head_size, head_size_v, group;
    DType cache;
    bool in_registers;  // whether kInRegisters exists here
  };
  for (const Case& k : {Case{"d128 e4m3 group 4", 128, 128, 4, kE4M3, true},
                        Case{"d128 e5m2 mha", 128, 128, 1, kE5M2, true},
                        Case{"d96/128 e4m3 group 8", 96, 128, 8, kE4M3, true},
                        Case{"d128/80 e5m2 group 2", 128, 80, 2, kE5M2, true},
                        Case{"d64 e4m3 group 4", 64, 64, 4, kE4M3, false},
                        Case{"d80 e4m3 group 4 (padded to 128)", 80, 80, 4, kE4M3, true},
                        Case{"d192/128 e5m2 group 8", 192, 128, 8, kE5M2, false},
                        Case{"d256 e4m3 group 4", 256, 256, 4, kE4M3, false},
                        Case{"d128 e4m3 group 9", 128, 128, 9, kE4M3, false},
                        Case{"d128 e5m2 group 12", 128, 128, 12, kE5M2, false},
                        Case{"d128 bf16 cache group 4", 128, 128, 4, kBf16, false},
                        Case{"d128 f16 cache group 8", 128, 128, 8, kF16, false}}) {
    SCOPED_TRACE(k.name);
    AttnCase c;
    c.head_size = k.head_size;
    c.head_size_v = k.head_size_v;
    c.num_kv_heads = 2;
    c.group = k.group;
    c.q_dtype = c.out_dtype = k.cache == kF16 ? kF16 : kBf16;
    c.cache_dtype = k.cache;
    c.quant = IsFp8(k.cache) ? KvQuantMode::kPerTensor : KvQuantMode::kNone;
    c.seqs = {{300, 1}, {67, 1}};
    AttnProblem pb(c);
    std::vector<uint8_t> out = pb.NewOut();
    absl::StatusOr<internal::PagedKernelParams> kp = HostKernelParams(pb.params(out));
    ASSERT_TRUE(kp.ok()) << kp.status();
    ASSERT_TRUE(internal::DecodeTensorCoresApply(*kp, c.q_dtype, c.out_dtype, k.cache));
    auto plan = [&](DecodeFp8Staging requested) {
      internal::DecodeLaunchOptions options;
      options.fp8_staging = requested;
      return internal::PlanDecodeTc(*kp, k.cache, options);
    };
    absl::StatusOr<internal::DecodeTcPlan> automatic = plan(DecodeFp8Staging::kAuto);
    ASSERT_TRUE(automatic.ok()) << automatic.status();
    EXPECT_EQ(DecodeFp8StagingName(automatic->fp8_staging),
              DecodeFp8StagingName(k.in_registers ? DecodeFp8Staging::kInRegisters
                                                  : DecodeFp8Staging::kShared));
    absl::StatusOr<internal::DecodeTcPlan> shared = plan(DecodeFp8Staging::kShared);
    ASSERT_TRUE(shared.ok()) << shared.status();
    EXPECT_EQ(DecodeFp8StagingName(shared->fp8_staging),
              DecodeFp8StagingName(DecodeFp8Staging::kShared));
    // The staging changes neither the split count nor the workspace.
    EXPECT_EQ(automatic->num_splits, shared->num_splits);
    EXPECT_EQ(automatic->workspace_bytes, shared->workspace_bytes);
    absl::StatusOr<internal::DecodeTcPlan> forced = plan(DecodeFp8Staging::kInRegisters);
    if (k.in_registers) {
      ASSERT_TRUE(forced.ok()) << forced.status();
      EXPECT_EQ(DecodeFp8StagingName(forced->fp8_staging),
                DecodeFp8StagingName(DecodeFp8Staging::kInRegisters));
    } else {
      EXPECT_EQ(forced.status().code(), absl::StatusCode::kInvalidArgument) << forced.status();
      EXPECT_THAT(std::string(forced.status().message()),
                  ::testing::HasSubstr("exists for fp8 caches at padded head size 128 with up "
                                       "to 8 query heads per KV head"));
    }
  }
}

// A causal bf16 decode case of head size d (K and V), kv_heads KV heads of `group` query
// heads each, block size 16.
AttnCase Bf16DecodeCase(int d, int kv_heads, int group, float scale,
                        std::vector<SeqSpec> seqs, uint32_t seed) {
  AttnCase c;
  c.head_size = d;
  c.head_size_v = d;
  c.num_kv_heads = kv_heads;
  c.group = group;
  c.block_size = 16;
  c.q_dtype = DType::kBFloat16;
  c.out_dtype = DType::kBFloat16;
  c.cache_dtype = DType::kBFloat16;
  c.causal = true;
  c.scale = scale;
  c.seqs = std::move(seqs);
  c.seed = seed;
  return c;
}

// Device copies of query_start_loc / seq_lens that disagree with the validated host copies
// (an engine bug): the sequence they make inconsistent is skipped (its rows keep their
// bytes), nothing is written outside the output's rows, and the other sequences come out
// right.
TEST(CudaDecodeEmulationTest, InconsistentDeviceMetadataSkipsOnlyThatSequence) {
  const AttnCase c = Bf16DecodeCase(64, 2, 4, 0.125f, {{100, 1}, {37, 1}, {300, 1}}, 3);
  AttnProblem pb(c);
  std::vector<uint8_t> ref_out = pb.NewOut();
  ASSERT_TRUE(RunAttentionReference(pb.params(ref_out)).ok());
  struct Corruption {
    const char* what;
    int skipped;  // the sequence it makes inconsistent
    std::function<void(std::vector<int32_t>& qsl, std::vector<int32_t>& lens)> apply;
  };
  const std::vector<Corruption> corruptions = {
      {"seq_len past every block of the table", 1,
       [](auto&, auto& lens) { lens[1] = 1 << 20; }},
      {"seq_len below the query length", 1, [](auto&, auto& lens) { lens[1] = 0; }},
      {"query rows past num_tokens", 2, [](auto& qsl, auto&) { qsl[3] = 1 << 20; }},
      {"negative first query row", 0, [](auto& qsl, auto&) { qsl[0] = -5; }},
  };
  for (const Corruption& k : corruptions) {
    for (int num_splits : {1, 3}) {
      SCOPED_TRACE(absl::StrCat(k.what, ", ", num_splits, " splits"));
      std::vector<uint8_t> out = pb.NewOut();
      PagedAttentionParams p = pb.params(out);
      std::vector<int32_t> qsl(p.query_start_loc, p.query_start_loc + p.num_seqs + 1);
      std::vector<int32_t> lens(p.seq_lens, p.seq_lens + p.num_seqs);
      k.apply(qsl, lens);
      const absl::Status st =
          Emulate(p, num_splits, EmulationMode{false, false},
                  [&](internal::PagedKernelParams& kp) {
                    kp.query_start_loc = qsl.data();
                    kp.seq_lens = lens.data();
                  });
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_EQ(pb.CountStrayWrites(out), 0);
      for (size_t s = 0; s < c.seqs.size(); ++s) {
        const int64_t row = pb.query_start(s);
        for (int h = 0; h < pb.num_heads(); ++h) {
          for (int d = 0; d < c.head_size_v; ++d) {
            const float got = pb.Out(out, row, h, d);
            if (static_cast<int>(s) == k.skipped) {
              const size_t byte =
                  static_cast<size_t>((row * p.o_token_stride + h * p.o_head_stride + d) * 2);
              ASSERT_EQ(out[byte], AttnProblem::kSentinel) << "seq " << s << " was written";
            } else {
              const float want = pb.Out(ref_out, row, h, d);
              ASSERT_LE(std::fabs(want - got), 1.5e-2f + 1.5e-2f * std::fabs(want))
                  << "seq " << s << " head " << h << " d " << d;
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvstream

namespace kvstream {
namespace {
// One sequence of the decode benchmark's shape (4096 keys, 32/8 heads, d128, bf16, block
// size 16) with the two splits the launcher picks for 64 such sequences on an H200.
TEST(CudaDecodeEmulationLongTest, BenchShapeOneSequence) {
  AttnProblem pb(Bf16DecodeCase(128, 8, 4, 0.0883883f, {{4095, 1}}, 5));
  ExpectEmulationMatchesReference(pb, 2, EmulationMode{false, false});
}
}  // namespace
}  // namespace kvstream
