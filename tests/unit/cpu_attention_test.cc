// Tests of the CPU attention kernels: the golden reference against closed forms and mask
// invariants, the fast path (every instruction-set variant this CPU runs, one thread and
// many) against the reference over grids of dtypes, layouts, shapes and features, the fast
// path's batch invariance (a row's bits do not depend on what else is in the call), the
// fast path's vectorised math against libm, and every validation error.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attention/src/cpu/fast_internal.h"
#include "attention/src/cpu/vec_math.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvstream/attention/backend.h"
#include "kvstream/attention/cpu_attention.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/common/numeric.h"
#include "tests/unit/attention_test_util.h"

namespace kvstream {
namespace {

using ::kvstream::testing_util::AttnCase;
using ::kvstream::testing_util::AttnProblem;
using ::kvstream::testing_util::DTypeGrid;
using ::kvstream::testing_util::DTypeGridCase;
using ::kvstream::testing_util::DTypeGridName;
using ::kvstream::testing_util::DTypeGridParam;
using ::kvstream::testing_util::FeatureGrid;
using ::kvstream::testing_util::FeatureGridCase;
using ::kvstream::testing_util::FeatureGridName;
using ::kvstream::testing_util::FeatureGridParam;
using ::kvstream::testing_util::ForEachQueryOutput;
using ::kvstream::testing_util::HeadConfig;
using ::kvstream::testing_util::HeadSizes;
using ::kvstream::testing_util::OutputTolerance;
using ::kvstream::testing_util::PromptData;
using ::kvstream::testing_util::QueryOutput;
using ::kvstream::testing_util::SeqSpec;
using ::kvstream::testing_util::ShapeGridCase;
using ::kvstream::testing_util::ShapeGridName;
using ::kvstream::testing_util::ShortDType;
using ::kvstream::testing_util::TestLayout;
using ::kvstream::testing_util::TestLayoutName;
using ::testing::HasSubstr;

// A named way of running attention; the tests loop over all of them.
struct Runner {
  std::string name;
  std::function<absl::Status(const PagedAttentionParams&)> run;
};

std::vector<Runner> FastRunners() {
  std::vector<Runner> runners;
  for (internal::CpuIsa isa : internal::SupportedCpuIsas()) {
    runners.push_back({absl::StrCat("fast/", internal::CpuIsaName(isa), "/1thread"),
                       [isa](const PagedAttentionParams& p) {
                         return internal::RunAttentionCpuWith(p, isa, 1);
                       }});
  }
  // The public entry: best variant, default thread count.
  runners.push_back({"fast/default", &RunAttentionCpu});
  return runners;
}

std::vector<Runner> AllRunners() {
  std::vector<Runner> runners = {{"reference", &RunAttentionReference}};
  for (Runner& r : FastRunners()) runners.push_back(std::move(r));
  return runners;
}

// Runs the reference and every fast variant on `pb` and compares element by element.
void ExpectFastMatchesReference(AttnProblem& pb) {
  const AttnCase& c = pb.config();
  std::vector<uint8_t> ref_out = pb.NewOut();
  ASSERT_TRUE(RunAttentionReference(pb.params(ref_out)).ok());
  EXPECT_EQ(pb.CountStrayWrites(ref_out), 0) << "reference wrote outside its rows";
  const float tol = OutputTolerance(c.out_dtype);
  for (const Runner& runner : FastRunners()) {
    SCOPED_TRACE(runner.name);
    std::vector<uint8_t> out = pb.NewOut();
    const absl::Status st = runner.run(pb.params(out));
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(pb.CountStrayWrites(out), 0) << "wrote outside its rows";
    int failures = 0;
    int nans = 0;
    ForEachQueryOutput(pb, [&](const QueryOutput& o) {
      const auto [s, t, row, h, d] = o;
      const float want = pb.Out(ref_out, row, h, d);
      const float got = pb.Out(out, row, h, d);
      if (std::isnan(want) || std::isnan(got)) {
        if (++nans <= 3) ADD_FAILURE() << "NaN at seq " << s << " token " << t;
        return;
      }
      if (std::fabs(want - got) > tol + tol * std::fabs(want)) {
        if (++failures <= 5) {
          ADD_FAILURE() << "seq " << s << " token " << t << " head " << h << " d " << d
                        << ": reference " << want << " fast " << got;
        }
      }
    });
    EXPECT_EQ(failures, 0);
    EXPECT_EQ(nans, 0);
  }
}

// ---------------------------------------------------------------------------------------
// The fast path's vectorised math.

TEST(CpuAttentionVecMathTest, HalfConversionIsBitExactForAllInputs) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float want = HalfToFloat(static_cast<uint16_t>(h));
    const float got = internal::HalfBitsToFloatVec(static_cast<uint16_t>(h));
    ASSERT_EQ(FloatBits(want), FloatBits(got)) << "half bits " << h;
  }
}

TEST(CpuAttentionVecMathTest, BFloat16ConversionIsBitExactForAllInputs) {
  for (uint32_t h = 0; h < 65536; ++h) {
    ASSERT_EQ(FloatBits(BFloat16ToFloat(static_cast<uint16_t>(h))),
              FloatBits(internal::BFloat16BitsToFloatVec(static_cast<uint16_t>(h))));
  }
}

TEST(CpuAttentionVecMathTest, ExpMatchesLibmOnNonPositiveArguments) {
  double worst = 0;
  for (float x = 0.0f; x > -87.0f; x -= 0.00731f) {
    const double want = std::exp(static_cast<double>(x));
    const double got = internal::ExpNonPositive(x);
    worst = std::max(worst, std::fabs(got - want) / want);
  }
  EXPECT_LT(worst, 4e-7);
  EXPECT_EQ(internal::ExpNonPositive(0.0f), 1.0f);
  EXPECT_EQ(internal::ExpNonPositive(-88.0f), 0.0f);
  EXPECT_EQ(internal::ExpNonPositive(-1e30f), 0.0f);
  EXPECT_EQ(internal::ExpNonPositive(-INFINITY), 0.0f);
}

