// The "cuda" attention backend (cuda_attention.h) against the golden CPU reference: creation
// and the registry; decode batches (the decode kernel) and mixed prefill/decode batches
// (the prefill kernel) over dtypes, layouts, block sizes, head configurations, head sizes
// and features; the whole step through the backend (cache update into a device KvCache,
// then attention) against the CPU backend's step; stream handling (own and borrowed
// stream, synchronisation with a deadline); and the errors Forward and UpdateCache report.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "gpu_test_util.h"
#include "kvstream/attention/backend.h"
#include "kvstream/attention/cpu_attention.h"
#include "kvstream/attention/cuda_attention.h"
#include "kvstream/cache/cache_update.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/cache/slot_mapping.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/numeric.h"
#include "tests/unit/attention_test_util.h"

namespace kvstream {
namespace {

using ::kvstream::gpu_test::DeviceAttnProblem;
using ::kvstream::gpu_test::ExpectMatchesReference;
using ::kvstream::gpu_test::ToDevice;
using ::kvstream::gpu_test::ToHost;
using ::kvstream::testing_util::AttnCase;
using ::kvstream::testing_util::AttnProblem;
using ::kvstream::testing_util::CacheKind;
using ::kvstream::testing_util::DTypeGrid;
using ::kvstream::testing_util::DTypeGridCase;
using ::kvstream::testing_util::DTypeGridName;
using ::kvstream::testing_util::DTypeGridParam;
using ::kvstream::testing_util::HeadConfig;
using ::kvstream::testing_util::HeadSizes;
using ::kvstream::testing_util::QuantSuffix;
using ::kvstream::testing_util::SeqSpec;
using ::kvstream::testing_util::ShapeGridCase;
using ::kvstream::testing_util::ShapeGridName;
using ::kvstream::testing_util::ShortDType;
using ::kvstream::testing_util::TestLayout;
using ::kvstream::testing_util::TestLayoutName;
using ::testing::Contains;
using ::testing::HasSubstr;

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const absl::Status status = CudaAvailability();
    if (!status.ok()) GTEST_SKIP() << "no usable GPU: " << status.message();
    auto backend = CreateCudaAttentionBackend(CudaBackendOptions());
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = std::move(backend).value();
    cuda_ = AsCudaAttentionBackend(backend_.get());
    ASSERT_NE(cuda_, nullptr);
  }

  // Runs `pb` through the backend and compares with the reference.
  void ExpectMatches(AttnProblem& pb, const std::string& what = "") {
    auto dev = DeviceAttnProblem::Create(pb);
    ASSERT_TRUE(dev.ok()) << dev.status();
    const absl::Status st = backend_->Forward((*dev)->params());
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_TRUE(cuda_->Synchronize(absl::Seconds(60)).ok());
    auto out = (*dev)->Out();
    ASSERT_TRUE(out.ok()) << out.status();
    ExpectMatchesReference(pb, *out, what);
  }

  std::unique_ptr<AttentionBackend> backend_;
  CudaAttentionBackend* cuda_ = nullptr;
};

// ---------------------------------------------------------------------------------------
// Creation and the registry.

// CudaDeviceScope (cuda_resources.h) on two GPUs: a thread that had used a device gets it
// back; a thread that had not used CUDA stays on the scope's device instead of being
// switched to device 0 (which would create a context there).
TEST(CudaDeviceScopeTest, RestoresOnlyADeviceTheThreadHadUsed) {
  if (GpuCount() < 2) GTEST_SKIP() << "needs two GPUs, found " << GpuCount();
  const int other = GpuCount() - 1;
  int after_used = -1;
  int after_fresh = -1;
  std::thread used([&] {
    cudaSetDevice(0);
    cudaFree(nullptr);  // the thread now has device 0's context current
    {
      CudaDeviceScope scope(other);
      EXPECT_TRUE(scope.status().ok()) << scope.status();
      int inside = -1;
      cudaGetDevice(&inside);
      EXPECT_EQ(inside, other);
    }
    cudaGetDevice(&after_used);
  });
  used.join();
  std::thread fresh([&] {
    {
      CudaDeviceScope scope(other);
      EXPECT_TRUE(scope.status().ok()) << scope.status();
    }
    cudaGetDevice(&after_fresh);
  });
  fresh.join();
  EXPECT_EQ(after_used, 0);
  EXPECT_EQ(after_fresh, other);
}

