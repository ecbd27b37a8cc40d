// CacheUpdateCuda against CacheUpdateCpu, byte for byte: every input dtype x cache dtype
// (fp8 with per-tensor and per-head scales), NHD, HND and two layouts the vector path cannot
// take (padded heads, strided head dimension), odd block and head sizes, odd token counts,
// padding slots, inputs with special values (NaN payloads, infinities, subnormals, values
// past the fp8/fp16 range); both fp8 methods on every 16-bit input bit pattern, under
// general and power-of-two scales; a device KvCache; and every rejected input leaving the
// cache untouched.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "cuda/cache_update.cuh"
#include "gpu_test_util.h"
#include "kvstream/cache/cache_update.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/cache/kv_cache_spec.h"
#include "kvstream/cache/slot_mapping.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/numeric.h"
#include "tests/unit/attention_test_util.h"

namespace kvstream {
namespace {

using ::kvstream::gpu_test::ToDevice;
using ::kvstream::gpu_test::ToHost;
using ::kvstream::testing_util::AllCacheKinds;
using ::kvstream::testing_util::CacheKind;
using ::kvstream::testing_util::MakeTestStrides;
using ::kvstream::testing_util::QuantSuffix;
using ::kvstream::testing_util::ShortDType;
using ::kvstream::testing_util::TestLayout;
using ::kvstream::testing_util::TestLayoutName;
using ::testing::HasSubstr;

constexpr uint8_t kCacheFill = 0xa5;  // initial cache bytes: untouched bytes must keep it

constexpr internal::CacheUpdateFp8Method kAllFp8Methods[] = {
    internal::CacheUpdateFp8Method::kReciprocal, internal::CacheUpdateFp8Method::kBracket,
    internal::CacheUpdateFp8Method::kDivision};

const char* Fp8MethodName(internal::CacheUpdateFp8Method method) {
  switch (method) {
    case internal::CacheUpdateFp8Method::kReciprocal: return "reciprocal";
    case internal::CacheUpdateFp8Method::kBracket: return "bracket";
    case internal::CacheUpdateFp8Method::kDivision: return "division";
  }
  return "?";
}

struct Shape {
  int block_size;
  int heads;
  int head_size;
  int head_size_v;
};

// One update problem: host inputs, slots and an initial cache, from which the CPU and the
// CUDA implementations each start.
class UpdateProblem {
 public:
  UpdateProblem(const Shape& shape, DType input, CacheKind kind, TestLayout layout,
                int64_t num_tokens, int input_pad, uint32_t seed)
      : shape_(shape), input_(input), rng_(seed) {
    spec_.block_size = shape.block_size;
    spec_.num_kv_heads = shape.heads;
    spec_.head_size = shape.head_size;
    spec_.head_size_v = shape.head_size_v;
    spec_.dtype = kind.dtype;
    spec_.quant_mode = IsFp8(kind.dtype) ? kind.quant : KvQuantMode::kNone;
    num_tokens_ = num_tokens;
    // Blocks: enough for every token, plus spares, used in shuffled order.
    num_blocks_ = (num_tokens + shape.block_size - 1) / shape.block_size + 3;
    k_strides_ = MakeTestStrides(layout, shape.block_size, shape.heads, shape.head_size);
    v_strides_ = MakeTestStrides(layout, shape.block_size, shape.heads, shape.head_size_v);
    k_cache_.assign(Extent(k_strides_, shape.head_size), kCacheFill);
    v_cache_.assign(Extent(v_strides_, shape.head_size_v), kCacheFill);
    if (IsFp8(kind.dtype)) {
      const int n = spec_.quant_mode == KvQuantMode::kPerHead ? shape.heads : 1;
      for (int i = 0; i < n; ++i) {
        k_scale_.push_back(0.02f * static_cast<float>(i + 1) + 0.003f);
        v_scale_.push_back(0.05f / static_cast<float>(i + 1));
      }
    }
    // Slots: every slot of the shuffled blocks at most once, every 7th token padding.
    std::vector<int64_t> slots(static_cast<size_t>(num_blocks_ * shape.block_size));
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng_);
    for (int64_t t = 0; t < num_tokens; ++t) {
      slots_.push_back(t % 7 == 3 ? kPaddingSlot : slots[static_cast<size_t>(t)]);
    }
    // Inputs [num_tokens, heads, head_size(_v)] with a padded token stride.
    key_token_stride_ = int64_t{shape.heads} * shape.head_size + input_pad;
    value_token_stride_ = int64_t{shape.heads} * shape.head_size_v + input_pad;
    key_ = RandomInput(num_tokens * key_token_stride_);
    value_ = RandomInput(num_tokens * value_token_stride_);
  }

