// Tests of cache/kv_cache.h: owned caches in both layouts, borrowed engine tensors with
// arbitrary strides (and the mismatches Borrow must reject), and fp8 scales.
#include "kvstream/cache/kv_cache.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvstream/cache/kv_cache_spec.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/tensor.h"

namespace kvstream {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

KvCacheSpec MakeSpec(int block_size, int heads, int head_size, int head_size_v, DType dtype,
                     KvQuantMode mode = KvQuantMode::kNone) {
  KvCacheSpec spec;
  spec.block_size = block_size;
  spec.num_kv_heads = heads;
  spec.head_size = head_size;
  spec.head_size_v = head_size_v;
  spec.dtype = dtype;
  spec.quant_mode = mode;
  return spec;
}

std::vector<int64_t> StrideVector(const CacheStrides& s) {
  return {s.block, s.token, s.head, s.dim};
}

std::unique_ptr<KvCache> MustCreate(const KvCacheSpec& spec, KvLayout layout, int64_t blocks) {
  KvCache::Options options;
  options.spec = spec;
  options.layout = layout;
  options.num_blocks = blocks;
  auto cache = KvCache::Create(options);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return std::move(cache).value();
}

bool AllZero(const void* p, size_t bytes) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < bytes; ++i) {
    if (b[i] != 0) return false;
  }
  return true;
}

TEST(KvCacheTest, CreateNhdOwnsZeroFilledAlignedBuffers) {
  const KvCacheSpec spec = MakeSpec(16, 4, 80, 64, DType::kBFloat16);
  auto cache = MustCreate(spec, KvLayout::kNHD, 5);
  EXPECT_TRUE(cache->owned());
  EXPECT_EQ(cache->num_blocks(), 5);
  EXPECT_EQ(cache->spec(), spec);
  ASSERT_TRUE(cache->layout().has_value());
  EXPECT_EQ(*cache->layout(), KvLayout::kNHD);
  EXPECT_THAT(cache->k().shape(), ElementsAre(5, 16, 4, 80));
  EXPECT_THAT(cache->v().shape(), ElementsAre(5, 16, 4, 64));
  EXPECT_EQ(cache->k().strides(), StrideVector(MakeCacheStrides(spec, KvLayout::kNHD, false)));
  EXPECT_EQ(cache->v().strides(), StrideVector(MakeCacheStrides(spec, KvLayout::kNHD, true)));
  EXPECT_TRUE(cache->k().is_contiguous());
  EXPECT_EQ(cache->k().dtype(), DType::kBFloat16);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(cache->k().data()) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(cache->v().data()) % 64, 0u);
  EXPECT_TRUE(AllZero(cache->k().data(), 5 * spec.KBytesPerBlock()));
  EXPECT_TRUE(AllZero(cache->v().data(), 5 * spec.VBytesPerBlock()));
  EXPECT_TRUE(cache->k_scales().empty());

  const KvCacheView view = cache->view();
  EXPECT_EQ(view.k, cache->k().data());
  EXPECT_EQ(view.v, cache->v().data());
  EXPECT_EQ(view.k_strides, MakeCacheStrides(spec, KvLayout::kNHD, false));
  EXPECT_EQ(view.v_strides, MakeCacheStrides(spec, KvLayout::kNHD, true));
  EXPECT_EQ(view.num_blocks, 5);
  EXPECT_EQ(view.spec, spec);
  EXPECT_EQ(view.k_scale, nullptr);
  EXPECT_EQ(view.v_scale, nullptr);
  EXPECT_EQ(view.num_scales, 0);
  EXPECT_EQ(view.memory, MemoryKind::kHost);
}

TEST(KvCacheTest, CreateHndUsesHeadMajorStrides) {
  const KvCacheSpec spec = MakeSpec(7, 3, 64, 80, DType::kFloat32);
  auto cache = MustCreate(spec, KvLayout::kHND, 2);
  ASSERT_TRUE(cache->layout().has_value());
  EXPECT_EQ(*cache->layout(), KvLayout::kHND);
  // The logical view stays [num_blocks, block_size, num_kv_heads, head_size].
  EXPECT_THAT(cache->k().shape(), ElementsAre(2, 7, 3, 64));
  EXPECT_THAT(cache->k().strides(), ElementsAre(3 * 7 * 64, 64, 7 * 64, 1));
  EXPECT_THAT(cache->v().strides(), ElementsAre(3 * 7 * 80, 80, 7 * 80, 1));
  EXPECT_FALSE(cache->k().is_contiguous());
  EXPECT_EQ(cache->view().k_strides, MakeCacheStrides(spec, KvLayout::kHND, false));
  EXPECT_TRUE(AllZero(cache->v().data(), 2 * spec.VBytesPerBlock()));
}

