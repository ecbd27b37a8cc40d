// Tests of cache/kv_cache_spec.h: cache dtype and layout names, spec validation, byte
// sizes, and the dense strides of NHD and HND.
#include "kvstream/cache/kv_cache_spec.h"

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvstream {
namespace {

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

TEST(KvCacheSpecTest, ParsesEveryCacheDTypeName) {
  const std::pair<const char*, KvCacheDType> cases[] = {
      {"auto", KvCacheDType::kAuto},         {"bfloat16", KvCacheDType::kBFloat16},
      {"float16", KvCacheDType::kFloat16},   {"float32", KvCacheDType::kFloat32},
      {"fp8", KvCacheDType::kFp8E4M3},       {"fp8_e4m3", KvCacheDType::kFp8E4M3},
      {"fp8_e5m2", KvCacheDType::kFp8E5M2},  {"AUTO", KvCacheDType::kAuto},
      {"BFloat16", KvCacheDType::kBFloat16}, {"FP8", KvCacheDType::kFp8E4M3},
      {"Fp8_E5M2", KvCacheDType::kFp8E5M2},
  };
  for (const auto& [name, want] : cases) {
    auto got = ParseKvCacheDType(name);
    ASSERT_TRUE(got.ok()) << name << ": " << got.status();
    EXPECT_EQ(*got, want) << name;
  }
}

TEST(KvCacheSpecTest, CacheDTypeNamesRoundTrip) {
  for (KvCacheDType d : {KvCacheDType::kAuto, KvCacheDType::kBFloat16, KvCacheDType::kFloat16,
                         KvCacheDType::kFloat32, KvCacheDType::kFp8E4M3, KvCacheDType::kFp8E5M2}) {
    auto parsed = ParseKvCacheDType(KvCacheDTypeName(d));
    ASSERT_TRUE(parsed.ok()) << KvCacheDTypeName(d);
    EXPECT_EQ(*parsed, d);
  }
}

TEST(KvCacheSpecTest, UnknownCacheDTypeNamesValueAndChoices) {
  for (const char* bad : {"int8", "", "fp8_e4m3fnuz", "bf16 ", "fp16"}) {
    auto got = ParseKvCacheDType(bad);
    ASSERT_FALSE(got.ok()) << bad;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(got.status().message(), HasSubstr(std::string("'") + bad + "'"));
    for (const char* choice :
         {"auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"}) {
      EXPECT_THAT(got.status().message(), HasSubstr(choice));
    }
  }
}

TEST(KvCacheSpecTest, ResolvesCacheDType) {
  EXPECT_EQ(ResolveKvCacheDType(KvCacheDType::kAuto, DType::kBFloat16), DType::kBFloat16);
  EXPECT_EQ(ResolveKvCacheDType(KvCacheDType::kAuto, DType::kFloat16), DType::kFloat16);
  EXPECT_EQ(ResolveKvCacheDType(KvCacheDType::kFloat32, DType::kBFloat16), DType::kFloat32);
  EXPECT_EQ(ResolveKvCacheDType(KvCacheDType::kFloat16, DType::kBFloat16), DType::kFloat16);
  EXPECT_EQ(ResolveKvCacheDType(KvCacheDType::kBFloat16, DType::kFloat32), DType::kBFloat16);
  EXPECT_EQ(ResolveKvCacheDType(KvCacheDType::kFp8E4M3, DType::kBFloat16), DType::kFloat8E4M3);
  EXPECT_EQ(ResolveKvCacheDType(KvCacheDType::kFp8E5M2, DType::kBFloat16), DType::kFloat8E5M2);
}

TEST(KvCacheSpecTest, LayoutAndQuantModeNames) {
  for (const char* name : {"NHD", "nhd", "Nhd"}) {
    auto l = ParseKvLayout(name);
    ASSERT_TRUE(l.ok());
    EXPECT_EQ(*l, KvLayout::kNHD);
  }
  auto hnd = ParseKvLayout("hnd");
  ASSERT_TRUE(hnd.ok());
  EXPECT_EQ(*hnd, KvLayout::kHND);
  auto bad = ParseKvLayout("NDH");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("'NDH'"));
  EXPECT_THAT(bad.status().message(), HasSubstr("HND"));
  EXPECT_EQ(KvLayoutName(KvLayout::kNHD), "NHD");
  EXPECT_EQ(KvLayoutName(KvLayout::kHND), "HND");
  EXPECT_EQ(KvQuantModeName(KvQuantMode::kNone), "none");
  EXPECT_EQ(KvQuantModeName(KvQuantMode::kPerTensor), "per_tensor");
  EXPECT_EQ(KvQuantModeName(KvQuantMode::kPerHead), "per_head");
}

TEST(KvCacheSpecTest, ValidateAcceptsGoodSpecs) {
  EXPECT_TRUE(MakeSpec(16, 8, 128, 128, DType::kBFloat16).Validate().ok());
  EXPECT_TRUE(MakeSpec(1, 1, 1, 1, DType::kFloat32).Validate().ok());
  EXPECT_TRUE(MakeSpec(7, 3, 80, 64, DType::kFloat16).Validate().ok());
  EXPECT_TRUE(
      MakeSpec(16, 8, 128, 128, DType::kFloat8E4M3, KvQuantMode::kPerTensor).Validate().ok());
  EXPECT_TRUE(
      MakeSpec(16, 8, 128, 128, DType::kFloat8E5M2, KvQuantMode::kPerHead).Validate().ok());
}

TEST(KvCacheSpecTest, ValidateRejectsBadSpecs) {
  struct Case {
    KvCacheSpec spec;
    const char* needle;
  };
  const Case cases[] = {
      {MakeSpec(0, 8, 128, 128, DType::kBFloat16), "block_size=0"},
      {MakeSpec(-16, 8, 128, 128, DType::kBFloat16), "block_size=-16"},
      {MakeSpec(16, 0, 128, 128, DType::kBFloat16), "num_kv_heads=0"},
      {MakeSpec(16, 8, 0, 128, DType::kBFloat16), "head_size=0"},
      {MakeSpec(16, 8, 128, 0, DType::kBFloat16), "head_size_v=0"},
      {MakeSpec(16, 8, 128, 128, DType::kInt32), "int32"},
      {MakeSpec(16, 8, 128, 128, DType::kUInt8), "uint8"},
      {MakeSpec(16, 8, 128, 128, DType::kFloat8E4M3), "per_tensor or per_head"},
      {MakeSpec(16, 8, 128, 128, DType::kBFloat16, KvQuantMode::kPerTensor), "per_tensor"},
      {MakeSpec(16, 8, 128, 128, DType::kFloat32, KvQuantMode::kPerHead), "per_head"},
  };
  for (const Case& c : cases) {
    const absl::Status s = c.spec.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.spec.DebugString();
    EXPECT_THAT(s.message(), HasSubstr(c.needle)) << c.spec.DebugString();
  }
}

TEST(KvCacheSpecTest, BytesPerTokenAndBlock) {
  const KvCacheSpec bf16 = MakeSpec(16, 8, 128, 128, DType::kBFloat16);
  EXPECT_EQ(bf16.BytesPerToken(), 8 * (128 + 128) * 2);
  EXPECT_EQ(bf16.KBytesPerBlock(), 16 * 8 * 128 * 2);
  EXPECT_EQ(bf16.VBytesPerBlock(), 16 * 8 * 128 * 2);
  EXPECT_EQ(bf16.BytesPerBlock(), 16 * 8 * 256 * 2);

  const KvCacheSpec f32 = MakeSpec(7, 3, 80, 64, DType::kFloat32);
  EXPECT_EQ(f32.BytesPerToken(), 3 * (80 + 64) * 4);
  EXPECT_EQ(f32.KBytesPerBlock(), 7 * 3 * 80 * 4);
  EXPECT_EQ(f32.VBytesPerBlock(), 7 * 3 * 64 * 4);
  EXPECT_EQ(f32.BytesPerBlock(), f32.KBytesPerBlock() + f32.VBytesPerBlock());

  const KvCacheSpec fp8 = MakeSpec(16, 2, 192, 128, DType::kFloat8E4M3, KvQuantMode::kPerHead);
  EXPECT_EQ(fp8.BytesPerToken(), 2 * (192 + 128));
  EXPECT_EQ(fp8.BytesPerBlock(), 16 * 2 * (192 + 128));
  EXPECT_EQ(fp8.VBytesPerBlock(), 16 * 2 * 128);

  const KvCacheSpec f16 = MakeSpec(1, 1, 64, 96, DType::kFloat16);
  EXPECT_EQ(f16.BytesPerToken(), (64 + 96) * 2);
  EXPECT_EQ(f16.BytesPerBlock(), (64 + 96) * 2);

  // Large enough that 32-bit arithmetic would overflow.
  const KvCacheSpec big = MakeSpec(1 << 16, 1 << 8, 1 << 10, 1 << 10, DType::kFloat32);
  EXPECT_EQ(big.BytesPerBlock(), int64_t{1} << (16 + 8 + 11 + 2));
}

TEST(KvCacheSpecTest, DebugStringAndEquality) {
  const KvCacheSpec a = MakeSpec(16, 8, 128, 64, DType::kFloat8E5M2, KvQuantMode::kPerHead);
  const std::string s = a.DebugString();
  for (const char* part : {"16", "8", "128", "64", "fp8_e5m2", "per_head"}) {
    EXPECT_THAT(s, HasSubstr(part));
  }
  KvCacheSpec b = a;
  EXPECT_EQ(a, b);
  b.head_size_v = 128;
  EXPECT_NE(a, b);
}

TEST(KvCacheSpecTest, DenseStridesMatchTheDocumentedOrder) {
  const KvCacheSpec spec = MakeSpec(16, 4, 80, 64, DType::kBFloat16);
  const CacheStrides nhd_k = MakeCacheStrides(spec, KvLayout::kNHD, false);
  EXPECT_EQ(nhd_k.dim, 1);
  EXPECT_EQ(nhd_k.head, 80);
  EXPECT_EQ(nhd_k.token, 4 * 80);
  EXPECT_EQ(nhd_k.block, 16 * 4 * 80);
  const CacheStrides nhd_v = MakeCacheStrides(spec, KvLayout::kNHD, true);
  EXPECT_EQ(nhd_v.head, 64);
  EXPECT_EQ(nhd_v.token, 4 * 64);
  EXPECT_EQ(nhd_v.block, 16 * 4 * 64);
  const CacheStrides hnd_k = MakeCacheStrides(spec, KvLayout::kHND, false);
  EXPECT_EQ(hnd_k.dim, 1);
  EXPECT_EQ(hnd_k.token, 80);
  EXPECT_EQ(hnd_k.head, 16 * 80);
  EXPECT_EQ(hnd_k.block, 4 * 16 * 80);
  const CacheStrides hnd_v = MakeCacheStrides(spec, KvLayout::kHND, true);
  EXPECT_EQ(hnd_v.token, 64);
  EXPECT_EQ(hnd_v.head, 16 * 64);
  EXPECT_EQ(hnd_v.block, 4 * 16 * 64);
  EXPECT_EQ(hnd_k.Offset(2, 3, 1, 5), 2 * hnd_k.block + 3 * 80 + 1 * 16 * 80 + 5);
}

// Every logical element of a num_blocks-block cache maps to its own offset inside the dense
// buffer, and together they fill it: the strides are a bijection onto [0, elements).
TEST(KvCacheSpecTest, EveryLayoutMapsEachElementToAUniqueOffsetInsideTheBuffer) {
  const int64_t num_blocks = 3;
  for (const KvCacheSpec& spec :
       {MakeSpec(16, 4, 80, 64, DType::kBFloat16), MakeSpec(7, 3, 64, 80, DType::kFloat32),
        MakeSpec(1, 1, 64, 64, DType::kFloat16), MakeSpec(5, 2, 3, 1, DType::kFloat32)}) {
    for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
      for (bool is_value : {false, true}) {
        SCOPED_TRACE(spec.DebugString() + " " + std::string(KvLayoutName(layout)) +
                     (is_value ? " V" : " K"));
        const int64_t head_size = is_value ? spec.head_size_v : spec.head_size;
        const int64_t elements = num_blocks * spec.block_size * spec.num_kv_heads * head_size;
        const CacheStrides s = MakeCacheStrides(spec, layout, is_value);
        std::vector<bool> seen(elements, false);
        for (int64_t b = 0; b < num_blocks; ++b) {
          for (int64_t t = 0; t < spec.block_size; ++t) {
            for (int64_t h = 0; h < spec.num_kv_heads; ++h) {
              for (int64_t d = 0; d < head_size; ++d) {
                const int64_t off = s.Offset(b, t, h, d);
                ASSERT_GE(off, 0);
                ASSERT_LT(off, elements);
                ASSERT_FALSE(seen[off]) << "offset " << off << " reached twice";
                seen[off] = true;
              }
            }
          }
        }
        // A block is one contiguous range of BytesPerBlock / dtype bytes in both layouts.
        EXPECT_EQ(s.block * static_cast<int64_t>(DTypeSize(spec.dtype)),
                  is_value ? spec.VBytesPerBlock() : spec.KBytesPerBlock());
      }
    }
  }
}

TEST(KvCacheSpecTest, LayoutsDifferInsideABlock) {
  const KvCacheSpec spec = MakeSpec(4, 2, 8, 8, DType::kBFloat16);
  const CacheStrides nhd = MakeCacheStrides(spec, KvLayout::kNHD, false);
  const CacheStrides hnd = MakeCacheStrides(spec, KvLayout::kHND, false);
  // Token 1 of head 0 follows head 1 of token 0 in NHD, but token 0 of head 0 in HND.
  EXPECT_EQ(nhd.Offset(0, 1, 0, 0), 16);
  EXPECT_EQ(nhd.Offset(0, 0, 1, 0), 8);
  EXPECT_EQ(hnd.Offset(0, 1, 0, 0), 8);
  EXPECT_EQ(hnd.Offset(0, 0, 1, 0), 32);
  EXPECT_FALSE(nhd == hnd);
}

}  // namespace
}  // namespace kvstream