  // Params over host memory (cache = the given buffers).
  CacheUpdateParams HostParams(std::vector<uint8_t>& k_cache, std::vector<uint8_t>& v_cache) {
    CacheUpdateParams p;
    p.key = key_.data();
    p.value = value_.data();
    p.key_token_stride = key_token_stride_;
    p.key_head_stride = shape_.head_size;
    p.value_token_stride = value_token_stride_;
    p.value_head_stride = shape_.head_size_v;
    p.input_dtype = input_;
    p.slot_mapping = slots_.data();
    p.num_tokens = num_tokens_;
    p.cache.k = k_cache.data();
    p.cache.v = v_cache.data();
    p.cache.k_strides = k_strides_;
    p.cache.v_strides = v_strides_;
    p.cache.num_blocks = num_blocks_;
    p.cache.spec = spec_;
    if (!k_scale_.empty()) {
      p.cache.k_scale = k_scale_.data();
      p.cache.v_scale = v_scale_.data();
      p.cache.num_scales = static_cast<int>(k_scale_.size());
    }
    return p;
  }

  // The CPU result: the initial cache updated by CacheUpdateCpu.
  void CpuResult(std::vector<uint8_t>& k, std::vector<uint8_t>& v) {
    k = k_cache_;
    v = v_cache_;
    const absl::Status st = CacheUpdateCpu(HostParams(k, v));
    ASSERT_TRUE(st.ok()) << st;
  }

  // Device copies of the inputs, slots and initial cache; params over them.
  absl::Status Upload() {
    ASSIGN_OR_RETURN(d_key_, ToDevice(key_));
    ASSIGN_OR_RETURN(d_value_, ToDevice(value_));
    ASSIGN_OR_RETURN(d_slots_, ToDevice(slots_));
    ASSIGN_OR_RETURN(d_k_, ToDevice(k_cache_));
    ASSIGN_OR_RETURN(d_v_, ToDevice(v_cache_));
    return absl::OkStatus();
  }
  CacheUpdateParams DeviceParams() {
    std::vector<uint8_t> unused_k, unused_v;
    CacheUpdateParams p = HostParams(unused_k, unused_v);
    p.key = d_key_.data();
    p.value = d_value_.data();
    p.slot_mapping = d_slots_.data_as<int64_t>();
    p.host_slot_mapping = slots_.data();
    p.cache.k = d_k_.data();
    p.cache.v = d_v_.data();
    p.cache.memory = MemoryKind::kDevice;
    return p;
  }
  absl::Status Download(std::vector<uint8_t>& k, std::vector<uint8_t>& v) const {
    k.resize(k_cache_.size());
    v.resize(v_cache_.size());
    RETURN_IF_ERROR(ToHost(d_k_.data(), k.size(), k.data()));
    return ToHost(d_v_.data(), v.size(), v.data());
  }

  // Replaces the fp8 scales (sizes as the quant mode wants: 1 or heads).
  void SetScales(std::vector<float> k, std::vector<float> v) {
    k_scale_ = std::move(k);
    v_scale_ = std::move(v);
  }

  // Replaces the inputs: 16-bit inputs get every bit pattern in K (element i holds i mod
  // 2^16) and in V (a permutation of them), 32-bit inputs random bit patterns (every
  // exponent); every token goes to slot t (no padding).
  void FillEveryBitPattern() {
    const size_t es = DTypeSize(input_);
    for (std::vector<uint8_t>* bytes : {&key_, &value_}) {
      const bool is_value = bytes == &value_;
      const size_t n = bytes->size() / es;
      for (size_t i = 0; i < n; ++i) {
        uint8_t* at = bytes->data() + i * es;
        if (es == 2) {
          const uint16_t bits =
              static_cast<uint16_t>(is_value ? i * 40503u + 12345u : i);  // 40503 is odd
          std::memcpy(at, &bits, 2);
        } else {
          const uint32_t bits = static_cast<uint32_t>(rng_());
          std::memcpy(at, &bits, 4);
        }
      }
    }
    for (size_t t = 0; t < slots_.size(); ++t) slots_[t] = static_cast<int64_t>(t);
  }

  const std::vector<uint8_t>& initial_k() const { return k_cache_; }
  const std::vector<uint8_t>& initial_v() const { return v_cache_; }
  std::vector<int64_t>& slots() { return slots_; }
  int64_t num_slots() const { return num_blocks_ * shape_.block_size; }

 private:
  size_t Extent(const CacheStrides& s, int dim) const {
    const int64_t last =
        s.Offset(num_blocks_ - 1, shape_.block_size - 1, shape_.heads - 1, dim - 1);
    return static_cast<size_t>(last + 1) * DTypeSize(spec_.dtype);
  }

