// Tests of the CUDA prefill attention kernel (LaunchPrefillAttention, prefill_attention.cuh)
// against the golden CPU reference (RunAttentionReference) on the same inputs: grids of
// block sizes, GQA ratios, head sizes (padded and not, head_size_v != head_size), query and
// cache dtypes (fp8 with per-tensor and per-head scales), NHD / HND, strided and dense
// query/output rows, causal and bidirectional masks, sliding windows, ALiBi and soft caps,
// over mixed batches of prefills, chunked prefills, decode rows and empty queries. Also the
// exact extent of the masks and the limits the launcher rejects. Each grid runs every
// variant: the baseline, the fast one and, on a compute capability 9.0 device of a build
// with sm_90a code, the wgmma kernel (prefill_wgmma.cuh), each where it applies. The wgmma
// kernel's own edge cases and the timing of the large causal prefill the kernels are tuned
// for are in cuda_prefill_wgmma_gpu_test.cc; the machinery both share in
// prefill_gpu_test_util.h.
//
// Every test skips where no GPU can be used.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attention_test_util.h"
#include "cuda/kernel_params.h"
#include "cuda/launchers.h"
#include "gpu_test_util.h"
#include "kvstream/cache/kv_cache_spec.h"
#include "kvstream/common/dtype.h"
#include "prefill_gpu_test_util.h"

