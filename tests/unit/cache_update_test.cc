// Tests of cache/cache_update.h (CPU): every input/cache dtype pair, both layouts, odd
// block and head sizes, padding, scattered blocks and strided inputs, checked byte for byte
// against a golden reference built from numeric.h one element at a time; fp8 per-tensor
// and per-head scales, saturation; and every invalid input rejected with nothing written.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvstream/cache/cache_update.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/cache/kv_cache_spec.h"
#include "kvstream/cache/slot_mapping.h"
#include "kvstream/common/numeric.h"
#include "kvstream/common/tensor.h"
#include "tests/unit/dtype_names.h"

namespace kvstream {
namespace {

using ::testing::HasSubstr;

struct Shape {
  int block_size;
  int heads;
  int head_size;
  int head_size_v;
};

KvCacheSpec MakeSpec(const Shape& s, DType dtype, KvQuantMode mode = KvQuantMode::kNone) {
  KvCacheSpec spec;
  spec.block_size = s.block_size;
  spec.num_kv_heads = s.heads;
  spec.head_size = s.head_size;
  spec.head_size_v = s.head_size_v;
  spec.dtype = dtype;
  spec.quant_mode = mode;
  return spec;
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

// Bytes spanned by one cache tensor of `view`, whatever its strides.
size_t ExtentBytes(const KvCacheView& view, bool is_value) {
  const CacheStrides& s = is_value ? view.v_strides : view.k_strides;
  const int64_t head_size = is_value ? view.spec.head_size_v : view.spec.head_size;
  const int64_t last = (view.num_blocks - 1) * s.block + (view.spec.block_size - 1) * s.token +
                       (view.spec.num_kv_heads - 1) * s.head + (head_size - 1) * s.dim;
  return static_cast<size_t>(last + 1) * DTypeSize(view.spec.dtype);
}

struct CacheBytes {
  std::vector<uint8_t> k;
  std::vector<uint8_t> v;
};

CacheBytes Snapshot(const KvCacheView& view) {
  CacheBytes b;
  const auto* k = static_cast<const uint8_t*>(view.k);
  const auto* v = static_cast<const uint8_t*>(view.v);
  b.k.assign(k, k + ExtentBytes(view, false));
  b.v.assign(v, v + ExtentBytes(view, true));
  return b;
}

// Reports the first differing byte, so a failure says where.
void ExpectSameBytes(const std::vector<uint8_t>& want, const std::vector<uint8_t>& got,
                     const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  const auto mismatch = std::mismatch(want.begin(), want.end(), got.begin());
  if (mismatch.first != want.end()) {
    const size_t at = static_cast<size_t>(mismatch.first - want.begin());
    ADD_FAILURE() << what << ": first difference at byte " << at << " of " << want.size()
                  << ": expected 0x" << std::hex << int{*mismatch.first} << ", got 0x"
                  << int{*mismatch.second};
  }
}

void ExpectUnchanged(const CacheBytes& before, const KvCacheView& view, const std::string& what) {
  const CacheBytes after = Snapshot(view);
  ExpectSameBytes(before.k, after.k, what + " (K)");
  ExpectSameBytes(before.v, after.v, what + " (V)");
}

// The golden reference: applies the update one element at a time with numeric.h to copies
// of the K and V memory (k_out and v_out stand for cache.k and cache.v), addressing the
// cache through the view's strides.
void ReferenceUpdate(const TensorView& key, const TensorView& value,
                     const std::vector<int64_t>& slots, const KvCacheView& cache, uint8_t* k_out,
                     uint8_t* v_out) {
  const KvCacheSpec& spec = cache.spec;
  const size_t in_size = DTypeSize(key.dtype());
  const size_t out_size = DTypeSize(spec.dtype);
  for (size_t t = 0; t < slots.size(); ++t) {
    if (slots[t] == -1) continue;
    const int64_t block = slots[t] / spec.block_size;
    const int64_t offset = slots[t] % spec.block_size;
    for (int h = 0; h < spec.num_kv_heads; ++h) {
      for (int which = 0; which < 2; ++which) {
        const TensorView& in = which == 0 ? key : value;
        const CacheStrides& strides = which == 0 ? cache.k_strides : cache.v_strides;
        uint8_t* out = which == 0 ? k_out : v_out;
        const int64_t n = which == 0 ? spec.head_size : spec.head_size_v;
        float scale = 1.0f;
        if (IsFp8(spec.dtype)) {
          const float* scales = which == 0 ? cache.k_scale : cache.v_scale;
          scale = scales[cache.num_scales == 1 ? 0 : h];
        }
        for (int64_t d = 0; d < n; ++d) {
          const int64_t src = static_cast<int64_t>(t) * in.stride(0) + h * in.stride(1) + d;
          const int64_t dst = strides.Offset(block, offset, h, d);
          if (in.dtype() == spec.dtype) {
            std::memcpy(out + dst * out_size,
                        static_cast<const uint8_t*>(in.data()) + src * in_size, in_size);
          } else {
            const float x = LoadAsFloat(in.data(), in.dtype(), src);
            if (IsFp8(spec.dtype)) {
              StoreFromFloat(out, spec.dtype, dst, x / scale);
            } else {
              // No arithmetic on x here: the compiler may treat `x / 1.0f` as x, or a
              // conditional x / scale as an unconditional one, and a division quiets a
              // signalling NaN that the cache must keep bit for bit.
              StoreFromFloat(out, spec.dtype, dst, x);
            }
          }
        }
      }
    }
  }
}

// Input values: mostly ordinary numbers, with specials mixed in (infinities, signed zero,
// values past the fp8/fp16 range, subnormals, NaNs with payloads) as raw bits so that the
// same-dtype path must copy them untouched.
float OrdinaryValue(std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  return normal(rng);
}

void FillInput(const TensorView& t, std::mt19937& rng) {
  const float kSpecials[] = {std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity(),
                             -0.0f,
                             1e5f,
                             -7e4f,
                             1e-6f,
                             -3e-7f,
                             1e-40f,
                             448.0f,
                             -1e9f};
  int64_t n = 0;
  for (int64_t i = 0; i < t.size(0); ++i) {
    for (int64_t h = 0; h < t.size(1); ++h) {
      for (int64_t d = 0; d < t.size(2); ++d, ++n) {
        const int64_t at = i * t.stride(0) + h * t.stride(1) + d;
        const bool special = n % 23 == 5;
        const bool nan = n % 97 == 11;
        const float x = special ? kSpecials[(n / 23) % 10] : OrdinaryValue(rng);
        switch (t.dtype()) {
          case DType::kFloat32: {
            const uint32_t bits = nan ? 0x7fa00123u : FloatBits(x);  // a signalling NaN
            std::memcpy(t.data_as<float>() + at, &bits, 4);
            break;
          }
          case DType::kFloat16:
            t.data_as<uint16_t>()[at] = nan ? uint16_t{0x7d01} : FloatToHalf(x);
            break;
          case DType::kBFloat16:
            t.data_as<uint16_t>()[at] = nan ? uint16_t{0xff81} : FloatToBFloat16(x);
            break;
          default:
            FAIL() << "unsupported input dtype";
        }
      }
    }
  }
}

// An input tensor [num_tokens, heads, head_size] inside a larger buffer: padded heads and
// tokens, as a slice of a fused QKV projection would be.
struct Input {
  Tensor storage;
  TensorView view;
};

Input MakeInput(DType dtype, int64_t num_tokens, int64_t heads, int64_t head_size,
                int64_t head_pad, int64_t token_pad, std::mt19937& rng) {
  Input in;
  const int64_t head_stride = head_size + head_pad;
  const int64_t token_stride = heads * head_stride + token_pad;
  in.storage = Tensor::Zeros({std::max<int64_t>(num_tokens, 1) * token_stride}, dtype);
  in.view = TensorView(in.storage.data(), dtype, {num_tokens, heads, head_size},
                       {token_stride, head_stride, 1});
  FillInput(in.view, rng);
  return in;
}

using ::kvstream::testing_util::ShortDType;

struct GridCase {
  DType input;
  DType cache;
  KvLayout layout;
  Shape shape;
  KvQuantMode quant;
};

std::string CaseName(const ::testing::TestParamInfo<GridCase>& info) {
  const GridCase& c = info.param;
  std::string name = absl::StrCat(ShortDType(c.input), "_to_", ShortDType(c.cache), "_",
                                  KvLayoutName(c.layout), "_bs", c.shape.block_size, "_h",
                                  c.shape.heads, "_d", c.shape.head_size, "_v",
                                  c.shape.head_size_v);
  if (c.quant != KvQuantMode::kNone) absl::StrAppend(&name, "_", KvQuantModeName(c.quant));
  return name;
}

// gtest prints a failing case through this instead of as raw bytes.
void PrintTo(const GridCase& c, std::ostream* os) {
  *os << ShortDType(c.input) << " -> " << ShortDType(c.cache) << " " << KvLayoutName(c.layout)
      << " block_size " << c.shape.block_size << " heads " << c.shape.heads << " head_size "
      << c.shape.head_size << " head_size_v " << c.shape.head_size_v << " "
      << KvQuantModeName(c.quant);
}

std::vector<GridCase> AllCases() {
  const Shape shapes[] = {{1, 1, 64, 64}, {16, 2, 80, 64}, {7, 3, 64, 80}};
  std::vector<GridCase> cases;
  for (DType input : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (DType cache : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3,
                        DType::kFloat8E5M2}) {
      for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
        for (const Shape& shape : shapes) {
          if (IsFp8(cache)) {
            for (KvQuantMode q : {KvQuantMode::kPerTensor, KvQuantMode::kPerHead}) {
              cases.push_back({input, cache, layout, shape, q});
            }
          } else {
            cases.push_back({input, cache, layout, shape, KvQuantMode::kNone});
          }
        }
      }
    }
  }
  return cases;
}

class CacheUpdateGridTest : public ::testing::TestWithParam<GridCase> {};

TEST_P(CacheUpdateGridTest, MatchesReferenceByteForByte) {
  const GridCase& c = GetParam();
  const KvCacheSpec spec = MakeSpec(c.shape, c.cache, c.quant);
  const int bs = c.shape.block_size;
  // Two sequences on shuffled blocks, two blocks left unused.
  const int64_t a_tokens = 9, b_first = 5, b_tokens = 4;
  const int64_t a_blocks = (a_tokens + bs - 1) / bs;
  const int64_t b_blocks = (b_first + b_tokens + bs - 1) / bs;
  const int64_t num_blocks = a_blocks + b_blocks + 2;
  std::vector<int32_t> order(num_blocks);
  std::iota(order.begin(), order.end(), 0);
  std::mt19937 rng(static_cast<uint32_t>(num_blocks * 131 + bs));
  std::shuffle(order.begin(), order.end(), rng);
  const std::vector<int32_t> row_a(order.begin(), order.begin() + a_blocks);
  const std::vector<int32_t> row_b(order.begin() + a_blocks,
                                   order.begin() + a_blocks + b_blocks);
  const std::vector<int32_t> unused(order.begin() + a_blocks + b_blocks, order.end());
  auto slots_a = ComputeSlotMapping(row_a, bs, 0, a_tokens);
  auto slots_b = ComputeSlotMapping(row_b, bs, b_first, b_tokens);
  ASSERT_TRUE(slots_a.ok() && slots_b.ok());
  // Interleave with padding: A0..A3, pad, B0..B3, A4..A8, pad.
  std::vector<int64_t> slots(slots_a->begin(), slots_a->begin() + 4);
  slots.push_back(kPaddingSlot);
  slots.insert(slots.end(), slots_b->begin(), slots_b->end());
  slots.insert(slots.end(), slots_a->begin() + 4, slots_a->end());
  slots.push_back(kPaddingSlot);
  const int64_t num_tokens = static_cast<int64_t>(slots.size());

  auto cache = MustCreate(spec, c.layout, num_blocks);
  if (c.quant == KvQuantMode::kPerTensor) {
    ASSERT_TRUE(cache->SetScales({0.37f}, {1.3f}).ok());
  } else if (c.quant == KvQuantMode::kPerHead) {
    std::vector<float> k_scales, v_scales;
    for (int h = 0; h < c.shape.heads; ++h) {
      k_scales.push_back(0.3f * static_cast<float>(h + 1));
      v_scales.push_back(0.11f + 0.5f * static_cast<float>(h));
    }
    ASSERT_TRUE(cache->SetScales(k_scales, v_scales).ok());
  }

  // Key strided (padded heads and tokens), value contiguous.
  Input key = MakeInput(c.input, num_tokens, c.shape.heads, c.shape.head_size, 4, 3, rng);
  Input value = MakeInput(c.input, num_tokens, c.shape.heads, c.shape.head_size_v, 0, 0, rng);

  CacheBytes expected = Snapshot(cache->view());
  ReferenceUpdate(key.view, value.view, slots, cache->view(), expected.k.data(),
                  expected.v.data());
  ASSERT_NE(expected.k, Snapshot(cache->view()).k) << "the reference wrote nothing";

  ASSERT_TRUE(ReshapeAndCache(key.view, value.view, *cache, slots).ok());
  const CacheBytes got = Snapshot(cache->view());
  ExpectSameBytes(expected.k, got.k, "K cache");
  ExpectSameBytes(expected.v, got.v, "V cache");

  // Blocks no token maps to are untouched (all zero), in K and V.
  const KvCacheView view = cache->view();
  const size_t cell = DTypeSize(spec.dtype);
  for (int32_t b : unused) {
    for (int t = 0; t < bs; ++t) {
      for (int h = 0; h < c.shape.heads; ++h) {
        for (int d = 0; d < c.shape.head_size; ++d) {
          const size_t at = static_cast<size_t>(view.k_strides.Offset(b, t, h, d)) * cell;
          for (size_t i = 0; i < cell; ++i) ASSERT_EQ(got.k[at + i], 0) << "block " << b;
        }
        for (int d = 0; d < c.shape.head_size_v; ++d) {
          const size_t at = static_cast<size_t>(view.v_strides.Offset(b, t, h, d)) * cell;
          for (size_t i = 0; i < cell; ++i) ASSERT_EQ(got.v[at + i], 0) << "block " << b;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllDTypesLayoutsAndShapes, CacheUpdateGridTest,
                         ::testing::ValuesIn(AllCases()), CaseName);

// ---- Hand-checked values ----

// One token, one block of size 1, a cache built for the test; returns the K and V bytes
// written for `k_row` and `v_row` (float32 input).
struct Written {
  std::vector<uint8_t> k;
  std::vector<uint8_t> v;
};
Written UpdateOneToken(const KvCacheSpec& spec, const std::vector<float>& k_scales,
                       const std::vector<float>& v_scales, std::vector<float> k_row,
                       std::vector<float> v_row) {
  auto cache = MustCreate(spec, KvLayout::kNHD, 1);
  if (!k_scales.empty()) {
    EXPECT_TRUE(cache->SetScales(k_scales, v_scales).ok());
  }
  TensorView key(k_row.data(), DType::kFloat32, {1, spec.num_kv_heads, spec.head_size});
  TensorView value(v_row.data(), DType::kFloat32, {1, spec.num_kv_heads, spec.head_size_v});
  const std::vector<int64_t> slots = {0};
  EXPECT_TRUE(ReshapeAndCache(key, value, *cache, slots).ok());
  const CacheBytes b = Snapshot(cache->view());
  return {b.k, b.v};
}

TEST(CacheUpdateTest, Fp8E4M3PerTensorByHand) {
  const KvCacheSpec spec = MakeSpec({1, 1, 6, 2}, DType::kFloat8E4M3, KvQuantMode::kPerTensor);
  const Written w = UpdateOneToken(spec, {2.0f}, {4.0f},
                                   {3.0f, 0.1f, 1000.0f, -1000.0f, -0.0f, 896.0f}, {3.0f, -1e9f});
  // 3/2 = 1.5 -> 0x3c; 0.1/2 = 0.05 -> 0.05078125 (0x15); 500 and -500 saturate to +-448;
  // -0 keeps its sign; 896/2 = 448 exactly.
  EXPECT_THAT(w.k, ::testing::ElementsAre(0x3c, 0x15, 0x7e, 0xfe, 0x80, 0x7e));
  // 3/4 = 0.75 = 1.5 * 2^-1 -> 0x34; -1e9/4 saturates to -448.
  EXPECT_THAT(w.v, ::testing::ElementsAre(0x34, 0xfe));
}

TEST(CacheUpdateTest, Fp8E5M2PerHeadByHand) {
  const KvCacheSpec spec = MakeSpec({1, 2, 2, 1}, DType::kFloat8E5M2, KvQuantMode::kPerHead);
  const Written w = UpdateOneToken(spec, {1.0f, 4.0f}, {4.0f, 0.5f},
                                   {3.0f, 1e6f, 3.0f, -0.3f}, {-0.3f, 4e4f});
  // Head 0 at scale 1: 3.0 -> 0x42, 1e6 saturates to 57344 (0x7b).
  // Head 1 at scale 4: 0.75 -> 0x3a, -0.075 -> -0.078125 (0xad).
  EXPECT_THAT(w.k, ::testing::ElementsAre(0x42, 0x7b, 0x3a, 0xad));
  // V head 0 at scale 4: -0.075 -> 0xad; head 1 at scale 0.5: 8e4 saturates (0x7b).
  EXPECT_THAT(w.v, ::testing::ElementsAre(0xad, 0x7b));
}

TEST(CacheUpdateTest, Fp8DividesByTheScaleRatherThanMultiplyingByItsInverse) {
  // Inputs where fp8(x / s) and fp8(x * (1 / s)) differ (found with numpy/ml_dtypes).
  const KvCacheSpec spec = MakeSpec({1, 1, 1, 1}, DType::kFloat8E4M3, KvQuantMode::kPerTensor);
  const Written a =
      UpdateOneToken(spec, {3.0f}, {0.37f}, {BitsToFloat(0xc063ffffu)}, {BitsToFloat(0xc01fd70au)});
  EXPECT_THAT(a.k, ::testing::ElementsAre(0xb9));
  EXPECT_THAT(a.v, ::testing::ElementsAre(0xcd));
}

TEST(CacheUpdateTest, SameDTypeCopiesBitsIncludingNaNPayloads) {
  const KvCacheSpec spec = MakeSpec({4, 1, 4, 4}, DType::kFloat16);
  auto cache = MustCreate(spec, KvLayout::kHND, 2);
  uint16_t k[4] = {0x7d01, 0xfc01, 0x0001, 0x8000};  // sNaN, negative NaN, subnormal, -0
  uint16_t v[4] = {0x3c00, 0x7bff, 0xfbff, 0x7c00};
  const std::vector<int64_t> slots = {6};
  ASSERT_TRUE(ReshapeAndCache(TensorView(k, DType::kFloat16, {1, 1, 4}),
                              TensorView(v, DType::kFloat16, {1, 1, 4}), *cache, slots)
                  .ok());
  const KvCacheView view = cache->view();
  for (int d = 0; d < 4; ++d) {
    EXPECT_EQ(static_cast<uint16_t*>(view.k)[view.k_strides.Offset(1, 2, 0, d)], k[d]) << d;
    EXPECT_EQ(static_cast<uint16_t*>(view.v)[view.v_strides.Offset(1, 2, 0, d)], v[d]) << d;
  }
}

TEST(CacheUpdateTest, ConversionsRoundToNearestEven) {
  const KvCacheSpec spec = MakeSpec({1, 1, 3, 3}, DType::kBFloat16);
  // 1 + 2^-8 ties to 1.0 (even); 1 + 3 * 2^-8 ties up to 1 + 2^-6; 65520 -> 65536.
  const Written w = UpdateOneToken(spec, {}, {}, {BitsToFloat(0x3f808000u),
                                                   BitsToFloat(0x3f818000u), 65520.0f},
                                   {1.0f, -2.0f, 0.0f});
  const uint16_t* k = reinterpret_cast<const uint16_t*>(w.k.data());
  EXPECT_EQ(k[0], 0x3f80);
  EXPECT_EQ(k[1], 0x3f82);
  EXPECT_EQ(k[2], 0x4780);

  const KvCacheSpec half = MakeSpec({1, 1, 3, 1}, DType::kFloat16);
  // 1 + 2^-11 ties to 1.0; 65520 rounds to infinity (ties to even), 1e-8 to zero.
  const Written h = UpdateOneToken(half, {}, {}, {1.00048828125f, 65520.0f, 1e-8f}, {0.5f});
  const uint16_t* hk = reinterpret_cast<const uint16_t*>(h.k.data());
  EXPECT_EQ(hk[0], 0x3c00);
  EXPECT_EQ(hk[1], 0x7c00);
  EXPECT_EQ(hk[2], 0x0000);
}

TEST(CacheUpdateTest, AllPaddingWritesNothing) {
  const KvCacheSpec spec = MakeSpec({16, 2, 8, 8}, DType::kBFloat16);
  auto cache = MustCreate(spec, KvLayout::kNHD, 2);
  std::mt19937 rng(3);
  Input key = MakeInput(DType::kBFloat16, 5, 2, 8, 0, 0, rng);
  Input value = MakeInput(DType::kBFloat16, 5, 2, 8, 0, 0, rng);
  const CacheBytes before = Snapshot(cache->view());
  const std::vector<int64_t> slots(5, kPaddingSlot);
  ASSERT_TRUE(ReshapeAndCache(key.view, value.view, *cache, slots).ok());
  ExpectUnchanged(before, cache->view(), "all padding");
}

TEST(CacheUpdateTest, ZeroTokensIsANoOp) {
  const KvCacheSpec spec = MakeSpec({16, 2, 8, 8}, DType::kFloat32);
  auto cache = MustCreate(spec, KvLayout::kNHD, 1);
  CacheUpdateParams params;
  params.input_dtype = DType::kFloat32;
  params.cache = cache->view();
  EXPECT_TRUE(ValidateCacheUpdate(params).ok());
  EXPECT_TRUE(CacheUpdateCpu(params).ok());
}

TEST(CacheUpdateTest, LaterTokenOverwritesEarlierOnTheSameSlot) {
  const KvCacheSpec spec = MakeSpec({2, 1, 1, 1}, DType::kFloat32);
  auto cache = MustCreate(spec, KvLayout::kNHD, 1);
  float k[2] = {1.0f, 2.0f};
  float v[2] = {3.0f, 4.0f};
  const std::vector<int64_t> slots = {1, 1};
  ASSERT_TRUE(ReshapeAndCache(TensorView(k, DType::kFloat32, {2, 1, 1}),
                              TensorView(v, DType::kFloat32, {2, 1, 1}), *cache, slots)
                  .ok());
  EXPECT_EQ(cache->k().data_as<float>()[1], 2.0f);
  EXPECT_EQ(cache->v().data_as<float>()[1], 4.0f);
  EXPECT_EQ(cache->k().data_as<float>()[0], 0.0f);
}

// A borrowed cache with K and V of a block interleaved (no dense layout), updated through
// its own strides.
TEST(CacheUpdateTest, BorrowedInterleavedCache) {
  const Shape shape = {5, 2, 16, 12};
  const KvCacheSpec spec = MakeSpec(shape, DType::kFloat16);
  // Per block: K [5, 2, 16] then V [5, 2, 12], then 8 elements of padding.
  const int64_t k_block = 5 * 2 * 16, v_block = 5 * 2 * 12, block = k_block + v_block + 8;
  const int64_t num_blocks = 4;
  Tensor storage = Tensor::Zeros({num_blocks * block}, DType::kFloat16);
  TensorView k(storage.data(), DType::kFloat16, {num_blocks, 5, 2, 16}, {block, 32, 16, 1});
  TensorView v(storage.data_as<uint16_t>() + k_block, DType::kFloat16, {num_blocks, 5, 2, 12},
               {block, 24, 12, 1});
  auto cache = KvCache::Borrow(spec, k, v);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_FALSE((*cache)->layout().has_value());
  std::mt19937 rng(5);
  Input key = MakeInput(DType::kFloat32, 6, 2, 16, 0, 0, rng);
  Input value = MakeInput(DType::kFloat32, 6, 2, 12, 0, 0, rng);
  const std::vector<int64_t> slots = {17, 3, kPaddingSlot, 19, 0, 11};
  // K and V share one buffer, so the reference works on a copy of all of it.
  const auto* base = static_cast<const uint8_t*>(storage.data());
  std::vector<uint8_t> expected(base, base + storage.nbytes());
  ReferenceUpdate(key.view, value.view, slots, (*cache)->view(), expected.data(),
                  expected.data() + k_block * 2);
  ASSERT_TRUE(ReshapeAndCache(key.view, value.view, **cache, slots).ok());
  ExpectSameBytes(expected, std::vector<uint8_t>(base, base + storage.nbytes()), "K/V buffer");
  // The padding between blocks is never written.
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int64_t i = k_block + v_block; i < block; ++i) {
      EXPECT_EQ(storage.data_as<uint16_t>()[b * block + i], 0) << b;
    }
  }
}

// A hand-built view whose head dimension is not contiguous in the cache (dim stride 2):
// the strided copy and convert paths.
TEST(CacheUpdateTest, NonContiguousCacheRows) {
  for (DType in : {DType::kFloat16, DType::kFloat32}) {
    for (DType cache_dtype : {DType::kFloat16, DType::kFloat8E4M3}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(in), " -> ", DTypeName(cache_dtype)));
      const Shape shape = {3, 2, 8, 8};
      const KvCacheSpec spec = MakeSpec(
          shape, cache_dtype, IsFp8(cache_dtype) ? KvQuantMode::kPerHead : KvQuantMode::kNone);
      const int64_t num_blocks = 2;
      CacheStrides strides = MakeCacheStrides(spec, KvLayout::kNHD, false);
      strides.block *= 2;
      strides.token *= 2;
      strides.head *= 2;
      strides.dim = 2;
      Tensor k = Tensor::Zeros({num_blocks * strides.block}, cache_dtype);
      Tensor v = Tensor::Zeros({num_blocks * strides.block}, cache_dtype);
      const float scales[2] = {0.5f, 3.0f};
      CacheUpdateParams params;
      params.cache.k = k.data();
      params.cache.v = v.data();
      params.cache.k_strides = strides;
      params.cache.v_strides = strides;
      params.cache.num_blocks = num_blocks;
      params.cache.spec = spec;
      if (IsFp8(cache_dtype)) {
        params.cache.k_scale = scales;
        params.cache.v_scale = scales;
        params.cache.num_scales = 2;
      }
      std::mt19937 rng(9);
      Input key = MakeInput(in, 4, 2, 8, 0, 0, rng);
      Input value = MakeInput(in, 4, 2, 8, 0, 0, rng);
      const std::vector<int64_t> slots = {5, 0, kPaddingSlot, 2};
      params.key = key.view.data();
      params.value = value.view.data();
      params.key_token_stride = key.view.stride(0);
      params.key_head_stride = key.view.stride(1);
      params.value_token_stride = value.view.stride(0);
      params.value_head_stride = value.view.stride(1);
      params.input_dtype = in;
      params.slot_mapping = slots.data();
      params.num_tokens = 4;
      CacheBytes expected = Snapshot(params.cache);
      ReferenceUpdate(key.view, value.view, slots, params.cache, expected.k.data(),
                      expected.v.data());
      ASSERT_TRUE(CacheUpdateCpu(params).ok());
      const CacheBytes got = Snapshot(params.cache);
      ExpectSameBytes(expected.k, got.k, "K cache");
      ExpectSameBytes(expected.v, got.v, "V cache");
      // The odd elements between the strided cells stay zero.
      const size_t cell = DTypeSize(cache_dtype);
      for (size_t i = cell; i < got.k.size(); i += 2 * cell) {
        for (size_t j = 0; j < cell; ++j) ASSERT_EQ(got.k[i + j], 0) << i;
      }
    }
  }
}

// ---- Invalid inputs: the error, and nothing written ----

class CacheUpdateErrorTest : public ::testing::Test {
 protected:
  static constexpr int kTokens = 4;

