// GPU tests of the synthetic model's CUDA pieces (serving/src/cuda/): each kernel against a
// CPU computation of the same formula from the same bf16 inputs, bit-reproducibility across
// runs, and batch invariance (a row's result does not depend on the rows around it); the
// cuBLAS products against an fp64 CPU product, reproducible, with the fused residual add.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "cuda/cublas_gemm.h"
#include "cuda/model_ops.h"
#include "gpu_test_util.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "random_weights.h"

namespace kvstream {
namespace {

using gpu_test::ToDevice;
using gpu_test::ToHost;

float Bf16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint16_t FloatToBf16(float f) {  // round to nearest even (finite inputs)
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

std::vector<uint16_t> RandomBf16(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<uint16_t> out(n);
  for (uint16_t& v : out) v = FloatToBf16(dist(rng));
  return out;
}

template <typename T>
std::vector<T> Download(const DeviceBuffer& buffer, size_t n) {
  std::vector<T> out(n);
  EXPECT_TRUE(ToHost(buffer.data(), n * sizeof(T), out.data()).ok());
  return out;
}

class CudaModelOpsGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const absl::Status available = CudaAvailability();
    if (!available.ok()) GTEST_SKIP() << "SKIPPED: no usable GPU: " << available.message();
    auto stream = CudaStream::Create();
    ASSERT_TRUE(stream.ok()) << stream.status();
    stream_ = std::move(stream).value();
  }
  void Sync() { ASSERT_TRUE(stream_.Synchronize(absl::Seconds(30)).ok()); }

