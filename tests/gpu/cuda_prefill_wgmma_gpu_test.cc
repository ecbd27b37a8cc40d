// Tests of the CUDA prefill attention's wgmma kernel (prefill_wgmma.cuh, run through
// LaunchPrefillAttention) on a compute capability 9.0 device of a build with sm_90a code:
// its own edge cases against the golden CPU reference (every block size TMA boxes take, 16
// to 256, sequences that end around a page or a 128-key tile, tiny and ragged sequences,
// fp8 caches, both grid orders, a CTA per unit and persistent grids), each alongside the
// baseline and fast variants; and a timing of the large causal prefill the kernels are
// tuned for (8k tokens, head size 128), of every variant and wgmma schedule and clustering,
// checked at a few rows. The grids over shapes, dtypes and features, the masks and the
// launcher's limits are in cuda_prefill_attention_gpu_test.cc; the machinery both share in
// prefill_gpu_test_util.h.
//
// Every test skips where no GPU can be used.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attention_test_util.h"
#include "cuda/launchers.h"
#include "gpu_test_util.h"
#include "kvstream/attention/backend.h"
#include "kvstream/attention/cpu_attention.h"
#include "kvstream/cache/kv_cache_spec.h"
#include "kvstream/common/dtype.h"
#include "kvstream/common/numeric.h"
#include "prefill_gpu_test_util.h"