  void SetUp() override {
    spec_ = MakeSpec({7, 3, 16, 8}, DType::kFloat8E4M3, KvQuantMode::kPerHead);
    cache_ = MustCreate(spec_, KvLayout::kHND, 3);
    ASSERT_TRUE(cache_->SetScales({0.5f, 1.0f, 2.0f}, {1.5f, 0.25f, 4.0f}).ok());
    std::mt19937 rng(17);
    key_ = MakeInput(DType::kBFloat16, kTokens, 3, 16, 2, 1, rng);
    value_ = MakeInput(DType::kBFloat16, kTokens, 3, 8, 0, 0, rng);
    // Put something in the cache first so that "unchanged" means more than "still zero".
    const std::vector<int64_t> warm = {20, 1, 13, 7};
    ASSERT_TRUE(ReshapeAndCache(key_.view, value_.view, *cache_, warm).ok());
    slots_ = {2, 9, 15, 19};  // all valid and different from the warm-up slots
    before_ = Snapshot(cache_->view());
  }

  // Params for a valid update of slots_; each test breaks one thing.
  CacheUpdateParams GoodParams() const {
    CacheUpdateParams p;
    p.key = key_.view.data();
    p.value = value_.view.data();
    p.key_token_stride = key_.view.stride(0);
    p.key_head_stride = key_.view.stride(1);
    p.value_token_stride = value_.view.stride(0);
    p.value_head_stride = value_.view.stride(1);
    p.input_dtype = DType::kBFloat16;
    p.slot_mapping = slots_.data();
    p.num_tokens = kTokens;
    p.cache = cache_->view();
    return p;
  }