  // Raw input bytes: mostly normal values, one in 16 a special bit pattern of the input
  // format (NaN payloads, infinities, zeros, subnormals, values past fp16/fp8 ranges).
  std::vector<uint8_t> RandomInput(int64_t elements) {
    const size_t es = DTypeSize(input_);
    std::vector<uint8_t> bytes(static_cast<size_t>(elements) * es);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::uniform_int_distribution<int> pick(0, 15);
    static const uint32_t kF32Specials[] = {0x7fc00123u, 0xffc00001u, 0x7f800000u, 0xff800000u,
                                           0x80000000u, 0x00000001u, 0x00700000u, 0x47800000u,
                                           0x43f00000u, 0xc7700000u, 0x3b800000u, 0x33800000u};
    static const uint16_t kF16Specials[] = {0x7e01u, 0xfe00u, 0x7c00u, 0xfc00u, 0x8000u,
                                            0x0001u, 0x03ffu, 0x7bffu, 0x5fa0u, 0xdfa0u};
    static const uint16_t kBF16Specials[] = {0x7fc1u, 0xffc0u, 0x7f80u, 0xff80u, 0x8000u,
                                             0x0001u, 0x007fu, 0x7f7fu, 0x4780u, 0x43f0u};
    for (int64_t i = 0; i < elements; ++i) {
      const bool special = pick(rng_) == 0;
      uint8_t* at = bytes.data() + static_cast<size_t>(i) * es;
      if (input_ == DType::kFloat32) {
        const uint32_t bits =
            special ? kF32Specials[static_cast<size_t>(i) % 12] : FloatBits(normal(rng_));
        std::memcpy(at, &bits, 4);
      } else if (input_ == DType::kFloat16) {
        const uint16_t bits =
            special ? kF16Specials[static_cast<size_t>(i) % 10] : FloatToHalf(normal(rng_));
        std::memcpy(at, &bits, 2);
      } else {
        const uint16_t bits =
            special ? kBF16Specials[static_cast<size_t>(i) % 10] : FloatToBFloat16(normal(rng_));
        std::memcpy(at, &bits, 2);
      }
    }
    return bytes;
  }

  Shape shape_;
  DType input_;
  std::mt19937 rng_;
  KvCacheSpec spec_;
  int64_t num_tokens_ = 0;
  int64_t num_blocks_ = 0;
  CacheStrides k_strides_, v_strides_;
  std::vector<uint8_t> k_cache_, v_cache_;
  std::vector<float> k_scale_, v_scale_;
  std::vector<int64_t> slots_;
  int64_t key_token_stride_ = 0, value_token_stride_ = 0;
  std::vector<uint8_t> key_, value_;
  DeviceBuffer d_key_, d_value_, d_slots_, d_k_, d_v_;
};

void ExpectSameBytes(const std::vector<uint8_t>& want, const std::vector<uint8_t>& got,
                     const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  const auto mismatch = std::mismatch(want.begin(), want.end(), got.begin());
  if (mismatch.first != want.end()) {
    const size_t at = static_cast<size_t>(mismatch.first - want.begin());
    size_t differing = 0;
    for (size_t i = 0; i < want.size(); ++i) differing += want[i] != got[i];
    ADD_FAILURE() << what << ": " << differing << " of " << want.size()
                  << " bytes differ; first at byte " << at << ": cpu 0x" << std::hex
                  << int{*mismatch.first} << ", cuda 0x" << int{*mismatch.second};
  }
}

class CudaCacheUpdateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const absl::Status status = CudaAvailability();
    if (!status.ok()) GTEST_SKIP() << "no usable GPU: " << status.message();
    auto stream = CudaStream::Create();
    ASSERT_TRUE(stream.ok()) << stream.status();
    stream_ = std::move(stream).value();
  }

  // Runs both implementations on `pb` and compares the whole K and V buffers.
  void ExpectCudaMatchesCpu(UpdateProblem& pb, const std::string& what) {
    SCOPED_TRACE(what);
    std::vector<uint8_t> cpu_k, cpu_v;
    pb.CpuResult(cpu_k, cpu_v);
    ExpectMethodGives(pb, std::nullopt, cpu_k, cpu_v);
  }

  // Uploads `pb`, runs the CUDA update (CacheUpdateCuda, or with `method` when given) and
  // compares with the CPU's bytes.
  void ExpectMethodGives(UpdateProblem& pb,
                         std::optional<internal::CacheUpdateFp8Method> method,
                         const std::vector<uint8_t>& cpu_k, const std::vector<uint8_t>& cpu_v) {
    ASSERT_TRUE(pb.Upload().ok());
    const absl::Status st =
        method ? internal::CacheUpdateCudaWithMethod(pb.DeviceParams(), stream_.get(), *method)
               : CacheUpdateCuda(pb.DeviceParams(), stream_.get());
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_TRUE(stream_.Synchronize(absl::Seconds(30)).ok());
    std::vector<uint8_t> gpu_k, gpu_v;
    ASSERT_TRUE(pb.Download(gpu_k, gpu_v).ok());
    ExpectSameBytes(cpu_k, gpu_k, "K cache");
    ExpectSameBytes(cpu_v, gpu_v, "V cache");
  }

  CudaStream stream_;
};

// Input dtype x cache dtype and scale mode x layout, on a shape the vector path takes in the
// dense layouts (head sizes multiples of 8) and an odd token count.
class CudaCacheUpdateDTypeTest
    : public CudaCacheUpdateTest,
      public ::testing::WithParamInterface<std::tuple<DType, CacheKind, TestLayout>> {};