namespace kvstream {
namespace {

using ::kvstream::gpu_test::AbsTolerance;
using ::kvstream::gpu_test::ClusterName;
using ::kvstream::gpu_test::DeviceRunsWgmma;
using ::kvstream::gpu_test::ExpectAllVariantsMatchReference;
using ::kvstream::gpu_test::ExpectWgmmaMatchesReference;
using ::kvstream::gpu_test::GpuIo;
using ::kvstream::gpu_test::kClusters;
using ::kvstream::gpu_test::kSchedules;
using ::kvstream::gpu_test::RunOnGpu;
using ::kvstream::gpu_test::ScheduleName;
using ::kvstream::gpu_test::VariantName;
using ::kvstream::internal::PrefillVariant;
using ::kvstream::internal::PrefillWgmmaCluster;
using ::kvstream::internal::PrefillWgmmaSchedule;
using ::kvstream::testing_util::AttnCase;
using ::kvstream::testing_util::AttnProblem;
using ::kvstream::testing_util::CacheKind;
using ::kvstream::testing_util::QuantSuffix;
using ::kvstream::testing_util::ShortDType;
using ::kvstream::testing_util::TestLayout;
using ::kvstream::testing_util::TestLayoutName;

// ---------------------------------------------------------------------------------------
// The wgmma kernel's own edges: every block size it takes (one TMA box per page below 128
// keys, one per 128-key tile of a larger block), sequences that end one key before, at and
// after a page or a 128-key tile, tiny ones (1 and 2 keys, a single query row against
// cached keys), and ragged batches, over both layouts, both 16-bit types and both head
// sizes; the cache is NaN past every sequence's end, in the last page too.

// Block size, head size, q dtype, cache (CacheKind::dtype kFloat16: q's own dtype).
using WgmmaEdgeParam = std::tuple<int, int, DType, CacheKind>;
class CudaPrefillWgmmaEdgeTest : public ::testing::TestWithParam<WgmmaEdgeParam> {
 protected:
  void SetUp() override { KVSTREAM_SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaPrefillWgmmaEdgeTest, MatchesReference) {
  const auto& [block_size, head_size, dtype, cache] = GetParam();
  for (TestLayout layout : {TestLayout::kNHD, TestLayout::kHND}) {
    for (bool causal : {true, false}) {
      SCOPED_TRACE(absl::StrCat(TestLayoutName(layout), causal ? " causal" : " bidirectional"));
      AttnCase c;
      c.q_dtype = dtype;
      c.out_dtype = dtype;
      c.cache_dtype = IsFp8(cache.dtype) ? cache.dtype : dtype;
      c.quant = cache.quant;
      c.layout = layout;
      c.causal = causal;
      c.block_size = block_size;
      c.head_size = head_size;
      c.head_size_v = head_size;
      c.num_kv_heads = 2;
      c.group = 3;  // 128-row tiles that end inside a token's heads
      const int b = block_size;
      c.seqs = {{0, 1},          {0, 2},       {b - 1, 1},   {b - 1, 2},   {0, b - 1},
                {0, b},          {0, b + 1},   {127, 1},     {128, 1},     {127, 2},
                {0, 127},        {0, 129},     {b, 128},     {255, 130},   {3, 200},
                {2 * b + 1, 40}, {5, 0},       {0, 300}};
      c.seed = static_cast<uint32_t>(block_size * 31 + head_size);
      AttnProblem pb(c);
      // The reference once; every variant in the default grid, then the wgmma kernel in both
      // grid orders, a CTA (pair) per unit and persistent grids: every (sequence, KV head,
      // row tile) computed once either way, the pairs' partners included. Persistent grids
      // of 3 and 7 CTAs (pairs): each walks many units in both directions of the
      // serpentine, its ring and barriers carried from unit to unit, and some have none
      // in the last round.
      std::vector<uint8_t> ref_out = pb.NewOut();
      const absl::Status ref_status = RunAttentionReference(pb.params(ref_out));
      ASSERT_TRUE(ref_status.ok()) << ref_status;
      {
        GpuIo io;
        io.dense = true;
        ExpectAllVariantsMatchReference(pb, ref_out, io);
        if (HasFailure()) return;
      }
      for (internal::PrefillWgmmaOrder order :
           {internal::PrefillWgmmaOrder::kHeadsInner, internal::PrefillWgmmaOrder::kHeadsOuter}) {
        for (int max_ctas : {-1, 3, 7}) {
          SCOPED_TRACE(absl::StrCat(
              order == internal::PrefillWgmmaOrder::kHeadsOuter ? "KV heads outer, "
                                                                : "KV heads inner, ",
              max_ctas < 0 ? "a CTA per unit" : absl::StrCat("persistent, ", max_ctas, " CTAs")));
          GpuIo io;
          io.dense = true;
          io.order = order;
          io.grid = max_ctas < 0 ? internal::PrefillWgmmaGrid::kPerUnit
                                 : internal::PrefillWgmmaGrid::kPersistent;
          io.max_ctas = max_ctas < 0 ? 0 : max_ctas;
          ExpectWgmmaMatchesReference(pb, ref_out, io);
          if (HasFailure()) return;
        }
      }
    }
  }
}

std::string WgmmaEdgeName(const ::testing::TestParamInfo<WgmmaEdgeParam>& info) {
  const CacheKind& cache = std::get<3>(info.param);
  return absl::StrCat("bs", std::get<0>(info.param), "_d", std::get<1>(info.param), "_",
                      ShortDType(std::get<2>(info.param)),
                      IsFp8(cache.dtype) ? absl::StrCat("_cache", ShortDType(cache.dtype),
                                                        QuantSuffix(cache.quant))
                                         : "");
}

INSTANTIATE_TEST_SUITE_P(
    Pages, CudaPrefillWgmmaEdgeTest,
    ::testing::Combine(::testing::Values(16, 32, 64, 128, 256), ::testing::Values(64, 128, 256),
                       ::testing::Values(DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(CacheKind{DType::kFloat16, KvQuantMode::kNone})),
    WgmmaEdgeName);

// fp8 caches: raw rows converted in the kernel.
INSTANTIATE_TEST_SUITE_P(
    Fp8Pages, CudaPrefillWgmmaEdgeTest,
    ::testing::Combine(::testing::Values(16, 64, 256), ::testing::Values(64, 128),
                       ::testing::Values(DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(CacheKind{DType::kFloat8E4M3, KvQuantMode::kPerTensor},
                                         CacheKind{DType::kFloat8E5M2, KvQuantMode::kPerHead})),
    WgmmaEdgeName);

// ---------------------------------------------------------------------------------------
// The shape the kernels are tuned for: one 8k-token causal prefill, bfloat16, head size 128,
// 32 query / 8 KV heads, block size 16 and 64 (and the same over an fp8 e4m3 cache). Prints
// the throughput (counting 4 n^2 d heads / 2 flops) of every variant and wgmma schedule,
// and checks a few rows of the last run against the reference run as single-token calls.

class CudaPrefillPerformanceTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { KVSTREAM_SKIP_WITHOUT_GPU(); }
};

// Times every prefill variant that takes a causal 8k-token prefill of 32/8 heads, d128,
// bf16 q and out over a cache of `cache_dtype` (per-tensor scales where fp8) in blocks of
// `block_size`, prints their TFLOP/s, and checks the last run's output at a few rows.
void TimeCausal8kHead128(int block_size, DType cache_dtype) {
  constexpr int kTokens = 8192;
  const bool fp8 = IsFp8(cache_dtype);
  AttnCase c;
  c.seqs = {{0, kTokens}};
  c.num_kv_heads = 8;
  c.group = 4;
  c.head_size = 128;
  c.head_size_v = 128;
  c.block_size = block_size;
  c.q_dtype = DType::kBFloat16;
  c.out_dtype = DType::kBFloat16;
  c.cache_dtype = cache_dtype;
  c.quant = fp8 ? KvQuantMode::kPerTensor : KvQuantMode::kNone;
  c.pad_tokens = 0;
  AttnProblem pb(c);
  // The baseline first, then the fast variant (16-bit caches), then (where the device runs
  // it) the wgmma kernel: the last one's output is checked below.
  std::vector<uint8_t> out;
  struct Run {
    PrefillVariant variant;
    PrefillWgmmaSchedule schedule;
    PrefillWgmmaCluster cluster;
  };
  constexpr PrefillWgmmaSchedule kDefaultSchedule = PrefillWgmmaSchedule::kDefault;
  constexpr PrefillWgmmaCluster kDefaultCluster = PrefillWgmmaCluster::kDefault;
  std::vector<Run> runs = {{PrefillVariant::kBaseline, kDefaultSchedule, kDefaultCluster}};
  if (!fp8) {  // the fast variant takes 16-bit caches only
    runs.push_back({PrefillVariant::kFast, kDefaultSchedule, kDefaultCluster});
  }
  if (DeviceRunsWgmma()) {
    // Each clustering with every schedule (fp8 caches run the serial one only), then the
    // defaults.
    for (PrefillWgmmaCluster cluster : kClusters) {
      for (PrefillWgmmaSchedule schedule : kSchedules) {
        if (!fp8 || schedule == PrefillWgmmaSchedule::kSerial) {
          runs.push_back({PrefillVariant::kWgmma, schedule, cluster});
        }
      }
    }
    runs.push_back({PrefillVariant::kWgmma, kDefaultSchedule, kDefaultCluster});
  }
  for (const Run& run : runs) {
    out = pb.NewOut();
    float ms = 0;
    GpuIo io;
    io.dense = true;
    io.variant = run.variant;
    io.schedule = run.schedule;
    io.cluster = run.cluster;
    const absl::Status st = RunOnGpu(pb.params(out), out, io, &ms, /*repeats=*/11);
    ASSERT_TRUE(st.ok()) << st;
    const double flops = 4.0 * kTokens * kTokens * 128.0 * 32 / 2;
    const std::string name =
        run.variant == PrefillVariant::kWgmma
            ? absl::StrCat("wgmma variant, ", ClusterName(run.cluster), ", ",
                           ScheduleName(run.schedule), " schedule")
            : absl::StrCat(VariantName(run.variant), " variant");
    std::printf("[ PERF     ] causal prefill 8k bf16 d128 32/8 heads, %s cache bs%d, %s: "
                "%.3f ms, %.1f TFLOP/s\n",
                ShortDType(cache_dtype), c.block_size, name.c_str(), ms,
                flops / (ms * 1e-3) / 1e12);
  }

  // Rows at a few positions: the reference as a one-token call whose query sits at `pos`.
  PagedAttentionParams full = pb.params(out);
  for (int pos : {0, 1, 1000, 4095, kTokens - 1}) {
    SCOPED_TRACE(absl::StrCat("position ", pos));
    PagedAttentionParams one = full;
    const int32_t loc[2] = {0, 1};
    const int32_t len[1] = {pos + 1};
    one.query_start_loc = loc;
    one.seq_lens = len;
    one.num_tokens = 1;
    one.max_query_len = 1;
    one.max_seq_len = pos + 1;
    one.q = static_cast<const uint8_t*>(full.q) + pos * full.q_token_stride * 2;
    std::vector<uint8_t> ref(static_cast<size_t>(full.o_token_stride) * 2);
    one.out = ref.data();
    ASSERT_TRUE(RunAttentionReference(one).ok());
    int failures = 0;
    for (int h = 0; h < 32; ++h) {
      for (int d = 0; d < 128; ++d) {
        const float want = LoadAsFloat(ref.data(), DType::kBFloat16, int64_t{h} * 128 + d);
        const float got = pb.Out(out, pos, h, d);
        if (!(std::fabs(want - got) <= AbsTolerance(DType::kBFloat16) + 1e-2 * std::fabs(want)) &&
            ++failures <= 5) {
          ADD_FAILURE() << "head " << h << " d " << d << ": reference " << want << " gpu "
                        << got;
        }
      }
    }
    EXPECT_EQ(failures, 0);
  }
}

TEST_P(CudaPrefillPerformanceTest, Causal8kBf16Head128) {
  TimeCausal8kHead128(GetParam(), DType::kBFloat16);
}

// The same over an fp8 e4m3 cache (half the bytes of K and V, converted in the kernel).
TEST_P(CudaPrefillPerformanceTest, Causal8kFp8E4m3Head128) {
  TimeCausal8kHead128(GetParam(), DType::kFloat8E4M3);
}

INSTANTIATE_TEST_SUITE_P(BlockSizes, CudaPrefillPerformanceTest, ::testing::Values(16, 64),
                         [](const auto& test_info) {
                           return absl::StrCat("bs", test_info.param);
                         });

}  // namespace
}  // namespace kvstream