  void ExpectRejected(const CacheUpdateParams& p, absl::StatusCode code,
                      const std::string& needle) {
    const absl::Status s = CacheUpdateCpu(p);
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(needle));
    ExpectUnchanged(before_, cache_->view(), needle);
  }

  void ExpectReshapeRejected(const TensorView& key, const TensorView& value,
                             const std::vector<int64_t>& slots, const std::string& needle,
                             absl::StatusCode code = absl::StatusCode::kInvalidArgument) {
    const absl::Status s = ReshapeAndCache(key, value, *cache_, slots);
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(needle));
    ExpectUnchanged(before_, cache_->view(), needle);
  }

  KvCacheSpec spec_;
  std::unique_ptr<KvCache> cache_;
  Input key_;
  Input value_;
  std::vector<int64_t> slots_;
  CacheBytes before_;
};

TEST_F(CacheUpdateErrorTest, GoodParamsDoWrite) {
  // The baseline the other tests break: valid params change the cache.
  ASSERT_TRUE(CacheUpdateCpu(GoodParams()).ok());
  EXPECT_NE(Snapshot(cache_->view()).k, before_.k);
}

TEST_F(CacheUpdateErrorTest, SlotBelowPaddingOnLastToken) {
  slots_[3] = -2;
  ExpectRejected(GoodParams(), absl::StatusCode::kInvalidArgument, "token 3 has slot -2");
}