  CudaStream stream_;
};

TEST_F(CudaModelOpsGpuTest, RandomWeightsAreTheCpuModelsRoundedToBf16) {
  constexpr int64_t kN = 100003;
  auto out = DeviceBuffer::Create(kN * 2, MemoryKind::kDevice);
  ASSERT_TRUE(out.ok());
  ASSERT_TRUE(internal::LaunchRandomBf16(7, 42, kN, 1.0f, 0.05f,
                                         static_cast<uint16_t*>(out->data()), stream_.get())
                  .ok());
  Sync();
  const std::vector<uint16_t> got = Download<uint16_t>(*out, kN);
  const uint64_t base = internal::RandomTensorBase(7, 42);
  int64_t differ = 0;
  for (int64_t i = 0; i < kN; ++i) {
    const float want = internal::RandomTensorElement(base, static_cast<uint64_t>(i), 1.0f, 0.05f);
    differ += got[static_cast<size_t>(i)] != FloatToBf16(want);
  }
  EXPECT_EQ(differ, 0);
  // Another tensor id gives other numbers.
  ASSERT_TRUE(internal::LaunchRandomBf16(7, 43, kN, 1.0f, 0.05f,
                                         static_cast<uint16_t*>(out->data()), stream_.get())
                  .ok());
  Sync();
  EXPECT_NE(Download<uint16_t>(*out, kN), got);
}

TEST_F(CudaModelOpsGpuTest, EmbedGathersRowsAndZeroesInvalidTokens) {
  constexpr int64_t kVocab = 50, kHidden = 24;
  const std::vector<uint16_t> table = RandomBf16(kVocab * kHidden, 1);
  const std::vector<int32_t> tokens = {3, 49, 0, -1, 50, 3};
  auto d_table = ToDevice(table);
  auto d_tokens = ToDevice(tokens);
  auto d_out = DeviceBuffer::Create(tokens.size() * kHidden * 2, MemoryKind::kDevice);
  ASSERT_TRUE(d_table.ok() && d_tokens.ok() && d_out.ok());
  ASSERT_TRUE(internal::LaunchEmbed(static_cast<const uint16_t*>(d_table->data()), kVocab,
                                    kHidden, static_cast<const int32_t*>(d_tokens->data()),
                                    static_cast<int64_t>(tokens.size()),
                                    static_cast<uint16_t*>(d_out->data()), stream_.get())
                  .ok());
  Sync();
  const std::vector<uint16_t> got = Download<uint16_t>(*d_out, tokens.size() * kHidden);
  for (size_t r = 0; r < tokens.size(); ++r) {
    for (int64_t j = 0; j < kHidden; ++j) {
      const bool valid = tokens[r] >= 0 && tokens[r] < kVocab;
      const uint16_t want = valid ? table[static_cast<size_t>(tokens[r] * kHidden + j)] : 0;
      ASSERT_EQ(got[r * kHidden + static_cast<size_t>(j)], want) << "row " << r << " col " << j;
    }
  }
  EXPECT_FALSE(internal::LaunchEmbed(nullptr, 0, kHidden, nullptr, 1, nullptr, stream_.get()).ok());
}

// RMSNorm against the formula in double, within bf16 rounding; and batch invariance: a
// row normalised alone equals the same row inside a batch, bit for bit.
TEST_F(CudaModelOpsGpuTest, RmsNormMatchesTheFormulaAndIsBatchInvariant) {
  constexpr int64_t kRows = 37, kHidden = 4096;
  const std::vector<uint16_t> x = RandomBf16(kRows * kHidden, 2, 3.0f);
  std::vector<uint16_t> w = RandomBf16(kHidden, 3, 0.05f);
  for (uint16_t& v : w) v = FloatToBf16(1.0f + Bf16ToFloat(v));
  auto d_x = ToDevice(x);
  auto d_w = ToDevice(w);
  auto d_out = DeviceBuffer::Create(x.size() * 2, MemoryKind::kDevice);
  ASSERT_TRUE(d_x.ok() && d_w.ok() && d_out.ok());
  auto run = [&](const uint16_t* in, int64_t rows, uint16_t* out) {
    ASSERT_TRUE(internal::LaunchRmsNorm(in, static_cast<const uint16_t*>(d_w->data()), rows,
                                        kHidden, 1e-6f, out, stream_.get())
                    .ok());
  };
  run(static_cast<const uint16_t*>(d_x->data()), kRows, static_cast<uint16_t*>(d_out->data()));
  Sync();
  const std::vector<uint16_t> got = Download<uint16_t>(*d_out, x.size());
  for (int64_t r = 0; r < kRows; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < kHidden; ++j) {
      const double v = Bf16ToFloat(x[static_cast<size_t>(r * kHidden + j)]);
      ss += v * v;
    }
    const double inv = 1.0 / std::sqrt(ss / kHidden + 1e-6);
    for (int64_t j = 0; j < kHidden; ++j) {
      const size_t i = static_cast<size_t>(r * kHidden + j);
      const double want = Bf16ToFloat(x[i]) * inv * Bf16ToFloat(w[static_cast<size_t>(j)]);
      ASSERT_NEAR(Bf16ToFloat(got[i]), want, std::abs(want) * 1.0 / 128 + 1e-6)
          << "row " << r << " col " << j;
    }
  }
  // Row 20 alone, from its own buffer, in place.
  constexpr int64_t kRow = 20;
  auto single = ToDevice(x.data() + kRow * kHidden, kHidden * 2);
  ASSERT_TRUE(single.ok());
  run(static_cast<const uint16_t*>(single->data()), 1, static_cast<uint16_t*>(single->data()));
  Sync();
  const std::vector<uint16_t> alone = Download<uint16_t>(*single, kHidden);
  EXPECT_TRUE(std::equal(alone.begin(), alone.end(), got.begin() + kRow * kHidden));
  EXPECT_FALSE(internal::LaunchRmsNorm(nullptr, nullptr, 1, 12, 1e-6f, nullptr, stream_.get()).ok());
}