TEST_P(CudaCacheUpdateDTypeTest, MatchesCpuBitForBit) {
  const auto& [input, kind, layout] = GetParam();
  for (const Shape& shape : {Shape{16, 8, 128, 128}, Shape{5, 3, 80, 48}}) {
    UpdateProblem pb(shape, input, kind, layout, /*num_tokens=*/333, /*input_pad=*/8,
                     /*seed=*/static_cast<uint32_t>(shape.block_size + shape.heads));
    ExpectCudaMatchesCpu(pb, absl::StrCat("block ", shape.block_size, " heads ", shape.heads,
                                          " d ", shape.head_size, "/", shape.head_size_v));
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllDTypes, CudaCacheUpdateDTypeTest,
    ::testing::Combine(
        ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
        ::testing::ValuesIn(AllCacheKinds()),
        ::testing::Values(TestLayout::kNHD, TestLayout::kHND, TestLayout::kPadded,
                          TestLayout::kDimStrided)),
    [](const auto& param_info) {
      const CacheKind& kind = std::get<1>(param_info.param);
      return absl::StrCat(ShortDType(std::get<0>(param_info.param)), "_to_", ShortDType(kind.dtype),
                          QuantSuffix(kind.quant),
                          "_", TestLayoutName(std::get<2>(param_info.param)));
    });

// The fp8 methods (cache_update.cuh: the split reciprocal for 16-bit inputs, the reciprocal
// bracket with the exact quotient where its ends disagree, and the per-element division)
// against the CPU, byte for byte, on every 16-bit input bit pattern (and random 32-bit
// ones) under scales that stress the quotient:
// 1, small, tiny, odd, 448/65504 (the fp16 range mapped onto e4m3's), and scales outside
// the reciprocal's range, which fall back to the division. Some of these inputs land
// between the bracket's ends and a rounding boundary: without the exact fallback the
// kernel writes the neighbouring code for them (checked by mutation: 16 failures).
TEST_F(CudaCacheUpdateTest, Fp8MethodsMatchCpuOnEveryInputBitPattern) {
  using internal::CacheUpdateFp8Method;
  struct ScaleSet {
    KvQuantMode quant;
    std::vector<float> k, v;
  };
  const float kF16OntoE4m3 = 448.0f / 65504.0f;
  const std::vector<ScaleSet> scale_sets = {
      {KvQuantMode::kPerTensor, {1.0f}, {0.01f}},
      {KvQuantMode::kPerTensor, {3e-5f}, {7.3f}},
      {KvQuantMode::kPerTensor, {kF16OntoE4m3}, {57344.0f / 65504.0f}},
      {KvQuantMode::kPerTensor, {0.3333333f}, {1.7e-3f}},
      {KvQuantMode::kPerTensor, {0x1p-40f}, {3e9f}},  // outside [2^-30, 2^30]: division
      {KvQuantMode::kPerHead, {1.0f, 0.01f, 3e-5f, 7.3f}, {kF16OntoE4m3, 0.37f, 1e-3f, 9.9e8f}},
      {KvQuantMode::kPerHead, {0x1p-30f, 0x1p30f, 0.1f, 1.1f}, {0.7f, 13.0f, 2.5e-4f, 5.0f}},
      {KvQuantMode::kPerHead, {1.0f, 0x1p-35f, 0.5f, 3.0f}, {1.0f, 1.0f, 1.0f, 1.0f}},
  };
  const Shape shape{16, 4, 128, 128};
  const int64_t tokens = 65536 / (4 * 128);
  for (const DType input : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (const DType cache : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
      for (const TestLayout layout : {TestLayout::kNHD, TestLayout::kHND}) {
        for (size_t si = 0; si < scale_sets.size(); ++si) {
          const ScaleSet& set = scale_sets[si];
          UpdateProblem pb(shape, input, CacheKind{cache, set.quant}, layout, tokens,
                           /*input_pad=*/0, /*seed=*/static_cast<uint32_t>(si + 11));
          pb.SetScales(set.k, set.v);
          pb.FillEveryBitPattern();
          std::vector<uint8_t> cpu_k, cpu_v;
          pb.CpuResult(cpu_k, cpu_v);
          for (const CacheUpdateFp8Method method : kAllFp8Methods) {
            SCOPED_TRACE(absl::StrCat(ShortDType(input), "->", ShortDType(cache), " ",
                                      TestLayoutName(layout), " scale set ", si, " method ",
                                      Fp8MethodName(method)));
            ExpectMethodGives(pb, method, cpu_k, cpu_v);
          }
        }
      }
    }
  }
}

// Power-of-two scales take the kernel's one-multiply quotient (x * (1 / scale)), which is
// exact only for scales 2^e with e in [-126, 126]; everything else must be refused.
TEST(CudaCacheUpdatePowerOfTwoTest, OnlyNormalPowersOfTwoWithNormalReciprocals) {
  using internal::Fp8ScaleIsPowerOfTwo;
  for (const float s : {1.0f, 0.25f, 2.0f, 0x1p-10f, 0x1p10f, 0x1p-126f, 0x1p126f}) {
    EXPECT_TRUE(Fp8ScaleIsPowerOfTwo(s)) << s;
  }
  const float kInf = std::numeric_limits<float>::infinity();
  for (const float s : {3.0f, 0.3f, 0.1f, 1.0000001f, 0x1.8p-3f, 0x1p-127f, 0x1p127f, 0x1p-149f,
                        0.0f, -0.0f, -1.0f, -0.25f, kInf, -kInf,
                        std::numeric_limits<float>::quiet_NaN()}) {
    EXPECT_FALSE(Fp8ScaleIsPowerOfTwo(s)) << s;
  }
}

// `fixed`, then `random` scales drawn log-uniformly from [2^-30, 2^30] (the reciprocal
// paths' range).
std::vector<float> ScalesToTry(std::vector<float> fixed, int random, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> log2_scale(-30.0f, 30.0f);
  for (int i = 0; i < random; ++i) fixed.push_back(std::exp2(log2_scale(rng)));
  return fixed;
}

// The reciprocal bracket (the fast fp8 path's two multipliers): the floats either side of
// the real 1 / scale, adjacent unless 1 / scale is a float, one of them RN(1 / scale).
// Products of two floats are exact in double, so the sides are checked exactly.
TEST(CudaCacheUpdateBracketTest, FloatsEitherSideOfTheReciprocal) {
  const std::vector<float> scales =
      ScalesToTry({1.0f, 0.25f, 0x1p-30f, 0x1p30f, 3.0f, 0.05f, 0.3333333f, 7.3f, 0.1f,
                   1.0000001f, 448.0f / 65504.0f, 0.99999994f},
                  20000, 5);
  int exact = 0;
  for (const float s : scales) {
    float down = 0.0f;
    float up = 0.0f;
    internal::Fp8ReciprocalBracket(s, &down, &up);
    const double ds = static_cast<double>(s);
    EXPECT_LE(static_cast<double>(down) * ds, 1.0) << s;
    EXPECT_GE(static_cast<double>(up) * ds, 1.0) << s;
    if (static_cast<double>(down) * ds == 1.0) {
      EXPECT_EQ(down, up) << s;
      ++exact;
    } else {
      EXPECT_EQ(std::nextafter(down, std::numeric_limits<float>::infinity()), up) << s;
    }
    const float r = 1.0f / s;
    EXPECT_TRUE(r == down || r == up) << s;
  }
  EXPECT_GE(exact, 3);  // 1, 0.25, 2^-30, 2^30 at least
}

// The split reciprocal (the default fp8 path for 16-bit inputs): where
// Fp8SplitReciprocalExact passes for a scale, fma(x, high, RN(x * low)) must encode like
// the division x / scale for every bf16 / fp16 bit pattern, infinities and NaNs included
// (emulated here with the host's correctly rounded fmaf), in e4m3 and e5m2; the check
// passes for typical scales and powers of two; and a pair that is not a split of
// 1 / scale (low = 0: RN(x * high) alone) fails the check. Runs without a GPU.
TEST(CudaCacheUpdateSplitTest, CheckedSplitsEncodeLikeTheDivision) {
  const std::vector<float> scales =
      ScalesToTry({0.05f, 0.023f, 0.3333333f, 7.3f, 1.7e-3f, 448.0f / 65504.0f, 0.1f, 3e-5f,
                   0x1.000002p-30f, 0x1.fffffep29f,
                   // Powers of two (taken with others in one launch): low is tiny then,
                   // but positive, or infinities would give NaN.
                   1.0f, 0.25f, 0x1p-30f, 0x1p30f},
                  40, 7);
  int checked = 0;
  for (const float s : scales) {
    float high = 0.0f;
    float up = 0.0f;
    internal::Fp8ReciprocalBracket(s, &high, &up);
    const float low = internal::Fp8SplitReciprocalLow(s, high);
    EXPECT_GT(low, 0.0f) << s;
    if (!internal::Fp8ScaleIsPowerOfTwo(s)) {
      EXPECT_FALSE(internal::Fp8SplitReciprocalExact(s, high, 0.0f, 8) &&
                   internal::Fp8SplitReciprocalExact(s, high, 0.0f, 11))
          << s << ": RN(x * high) alone passed the check";
    }
    for (const int bits : {8, 11}) {
      if (!internal::Fp8SplitReciprocalExact(s, high, low, bits)) continue;
      ++checked;
      for (uint32_t b = 0; b < 65536; ++b) {
        const uint16_t h = static_cast<uint16_t>(b);
        const float x = bits == 8 ? BFloat16ToFloat(h) : HalfToFloat(h);
        const float t = static_cast<float>(static_cast<double>(x) * static_cast<double>(low));
        const float q = std::fma(x, high, t);
        const float want = x / s;
        if (FloatToFp8E4M3(q) != FloatToFp8E4M3(want) ||
            FloatToFp8E5M2(q) != FloatToFp8E5M2(want)) {
          ADD_FAILURE() << "scale " << s << ", " << (bits == 8 ? "bf16" : "fp16") << " bits 0x"
                        << std::hex << b << ": split " << q << ", division " << want;
          break;
        }
      }
    }
  }
  EXPECT_GE(checked, static_cast<int>(2 * scales.size()) * 9 / 10);
}

// Power-of-two scales (the kernel multiplies by 1 / scale instead of dividing) against the
// CPU, byte for byte, on every 16-bit input bit pattern (NaN payloads and infinities
// included; random bit patterns for 32-bit inputs), per tensor and per head, with scales
// that make quotients subnormal (2^10, 2^126) or overflow (2^-126; 2^-10 for the largest
// bf16/f32 inputs), scales outside the reciprocal's range [2^-30, 2^30] (2^+-40, 2^+-126);
// and sets with one scale that is not a power of two, which must fall back to the
// reciprocal (0.3) or to the division (3 next to 2^-40). K and V head sizes differ in the
// second shape, whose 24 K chunks per token end inside a warp's step of 32.
TEST_F(CudaCacheUpdateTest, PowerOfTwoScalesMatchCpuOnEveryInputBitPattern) {
  using internal::CacheUpdateFp8Method;
  struct ScaleSet {
    KvQuantMode quant;
    std::vector<float> k, v;  // per head: the first `heads` entries
  };
  const std::vector<ScaleSet> scale_sets = {
      {KvQuantMode::kPerTensor, {1.0f}, {1.0f}},
      {KvQuantMode::kPerTensor, {0.25f}, {0x1p-10f}},
      {KvQuantMode::kPerTensor, {0x1p10f}, {0x1p-126f}},
      {KvQuantMode::kPerTensor, {0x1p126f}, {0x1p-30f}},
      {KvQuantMode::kPerHead, {1.0f, 0.25f, 0x1p-10f, 0x1p10f}, {0x1p-126f, 0x1p126f, 0.5f, 4.0f}},
      {KvQuantMode::kPerHead, {0x1p-40f, 1.0f, 0x1p40f, 2.0f}, {1.0f, 1.0f, 1.0f, 1.0f}},
      {KvQuantMode::kPerHead, {1.0f, 0.25f, 0.3f, 2.0f}, {1.0f, 1.0f, 1.0f, 1.0f}},  // reciprocal
      {KvQuantMode::kPerTensor, {0x1p-40f}, {3.0f}},  // division
  };
  for (const Shape& shape : {Shape{16, 4, 128, 128}, Shape{16, 3, 64, 40}}) {
    const int64_t tokens = (65536 + shape.heads * shape.head_size - 1) /
                           (int64_t{shape.heads} * shape.head_size);
    for (const DType input : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      for (const DType cache : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
        for (const TestLayout layout : {TestLayout::kNHD, TestLayout::kHND}) {
          for (size_t si = 0; si < scale_sets.size(); ++si) {
            const ScaleSet& set = scale_sets[si];
            const size_t n =
                set.quant == KvQuantMode::kPerHead ? static_cast<size_t>(shape.heads) : 1;
            UpdateProblem pb(shape, input, CacheKind{cache, set.quant}, layout, tokens,
                             /*input_pad=*/0, /*seed=*/static_cast<uint32_t>(si + 29));
            pb.SetScales(std::vector<float>(set.k.begin(), set.k.begin() + n),
                         std::vector<float>(set.v.begin(), set.v.begin() + n));
            pb.FillEveryBitPattern();
            std::vector<uint8_t> cpu_k, cpu_v;
            pb.CpuResult(cpu_k, cpu_v);
            for (const CacheUpdateFp8Method method : kAllFp8Methods) {
              SCOPED_TRACE(absl::StrCat("heads ", shape.heads, " d ", shape.head_size, "/",
                                        shape.head_size_v, " ", ShortDType(input), "->",
                                        ShortDType(cache), " ", TestLayoutName(layout),
                                        " scale set ", si, " method ", Fp8MethodName(method)));
              ExpectMethodGives(pb, method, cpu_k, cpu_v);
            }
          }
        }
      }
    }
  }
}

// Shapes: block size 1, odd head sizes (scalar path), one KV head, odd input strides, token
// counts from 1 to several thousand.
TEST_F(CudaCacheUpdateTest, OddShapesAndTokenCounts) {
  struct Case {
    Shape shape;
    int64_t tokens;
    int input_pad;
  };
  const Case cases[] = {
      {{1, 2, 64, 64}, 1, 0},     {{1, 2, 64, 64}, 37, 0},    {{7, 1, 36, 20}, 101, 3},
      {{16, 8, 128, 128}, 4097, 0}, {{16, 4, 256, 64}, 513, 5}, {{3, 5, 8, 16}, 77, 1},
  };
  for (const Case& c : cases) {
    for (DType input : {DType::kBFloat16, DType::kFloat32}) {
      for (CacheKind kind : {CacheKind{DType::kBFloat16, KvQuantMode::kNone},
                             CacheKind{DType::kFloat8E4M3, KvQuantMode::kPerHead},
                             CacheKind{DType::kFloat16, KvQuantMode::kNone}}) {
        for (TestLayout layout : {TestLayout::kNHD, TestLayout::kHND}) {
          UpdateProblem pb(c.shape, input, kind, layout, c.tokens, c.input_pad, 5);
          ExpectCudaMatchesCpu(
              pb, absl::StrCat("block ", c.shape.block_size, " heads ", c.shape.heads, " d ",
                               c.shape.head_size, "/", c.shape.head_size_v, " tokens ",
                               c.tokens, " pad ", c.input_pad, " ", ShortDType(input), "->",
                               ShortDType(kind.dtype), " ", TestLayoutName(layout)));
        }
      }
    }
  }
}

// Rejected before any device work, so this needs no GPU: a spec whose per-token element
// count the kernels' 32-bit counters cannot hold.
TEST(CudaCacheUpdateLimitsTest, TooManyElementsPerTokenIsInvalid) {
  KvCacheSpec spec;
  spec.block_size = 1;
  spec.num_kv_heads = 65536;
  spec.head_size = spec.head_size_v = 32768;
  spec.dtype = DType::kBFloat16;
  CacheUpdateParams p;
  alignas(16) static uint16_t fake[8];  // never dereferenced: the call fails first
  p.key = p.value = fake;
  p.key_head_stride = p.value_head_stride = spec.head_size;
  p.key_token_stride = p.value_token_stride = int64_t{spec.num_kv_heads} * spec.head_size;
  p.input_dtype = DType::kBFloat16;
  const int64_t slot = -1;
  p.slot_mapping = &slot;
  p.host_slot_mapping = &slot;
  p.num_tokens = 1;
  p.cache.k = p.cache.v = fake;
  p.cache.spec = spec;
  p.cache.num_blocks = 1;
  p.cache.k_strides = MakeCacheStrides(spec, KvLayout::kNHD, false);
  p.cache.v_strides = MakeCacheStrides(spec, KvLayout::kNHD, true);
  p.cache.memory = MemoryKind::kDevice;
  const absl::Status st = CacheUpdateCuda(p, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("elements per token"));
}

TEST_F(CudaCacheUpdateTest, AllPaddingAndZeroTokensWriteNothing) {
  UpdateProblem pb({16, 2, 64, 64}, DType::kBFloat16, {DType::kBFloat16, KvQuantMode::kNone},
                   TestLayout::kNHD, 20, 0, 3);
  std::fill(pb.slots().begin(), pb.slots().end(), kPaddingSlot);
  ASSERT_TRUE(pb.Upload().ok());
  ASSERT_TRUE(CacheUpdateCuda(pb.DeviceParams(), stream_.get()).ok());
  CacheUpdateParams none = pb.DeviceParams();
  none.num_tokens = 0;
  ASSERT_TRUE(CacheUpdateCuda(none, stream_.get()).ok());
  ASSERT_TRUE(stream_.Synchronize(absl::Seconds(30)).ok());
  std::vector<uint8_t> k, v;
  ASSERT_TRUE(pb.Download(k, v).ok());
  ExpectSameBytes(pb.initial_k(), k, "K");
  ExpectSameBytes(pb.initial_v(), v, "V");
}

// A device KvCache (zero-filled by Create) updated on the GPU holds what a host KvCache
// updated on the CPU holds.
TEST_F(CudaCacheUpdateTest, DeviceKvCacheMatchesHostKvCache) {
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
    SCOPED_TRACE(KvLayoutName(layout));
    KvCache::Options options;
    options.spec.block_size = 16;
    options.spec.num_kv_heads = 4;
    options.spec.head_size = 128;
    options.spec.head_size_v = 128;
    options.spec.dtype = DType::kFloat8E4M3;
    options.spec.quant_mode = KvQuantMode::kPerHead;
    options.layout = layout;
    options.num_blocks = 40;
    auto host = KvCache::Create(options);
    ASSERT_TRUE(host.ok()) << host.status();
    options.memory = MemoryKind::kDevice;
    auto device = KvCache::Create(options);
    ASSERT_TRUE(device.ok()) << device.status();
    ASSERT_EQ((*device)->view().memory, MemoryKind::kDevice);
    const std::vector<float> k_scales = {0.01f, 0.02f, 0.03f, 0.04f};
    const std::vector<float> v_scales = {0.05f, 0.04f, 0.03f, 0.02f};
    ASSERT_TRUE((*host)->SetScales(k_scales, v_scales).ok());
    ASSERT_TRUE((*device)->SetScales(k_scales, v_scales).ok());

    const size_t k_bytes = static_cast<size_t>(options.num_blocks * options.spec.KBytesPerBlock());
    const size_t v_bytes = static_cast<size_t>(options.num_blocks * options.spec.VBytesPerBlock());
    std::vector<uint8_t> zeros_k(k_bytes, 0xff), zeros_v(v_bytes, 0xff);
    ASSERT_TRUE(ToHost((*device)->view().k, k_bytes, zeros_k.data()).ok());
    ASSERT_TRUE(ToHost((*device)->view().v, v_bytes, zeros_v.data()).ok());
    EXPECT_TRUE(std::all_of(zeros_k.begin(), zeros_k.end(), [](uint8_t b) { return b == 0; }));
    EXPECT_TRUE(std::all_of(zeros_v.begin(), zeros_v.end(), [](uint8_t b) { return b == 0; }));

    const int64_t tokens = 300;
    std::vector<uint16_t> key(static_cast<size_t>(tokens * 4 * 128));
    std::vector<uint16_t> value(key.size());
    std::mt19937 rng(9);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < key.size(); ++i) {
      key[i] = FloatToBFloat16(normal(rng));
      value[i] = FloatToBFloat16(normal(rng));
    }
    std::vector<int64_t> slots;
    for (int64_t t = 0; t < tokens; ++t) slots.push_back(t % 11 == 0 ? -1 : (tokens - t) * 2);
    CacheUpdateParams p;
    p.key = key.data();
    p.value = value.data();
    p.key_token_stride = p.value_token_stride = 4 * 128;
    p.key_head_stride = p.value_head_stride = 128;
    p.input_dtype = DType::kBFloat16;
    p.slot_mapping = slots.data();
    p.num_tokens = tokens;
    p.cache = (*host)->view();
    ASSERT_TRUE(CacheUpdateCpu(p).ok());

    auto d_key = ToDevice(key);
    auto d_value = ToDevice(value);
    auto d_slots = ToDevice(slots);
    ASSERT_TRUE(d_key.ok() && d_value.ok() && d_slots.ok());
    p.key = d_key->data();
    p.value = d_value->data();
    p.slot_mapping = d_slots->data_as<int64_t>();
    p.host_slot_mapping = slots.data();
    p.cache = (*device)->view();
    const absl::Status st = CacheUpdateCuda(p, stream_.get());
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_TRUE(stream_.Synchronize(absl::Seconds(30)).ok());
    std::vector<uint8_t> got_k(k_bytes), got_v(v_bytes);
    ASSERT_TRUE(ToHost((*device)->view().k, k_bytes, got_k.data()).ok());
    ASSERT_TRUE(ToHost((*device)->view().v, v_bytes, got_v.data()).ok());
    const auto* want_k = static_cast<const uint8_t*>((*host)->view().k);
    const auto* want_v = static_cast<const uint8_t*>((*host)->view().v);
    ExpectSameBytes(std::vector<uint8_t>(want_k, want_k + k_bytes), got_k, "K");
    ExpectSameBytes(std::vector<uint8_t>(want_v, want_v + v_bytes), got_v, "V");
  }
}