TEST_F(CacheUpdateErrorTest, SlotPastTheCacheOnLastToken) {
  slots_[3] = 3 * 7;  // num_blocks * block_size
  ExpectRejected(GoodParams(), absl::StatusCode::kInvalidArgument, "token 3 has slot 21");
  slots_[3] = std::numeric_limits<int64_t>::max();
  ExpectRejected(GoodParams(), absl::StatusCode::kInvalidArgument, "token 3");
}

TEST_F(CacheUpdateErrorTest, NullPointers) {
  CacheUpdateParams p = GoodParams();
  p.key = nullptr;
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "null key");
  p = GoodParams();
  p.value = nullptr;
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "null value");
  p = GoodParams();
  p.slot_mapping = nullptr;
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "null slot_mapping");
  p = GoodParams();
  p.cache.v = nullptr;
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "null K or V cache");
}

TEST_F(CacheUpdateErrorTest, BadSizesAndStrides) {
  CacheUpdateParams p = GoodParams();
  p.num_tokens = -1;
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "negative num_tokens");
  p = GoodParams();
  p.key_head_stride = -16;
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "negative input strides");
  p = GoodParams();
  p.cache.num_blocks = 0;
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "0 blocks");
  p = GoodParams();
  p.cache.k_strides.dim = 0;
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "K cache strides");
  p = GoodParams();
  p.cache.spec.head_size = 0;
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "head_size=0");
}