TEST_F(CudaBackendTest, CreatedByNameAndOptions) {
  EXPECT_EQ(backend_->name(), "cuda");
  EXPECT_TRUE(backend_->SupportsMemory(MemoryKind::kDevice));
  EXPECT_FALSE(backend_->SupportsMemory(MemoryKind::kHost));
  EXPECT_FALSE(backend_->SupportsMemory(MemoryKind::kPinned));
  EXPECT_NE(cuda_->stream(), nullptr);
  EXPECT_EQ(cuda_->device(), 0);
  EXPECT_THAT(AttentionBackendNames(), Contains("cuda"));
  auto by_name = CreateAttentionBackend("cuda");
  ASSERT_TRUE(by_name.ok()) << by_name.status();
  EXPECT_EQ((*by_name)->name(), "cuda");
  auto cpu = CreateAttentionBackend("cpu");
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(AsCudaAttentionBackend(cpu->get()), nullptr);

  CudaBackendOptions bad;
  bad.device = GpuCount();
  EXPECT_EQ(CreateCudaAttentionBackend(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad.device = -1;
  EXPECT_EQ(CreateCudaAttentionBackend(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(cuda_->Synchronize(absl::Seconds(10)).ok());
}

TEST_F(CudaBackendTest, BorrowedStreamIsUsedAndLeftAlive) {
  auto stream = CudaStream::Create();
  ASSERT_TRUE(stream.ok());
  CudaBackendOptions options;
  options.stream = stream->get();
  {
    auto backend = CreateCudaAttentionBackend(options);
    ASSERT_TRUE(backend.ok()) << backend.status();
    CudaAttentionBackend* cuda = AsCudaAttentionBackend(backend->get());
    ASSERT_NE(cuda, nullptr);
    EXPECT_EQ(cuda->stream(), stream->get());
    AttnCase c;
    c.seqs = {{40, 1}, {3000, 1}};  // long enough to split: the workspace is allocated
    AttnProblem pb(c);
    auto dev = DeviceAttnProblem::Create(pb);
    ASSERT_TRUE(dev.ok());
    ASSERT_TRUE((*backend)->Forward((*dev)->params()).ok());
    ASSERT_TRUE(stream->Synchronize(absl::Seconds(60)).ok());
    auto out = (*dev)->Out();
    ASSERT_TRUE(out.ok());
    ExpectMatchesReference(pb, *out, "borrowed stream");
  }
  // The backend is gone (its workspace freed in stream order); the stream still works.
  EXPECT_TRUE(stream->Synchronize(absl::Seconds(10)).ok());
}

// ---------------------------------------------------------------------------------------
// Decode batches: the decode kernel.

class CudaBackendDecodeTest
    : public CudaBackendTest,
      public ::testing::WithParamInterface<DTypeGridParam> {};

TEST_P(CudaBackendDecodeTest, MatchesReference) {
  AttnCase c = DTypeGridCase(GetParam());
  c.block_size = 16;
  c.num_kv_heads = 2;
  c.group = 4;
  c.head_size = 128;
  c.head_size_v = 128;
  c.seqs = {{0, 1}, {99, 1}, {2047, 1}, {5, 0}, {700, 1}};
  AttnProblem pb(c);
  ExpectMatches(pb);
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, CudaBackendDecodeTest, DTypeGrid(), DTypeGridName);

// ---------------------------------------------------------------------------------------
// Mixed batches (prefill, chunked prefill and decode together): the prefill kernel, with
// what it supports: q and out float16 or bfloat16 (the same), cache of q's dtype or fp8.

class CudaBackendMixedDTypeTest
    : public CudaBackendTest,
      public ::testing::WithParamInterface<DTypeGridParam> {};

TEST_P(CudaBackendMixedDTypeTest, MatchesReference) {
  const auto& [q_dtype, cache, layout] = GetParam();
  AttnCase c;
  c.q_dtype = q_dtype;
  c.out_dtype = q_dtype;
  c.cache_dtype = cache.dtype == DType::kFloat32 ? q_dtype : cache.dtype;
  c.quant = cache.quant;
  c.layout = layout;
  c.block_size = 5;
  c.seqs = {{0, 7}, {26, 7}, {99, 1}, {0, 1}, {32, 1}, {0, 130}, {70, 65}};
  c.seed = 7;
  AttnProblem pb(c);
  ExpectMatches(pb);
}

INSTANTIATE_TEST_SUITE_P(
    PrefillDTypes, CudaBackendMixedDTypeTest,
    ::testing::Combine(::testing::Values(DType::kFloat16, DType::kBFloat16),
                       ::testing::Values(CacheKind{DType::kFloat32, KvQuantMode::kNone},  // = q
                                         CacheKind{DType::kFloat8E4M3, KvQuantMode::kPerTensor},
                                         CacheKind{DType::kFloat8E4M3, KvQuantMode::kPerHead},
                                         CacheKind{DType::kFloat8E5M2, KvQuantMode::kPerTensor},
                                         CacheKind{DType::kFloat8E5M2, KvQuantMode::kPerHead}),
                       ::testing::Values(TestLayout::kNHD, TestLayout::kHND)),
    [](const auto& param_info) {
      const CacheKind& cache = std::get<1>(param_info.param);
      return absl::StrCat("q", ShortDType(std::get<0>(param_info.param)), "_cache",
                          cache.dtype == DType::kFloat32 ? "SameAsQ" : ShortDType(cache.dtype),
                          QuantSuffix(cache.quant),
                          "_", TestLayoutName(std::get<2>(param_info.param)));
    });

// Block sizes x head configurations x head sizes, decode-only and mixed batches.
class CudaBackendShapeTest
    : public CudaBackendTest,
      public ::testing::WithParamInterface<std::tuple<int, HeadConfig, HeadSizes, bool>> {};

TEST_P(CudaBackendShapeTest, MatchesReference) {
  const auto& [block_size, heads, sizes, mixed] = GetParam();
  AttnCase c = ShapeGridCase(block_size, heads, sizes);
  c.q_dtype = DType::kBFloat16;
  c.out_dtype = DType::kBFloat16;
  c.seqs = mixed ? std::vector<SeqSpec>{{0, 33}, {67, 33}, {99, 1}, {6, 1}, {0, 7}, {0, 1}}
                 : std::vector<SeqSpec>{{0, 1}, {67, 1}, {99, 1}, {6, 1}, {500, 1}, {0, 1}};
  c.seed = static_cast<uint32_t>(block_size * 100 + heads.group * 10 + sizes.v);
  AttnProblem pb(c);
  ExpectMatches(pb);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaBackendShapeTest,
    ::testing::Combine(::testing::Values(1, 5, 16),
                       ::testing::Values(HeadConfig{4, 1}, HeadConfig{2, 3}, HeadConfig{2, 4},
                                         HeadConfig{1, 8}, HeadConfig{2, 8}),
                       ::testing::Values(HeadSizes{64, 64}, HeadSizes{80, 80},
                                         HeadSizes{128, 128}, HeadSizes{256, 256},
                                         HeadSizes{64, 32}, HeadSizes{128, 64}),
                       ::testing::Bool()),
    [](const auto& param_info) {
      return absl::StrCat(std::get<3>(param_info.param) ? "mixed" : "decode", "_",
                          ShapeGridName(std::get<0>(param_info.param), std::get<1>(param_info.param),
                                        std::get<2>(param_info.param)));
    });

using FeatureParam = std::tuple<bool, int, bool, bool, bool>;
class CudaBackendFeatureTest : public CudaBackendTest,
                               public ::testing::WithParamInterface<FeatureParam> {};

std::string FeatureName(const ::testing::TestParamInfo<FeatureParam>& param_info) {
  const auto& [causal, window, alibi, cap, mixed] = param_info.param;
  return absl::StrCat(mixed ? "mixed_" : "decode_", causal ? "causal" : "bidir", "_window",
                      window, alibi ? "_alibi" : "", cap ? "_cap" : "");
}

TEST_P(CudaBackendFeatureTest, MatchesReference) {
  const auto& [causal, window, alibi, cap, mixed] = GetParam();
  AttnCase c;
  c.causal = causal;
  c.sliding_window = window;
  c.alibi = alibi;
  c.soft_cap = cap ? 2.0f : 0.0f;
  c.head_size_v = 48;
  c.q_dtype = DType::kBFloat16;
  c.out_dtype = DType::kBFloat16;
  c.cache_dtype = DType::kBFloat16;
  c.scale = 0.3f;
  c.block_size = 16;
  c.seqs = mixed ? std::vector<SeqSpec>{{0, 21}, {150, 20}, {200, 1}, {3, 1}, {40, 3}}
                 : std::vector<SeqSpec>{{150, 1}, {200, 1}, {3, 1}, {40, 1}, {1500, 1}};
  c.seed = 11;
  AttnProblem pb(c);
  ExpectMatches(pb);
}

INSTANTIATE_TEST_SUITE_P(Features, CudaBackendFeatureTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(0, 5, 70),
                                            ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Bool()),
                         FeatureName);

// ---------------------------------------------------------------------------------------
// One whole step through the backend: cache update into a device KvCache, then attention,
// against the CPU backend's step on a host KvCache.

TEST_F(CudaBackendTest, UpdateThenForwardMatchesTheCpuBackend) {
  for (DType cache_dtype : {DType::kBFloat16, DType::kFloat8E4M3}) {
    SCOPED_TRACE(ShortDType(cache_dtype));
    const int heads = 8, kv_heads = 2, d = 128, block_size = 16, num_blocks = 64;
    KvCache::Options options;
    options.spec.block_size = block_size;
    options.spec.num_kv_heads = kv_heads;
    options.spec.head_size = d;
    options.spec.head_size_v = d;
    options.spec.dtype = cache_dtype;
    options.spec.quant_mode =
        IsFp8(cache_dtype) ? KvQuantMode::kPerHead : KvQuantMode::kNone;
    options.layout = KvLayout::kHND;
    options.num_blocks = num_blocks;
    auto host_cache = KvCache::Create(options);
    ASSERT_TRUE(host_cache.ok());
    options.memory = MemoryKind::kDevice;
    auto device_cache = KvCache::Create(options);
    ASSERT_TRUE(device_cache.ok()) << device_cache.status();
    if (IsFp8(cache_dtype)) {
      ASSERT_TRUE((*host_cache)->SetScales({0.01f, 0.02f}, {0.015f, 0.01f}).ok());
      ASSERT_TRUE((*device_cache)->SetScales({0.01f, 0.02f}, {0.015f, 0.01f}).ok());
    }
    // Two sequences: 300 tokens of prompt (one prefill step), then one decode step each.
    const std::vector<std::vector<int32_t>> tables = {{5, 9, 1, 30, 17, 2, 40, 41, 8, 3, 60, 22,
                                                       23, 24, 25, 26, 27, 28, 29, 31},
                                                      {10, 11, 12, 13, 14, 15, 16, 18, 19, 20,
                                                       21, 32, 33, 34, 35, 36, 37, 38, 39, 42}};
    const int stride = 20;
    std::vector<int32_t> block_table;
    for (const auto& row : tables) block_table.insert(block_table.end(), row.begin(), row.end());
    auto cpu = CreateAttentionBackend("cpu_reference");
    ASSERT_TRUE(cpu.ok());
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    struct Step {
      std::vector<int32_t> query_start_loc, seq_lens;
      int32_t max_query_len;
    };
    const Step steps[] = {{{0, 300, 600}, {300, 300}, 300}, {{0, 1, 2}, {301, 301}, 1}};
    for (const Step& step : steps) {
      SCOPED_TRACE(absl::StrCat("max_query_len ", step.max_query_len));
      const int tokens = step.query_start_loc.back();
      std::vector<uint16_t> q(static_cast<size_t>(tokens) * heads * d);
      std::vector<uint16_t> k(static_cast<size_t>(tokens) * kv_heads * d);
      std::vector<uint16_t> v(k.size());
      for (auto* t : {&q, &k, &v}) {
        for (uint16_t& x : *t) x = FloatToBFloat16(uni(rng));
      }
      std::vector<int64_t> slots;
      for (int s = 0; s < 2; ++s) {
        const int len = step.query_start_loc[s + 1] - step.query_start_loc[s];
        auto sm = ComputeSlotMapping(tables[static_cast<size_t>(s)], block_size,
                                     step.seq_lens[static_cast<size_t>(s)] - len, len);
        ASSERT_TRUE(sm.ok()) << sm.status();
        slots.insert(slots.end(), sm->begin(), sm->end());
      }
      CacheUpdateParams update;
      update.key = k.data();
      update.value = v.data();
      update.key_token_stride = update.value_token_stride = kv_heads * d;
      update.key_head_stride = update.value_head_stride = d;
      update.input_dtype = DType::kBFloat16;
      update.slot_mapping = slots.data();
      update.num_tokens = tokens;
      update.cache = (*host_cache)->view();
      ASSERT_TRUE((*cpu)->UpdateCache(update).ok());

      PagedAttentionParams attn;
      attn.q = q.data();
      attn.q_dtype = DType::kBFloat16;
      attn.q_token_stride = heads * d;
      attn.q_head_stride = d;
      std::vector<uint16_t> cpu_out(q.size()), gpu_out(q.size());
      attn.out = cpu_out.data();
      attn.out_dtype = DType::kBFloat16;
      attn.o_token_stride = heads * d;
      attn.o_head_stride = d;
      attn.num_tokens = tokens;
      attn.cache = (*host_cache)->view();
      attn.query_start_loc = step.query_start_loc.data();
      attn.seq_lens = step.seq_lens.data();
      attn.block_table = block_table.data();
      attn.block_table_stride = stride;
      attn.num_seqs = 2;
      attn.max_query_len = step.max_query_len;
      attn.max_seq_len = 301;
      attn.num_heads = heads;
      attn.scale = 0.088f;
      ASSERT_TRUE((*cpu)->Forward(attn).ok());

      auto dq = ToDevice(q), dk = ToDevice(k), dv = ToDevice(v), dslots = ToDevice(slots);
      auto dqsl = ToDevice(step.query_start_loc), dlens = ToDevice(step.seq_lens);
      auto dtable = ToDevice(block_table), dout = ToDevice(gpu_out);
      ASSERT_TRUE(dq.ok() && dk.ok() && dv.ok() && dslots.ok() && dqsl.ok() && dlens.ok() &&
                  dtable.ok() && dout.ok());
      update.key = dk->data();
      update.value = dv->data();
      update.slot_mapping = dslots->data_as<int64_t>();
      update.host_slot_mapping = slots.data();
      update.cache = (*device_cache)->view();
      ASSERT_TRUE(backend_->UpdateCache(update).ok());
      attn.q = dq->data();
      attn.out = dout->data();
      attn.cache = (*device_cache)->view();
      attn.host.query_start_loc = step.query_start_loc.data();
      attn.host.seq_lens = step.seq_lens.data();
      attn.host.block_table = block_table.data();
      attn.query_start_loc = dqsl->data_as<int32_t>();
      attn.seq_lens = dlens->data_as<int32_t>();
      attn.block_table = dtable->data_as<int32_t>();
      const absl::Status st = backend_->Forward(attn);
      ASSERT_TRUE(st.ok()) << st;
      ASSERT_TRUE(cuda_->Synchronize(absl::Seconds(60)).ok());
      ASSERT_TRUE(ToHost(dout->data(), gpu_out.size() * 2, gpu_out.data()).ok());

      // The caches hold the same bytes (bit-exact updates) ...
      const size_t k_bytes = static_cast<size_t>(num_blocks * options.spec.KBytesPerBlock());
      const size_t v_bytes = static_cast<size_t>(num_blocks * options.spec.VBytesPerBlock());
      std::vector<uint8_t> device_k(k_bytes), device_v(v_bytes);
      ASSERT_TRUE(ToHost((*device_cache)->view().k, k_bytes, device_k.data()).ok());
      ASSERT_TRUE(ToHost((*device_cache)->view().v, v_bytes, device_v.data()).ok());
      EXPECT_EQ(0, std::memcmp(device_k.data(), (*host_cache)->view().k, k_bytes));
      EXPECT_EQ(0, std::memcmp(device_v.data(), (*host_cache)->view().v, v_bytes));
      // ... and the outputs agree to bfloat16 precision.
      int bad = 0;
      for (size_t i = 0; i < cpu_out.size(); ++i) {
        const float want = BFloat16ToFloat(cpu_out[i]);
        const float got = BFloat16ToFloat(gpu_out[i]);
        if (!(std::fabs(want - got) <= 1.5e-2f + 1.5e-2f * std::fabs(want)) && ++bad <= 5) {
          ADD_FAILURE() << "element " << i << ": cpu " << want << " cuda " << got;
        }
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Errors.

class CudaBackendErrorTest : public CudaBackendTest {
 protected:
  void SetUp() override {
    CudaBackendTest::SetUp();
    if (IsSkipped()) return;
    AttnCase c;
    c.q_dtype = DType::kBFloat16;
    c.out_dtype = DType::kBFloat16;
    c.cache_dtype = DType::kBFloat16;
    pb_ = std::make_unique<AttnProblem>(c);  // a mixed batch
    auto dev = DeviceAttnProblem::Create(*pb_);
    ASSERT_TRUE(dev.ok()) << dev.status();
    dev_ = std::move(dev).value();
  }

  void ExpectInvalid(const PagedAttentionParams& p, const std::string& needle) {
    const absl::Status st = backend_->Forward(p);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(needle));
    ASSERT_TRUE(cuda_->Synchronize(absl::Seconds(30)).ok());
    auto out = dev_->Out();
    ASSERT_TRUE(out.ok());
    EXPECT_EQ(*out, pb_->NewOut()) << "wrote output despite the error";
  }

  std::unique_ptr<AttnProblem> pb_;
  std::unique_ptr<DeviceAttnProblem> dev_;
};

TEST_F(CudaBackendErrorTest, BadBlockIds) {
  PagedAttentionParams p = dev_->params();
  std::vector<int32_t> table = pb_->block_table();
  table[static_cast<size_t>(p.block_table_stride + 1)] = 1 << 20;
  p.host.block_table = table.data();
  ExpectInvalid(p, "sequence 1 block_table[1]");
}

TEST_F(CudaBackendErrorTest, MissingHostMirrors) {
  PagedAttentionParams p = dev_->params();
  p.host.query_start_loc = nullptr;
  ExpectInvalid(p, "host copies");
  p = dev_->params();
  p.host.seq_lens = nullptr;
  ExpectInvalid(p, "host copies");
}

TEST_F(CudaBackendErrorTest, HostCachesAreNotForThisBackend) {
  std::vector<uint8_t> host_out = pb_->NewOut();
  const PagedAttentionParams p = pb_->params(host_out);
  const absl::Status st = backend_->Forward(p);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("device memory"));
}

TEST_F(CudaBackendErrorTest, UpdateCacheNeedsItsHostMirror) {
  CacheUpdateParams update;
  update.key = dev_->params().q;
  update.value = dev_->params().q;
  update.key_token_stride = update.value_token_stride = 128;
  update.key_head_stride = update.value_head_stride = 64;
  update.input_dtype = DType::kBFloat16;
  auto slots = ToDevice(std::vector<int64_t>{0, 1});
  ASSERT_TRUE(slots.ok());
  update.slot_mapping = slots->data_as<int64_t>();
  update.num_tokens = 2;
  update.cache = dev_->params().cache;
  const absl::Status st = backend_->UpdateCache(update);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("host_slot_mapping"));
}

}  // namespace
}  // namespace kvstream