TEST(KvCacheTest, CreateFp8StartsWithUnitScales) {
  auto per_tensor =
      MustCreate(MakeSpec(16, 4, 64, 64, DType::kFloat8E4M3, KvQuantMode::kPerTensor),
                 KvLayout::kNHD, 1);
  EXPECT_THAT(per_tensor->k_scales(), ElementsAre(1.0f));
  EXPECT_THAT(per_tensor->v_scales(), ElementsAre(1.0f));
  EXPECT_EQ(per_tensor->view().num_scales, 1);
  EXPECT_EQ(per_tensor->view().k_scale, per_tensor->k_scales().data());

  auto per_head = MustCreate(MakeSpec(16, 4, 64, 64, DType::kFloat8E5M2, KvQuantMode::kPerHead),
                             KvLayout::kHND, 1);
  EXPECT_THAT(per_head->k_scales(), ElementsAre(1.0f, 1.0f, 1.0f, 1.0f));
  EXPECT_THAT(per_head->v_scales(), ElementsAre(1.0f, 1.0f, 1.0f, 1.0f));
  EXPECT_EQ(per_head->view().num_scales, 4);
}

TEST(KvCacheTest, CreateErrors) {
  KvCache::Options options;
  options.spec = MakeSpec(16, 4, 64, 64, DType::kBFloat16);
  options.num_blocks = 0;
  EXPECT_EQ(KvCache::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.num_blocks = -3;
  EXPECT_EQ(KvCache::Create(options).status().code(), absl::StatusCode::kInvalidArgument);

  options.num_blocks = 4;
  options.spec.head_size_v = 0;
  EXPECT_EQ(KvCache::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.spec = MakeSpec(16, 4, 64, 64, DType::kFloat8E4M3);  // fp8 without quant mode
  EXPECT_EQ(KvCache::Create(options).status().code(), absl::StatusCode::kInvalidArgument);

  // Pinned and device memory: Unimplemented without CUDA; with CUDA, allocated where a GPU
  // can be used and FailedPrecondition (naming the kind) where none can.
  options.spec = MakeSpec(16, 4, 64, 64, DType::kBFloat16);
  for (MemoryKind kind : {MemoryKind::kPinned, MemoryKind::kDevice}) {
    SCOPED_TRACE(MemoryKindName(kind));
    options.memory = kind;
    auto cache = KvCache::Create(options);
    if (!BuiltWithCuda()) {
      ASSERT_FALSE(cache.ok());
      EXPECT_EQ(cache.status().code(), absl::StatusCode::kUnimplemented);
      EXPECT_THAT(cache.status().message(), HasSubstr("CUDA backend"));
      EXPECT_THAT(cache.status().message(), HasSubstr(std::string(MemoryKindName(kind))));
    } else if (CudaAvailability().ok()) {
      ASSERT_TRUE(cache.ok()) << cache.status();
      EXPECT_EQ((*cache)->view().memory, kind);
      EXPECT_EQ((*cache)->k().memory(), kind);
      EXPECT_NE((*cache)->view().k, nullptr);
      EXPECT_NE((*cache)->view().v, nullptr);
      if (kind == MemoryKind::kPinned) {  // host-readable: check the zero fill here
        EXPECT_TRUE(AllZero((*cache)->view().k, 4 * options.spec.KBytesPerBlock()));
        EXPECT_TRUE(AllZero((*cache)->view().v, 4 * options.spec.VBytesPerBlock()));
      }
    } else {
      ASSERT_FALSE(cache.ok());
      EXPECT_EQ(cache.status().code(), absl::StatusCode::kFailedPrecondition) << cache.status();
      EXPECT_THAT(cache.status().message(), HasSubstr(std::string(MemoryKindName(kind))));
    }
  }

  // Sizes whose byte count does not fit in 64 bits are refused, not wrapped.
  options.memory = MemoryKind::kHost;
  options.spec = MakeSpec(1 << 20, 1 << 10, 1 << 12, 1 << 12, DType::kFloat32);
  options.num_blocks = int64_t{1} << 40;
  EXPECT_EQ(KvCache::Create(options).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(KvCacheTest, BorrowNhdTensorsWithoutCopying) {
  const KvCacheSpec spec = MakeSpec(16, 2, 64, 32, DType::kFloat16);
  Tensor k = Tensor::Zeros({3, 16, 2, 64}, DType::kFloat16);
  Tensor v = Tensor::Zeros({3, 16, 2, 32}, DType::kFloat16);
  auto cache = KvCache::Borrow(spec, k.view(), v.view());
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_FALSE((*cache)->owned());
  EXPECT_EQ((*cache)->num_blocks(), 3);
  EXPECT_EQ((*cache)->view().k, k.data());
  EXPECT_EQ((*cache)->view().v, v.data());
  ASSERT_TRUE((*cache)->layout().has_value());
  EXPECT_EQ(*(*cache)->layout(), KvLayout::kNHD);
}

TEST(KvCacheTest, BorrowHndTensorAsPermutedStrideView) {
  // The engine stores [num_blocks, num_kv_heads, block_size, head_size] and passes the
  // logical [num_blocks, block_size, num_kv_heads, head_size] permutation of it.
  const KvCacheSpec spec = MakeSpec(16, 4, 128, 128, DType::kBFloat16);
  Tensor k_phys = Tensor::Zeros({6, 4, 16, 128}, DType::kBFloat16);
  Tensor v_phys = Tensor::Zeros({6, 4, 16, 128}, DType::kBFloat16);
  auto permute = [](const Tensor& t) {
    const std::vector<int64_t> s = t.view().strides();
    return TensorView(t.data(), t.dtype(), {t.shape()[0], t.shape()[2], t.shape()[1], t.shape()[3]},
                      {s[0], s[2], s[1], s[3]});
  };
  auto cache = KvCache::Borrow(spec, permute(k_phys), permute(v_phys));
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE((*cache)->layout().has_value());
  EXPECT_EQ(*(*cache)->layout(), KvLayout::kHND);
  EXPECT_EQ((*cache)->view().k_strides, MakeCacheStrides(spec, KvLayout::kHND, false));
}

TEST(KvCacheTest, BorrowVllmFlashLayoutHalves) {
  // vLLM's flash attention cache: one tensor [2, num_blocks, block_size, heads, head_size];
  // K is [0] and V is [1].
  const KvCacheSpec spec = MakeSpec(16, 2, 64, 64, DType::kBFloat16);
  Tensor kv = Tensor::Zeros({2, 4, 16, 2, 64}, DType::kBFloat16);
  const int64_t half = 4 * 16 * 2 * 64;
  TensorView k(kv.data(), DType::kBFloat16, {4, 16, 2, 64});
  TensorView v(kv.data_as<uint16_t>() + half, DType::kBFloat16, {4, 16, 2, 64});
  auto cache = KvCache::Borrow(spec, k, v);
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ((*cache)->view().v, kv.data_as<uint16_t>() + half);
  EXPECT_EQ(*(*cache)->layout(), KvLayout::kNHD);
}

TEST(KvCacheTest, BorrowInterleavedBlocksHasNoDenseLayout) {
  // K and V of a block next to each other: [num_blocks, 2, block_size, heads, head_size].
  const KvCacheSpec spec = MakeSpec(8, 2, 16, 16, DType::kFloat32);
  Tensor kv = Tensor::Zeros({5, 2, 8, 2, 16}, DType::kFloat32);
  const std::vector<int64_t> strides = {2 * 8 * 2 * 16, 2 * 16, 16, 1};
  TensorView k(kv.data(), DType::kFloat32, {5, 8, 2, 16}, strides);
  TensorView v(kv.data_as<float>() + 8 * 2 * 16, DType::kFloat32, {5, 8, 2, 16}, strides);
  auto cache = KvCache::Borrow(spec, k, v);
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_FALSE((*cache)->layout().has_value());
  EXPECT_EQ((*cache)->view().k_strides.block, 2 * 8 * 2 * 16);
}

TEST(KvCacheTest, BorrowRejectsMismatchesNamingThem) {
  const KvCacheSpec spec = MakeSpec(16, 2, 64, 32, DType::kFloat16);
  Tensor k = Tensor::Zeros({3, 16, 2, 64}, DType::kFloat16);
  Tensor v = Tensor::Zeros({3, 16, 2, 32}, DType::kFloat16);
  const TensorView good_k = k.view();
  const TensorView good_v = v.view();
  struct Case {
    const char* what;
    TensorView k;
    TensorView v;
    const char* needle;
  };
  const Case cases[] = {
      {"rank", TensorView(k.data(), DType::kFloat16, {3 * 16, 2, 64}), good_v, "4-D"},
      {"block size", TensorView(k.data(), DType::kFloat16, {6, 8, 2, 64}), good_v, "block_size"},
      {"heads", TensorView(k.data(), DType::kFloat16, {3, 16, 4, 32}), good_v, "num_kv_heads"},
      {"head size", TensorView(k.data(), DType::kFloat16, {3, 16, 1, 128}), good_v, "num_kv_heads"},
      {"head size", TensorView(k.data(), DType::kFloat16, {6, 16, 2, 32}), good_v, "head_size"},
      {"v head size", good_k, TensorView(v.data(), DType::kFloat16, {3, 16, 1, 64}), "V cache"},
      {"v head size_v", good_k, TensorView(k.data(), DType::kFloat16, {3, 16, 2, 64}), "32"},
      {"dtype", TensorView(k.data(), DType::kBFloat16, {3, 16, 2, 64}), good_v, "bfloat16"},
      {"dim stride", TensorView(k.data(), DType::kFloat16, {3, 16, 2, 64}, {4096, 256, 128, 2}),
       good_v, "stride 1"},
      {"null", TensorView(nullptr, DType::kFloat16, {3, 16, 2, 64}), good_v, "null"},
      {"null v", good_k, TensorView(nullptr, DType::kFloat16, {3, 16, 2, 32}), "V cache"},
      {"negative stride",
       TensorView(k.data(), DType::kFloat16, {3, 16, 2, 64}, {-2048, 128, 64, 1}), good_v,
       "negative"},
      {"overlap", TensorView(k.data(), DType::kFloat16, {3, 16, 2, 64}, {0, 128, 64, 1}), good_v,
       "overlap"},
      {"overlap heads", TensorView(k.data(), DType::kFloat16, {3, 16, 2, 64}, {2048, 128, 32, 1}),
       good_v, "overlap"},
      {"no blocks", TensorView(k.data(), DType::kFloat16, {0, 16, 2, 64}), good_v, "no blocks"},
      {"block counts", good_k, TensorView(v.data(), DType::kFloat16, {2, 16, 2, 32}), "blocks"},
      {"memory kinds", good_k,
       TensorView(v.data(), DType::kFloat16, {3, 16, 2, 32}, MemoryKind::kDevice), "device"},
  };
  for (const Case& c : cases) {
    auto cache = KvCache::Borrow(spec, c.k, c.v);
    ASSERT_FALSE(cache.ok()) << c.what;
    EXPECT_EQ(cache.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(cache.status().message(), HasSubstr(c.needle)) << c.what;
  }
  KvCacheSpec bad_spec = spec;
  bad_spec.num_kv_heads = 0;
  EXPECT_EQ(KvCache::Borrow(bad_spec, good_k, good_v).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(KvCacheTest, BorrowDeviceViewsKeepsTheMemoryKind) {
  const KvCacheSpec spec = MakeSpec(4, 1, 8, 8, DType::kFloat32);
  std::vector<float> fake(4 * 8);  // never dereferenced: a stand-in for a device pointer
  TensorView k(fake.data(), DType::kFloat32, {1, 4, 1, 8}, MemoryKind::kDevice);
  TensorView v(fake.data(), DType::kFloat32, {1, 4, 1, 8}, MemoryKind::kDevice);
  auto cache = KvCache::Borrow(spec, k, v);
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ((*cache)->view().memory, MemoryKind::kDevice);
}

TEST(KvCacheTest, SetScalesPerTensor) {
  auto cache = MustCreate(MakeSpec(16, 4, 64, 64, DType::kFloat8E4M3, KvQuantMode::kPerTensor),
                          KvLayout::kNHD, 1);
  ASSERT_TRUE(cache->SetScales({0.02f}, {0.03f}).ok());
  EXPECT_THAT(cache->k_scales(), ElementsAre(0.02f));
  EXPECT_THAT(cache->v_scales(), ElementsAre(0.03f));
  const KvCacheView view = cache->view();
  ASSERT_NE(view.k_scale, nullptr);
  EXPECT_EQ(view.k_scale[0], 0.02f);
  EXPECT_EQ(view.v_scale[0], 0.03f);
  EXPECT_EQ(view.num_scales, 1);

  const absl::Status wrong_count = cache->SetScales({0.5f, 0.5f, 0.5f, 0.5f}, {0.5f});
  EXPECT_EQ(wrong_count.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong_count.message(), HasSubstr("needs 1 k scale"));
  EXPECT_THAT(cache->k_scales(), ElementsAre(0.02f));
}

TEST(KvCacheTest, SetScalesPerHead) {
  auto cache = MustCreate(MakeSpec(16, 3, 64, 64, DType::kFloat8E5M2, KvQuantMode::kPerHead),
                          KvLayout::kHND, 1);
  ASSERT_TRUE(cache->SetScales({1.0f, 2.0f, 4.0f}, {0.5f, 0.25f, 0.125f}).ok());
  EXPECT_THAT(cache->k_scales(), ElementsAre(1.0f, 2.0f, 4.0f));
  EXPECT_THAT(cache->v_scales(), ElementsAre(0.5f, 0.25f, 0.125f));
  EXPECT_EQ(cache->view().num_scales, 3);
  EXPECT_EQ(cache->view().v_scale[2], 0.125f);

  const absl::Status one = cache->SetScales({1.0f}, {1.0f});
  EXPECT_EQ(one.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(one.message(), HasSubstr("needs 3"));
  // A good K with a bad V changes neither.
  const absl::Status v_only = cache->SetScales({9.0f, 9.0f, 9.0f}, {1.0f, 1.0f});
  EXPECT_EQ(v_only.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(cache->k_scales(), ElementsAre(1.0f, 2.0f, 4.0f));
  EXPECT_THAT(cache->v_scales(), ElementsAre(0.5f, 0.25f, 0.125f));
}

TEST(KvCacheTest, SetScalesRejectsNonPositiveOrNonFinite) {
  auto cache = MustCreate(MakeSpec(16, 2, 64, 64, DType::kFloat8E4M3, KvQuantMode::kPerHead),
                          KvLayout::kNHD, 1);
  for (float bad : {0.0f, -0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(cache->SetScales({1.0f, bad}, {1.0f, 1.0f}).code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
    const absl::Status s = cache->SetScales({1.0f, 1.0f}, {bad, 1.0f});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.message(), HasSubstr("v scale 0"));
  }
  EXPECT_THAT(cache->k_scales(), ElementsAre(1.0f, 1.0f));
  EXPECT_THAT(cache->v_scales(), ElementsAre(1.0f, 1.0f));
}

TEST(KvCacheTest, SetScalesOnNonFp8CacheFails) {
  auto cache = MustCreate(MakeSpec(16, 2, 64, 64, DType::kBFloat16), KvLayout::kNHD, 1);
  const absl::Status s = cache->SetScales({1.0f}, {1.0f});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("bfloat16"));
  EXPECT_TRUE(cache->k_scales().empty());
}

TEST(KvCacheTest, BorrowedFp8CacheHasScales) {
  const KvCacheSpec spec = MakeSpec(4, 2, 8, 8, DType::kFloat8E4M3, KvQuantMode::kPerHead);
  Tensor k = Tensor::Zeros({2, 4, 2, 8}, DType::kFloat8E4M3);
  Tensor v = Tensor::Zeros({2, 4, 2, 8}, DType::kFloat8E4M3);
  auto cache = KvCache::Borrow(spec, k.view(), v.view());
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_THAT((*cache)->k_scales(), ElementsAre(1.0f, 1.0f));
  ASSERT_TRUE((*cache)->SetScales({0.5f, 2.0f}, {3.0f, 4.0f}).ok());
  EXPECT_EQ((*cache)->view().k_scale[1], 2.0f);
}

}  // namespace
}  // namespace kvstream