// Rejected inputs: the error, and the device cache unchanged.
class CudaCacheUpdateErrorTest : public CudaCacheUpdateTest {
 protected:
  void SetUp() override {
    CudaCacheUpdateTest::SetUp();
    if (IsSkipped()) return;
    pb_ = std::make_unique<UpdateProblem>(Shape{16, 2, 64, 64}, DType::kBFloat16,
                                          CacheKind{DType::kFloat8E4M3, KvQuantMode::kPerTensor},
                                          TestLayout::kNHD, 50, 0, 4);
    ASSERT_TRUE(pb_->Upload().ok());
  }

  void ExpectRejected(const CacheUpdateParams& p, absl::StatusCode code,
                      const std::string& needle) {
    const absl::Status st = CacheUpdateCuda(p, stream_.get());
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(needle));
    ASSERT_TRUE(stream_.Synchronize(absl::Seconds(30)).ok());
    std::vector<uint8_t> k, v;
    ASSERT_TRUE(pb_->Download(k, v).ok());
    ExpectSameBytes(pb_->initial_k(), k, "K after a rejected update");
    ExpectSameBytes(pb_->initial_v(), v, "V after a rejected update");
  }

  std::unique_ptr<UpdateProblem> pb_;
};

TEST_F(CudaCacheUpdateErrorTest, SlotPastTheCache) {
  // The host mirror carries the bad slot; the device copy is the good one, so only the
  // validation can have rejected it.
  CacheUpdateParams p = pb_->DeviceParams();
  std::vector<int64_t> bad = pb_->slots();
  bad[17] = pb_->num_slots();
  p.host_slot_mapping = bad.data();
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "token 17");
}