TEST(CpuAttentionVecMathTest, TanhMatchesLibm) {
  double worst = 0;
  for (float x = -20.0f; x < 20.0f; x += 0.00377f) {
    worst = std::max(worst, std::fabs(static_cast<double>(internal::TanhVec(x)) -
                                      std::tanh(static_cast<double>(x))));
  }
  EXPECT_LT(worst, 2e-7);
  EXPECT_EQ(internal::TanhVec(0.0f), 0.0f);
  EXPECT_EQ(internal::TanhVec(100.0f), 1.0f);
  EXPECT_EQ(internal::TanhVec(-100.0f), -1.0f);
}

// ---------------------------------------------------------------------------------------
// The reference against answers computed by hand, and both implementations against the
// same closed forms.

// A problem with one KV head per query head, head sizes as given and the cache zeroed
// out for the positions the test sets.
AttnCase TinyCase(std::vector<SeqSpec> seqs, int head_size, int head_size_v) {
  AttnCase c;
  c.block_size = 2;  // several blocks even for three keys
  c.num_kv_heads = 1;
  c.group = 1;
  c.head_size = head_size;
  c.head_size_v = head_size_v;
  c.scale = 1.0f;
  c.seqs = std::move(seqs);
  c.pad_tokens = 1;
  return c;
}

TEST(CpuAttentionReferenceTest, OneQueryTwoKeysClosedForm) {
  AttnProblem pb(TinyCase({{1, 1}}, 2, 2));
  pb.SetQuery(0, 0, 0, 1.0f);
  pb.SetQuery(0, 0, 1, 0.5f);
  // k0 = (1, 0), k1 = (0, -2): scores 1 and -1. v0 = (1, 2), v1 = (3, -1).
  const float k[2][2] = {{1, 0}, {0, -2}};
  const float v[2][2] = {{1, 2}, {3, -1}};
  for (int j = 0; j < 2; ++j) {
    for (int d = 0; d < 2; ++d) {
      pb.SetCache(false, 0, j, 0, d, k[j][d]);
      pb.SetCache(true, 0, j, 0, d, v[j][d]);
    }
  }
  const double p0 = std::exp(1.0) / (std::exp(1.0) + std::exp(-1.0));
  const double p1 = 1.0 - p0;
  for (const Runner& runner : AllRunners()) {
    SCOPED_TRACE(runner.name);
    std::vector<uint8_t> out = pb.NewOut();
    ASSERT_TRUE(runner.run(pb.params(out)).ok());
    EXPECT_NEAR(pb.Out(out, 0, 0, 0), p0 * 1 + p1 * 3, 1e-6);
    EXPECT_NEAR(pb.Out(out, 0, 0, 1), p0 * 2 + p1 * -1, 1e-6);
    EXPECT_EQ(pb.CountStrayWrites(out), 0);
  }
}

TEST(CpuAttentionReferenceTest, CausalIsBottomRightAligned) {
  // Three keys, the last two are this step's queries: query 0 sits at position 1.
  for (bool causal : {true, false}) {
    AttnCase c = TinyCase({{1, 2}}, 1, 1);
    c.causal = causal;
    AttnProblem pb(c);
    for (int j = 0; j < 3; ++j) {
      pb.SetCache(false, 0, j, 0, 0, static_cast<float>(j));          // scores 0, 1, 2
      pb.SetCache(true, 0, j, 0, 0, std::pow(10.0f, static_cast<float>(j)));  // 1, 10, 100
    }
    pb.SetQuery(0, 0, 0, 1.0f);
    pb.SetQuery(1, 0, 0, 1.0f);
    const double e = std::exp(1.0);
    const double all = (1 + 10 * e + 100 * e * e) / (1 + e + e * e);
    const double first = causal ? (1 + 10 * e) / (1 + e) : all;
    for (const Runner& runner : AllRunners()) {
      SCOPED_TRACE(absl::StrCat(runner.name, causal ? " causal" : " bidirectional"));
      std::vector<uint8_t> out = pb.NewOut();
      ASSERT_TRUE(runner.run(pb.params(out)).ok());
      EXPECT_NEAR(pb.Out(out, 0, 0, 0), first, 1e-4);
      EXPECT_NEAR(pb.Out(out, 1, 0, 0), all, 1e-4);
    }
  }
}

TEST(CpuAttentionReferenceTest, SoftCapThenAlibiClosedForm) {
  AttnCase c = TinyCase({{1, 1}}, 1, 1);
  c.soft_cap = 0.5f;
  c.alibi = true;
  AttnProblem pb(c);
  pb.alibi_slopes()[0] = 0.25f;
  pb.SetQuery(0, 0, 0, 1.0f);
  pb.SetCache(false, 0, 0, 0, 0, 2.0f);
  pb.SetCache(false, 0, 1, 0, 0, 0.0f);
  pb.SetCache(true, 0, 0, 0, 0, 1.0f);
  pb.SetCache(true, 0, 1, 0, 0, -1.0f);
  // The query sits at position 1: s0 = 0.5 tanh(2 / 0.5) + 0.25 (0 - 1), s1 = 0.
  const double s0 = 0.5 * std::tanh(4.0) - 0.25;
  const double w0 = std::exp(s0) / (std::exp(s0) + 1.0);
  for (const Runner& runner : AllRunners()) {
    SCOPED_TRACE(runner.name);
    std::vector<uint8_t> out = pb.NewOut();
    ASSERT_TRUE(runner.run(pb.params(out)).ok());
    EXPECT_NEAR(pb.Out(out, 0, 0, 0), w0 * 1 + (1 - w0) * -1, 1e-6);
  }
}