TEST_F(CacheUpdateErrorTest, InputDTypeMustBeFloat) {
  for (DType bad : {DType::kInt32, DType::kUInt8, DType::kFloat8E4M3, DType::kInt64}) {
    CacheUpdateParams p = GoodParams();
    p.input_dtype = bad;
    ExpectRejected(p, absl::StatusCode::kInvalidArgument, std::string(DTypeName(bad)));
  }
}

TEST_F(CacheUpdateErrorTest, Fp8WithoutScales) {
  CacheUpdateParams p = GoodParams();
  p.cache.k_scale = nullptr;
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "without K scales");
  p = GoodParams();
  p.cache.v_scale = nullptr;
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "without V scales");
  p = GoodParams();
  p.cache.k_scale = nullptr;
  p.cache.v_scale = nullptr;
  p.cache.num_scales = 0;
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "got 0");
}

TEST_F(CacheUpdateErrorTest, Fp8WithWrongNumberOfScales) {
  CacheUpdateParams p = GoodParams();
  p.cache.num_scales = 1;  // per-head cache with 3 heads
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "needs 3 scale(s)");
  p = GoodParams();
  p.cache.spec.quant_mode = KvQuantMode::kPerTensor;  // 3 scales for a per-tensor cache
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "needs 1 scale(s)");
}