namespace kvstream {
namespace {

using ::kvstream::gpu_test::AllVariants;
using ::kvstream::gpu_test::DeviceRunsWgmma;
using ::kvstream::gpu_test::ExpectGpuMatchesReference;
using ::kvstream::gpu_test::GpuIo;
using ::kvstream::gpu_test::RunOnGpu;
using ::kvstream::gpu_test::VariantName;
using ::kvstream::internal::PrefillVariant;
using ::kvstream::internal::PrefillWgmmaCluster;
using ::kvstream::testing_util::AttnCase;
using ::kvstream::testing_util::AttnProblem;
using ::kvstream::testing_util::CacheKind;
using ::kvstream::testing_util::FeatureGridCase;
using ::kvstream::testing_util::HeadConfig;
using ::kvstream::testing_util::HeadSizes;
using ::kvstream::testing_util::QuantSuffix;
using ::kvstream::testing_util::SeqSpec;
using ::kvstream::testing_util::ShapeGridCase;
using ::kvstream::testing_util::ShortDType;
using ::kvstream::testing_util::TestLayout;
using ::kvstream::testing_util::TestLayoutName;

// The batch most grids use: prefill, chunked prefill and decode rows, an empty query, and
// a prefill long enough for several query and key tiles (130 tokens x the group's heads).
std::vector<SeqSpec> MixedBatch() {
  return {{0, 33}, {67, 33}, {99, 1}, {6, 1}, {0, 7}, {0, 1}, {20, 0}, {0, 130}};
}

// ---------------------------------------------------------------------------------------
// Block sizes x head configurations, each over every head size (64, 80, 128, 256, and
// head_size_v != head_size: 192/128, 64/48), bfloat16.

class CudaPrefillShapeTest : public ::testing::TestWithParam<std::tuple<int, HeadConfig>> {
 protected:
  void SetUp() override { KVSTREAM_SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaPrefillShapeTest, MatchesReference) {
  const auto& [block_size, heads] = GetParam();
  for (HeadSizes sizes : {HeadSizes{64, 64}, HeadSizes{80, 80}, HeadSizes{128, 128},
                          HeadSizes{256, 256}, HeadSizes{192, 128}, HeadSizes{64, 48}}) {
    SCOPED_TRACE(absl::StrCat("head_size ", sizes.k, " head_size_v ", sizes.v));
    AttnCase c = ShapeGridCase(block_size, heads, sizes);
    c.q_dtype = DType::kBFloat16;
    c.out_dtype = DType::kBFloat16;
    c.seqs = MixedBatch();
    c.seed = static_cast<uint32_t>(block_size * 1000 + heads.group * 10 + sizes.v);
    AttnProblem pb(c);
    ExpectGpuMatchesReference(pb, GpuIo{sizes.k == 128});
    if (HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaPrefillShapeTest,
    ::testing::Combine(::testing::Values(1, 5, 16),
                       ::testing::Values(HeadConfig{4, 1}, HeadConfig{2, 2}, HeadConfig{2, 4},
                                         HeadConfig{2, 8}, HeadConfig{1, 3})),
    [](const auto& test_info) {
      const HeadConfig& h = std::get<1>(test_info.param);
      return absl::StrCat("bs", std::get<0>(test_info.param), "_kv", h.num_kv_heads, "x", h.group,
                          h.group == 1 ? "_MHA" : h.num_kv_heads == 1 ? "_MQA" : "_GQA");
    });

// ---------------------------------------------------------------------------------------
// Query dtype x cache dtype and scale mode, each over layouts, head sizes (fp8 rows of 80
// bytes and padded layouts take the element path, the others cp.async) and strided / dense
// activations.

// CacheKind::dtype kFloat16 here means "the query's 16-bit type".
class CudaPrefillDTypeTest : public ::testing::TestWithParam<std::tuple<DType, CacheKind>> {
 protected:
  void SetUp() override { KVSTREAM_SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaPrefillDTypeTest, MatchesReference) {
  const auto& [q_dtype, cache] = GetParam();
  // kPadded's odd head and token gaps leave no row 16-byte aligned: the element path.
  for (TestLayout layout : {TestLayout::kNHD, TestLayout::kHND, TestLayout::kPadded}) {
    for (HeadSizes sizes : {HeadSizes{64, 64}, HeadSizes{80, 80}, HeadSizes{128, 128},
                            HeadSizes{96, 48}}) {
      for (bool dense : {false, true}) {
        SCOPED_TRACE(absl::StrCat(TestLayoutName(layout), " head_size ", sizes.k, "/", sizes.v,
                                  dense ? " dense" : " strided"));
        AttnCase c;
        c.q_dtype = q_dtype;
        c.out_dtype = q_dtype;
        c.cache_dtype = IsFp8(cache.dtype) ? cache.dtype : q_dtype;
        c.quant = cache.quant;
        c.layout = layout;
        c.block_size = 16;
        c.head_size = sizes.k;
        c.head_size_v = sizes.v;
        c.seqs = {{0, 7}, {26, 7}, {99, 1}, {0, 1}, {32, 1}, {3, 70}};
        c.seed = 7;
        AttnProblem pb(c);
        ExpectGpuMatchesReference(pb, GpuIo{dense});
        if (HasFailure()) return;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllDTypes, CudaPrefillDTypeTest,
    ::testing::Combine(::testing::Values(DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(CacheKind{DType::kFloat16, KvQuantMode::kNone},
                                         CacheKind{DType::kFloat8E4M3, KvQuantMode::kPerTensor},
                                         CacheKind{DType::kFloat8E4M3, KvQuantMode::kPerHead},
                                         CacheKind{DType::kFloat8E5M2, KvQuantMode::kPerTensor},
                                         CacheKind{DType::kFloat8E5M2, KvQuantMode::kPerHead})),
    [](const auto& test_info) {
      const CacheKind& cache = std::get<1>(test_info.param);
      const bool fp8 = IsFp8(cache.dtype);
      return absl::StrCat("q", ShortDType(std::get<0>(test_info.param)), "_cache",
                          fp8 ? ShortDType(cache.dtype) : "Same",
                          QuantSuffix(cache.quant));
    });

// ---------------------------------------------------------------------------------------
// Features: causal or not x sliding window x ALiBi x soft cap, each over head_size_v 64 and
// 48 and both layouts, with sequences long enough to skip whole key tiles.

using FeatureParam = std::tuple<bool, int, bool, bool>;
class CudaPrefillFeatureTest : public ::testing::TestWithParam<FeatureParam> {
 protected:
  void SetUp() override { KVSTREAM_SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaPrefillFeatureTest, MatchesReference) {
  const auto& [causal, window, alibi, cap] = GetParam();
  for (int head_size_v : {64, 48}) {
    for (TestLayout layout : {TestLayout::kNHD, TestLayout::kHND}) {
      SCOPED_TRACE(absl::StrCat("head_size_v ", head_size_v, " ", TestLayoutName(layout)));
      AttnCase c = FeatureGridCase({causal, window, alibi, cap, head_size_v, layout});
      c.q_dtype = DType::kBFloat16;
      c.out_dtype = DType::kBFloat16;
      c.seqs = {{0, 21}, {150, 20}, {200, 1}, {3, 1}, {40, 3}, {0, 150}, {250, 0}};
      AttnProblem pb(c);
      ExpectGpuMatchesReference(pb, GpuIo{layout == TestLayout::kHND});
      if (HasFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Features, CudaPrefillFeatureTest,
    ::testing::Combine(::testing::Bool(), ::testing::Values(0, 5, 70), ::testing::Bool(),
                       ::testing::Bool()),
    [](const auto& test_info) {
      const FeatureParam& f = test_info.param;
      return absl::StrCat(std::get<0>(f) ? "causal" : "bidir", "_window", std::get<1>(f),
                          std::get<2>(f) ? "_alibi" : "", std::get<3>(f) ? "_cap" : "");
    });

// ---------------------------------------------------------------------------------------
// Long mixed batches: many query tiles (517 tokens x 4 heads per KV head), many key tiles,
// odd lengths, a decode row far into a long sequence, an empty query.

struct LongCase {
  const char* name;
  DType q_dtype;
  DType cache_dtype;
  KvQuantMode quant;
  bool causal;
  int window;
  bool alibi_and_cap;
  bool dense;
};

class CudaPrefillLongTest : public ::testing::TestWithParam<LongCase> {
 protected:
  void SetUp() override { KVSTREAM_SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaPrefillLongTest, MatchesReference) {
  const LongCase& lc = GetParam();
  AttnCase c;
  c.q_dtype = lc.q_dtype;
  c.out_dtype = lc.q_dtype;
  c.cache_dtype = lc.cache_dtype;
  c.quant = lc.quant;
  c.causal = lc.causal;
  c.sliding_window = lc.window;
  c.alibi = lc.alibi_and_cap;
  c.soft_cap = lc.alibi_and_cap ? 30.0f : 0.0f;
  c.num_kv_heads = 2;
  c.group = 4;
  c.head_size = 128;
  c.head_size_v = 128;
  c.block_size = 16;
  c.seqs = {{0, 517}, {300, 130}, {1000, 1}, {0, 7}, {77, 0}, {5, 1}, {1, 1}};
  c.seed = 3;
  AttnProblem pb(c);
  ExpectGpuMatchesReference(pb, GpuIo{lc.dense});
}

INSTANTIATE_TEST_SUITE_P(
    Batches, CudaPrefillLongTest,
    ::testing::Values(
        LongCase{"bf16_causal", DType::kBFloat16, DType::kBFloat16, KvQuantMode::kNone, true, 0,
                 false, true},
        LongCase{"bf16_causal_strided", DType::kBFloat16, DType::kBFloat16, KvQuantMode::kNone,
                 true, 0, false, false},
        LongCase{"bf16_bidir", DType::kBFloat16, DType::kBFloat16, KvQuantMode::kNone, false, 0,
                 false, true},
        LongCase{"bf16_causal_window100", DType::kBFloat16, DType::kBFloat16,
                 KvQuantMode::kNone, true, 100, false, true},
        LongCase{"bf16_bidir_window100", DType::kBFloat16, DType::kBFloat16, KvQuantMode::kNone,
                 false, 100, false, true},
        LongCase{"bf16_causal_alibi_cap", DType::kBFloat16, DType::kBFloat16,
                 KvQuantMode::kNone, true, 0, true, true},
        LongCase{"f16_causal", DType::kFloat16, DType::kFloat16, KvQuantMode::kNone, true, 0,
                 false, true},
        LongCase{"bf16_e4m3_perhead_causal", DType::kBFloat16, DType::kFloat8E4M3,
                 KvQuantMode::kPerHead, true, 0, false, true},
        LongCase{"f16_e5m2_pertensor_window100_alibi_cap", DType::kFloat16, DType::kFloat8E5M2,
                 KvQuantMode::kPerTensor, true, 100, true, false}),
    [](const auto& test_info) { return std::string(test_info.param.name); });

// ---------------------------------------------------------------------------------------
// The masks' exact extent: changing the key and value at one position moves exactly the
// outputs of the queries that see it, and leaves the others bit for bit (the kernel is
// deterministic).

TEST(CudaPrefillMaskTest, OneKeyMovesExactlyTheRowsThatSeeIt) {
  KVSTREAM_SKIP_WITHOUT_GPU();
  struct MaskCase {
    bool causal;
    int window;
  };
  for (MaskCase mc : {MaskCase{true, 0}, MaskCase{false, 0}, MaskCase{true, 4},
                      MaskCase{false, 4}, MaskCase{true, 70}, MaskCase{false, 65}}) {
    for (int pos : {0, 63, 64, 70, 127, 149}) {
      for (PrefillVariant variant : AllVariants()) {
        if (variant == PrefillVariant::kWgmma && !DeviceRunsWgmma()) continue;
        SCOPED_TRACE(absl::StrCat(mc.causal ? "causal" : "bidirectional", " window ", mc.window,
                                  " key ", pos, " ", VariantName(variant), " variant"));
        AttnCase c;
        c.seqs = {{10, 140}};  // query positions 10 .. 149
        c.num_kv_heads = 1;
        c.group = 2;
        c.causal = mc.causal;
        c.sliding_window = mc.window;
        // float16: an output's last place is small enough that every row that sees the
        // changed key moves.
        c.q_dtype = DType::kFloat16;
        c.out_dtype = DType::kFloat16;
        c.cache_dtype = DType::kFloat16;
        c.pad_tokens = 1;
        AttnProblem pb(c);
        std::vector<uint8_t> before = pb.NewOut();
        GpuIo io;
        io.variant = variant;
        io.dense = variant == PrefillVariant::kWgmma;  // its rows must be 16-byte aligned
        const absl::Status first = RunOnGpu(pb.params(before), before, io);
        ASSERT_TRUE(first.ok()) << first;
        for (int d = 0; d < c.head_size; ++d) pb.SetCache(false, 0, pos, 0, d, 0.9f);
        for (int d = 0; d < c.head_size_v; ++d) pb.SetCache(true, 0, pos, 0, d, 5.0f);
        std::vector<uint8_t> after = pb.NewOut();
        ASSERT_TRUE(RunOnGpu(pb.params(after), after, io).ok());
        int wrong = 0;
        for (int t = 0; t < 140; ++t) {
          const int qp = 10 + t;
          bool sees = !mc.causal || pos <= qp;
          if (mc.window > 0) sees = sees && std::abs(qp - pos) <= mc.window - 1;
          for (int h = 0; h < 2; ++h) {
            bool moved = false;
            for (int d = 0; d < c.head_size_v; ++d) {
              moved |= pb.Out(before, t, h, d) != pb.Out(after, t, h, d);
            }
            if (moved != sees && ++wrong <= 5) {
              ADD_FAILURE() << "query at position " << qp << " head " << h
                            << (sees ? " should see" : " must not see") << " the key";
            }
          }
        }
        EXPECT_EQ(wrong, 0);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// What the launcher rejects, naming it; nothing is launched.

internal::PagedKernelParams SupportedKernelParams() {
  internal::PagedKernelParams p{};
  p.num_heads = 8;
  p.num_kv_heads = 2;
  p.head_size = 128;
  p.head_size_v = 128;
  p.block_size = 16;
  p.num_seqs = 1;
  p.max_query_len = 1;
  p.max_seq_len = 1;
  p.scale = 1.0f;
  p.num_scales = 1;
  p.k_scale[0] = 1.0f;
  p.v_scale[0] = 1.0f;
  return p;
}

TEST(CudaPrefillLimitsTest, UnsupportedCombinationsAreInvalidArgument) {
  KVSTREAM_SKIP_WITHOUT_GPU();
  const internal::PagedKernelParams ok = SupportedKernelParams();
  struct Bad {
    internal::PagedKernelParams params;
    DType q, out, cache;
    const char* names;
  };
  internal::PagedKernelParams big_head = ok;
  big_head.head_size = 512;
  big_head.head_size_v = 512;
  internal::PagedKernelParams big_head_v = ok;
  big_head_v.head_size_v = 320;
  const Bad cases[] = {
      {ok, DType::kFloat32, DType::kFloat32, DType::kFloat32, "float32"},
      {ok, DType::kBFloat16, DType::kFloat32, DType::kBFloat16, "out dtype"},
      {ok, DType::kBFloat16, DType::kBFloat16, DType::kFloat16, "cache dtype"},
      {ok, DType::kFloat16, DType::kFloat16, DType::kFloat32, "cache dtype"},
      {big_head, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16, "head_size=512"},
      {big_head_v, DType::kFloat16, DType::kFloat16, DType::kFloat8E4M3, "head_size_v=320"},
  };
  // Rejected with InvalidArgument naming what was wrong (bad.names and `also`).
  auto expect_rejected = [](const Bad& bad, const internal::PrefillLaunchOptions& options,
                            const char* also) {
    const absl::Status st =
        internal::LaunchPrefillAttention(bad.params, bad.q, bad.out, bad.cache, options, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(std::string(st.message()).find(bad.names), std::string::npos) << st;
    EXPECT_NE(std::string(st.message()).find(also), std::string::npos) << st;
  };
  for (const Bad& bad : cases) expect_rejected(bad, {}, "");
  // The fast variant, asked for where it does not apply.
  internal::PrefillLaunchOptions fast;
  fast.variant = PrefillVariant::kFast;
  internal::PagedKernelParams unequal = ok;
  unequal.head_size_v = 64;
  for (const Bad& bad : {Bad{ok, DType::kBFloat16, DType::kBFloat16, DType::kFloat8E4M3,
                             "fast variant"},
                         Bad{big_head_v, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16,
                             "head_size_v"},
                         Bad{unequal, DType::kFloat16, DType::kFloat16, DType::kFloat16,
                             "fast variant"}}) {
    expect_rejected(bad, fast, "");
  }
  // The wgmma kernel, asked for where it does not apply or where the device cannot run it.
  internal::PrefillLaunchOptions wgmma;
  wgmma.variant = PrefillVariant::kWgmma;
  wgmma.wgmma = true;
  internal::PagedKernelParams odd_block = ok;
  odd_block.block_size = 24;
  internal::PagedKernelParams head_256 = ok;
  head_256.head_size = 256;
  head_256.head_size_v = 256;
  for (const Bad& bad : {Bad{head_256, DType::kBFloat16, DType::kBFloat16, DType::kFloat8E4M3,
                             "head sizes 256/256"},
                         Bad{unequal, DType::kFloat16, DType::kFloat16, DType::kFloat16,
                             "head sizes 128/64"},
                         Bad{odd_block, DType::kFloat16, DType::kFloat16, DType::kFloat16,
                             "block size 24 is not a power of two in [16, 256] (TMA loads)"}}) {
    expect_rejected(bad, wgmma, "wgmma kernel does not apply");
  }
  // Pairs take what single CTAs take, no more (params the kernel otherwise takes: a cache
  // of 4 blocks with NHD strides, in blocks of 24 keys).
  internal::PagedKernelParams cached_odd = ok;
  cached_odd.num_blocks = 4;
  cached_odd.k_token_stride = cached_odd.v_token_stride = 2 * 128;
  cached_odd.k_head_stride = cached_odd.v_head_stride = 128;
  cached_odd.block_size = 24;
  cached_odd.k_block_stride = cached_odd.v_block_stride = 24 * 2 * 128;
  internal::PrefillLaunchOptions pair = wgmma;
  pair.wgmma_cluster = PrefillWgmmaCluster::kPair;
  expect_rejected(Bad{cached_odd, DType::kFloat16, DType::kFloat16, DType::kFloat16,
                      "block size 24 is not a power of two"},
                  pair, "wgmma kernel does not apply");
  wgmma.wgmma = false;
  expect_rejected(Bad{ok, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16, "wgmma"}, wgmma,
                  "sm_90a");
}

}  // namespace
}  // namespace kvstream