TEST(CpuAttentionReferenceTest, Fp8PerHeadScalesDequantise) {
  AttnCase c = TinyCase({{1, 1}}, 1, 1);
  c.num_kv_heads = 2;
  c.cache_dtype = DType::kFloat8E4M3;
  c.quant = KvQuantMode::kPerHead;
  AttnProblem pb(c);
  // Stored codes 2 and 0 for K, 4 and -8 for V (exact in e4m3), scaled per head.
  for (int g = 0; g < 2; ++g) {
    const float ks = pb.k_scales()[static_cast<size_t>(g)];
    const float vs = pb.v_scales()[static_cast<size_t>(g)];
    pb.SetQuery(0, g, 0, 1.0f);
    pb.SetCache(false, 0, 0, g, 0, 2.0f * ks);
    pb.SetCache(false, 0, 1, g, 0, 0.0f);
    pb.SetCache(true, 0, 0, g, 0, 4.0f * vs);
    pb.SetCache(true, 0, 1, g, 0, -8.0f * vs);
  }
  for (const Runner& runner : AllRunners()) {
    SCOPED_TRACE(runner.name);
    std::vector<uint8_t> out = pb.NewOut();
    ASSERT_TRUE(runner.run(pb.params(out)).ok());
    for (int g = 0; g < 2; ++g) {
      const double ks = pb.k_scales()[static_cast<size_t>(g)];
      const double vs = pb.v_scales()[static_cast<size_t>(g)];
      const double w0 = std::exp(2 * ks) / (std::exp(2 * ks) + 1.0);
      EXPECT_NEAR(pb.Out(out, 0, g, 0), w0 * 4 * vs + (1 - w0) * -8 * vs, 1e-6) << "head " << g;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Masks and head mapping: which outputs a change to one key may move.

// Runs `runner`, changes key and value at `pos` of sequence 0 (KV head `g`), runs again,
// and returns for each (query row, head) whether the output moved.
std::vector<std::vector<bool>> RowsMovedByKey(AttnProblem& pb, const Runner& runner, int pos,
                                              int g) {
  const AttnCase& c = pb.config();
  std::vector<uint8_t> before = pb.NewOut();
  EXPECT_TRUE(runner.run(pb.params(before)).ok());
  for (int d = 0; d < c.head_size; ++d) pb.SetCache(false, 0, pos, g, d, 0.9f);
  for (int d = 0; d < c.head_size_v; ++d) pb.SetCache(true, 0, pos, g, d, 5.0f);
  std::vector<uint8_t> after = pb.NewOut();
  EXPECT_TRUE(runner.run(pb.params(after)).ok());
  std::vector<std::vector<bool>> moved(static_cast<size_t>(c.seqs[0].query_len),
                                       std::vector<bool>(static_cast<size_t>(pb.num_heads())));
  for (int t = 0; t < c.seqs[0].query_len; ++t) {
    for (int h = 0; h < pb.num_heads(); ++h) {
      bool differs = false;
      for (int d = 0; d < c.head_size_v; ++d) {
        differs |= pb.Out(before, t, h, d) != pb.Out(after, t, h, d);
      }
      moved[static_cast<size_t>(t)][static_cast<size_t>(h)] = differs;
    }
  }
  return moved;
}

TEST(CpuAttentionMaskTest, CausalMaskHidesFutureKeys) {
  for (const Runner& runner : AllRunners()) {
    SCOPED_TRACE(runner.name);
    AttnCase c;
    c.seqs = {{5, 20}};  // positions 5 .. 24
    c.num_kv_heads = 1;
    c.group = 2;
    AttnProblem pb(c);
    const auto moved = RowsMovedByKey(pb, runner, /*pos=*/15, /*g=*/0);
    for (int t = 0; t < 20; ++t) {
      for (int h = 0; h < 2; ++h) {
        EXPECT_EQ(moved[static_cast<size_t>(t)][static_cast<size_t>(h)], 5 + t >= 15)
            << "query at position " << 5 + t << " head " << h;
      }
    }
  }
}

TEST(CpuAttentionMaskTest, BidirectionalSeesFutureKeys) {
  for (const Runner& runner : AllRunners()) {
    SCOPED_TRACE(runner.name);
    AttnCase c;
    c.seqs = {{5, 20}};
    c.num_kv_heads = 1;
    c.group = 1;
    c.causal = false;
    AttnProblem pb(c);
    const auto moved = RowsMovedByKey(pb, runner, /*pos=*/15, /*g=*/0);
    for (int t = 0; t < 20; ++t) EXPECT_TRUE(moved[static_cast<size_t>(t)][0]) << t;
  }
}

TEST(CpuAttentionMaskTest, SlidingWindowRestrictsToRecentKeys) {
  for (bool causal : {true, false}) {
    for (const Runner& runner : AllRunners()) {
      SCOPED_TRACE(absl::StrCat(runner.name, causal ? " causal" : " bidirectional"));
      AttnCase c;
      c.seqs = {{0, 90}};
      c.num_kv_heads = 1;
      c.group = 1;
      c.causal = causal;
      c.sliding_window = 4;
      AttnProblem pb(c);
      // Key 70 is seen by queries at |qp - 70| <= 3, and only from the left when causal.
      const auto moved = RowsMovedByKey(pb, runner, /*pos=*/70, /*g=*/0);
      for (int qp = 0; qp < 90; ++qp) {
        const bool sees = qp >= 70 - (causal ? 0 : 3) && qp <= 73;
        EXPECT_EQ(moved[static_cast<size_t>(qp)][0], sees) << "query at position " << qp;
      }
    }
  }
}

TEST(CpuAttentionMaskTest, QueryHeadsReadTheirGroupsKvHead) {
  for (const Runner& runner : AllRunners()) {
    SCOPED_TRACE(runner.name);
    AttnCase c;
    c.seqs = {{3, 4}};
    c.num_kv_heads = 2;
    c.group = 3;
    AttnProblem pb(c);
    const auto moved = RowsMovedByKey(pb, runner, /*pos=*/0, /*g=*/1);
    for (int t = 0; t < 4; ++t) {
      for (int h = 0; h < 6; ++h) {
        EXPECT_EQ(moved[static_cast<size_t>(t)][static_cast<size_t>(h)], h >= 3)
            << "token " << t << " head " << h;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Fast path against the reference.

// Every query dtype x every cache dtype and scale mode x both dense layouts.
class CpuAttentionDTypeGridTest
    : public ::testing::TestWithParam<DTypeGridParam> {};

TEST_P(CpuAttentionDTypeGridTest, FastMatchesReference) {
  AttnCase c = DTypeGridCase(GetParam());
  c.block_size = 5;
  c.seed = 7;
  AttnProblem pb(c);
  ExpectFastMatchesReference(pb);
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, CpuAttentionDTypeGridTest, DTypeGrid(), DTypeGridName);

TEST(CpuAttentionMixedDTypeTest, OutputDTypeDiffersFromQuery) {
  for (DType out : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(ShortDType(out));
    AttnCase c;
    c.q_dtype = DType::kBFloat16;
    c.out_dtype = out;
    c.cache_dtype = DType::kFloat16;
    AttnProblem pb(c);
    ExpectFastMatchesReference(pb);
  }
}

// Block sizes x GQA ratios (MHA, GQA 3/4/8, MQA) x head sizes, over a batch with sequence
// lengths 1, 7, 33 and 100 in prefill, chunked prefill and decode.
class CpuAttentionShapeGridTest
    : public ::testing::TestWithParam<std::tuple<int, HeadConfig, HeadSizes>> {};

TEST_P(CpuAttentionShapeGridTest, FastMatchesReference) {
  const auto& [block_size, heads, sizes] = GetParam();
  AttnCase c = ShapeGridCase(block_size, heads, sizes);
  c.seqs = {{0, 33}, {67, 33}, {99, 1}, {6, 1}, {0, 7}, {0, 1}};
  c.seed = static_cast<uint32_t>(block_size * 100 + heads.group * 10 + sizes.v);
  AttnProblem pb(c);
  ExpectFastMatchesReference(pb);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CpuAttentionShapeGridTest,
    ::testing::Combine(::testing::Values(1, 5, 16),
                       ::testing::Values(HeadConfig{4, 1}, HeadConfig{2, 3}, HeadConfig{2, 4},
                                         HeadConfig{1, 8}, HeadConfig{2, 8}),
                       ::testing::Values(HeadSizes{64, 64}, HeadSizes{64, 80},
                                         HeadSizes{64, 32}, HeadSizes{72, 40})),
    [](const auto& test_info) {
      return ShapeGridName(std::get<0>(test_info.param), std::get<1>(test_info.param),
                           std::get<2>(test_info.param));
    });

// Every feature alone and in combination: causal or not x sliding window x ALiBi x soft
// cap x head_size_v, on both layouts, with sequences long enough to skip whole KV tiles.
class CpuAttentionFeatureGridTest : public ::testing::TestWithParam<FeatureGridParam> {};

TEST_P(CpuAttentionFeatureGridTest, FastMatchesReference) {
  AttnCase c = FeatureGridCase(GetParam());
  c.seqs = {{0, 21}, {150, 20}, {200, 1}, {3, 1}, {40, 3}};
  AttnProblem pb(c);
  ExpectFastMatchesReference(pb);
}

INSTANTIATE_TEST_SUITE_P(Features, CpuAttentionFeatureGridTest, FeatureGrid(), FeatureGridName);

// Strides that match neither dense layout: padded heads, tokens and blocks, and a strided
// head dimension.
class CpuAttentionStrideTest : public ::testing::TestWithParam<std::tuple<TestLayout, DType>> {};

TEST_P(CpuAttentionStrideTest, FastMatchesReference) {
  AttnCase c;
  c.layout = std::get<0>(GetParam());
  c.cache_dtype = std::get<1>(GetParam());
  c.quant = KvQuantMode::kPerHead;
  c.head_size_v = 48;
  c.sliding_window = 30;
  AttnProblem pb(c);
  ExpectFastMatchesReference(pb);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, CpuAttentionStrideTest,
    ::testing::Combine(::testing::Values(TestLayout::kPadded, TestLayout::kDimStrided),
                       ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16,
                                         DType::kFloat8E4M3, DType::kFloat8E5M2)),
    [](const auto& test_info) {
      return absl::StrCat(TestLayoutName(std::get<0>(test_info.param)), "_",
                          ShortDType(std::get<1>(test_info.param)));
    });

// Long sequences: many KV tiles and query tiles, split over threads.
TEST(CpuAttentionLongBatchTest, FastMatchesReference) {
  for (int window : {0, 100}) {
    for (TestLayout layout : {TestLayout::kNHD, TestLayout::kHND}) {
      SCOPED_TRACE(absl::StrCat("window ", window, " ", TestLayoutName(layout)));
      AttnCase c;
      c.layout = layout;
      c.sliding_window = window;
      c.cache_dtype = DType::kBFloat16;
      c.q_dtype = DType::kBFloat16;
      c.out_dtype = DType::kFloat32;
      c.alibi = window > 0;
      c.soft_cap = window > 0 ? 30.0f : 0.0f;
      c.seqs = {{0, 300}, {500, 40}, {700, 1}, {333, 1}, {65, 1}};
      AttnProblem pb(c);
      ExpectFastMatchesReference(pb);
    }
  }
}

// A cache made by the cache library (KvCache::Create), read through its own view.
TEST(CpuAttentionKvCacheTest, FastMatchesReferenceOnLibraryCache) {
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
    SCOPED_TRACE(KvLayoutName(layout));
    KvCache::Options options;
    options.spec.block_size = 16;
    options.spec.num_kv_heads = 2;
    options.spec.head_size = 64;
    options.spec.head_size_v = 64;
    options.spec.dtype = DType::kFloat8E4M3;
    options.spec.quant_mode = KvQuantMode::kPerTensor;
    options.layout = layout;
    options.num_blocks = 8;
    auto cache = KvCache::Create(options);
    ASSERT_TRUE(cache.ok()) << cache.status();
    ASSERT_TRUE((*cache)->SetScales({0.01f}, {0.02f}).ok());
    const KvCacheView view = (*cache)->view();
    // Fill through the view's strides: code i * 7 % 120, so every element differs.
    for (int64_t b = 0; b < 8; ++b) {
      for (int t = 0; t < 16; ++t) {
        for (int g = 0; g < 2; ++g) {
          for (int d = 0; d < 64; ++d) {
            const int64_t i = ((b * 16 + t) * 2 + g) * 64 + d;
            static_cast<uint8_t*>(view.k)[view.k_strides.Offset(b, t, g, d)] =
                static_cast<uint8_t>(i * 7 % 120);
            static_cast<uint8_t*>(view.v)[view.v_strides.Offset(b, t, g, d)] =
                static_cast<uint8_t>(i * 13 % 120 + 128 * (i % 2));
          }
        }
      }
    }
    std::vector<float> q(static_cast<size_t>(3 * 8 * 64));
    for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(static_cast<float>(i));
    const std::vector<int32_t> query_start_loc = {0, 2, 3};
    const std::vector<int32_t> seq_lens = {40, 70};
    const std::vector<int32_t> block_table = {5, 1, 6, 0, 0, 0, 2, 7, 3, 4};
    PagedAttentionParams p;
    p.q = q.data();
    p.q_dtype = DType::kFloat32;
    p.q_token_stride = 8 * 64;
    p.q_head_stride = 64;
    p.out_dtype = DType::kFloat32;
    p.o_token_stride = 8 * 64;
    p.o_head_stride = 64;
    p.num_tokens = 3;
    p.cache = view;
    p.query_start_loc = query_start_loc.data();
    p.seq_lens = seq_lens.data();
    p.block_table = block_table.data();
    p.block_table_stride = 5;
    p.num_seqs = 2;
    p.max_query_len = 2;
    p.max_seq_len = 70;
    p.num_heads = 8;
    p.scale = 0.125f;
    std::vector<float> want(q.size()), got(q.size());
    p.out = want.data();
    ASSERT_TRUE(RunAttentionReference(p).ok());
    p.out = got.data();
    ASSERT_TRUE(RunAttentionCpu(p).ok());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_FALSE(std::isnan(want[i])) << i;
      ASSERT_NEAR(want[i], got[i], 1e-4f * (1.0f + std::fabs(want[i]))) << i;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Batch invariance: the bits of a query row depend only on its query, its sequence's keys
// and values and the layer's parameters; not on the other rows of the call, the split into
// work items, the thread count, or decode versus prefill. A disaggregated decode worker
// computes a prompt's last token as a 1-token decode over the transferred cache and must
// match, bit for bit, the colocated run that computed it as a row of the whole prefill.
// Within one instruction-set variant; each variant is checked on its own.

// The bytes of one output row, every head.
using Row = std::vector<uint8_t>;

// One call: sequence i of `seqs` holds *prompts[i].
struct InvarianceCall {
  std::vector<SeqSpec> seqs;
  std::vector<const PromptData*> prompts;
};

// The problem of one call, built once and run with every variant and thread count.
class InvarianceRun {
 public:
  InvarianceRun(AttnCase c, const InvarianceCall& call, uint32_t seed) : call_(call) {
    c.seqs = call.seqs;
    c.seed = seed;
    pb_ = std::make_unique<AttnProblem>(c);
    for (size_t s = 0; s < call.seqs.size(); ++s) pb_->FillSequence(s, *call.prompts[s]);
  }

  // Output rows by sequence and query token; empty on error (after a test failure).
  std::vector<std::vector<Row>> Rows(internal::CpuIsa isa, int threads) const {
    std::vector<uint8_t> out = pb_->NewOut();
    const absl::Status st = internal::RunAttentionCpuWith(pb_->params(out), isa, threads);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) return {};
    std::vector<std::vector<Row>> rows(call_.seqs.size());
    for (size_t s = 0; s < call_.seqs.size(); ++s) {
      for (int t = 0; t < call_.seqs[s].query_len; ++t) {
        rows[s].push_back(pb_->OutRow(out, pb_->query_start(s) + t));
      }
    }
    return rows;
  }

 private:
  InvarianceCall call_;
  std::unique_ptr<AttnProblem> pb_;
};

// Whether two output rows are the same bits; names the first difference. The invariance
// tests store float32 outputs, the strictest comparison (and the one this message reads).
::testing::AssertionResult SameRow(const Row& want, const Row& got, int head_size_v) {
  if (want.size() != got.size()) return ::testing::AssertionFailure() << "row sizes differ";
  if (std::memcmp(want.data(), got.data(), want.size()) == 0) {
    return ::testing::AssertionSuccess();
  }
  size_t first = want.size();
  int differing = 0;
  for (size_t i = 0; i < want.size(); i += sizeof(float)) {
    if (std::memcmp(want.data() + i, got.data() + i, sizeof(float)) != 0) {
      first = std::min(first, i);
      ++differing;
    }
  }
  float a, b;
  std::memcpy(&a, want.data() + first, sizeof(float));
  std::memcpy(&b, got.data() + first, sizeof(float));
  const size_t e = first / sizeof(float);
  return ::testing::AssertionFailure()
         << differing << " of " << want.size() / sizeof(float) << " elements differ; first: head "
         << e / static_cast<size_t>(head_size_v) << " d " << e % static_cast<size_t>(head_size_v)
         << ": " << a << " (bits " << FloatBits(a) << ") vs " << b << " (bits " << FloatBits(b)
         << ")";
}

// Expects got[t] to be the bits of want[first + t] for every t; one failure per call, with
// the number of rows that differ and the first of them.
void ExpectSameRows(const std::vector<Row>& want, int first, const std::vector<Row>& got,
                    int head_size_v, const std::string& what) {
  int differing = 0;
  ::testing::AssertionResult first_failure = ::testing::AssertionSuccess();
  int first_token = -1;
  for (size_t t = 0; t < got.size(); ++t) {
    ::testing::AssertionResult same =
        SameRow(want[static_cast<size_t>(first) + t], got[t], head_size_v);
    if (!same && differing++ == 0) {
      first_failure = same;
      first_token = static_cast<int>(t);
    }
  }
  if (differing > 0) {
    ADD_FAILURE() << what << ": " << differing << " of " << got.size()
                  << " rows differ from the whole-prompt prefill; first at token "
                  << first + first_token << ": " << first_failure.message();
  }
}

struct InvarianceFeatures {
  const char* name;
  DType cache_dtype;
  int sliding_window;
  bool alibi;
  bool soft_cap;
};

void PrintTo(const InvarianceFeatures& f, std::ostream* os) { *os << f.name; }

using InvarianceParam = std::tuple<int, int, InvarianceFeatures>;  // block size, group, ...

class CpuAttentionBatchInvarianceTest : public ::testing::TestWithParam<InvarianceParam> {};

TEST_P(CpuAttentionBatchInvarianceTest, RowsDoNotDependOnTheBatch) {
  const auto& [block_size, group, features] = GetParam();
  AttnCase c;
  c.block_size = block_size;
  c.num_kv_heads = 2;
  c.group = group;
  c.head_size = 64;
  c.head_size_v = 48;
  c.cache_dtype = features.cache_dtype;
  c.quant = IsFp8(features.cache_dtype) ? KvQuantMode::kPerHead : KvQuantMode::kNone;
  c.sliding_window = features.sliding_window;
  c.alibi = features.alibi;
  c.soft_cap = features.soft_cap ? 2.0f : 0.0f;
  c.scale = 0.3f;  // a sharp softmax, so that the running max moves between tiles
  c.pad_tokens = 1;
  const PromptData other = PromptData::Random(c, 80, 999);
  for (int len : {1, 2, 17, 64, 65, 130, 200}) {
    SCOPED_TRACE(absl::StrCat("prompt of ", len, " tokens"));
    const PromptData prompt = PromptData::Random(c, len, static_cast<uint32_t>(len));
    const uint32_t seed = static_cast<uint32_t>(len * 7 + group);

    // (1) The whole prompt as one prefill: the rows every other call must reproduce.
    InvarianceRun prefill(c, {{{0, len}}, {&prompt}}, seed);
    // (2) Decodes: the last token alone (what the decode worker runs), and tokens at tile
    // boundaries and in the middle as separate sequences of one batch.
    InvarianceRun last(c, {{{len - 1, 1}}, {&prompt}}, seed);
    std::vector<int> positions;
    for (int pos : {len - 1, 0, len / 2, 63, 64, 127, 128}) {
      if (pos < len && std::find(positions.begin(), positions.end(), pos) == positions.end()) {
        positions.push_back(pos);
      }
    }
    InvarianceCall decodes;
    for (int pos : positions) {
      decodes.seqs.push_back({pos, 1});
      decodes.prompts.push_back(&prompt);
    }
    InvarianceRun decode_batch(c, decodes, seed);
    // (3) Chunked prefill, in chunks of 7 and of 50 tokens.
    std::vector<std::pair<int, std::unique_ptr<InvarianceRun>>> chunks;
    for (int chunk : {7, 50}) {
      for (int start = 0; start < len; start += chunk) {
        const int n = std::min(chunk, len - start);
        chunks.emplace_back(start,
                            std::make_unique<InvarianceRun>(
                                c, InvarianceCall{{{start, n}}, {&prompt}}, seed));
      }
    }
    // (4) The prompt batched with other sequences: a prefill, its last token's decode, and
    // unrelated chunks and decodes around them.
    InvarianceRun mixed(c,
                        {{{5, 9}, {0, len}, {40, 1}, {len - 1, 1}, {20, 33}},
                         {&other, &prompt, &other, &prompt, &other}},
                        seed);

    for (internal::CpuIsa isa : internal::SupportedCpuIsas()) {
      SCOPED_TRACE(internal::CpuIsaName(isa));
      const auto want = prefill.Rows(isa, 1);
      ASSERT_EQ(want.size(), 1u);
      const std::vector<Row>& ref = want[0];
      const int dv = c.head_size_v;
      const auto two_threads = prefill.Rows(isa, 2);
      ASSERT_EQ(two_threads.size(), 1u);
      ExpectSameRows(ref, 0, two_threads[0], dv, "prefill on 2 threads");
      const auto last_rows = last.Rows(isa, 1);
      ASSERT_EQ(last_rows.size(), 1u);
      ExpectSameRows(ref, len - 1, last_rows[0], dv, "decode of the last token");
      for (int threads : {1, 2}) {
        const auto rows = decode_batch.Rows(isa, threads);
        ASSERT_EQ(rows.size(), positions.size());
        for (size_t i = 0; i < positions.size(); ++i) {
          ExpectSameRows(ref, positions[i], rows[i], dv,
                         absl::StrCat("batched decode at position ", positions[i], ", ",
                                      threads, " threads"));
        }
      }
      for (auto& [start, run] : chunks) {
        const auto rows = run->Rows(isa, 1);
        ASSERT_EQ(rows.size(), 1u);
        ExpectSameRows(ref, start, rows[0], dv,
                       absl::StrCat("chunk of ", rows[0].size(), " from ", start));
      }
      for (int threads : {1, 2}) {
        const auto rows = mixed.Rows(isa, threads);
        ASSERT_EQ(rows.size(), 5u);
        ExpectSameRows(ref, 0, rows[1], dv,
                       absl::StrCat("prefill among other sequences, ", threads, " threads"));
        ExpectSameRows(ref, len - 1, rows[3], dv,
                       absl::StrCat("decode among other sequences, ", threads, " threads"));
      }
    }
    if (HasFailure()) return;  // one prompt length's report is enough
  }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, CpuAttentionBatchInvarianceTest,
    ::testing::Combine(
        ::testing::Values(1, 5, 16), ::testing::Values(1, 4, 8),
        ::testing::Values(InvarianceFeatures{"f32", DType::kFloat32, 0, false, false},
                          InvarianceFeatures{"bf16", DType::kBFloat16, 0, false, false},
                          InvarianceFeatures{"f16", DType::kFloat16, 0, false, false},
                          InvarianceFeatures{"e4m3", DType::kFloat8E4M3, 0, false, false},
                          InvarianceFeatures{"bf16_window37", DType::kBFloat16, 37, false,
                                             false},
                          InvarianceFeatures{"f32_alibi_cap", DType::kFloat32, 0, true, true},
                          InvarianceFeatures{"e4m3_window70_alibi_cap", DType::kFloat8E4M3, 70,
                                             true, true})),
    [](const auto& test_info) {
      return absl::StrCat("bs", std::get<0>(test_info.param), "_group",
                          std::get<1>(test_info.param), "_", std::get<2>(test_info.param).name);
    });

// Head sizes that are not a multiple of the vector width (the K tile is converted before
// it is transposed), bfloat16 queries, the HND layout; and bidirectional masks, which must
// be invariant to batching and threads too (a decode there is not a prefix of the prefill,
// so it has no row to match).
TEST(CpuAttentionBatchInvarianceCasesTest, OddHeadSizesBf16AndBidirectional) {
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "bidirectional");
    AttnCase c;
    c.block_size = 16;
    c.num_kv_heads = 2;
    c.group = 4;
    c.head_size = 72;
    c.head_size_v = 40;
    c.q_dtype = DType::kBFloat16;
    c.out_dtype = DType::kFloat32;
    c.cache_dtype = DType::kBFloat16;
    c.layout = TestLayout::kHND;
    c.causal = causal;
    c.sliding_window = causal ? 0 : 45;
    c.pad_tokens = 1;
    const int len = 150;
    const PromptData prompt = PromptData::Random(c, len, 5);
    const PromptData other = PromptData::Random(c, 60, 6);
    InvarianceRun prefill(c, {{{0, len}}, {&prompt}}, 1);
    InvarianceRun mixed(c, {{{3, 4}, {0, len}, {50, 1}}, {&other, &prompt, &other}}, 2);
    InvarianceRun last(c, {{{len - 1, 1}}, {&prompt}}, 3);
    for (internal::CpuIsa isa : internal::SupportedCpuIsas()) {
      SCOPED_TRACE(internal::CpuIsaName(isa));
      const auto ref = prefill.Rows(isa, 1);
      ASSERT_EQ(ref.size(), 1u);
      for (int threads : {1, 2}) {
        const auto rows = mixed.Rows(isa, threads);
        ASSERT_EQ(rows.size(), 3u);
        ExpectSameRows(ref[0], 0, rows[1], c.head_size_v,
                       absl::StrCat("among other sequences, ", threads, " threads"));
      }
      if (causal) {
        const auto rows = last.Rows(isa, 1);
        ASSERT_EQ(rows.size(), 1u);
        ExpectSameRows(ref[0], len - 1, rows[0], c.head_size_v, "decode of the last token");
      }
    }
  }
}

// The public entry (best variant, default threads) gives the bits of its variant.
TEST(CpuAttentionBatchInvarianceCasesTest, PublicEntryMatchesItsVariant) {
  AttnCase c;
  c.cache_dtype = DType::kBFloat16;
  c.seqs = {{0, 300}, {500, 40}, {700, 1}, {333, 1}, {65, 1}};  // enough work for a team
  AttnProblem pb(c);
  std::vector<uint8_t> want = pb.NewOut();
  std::vector<uint8_t> got = pb.NewOut();
  ASSERT_TRUE(
      internal::RunAttentionCpuWith(pb.params(want), internal::SupportedCpuIsas().back(), 1)
          .ok());
  ASSERT_TRUE(RunAttentionCpu(pb.params(got)).ok());
  EXPECT_EQ(want, got);
}

// ---------------------------------------------------------------------------------------
// Validation: each error has its code and names its field; nothing is written.

class CpuAttentionValidationTest : public ::testing::Test {
 protected:
  CpuAttentionValidationTest() : pb_(MakeCase()), out_(pb_.NewOut()) {}

  static AttnCase MakeCase() {
    AttnCase c;
    c.cache_dtype = DType::kFloat8E4M3;
    c.quant = KvQuantMode::kPerHead;
    return c;
  }

  PagedAttentionParams Valid() { return pb_.params(out_); }

  void ExpectInvalid(const PagedAttentionParams& p, const std::string& substring) {
    const absl::Status st = ValidatePagedAttention(p);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(substring));
    for (const Runner& runner : AllRunners()) {
      SCOPED_TRACE(runner.name);
      const absl::Status run = runner.run(p);
      EXPECT_EQ(run.code(), absl::StatusCode::kInvalidArgument) << run;
      EXPECT_THAT(std::string(run.message()), HasSubstr(substring));
      for (uint8_t byte : out_) {
        ASSERT_EQ(byte, AttnProblem::kSentinel) << "wrote output despite the error";
      }
    }
  }

  AttnProblem pb_;
  std::vector<uint8_t> out_;
};

TEST_F(CpuAttentionValidationTest, ValidParamsPass) {
  EXPECT_TRUE(ValidatePagedAttention(Valid()).ok());
}

TEST_F(CpuAttentionValidationTest, NullPointers) {
  PagedAttentionParams p = Valid();
  p.q = nullptr;
  ExpectInvalid(p, "q is null");
  p = Valid();
  p.out = nullptr;
  ExpectInvalid(p, "out is null");
  p = Valid();
  p.query_start_loc = nullptr;
  ExpectInvalid(p, "query_start_loc is null");
  p = Valid();
  p.seq_lens = nullptr;
  ExpectInvalid(p, "seq_lens is null");
  p = Valid();
  p.block_table = nullptr;
  ExpectInvalid(p, "block_table is null");
  p = Valid();
  p.cache.k = nullptr;
  ExpectInvalid(p, "cache.k is null");
  p = Valid();
  p.cache.v = nullptr;
  ExpectInvalid(p, "cache.v is null");
}

TEST_F(CpuAttentionValidationTest, NonPositiveSizes) {
  PagedAttentionParams p = Valid();
  p.num_tokens = 0;
  ExpectInvalid(p, "num_tokens");
  p = Valid();
  p.num_seqs = 0;
  ExpectInvalid(p, "num_seqs");
  p = Valid();
  p.num_heads = -8;
  ExpectInvalid(p, "num_heads");
  p = Valid();
  p.block_table_stride = 0;
  ExpectInvalid(p, "block_table_stride");
  p = Valid();
  p.cache.num_blocks = 0;
  ExpectInvalid(p, "num_blocks");
  p = Valid();
  p.cache.spec.head_size = 0;
  ExpectInvalid(p, "head_size=0");
  p = Valid();
  p.cache.spec.block_size = 0;
  ExpectInvalid(p, "block_size=0");
  p = Valid();
  p.cache.spec.head_size_v = 0;
  ExpectInvalid(p, "head_size_v=0");
  p = Valid();
  p.q_head_stride = -1;
  ExpectInvalid(p, "q_head_stride=-1");
  p = Valid();
  p.cache.v_strides.token = -1;
  ExpectInvalid(p, "cache.v_strides");
}

TEST_F(CpuAttentionValidationTest, HeadsNotAMultipleOfKvHeads) {
  PagedAttentionParams p = Valid();
  p.num_heads = 7;
  ExpectInvalid(p, "num_heads (7) must be a multiple of cache num_kv_heads (2)");
}

TEST_F(CpuAttentionValidationTest, UnsupportedDTypes) {
  PagedAttentionParams p = Valid();
  p.q_dtype = DType::kFloat8E4M3;
  ExpectInvalid(p, "q_dtype fp8_e4m3");
  p = Valid();
  p.out_dtype = DType::kInt32;
  ExpectInvalid(p, "out_dtype int32");
  p = Valid();
  p.cache.spec.dtype = DType::kUInt8;
  ExpectInvalid(p, "cache dtype uint8");
}

TEST_F(CpuAttentionValidationTest, QueryStartLocMustBeMonotoneAndInRange) {
  PagedAttentionParams p = Valid();
  std::vector<int32_t> loc = pb_.query_start_loc();
  loc[2] = loc[1] - 1;
  p.query_start_loc = loc.data();
  ExpectInvalid(p, "query_start_loc is not monotone at sequence 1");
  loc = pb_.query_start_loc();
  loc.back() = static_cast<int32_t>(p.num_tokens) + 1;
  p.query_start_loc = loc.data();
  ExpectInvalid(p, "past num_tokens");
  loc = pb_.query_start_loc();
  loc[0] = -1;
  p.query_start_loc = loc.data();
  ExpectInvalid(p, "query_start_loc[0]");
}

TEST_F(CpuAttentionValidationTest, QueryLongerThanSequence) {
  PagedAttentionParams p = Valid();
  std::vector<int32_t> lens = pb_.seq_lens();
  lens[1] = 6;  // sequence 1 has 7 query tokens
  p.seq_lens = lens.data();
  ExpectInvalid(p, "sequence 1 has query_len 7 > seq_len 6");
}

TEST_F(CpuAttentionValidationTest, MaxLengthsMustCoverTheBatch) {
  PagedAttentionParams p = Valid();
  p.max_query_len = 3;
  ExpectInvalid(p, "max_query_len");
  p = Valid();
  p.max_seq_len = 50;
  ExpectInvalid(p, "sequence 2 has seq_len 100 > max_seq_len 50");
}

TEST_F(CpuAttentionValidationTest, BlockIdsMustBeInTheCache) {
  PagedAttentionParams p = Valid();
  std::vector<int32_t> table = pb_.block_table();
  const int64_t stride = p.block_table_stride;
  table[static_cast<size_t>(2 * stride + 3)] = static_cast<int32_t>(pb_.num_blocks());
  p.block_table = table.data();
  ExpectInvalid(p, absl::StrCat("sequence 2 block_table[3] = ", pb_.num_blocks(),
                                " is outside the cache"));
  table = pb_.block_table();
  table[static_cast<size_t>(stride)] = -4;
  p.block_table = table.data();
  ExpectInvalid(p, "sequence 1 block_table[0] = -4");
}

TEST_F(CpuAttentionValidationTest, UnusedBlockTableEntriesAreNotChecked) {
  // Sequence 3 (one token) uses one block; the rest of its row is garbage and must be.
  PagedAttentionParams p = Valid();
  std::vector<int32_t> table = pb_.block_table();
  table[static_cast<size_t>(3 * p.block_table_stride + 1)] = 1 << 30;
  p.block_table = table.data();
  EXPECT_TRUE(ValidatePagedAttention(p).ok());
}

TEST_F(CpuAttentionValidationTest, BlockTableTooNarrow) {
  PagedAttentionParams p = Valid();
  p.block_table_stride = 2;  // sequence 0 (7 keys in blocks of 16) fits; sequence 1 does not
  ExpectInvalid(p, "sequence 1 needs 3 blocks for seq_len 33 but block_table_stride is 2");
}

TEST_F(CpuAttentionValidationTest, Fp8Scales) {
  PagedAttentionParams p = Valid();
  p.cache.k_scale = nullptr;
  ExpectInvalid(p, "k_scale");
  p = Valid();
  p.cache.v_scale = nullptr;
  ExpectInvalid(p, "v_scale");
  p = Valid();
  p.cache.num_scales = 1;  // per-head mode with two KV heads
  ExpectInvalid(p, "needs num_scales=2, got 1");
  p = Valid();
  p.cache.spec.quant_mode = KvQuantMode::kNone;
  ExpectInvalid(p, "quant_mode");
  p = Valid();
  std::vector<float> bad = {0.01f, NAN};
  p.cache.v_scale = bad.data();
  ExpectInvalid(p, "cache.v_scale[1]");
  bad = {0.0f, 0.01f};
  p = Valid();
  p.cache.k_scale = bad.data();
  ExpectInvalid(p, "cache.k_scale[0]");
}

TEST_F(CpuAttentionValidationTest, NonFiniteScalars) {
  PagedAttentionParams p = Valid();
  p.scale = INFINITY;
  ExpectInvalid(p, "scale must be finite");
  p = Valid();
  p.logits_soft_cap = NAN;
  ExpectInvalid(p, "logits_soft_cap");
  p = Valid();
  std::vector<float> slopes(8, 0.5f);
  slopes[5] = NAN;
  p.alibi_slopes = slopes.data();
  ExpectInvalid(p, "alibi_slopes[5]");
}

TEST_F(CpuAttentionValidationTest, CpuBackendsRejectDeviceCaches) {
  PagedAttentionParams p = Valid();
  p.cache.memory = MemoryKind::kDevice;
  // A device batch is validated through host copies of its arrays.
  EXPECT_THAT(ValidatePagedAttention(p).message(), HasSubstr("host copies"));
  p.host.query_start_loc = p.query_start_loc;
  p.host.seq_lens = p.seq_lens;
  p.host.block_table = p.block_table;
  EXPECT_TRUE(ValidatePagedAttention(p).ok());  // the CUDA backend may take it
  for (const Runner& runner : AllRunners()) {
    EXPECT_EQ(runner.run(p).code(), absl::StatusCode::kInvalidArgument) << runner.name;
  }
  for (uint8_t byte : out_) ASSERT_EQ(byte, AttnProblem::kSentinel);
}

}  // namespace
}  // namespace kvstream