TEST_F(CacheUpdateErrorTest, Fp8WithBadScaleValues) {
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity(), -0.0f}) {
    float scales[3] = {1.0f, 1.0f, bad};
    CacheUpdateParams p = GoodParams();
    p.cache.v_scale = scales;
    ExpectRejected(p, absl::StatusCode::kInvalidArgument, "V scale 2");
    p = GoodParams();
    p.cache.k_scale = scales;
    ExpectRejected(p, absl::StatusCode::kInvalidArgument, "K scale 2");
  }
}

TEST_F(CacheUpdateErrorTest, DeviceCacheOnTheCpuPath) {
  CacheUpdateParams p = GoodParams();
  p.cache.memory = MemoryKind::kDevice;
  ExpectRejected(p, absl::StatusCode::kFailedPrecondition, "device memory");
}

TEST_F(CacheUpdateErrorTest, ReshapeAndCacheShapeChecks) {
  const TensorView& k = key_.view;
  const TensorView& v = value_.view;
  const std::vector<int64_t> s = slots_;
  ExpectReshapeRejected(TensorView(k.data(), k.dtype(), {kTokens, 3 * 16}), v, s, "3-D");
  ExpectReshapeRejected(
      TensorView(k.data(), k.dtype(), {kTokens, 2, 16}, {k.stride(0), k.stride(1), 1}), v, s,
      "key has shape");
  ExpectReshapeRejected(
      TensorView(k.data(), k.dtype(), {kTokens, 3, 8}, {k.stride(0), k.stride(1), 1}), v, s,
      "[num_tokens, 3, 16]");
  // head_size_v (8) differs from head_size (16): a value with head_size is wrong.
  ExpectReshapeRejected(k, k, s, "value has shape");
  ExpectReshapeRejected(
      TensorView(k.data(), k.dtype(), {kTokens, 3, 16}, {k.stride(0), k.stride(1), 2}), v, s,
      "stride 1");
  ExpectReshapeRejected(k, TensorView(v.data(), v.dtype(), {kTokens - 1, 3, 8}), s,
                        "key has 4 tokens but value has 3");
  ExpectReshapeRejected(k, v, {2, 9, 15}, "4 tokens but 3 slots");
  ExpectReshapeRejected(k, TensorView(v.data(), DType::kFloat16, {kTokens, 3, 8}), s,
                        "key is bfloat16 but value is float16");
  ExpectReshapeRejected(
      TensorView(k.data(), k.dtype(), {kTokens, 3, 16}, k.strides(), MemoryKind::kDevice), v,
      s, "device memory", absl::StatusCode::kFailedPrecondition);
  ExpectReshapeRejected(k, v, {2, 9, 15, -5}, "token 3 has slot -5");
  ExpectReshapeRejected(
      k, TensorView(v.data(), DType::kInt32, {kTokens, 3, 8}), s, "int32");
}

TEST_F(CacheUpdateErrorTest, ReshapeAndCacheWithInt32Inputs) {
  const TensorView k(key_.view.data(), DType::kInt32, key_.view.shape(), key_.view.strides());
  const TensorView v(value_.view.data(), DType::kInt32, value_.view.shape());
  ExpectReshapeRejected(k, v, slots_, "must be float32, float16 or bfloat16");
}

}  // namespace
}  // namespace kvstream