// The rotary embedding against the CPU model's formula (angles in double), on the q and k
// heads of a fused qkv row, leaving v untouched; batch invariant by construction (one
// CTA per row), checked on a row alone.
TEST_F(CudaModelOpsGpuTest, RotaryRotatesPairsAtTheirPositions) {
  constexpr int kHeads = 4, kKvHeads = 2, kHeadSize = 128;
  constexpr int64_t kRows = 9, kStride = (kHeads + 2 * kKvHeads) * kHeadSize;
  const std::vector<uint16_t> qkv = RandomBf16(kRows * kStride, 4);
  const std::vector<int32_t> positions = {0, 1, 2, 17, 100, 4095, 8191, 32767, 131071};
  auto d_qkv = ToDevice(qkv);
  auto d_pos = ToDevice(positions);
  ASSERT_TRUE(d_qkv.ok() && d_pos.ok());
  constexpr double kTheta = 500000;
  // q and k heads are adjacent in the row: rotate heads + kv_heads heads from column 0.
  ASSERT_TRUE(internal::LaunchRotary(static_cast<uint16_t*>(d_qkv->data()), kRows, kStride,
                                     kHeads + kKvHeads, kHeadSize,
                                     static_cast<const int32_t*>(d_pos->data()), kTheta,
                                     stream_.get())
                  .ok());
  Sync();
  const std::vector<uint16_t> got = Download<uint16_t>(*d_qkv, qkv.size());
  const int half = kHeadSize / 2;
  for (int64_t r = 0; r < kRows; ++r) {
    for (int h = 0; h < kHeads + 2 * kKvHeads; ++h) {
      for (int i = 0; i < half; ++i) {
        const size_t ia = static_cast<size_t>(r * kStride + h * kHeadSize + i);
        const size_t ib = ia + half;
        if (h >= kHeads + kKvHeads) {  // v: untouched
          ASSERT_EQ(got[ia], qkv[ia]);
          ASSERT_EQ(got[ib], qkv[ib]);
          continue;
        }
        const double angle = positions[static_cast<size_t>(r)] * std::pow(kTheta, -2.0 * i / kHeadSize);
        const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
        const float a = Bf16ToFloat(qkv[ia]), b = Bf16ToFloat(qkv[ib]);
        const float want_a = a * c - b * s, want_b = a * s + b * c;
        ASSERT_NEAR(Bf16ToFloat(got[ia]), want_a, std::abs(want_a) / 128 + 1e-3)
            << "row " << r << " head " << h << " i " << i;
        ASSERT_NEAR(Bf16ToFloat(got[ib]), want_b, std::abs(want_b) / 128 + 1e-3);
      }
    }
  }
  auto single = ToDevice(qkv.data() + 5 * kStride, kStride * 2);
  auto pos5 = ToDevice(&positions[5], sizeof(int32_t));
  ASSERT_TRUE(single.ok() && pos5.ok());
  ASSERT_TRUE(internal::LaunchRotary(static_cast<uint16_t*>(single->data()), 1, kStride,
                                     kHeads + kKvHeads, kHeadSize,
                                     static_cast<const int32_t*>(pos5->data()), kTheta,
                                     stream_.get())
                  .ok());
  Sync();
  const std::vector<uint16_t> alone = Download<uint16_t>(*single, kStride);
  EXPECT_TRUE(std::equal(alone.begin(), alone.end(), got.begin() + 5 * kStride));
  EXPECT_FALSE(internal::LaunchRotary(nullptr, 1, 100, 1, 127, nullptr, kTheta, stream_.get()).ok());
  EXPECT_FALSE(internal::LaunchRotary(nullptr, 1, 100, 1, 128, nullptr, kTheta, stream_.get()).ok());
}

TEST_F(CudaModelOpsGpuTest, SiluMulMatchesTheFormula) {
  constexpr int64_t kRows = 5, kInter = 1000;
  const std::vector<uint16_t> gu = RandomBf16(kRows * 2 * kInter, 5, 4.0f);
  auto d_gu = ToDevice(gu);
  auto d_out = DeviceBuffer::Create(kRows * kInter * 2, MemoryKind::kDevice);
  ASSERT_TRUE(d_gu.ok() && d_out.ok());
  ASSERT_TRUE(internal::LaunchSiluMul(static_cast<const uint16_t*>(d_gu->data()), kRows, kInter,
                                      static_cast<uint16_t*>(d_out->data()), stream_.get())
                  .ok());
  Sync();
  const std::vector<uint16_t> got = Download<uint16_t>(*d_out, kRows * kInter);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < kInter; ++j) {
      const double g = Bf16ToFloat(gu[static_cast<size_t>(r * 2 * kInter + j)]);
      const double u = Bf16ToFloat(gu[static_cast<size_t>(r * 2 * kInter + kInter + j)]);
      const double want = g / (1 + std::exp(-g)) * u;
      ASSERT_NEAR(Bf16ToFloat(got[static_cast<size_t>(r * kInter + j)]), want,
                  std::abs(want) / 128 + 1e-6);
    }
  }
}