TEST_F(CudaCacheUpdateErrorTest, NegativeSlotOtherThanPadding) {
  CacheUpdateParams p = pb_->DeviceParams();
  std::vector<int64_t> bad = pb_->slots();
  bad[0] = -5;
  p.host_slot_mapping = bad.data();
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "slot -5");
}

TEST_F(CudaCacheUpdateErrorTest, MissingHostMirror) {
  CacheUpdateParams p = pb_->DeviceParams();
  p.host_slot_mapping = nullptr;
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "host_slot_mapping");
}

TEST_F(CudaCacheUpdateErrorTest, BadScalesAndDTypes) {
  CacheUpdateParams p = pb_->DeviceParams();
  const float zero = 0.0f;
  p.cache.k_scale = &zero;
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "scale");
  p = pb_->DeviceParams();
  p.input_dtype = DType::kFloat8E4M3;
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "key/value dtype");
}

TEST_F(CudaCacheUpdateErrorTest, HostCacheIsNotForTheCudaPath) {
  CacheUpdateParams p = pb_->DeviceParams();
  p.cache.memory = MemoryKind::kHost;
  ExpectRejected(p, absl::StatusCode::kFailedPrecondition, "device caches");
}

TEST_F(CudaCacheUpdateErrorTest, TooManyPerHeadScales) {
  CacheUpdateParams p = pb_->DeviceParams();
  p.cache.spec.num_kv_heads = 129;
  p.cache.spec.quant_mode = KvQuantMode::kPerHead;
  std::vector<float> scales(129, 0.5f);
  p.cache.k_scale = scales.data();
  p.cache.v_scale = scales.data();
  p.cache.num_scales = 129;
  p.cache.k_strides.block = p.cache.v_strides.block = 16 * 129 * 64;
  p.cache.k_strides.token = p.cache.v_strides.token = 129 * 64;
  p.num_tokens = 0;  // validation passes without reading inputs; the scale limit does not
  EXPECT_TRUE(CacheUpdateCuda(p, stream_.get()).ok());
  p.num_tokens = 1;
  p.key_token_stride = p.value_token_stride = 129 * 64;
  ExpectRejected(p, absl::StatusCode::kInvalidArgument, "at most 128");
}

}  // namespace
}  // namespace kvstream