// Greedy sampling: the largest logit, the first of equal ones, NaN never chosen.
TEST_F(CudaModelOpsGpuTest, ArgmaxTakesTheFirstLargestAndSkipsNan) {
  constexpr int64_t kVocab = 128256;
  constexpr int64_t kRows = 4;
  std::mt19937 rng(6);
  std::uniform_real_distribution<float> dist(-10, 10);
  std::vector<float> logits(kRows * kVocab);
  for (float& v : logits) v = dist(rng);
  logits[0 * kVocab + 77777] = 50;  // row 0: one clear maximum
  logits[1 * kVocab + 9000] = 50;   // row 1: a tie; the first wins
  logits[1 * kVocab + 100000] = 50;
  logits[2 * kVocab + 5] = std::nanf("");  // row 2: NaN is not a winner
  logits[2 * kVocab + 6] = 40;
  logits[2 * kVocab + 128255] = 41;  // the last element
  for (int64_t j = 0; j < kVocab; ++j) logits[3 * kVocab + j] = -1;  // row 3: all equal
  auto d_logits = ToDevice(logits);
  auto d_out = DeviceBuffer::Create(kRows * 4, MemoryKind::kDevice);
  ASSERT_TRUE(d_logits.ok() && d_out.ok());
  ASSERT_TRUE(internal::LaunchArgmax(static_cast<const float*>(d_logits->data()), kRows, kVocab,
                                     static_cast<int32_t*>(d_out->data()), stream_.get())
                  .ok());
  Sync();
  EXPECT_EQ(Download<int32_t>(*d_out, kRows), (std::vector<int32_t>{77777, 9000, 128255, 0}));
}

// The products: against an fp64 product of the same bf16 operands, the fused residual add,
// the fp32 output, and the same bits on a second run.
TEST_F(CudaModelOpsGpuTest, CublasProductsMatchAndReproduce) {
  auto gemm = internal::CublasGemm::Create(stream_.get());
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  constexpr int64_t kM = 33, kK = 512, kN = 160;
  const std::vector<uint16_t> a = RandomBf16(kM * kK, 7);
  const std::vector<uint16_t> b = RandomBf16(kK * kN, 8, 1.0f / 16);
  const std::vector<uint16_t> residual = RandomBf16(kM * kN, 9);
  auto d_a = ToDevice(a);
  auto d_b = ToDevice(b);
  auto d_c = ToDevice(residual);
  auto d_f = DeviceBuffer::Create(kM * kN * 4, MemoryKind::kDevice);
  ASSERT_TRUE(d_a.ok() && d_b.ok() && d_c.ok() && d_f.ok());
  const auto* pa = static_cast<const uint16_t*>(d_a->data());
  const auto* pb = static_cast<const uint16_t*>(d_b->data());
  ASSERT_TRUE(gemm->MatMulBf16(pa, pb, static_cast<uint16_t*>(d_c->data()), kM, kN, kK, 1.0f).ok());
  ASSERT_TRUE(gemm->MatMulBf16ToF32(pa, pb, static_cast<float*>(d_f->data()), kM, kN, kK).ok());
  Sync();
  const std::vector<uint16_t> fused = Download<uint16_t>(*d_c, kM * kN);
  const std::vector<float> f32 = Download<float>(*d_f, kM * kN);
  for (int64_t i = 0; i < kM; ++i) {
    for (int64_t j = 0; j < kN; ++j) {
      double sum = 0;
      for (int64_t k = 0; k < kK; ++k) {
        sum += static_cast<double>(Bf16ToFloat(a[static_cast<size_t>(i * kK + k)])) *
               Bf16ToFloat(b[static_cast<size_t>(k * kN + j)]);
      }
      const size_t o = static_cast<size_t>(i * kN + j);
      ASSERT_NEAR(f32[o], sum, 1e-3 + std::abs(sum) * 1e-5) << i << "," << j;
      const double with_residual = sum + Bf16ToFloat(residual[o]);
      // bf16 output; cuBLAS may round the product to bf16 before adding the residual: two
      // roundings, each within half a bf16 ulp (1/256 relative) of its value.
      ASSERT_NEAR(Bf16ToFloat(fused[o]), with_residual,
                  (std::abs(sum) + std::abs(with_residual)) / 256 + 1e-3);
    }
  }
  // Same operands, same shape: the same bits.
  auto d_f2 = DeviceBuffer::Create(kM * kN * 4, MemoryKind::kDevice);
  ASSERT_TRUE(d_f2.ok());
  ASSERT_TRUE(gemm->MatMulBf16ToF32(pa, pb, static_cast<float*>(d_f2->data()), kM, kN, kK).ok());
  Sync();
  EXPECT_EQ(Download<float>(*d_f2, kM * kN), f32);
  EXPECT_EQ(gemm->MatMulBf16ToF32(pa, pb, nullptr, 0, kN, kK).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstream
