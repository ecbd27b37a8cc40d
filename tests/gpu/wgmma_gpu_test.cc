// wgmma_ptx.cuh on an H200: one warpgroup's m64n64k16 and m64n128k16 products from
// 128-byte swizzled shared-memory panels (K-major and MN-major descriptors) and from
// register fragments taken from accumulators, against a double-precision reference. These
// are the building blocks of the Hopper prefill kernel; a wrong descriptor field, swizzle
// or fragment mapping moves or transposes values and fails here.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "kvstream/common/cuda_status.h"
#include "kvstream/common/numeric.h"
#include "wgmma_kernels.h"

namespace kvstream {
namespace {

class WgmmaGpuTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    absl::Status s = CudaAvailability();
    if (!s.ok()) GTEST_SKIP() << "no GPU: " << s.message();
  }
  bool bf16() const { return GetParam(); }
  uint16_t Round(float f) const { return bf16() ? FloatToBFloat16(f) : FloatToHalf(f); }
  float Value(uint16_t h) const { return bf16() ? BFloat16ToFloat(h) : HalfToFloat(h); }
  std::vector<uint16_t> Random(size_t n, uint32_t seed) const {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<uint16_t> out(n);
    for (uint16_t& x : out) x = Round(u(rng));
    return out;
  }
  // Skips where the products cannot run (not sm_90), else expects success.
  void CheckRun(int rc) {
    if (rc == static_cast<int>(cudaErrorNotSupported)) GTEST_SKIP() << "needs an sm_90 GPU";
    ASSERT_EQ(rc, 0) << cudaGetErrorString(static_cast<cudaError_t>(rc));
  }
  // out[r][c] = sum_i a[r][i] * b(i, c), with b(i, c) = b[c * inner + i] when b_by_col (k:
  // keys x dims, for q k^T) else b[i * cols + c] (v); the bound is f32 accumulation's.
  void ExpectProduct(const std::vector<float>& a, int rows, int inner,
                     const std::vector<float>& b, bool b_by_col, int cols,
                     const std::vector<float>& got, const char* what) {
    int bad = 0;
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < cols; ++c) {
        double sum = 0, mag = 0;
        for (int i = 0; i < inner; ++i) {
          const double x = a[r * inner + i];
          const double y = b_by_col ? b[c * inner + i] : b[i * cols + c];
          sum += x * y;
          mag += std::fabs(x * y);
        }
        const double err = std::fabs(got[r * cols + c] - sum);
        if (!(err <= 1e-5 * mag + 1e-6) && ++bad <= 5) {
          ADD_FAILURE() << what << "[" << r << "][" << c << "] = " << got[r * cols + c]
                        << ", expected " << sum;
        }
      }
    }
    EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << rows * cols << " elements wrong";
  }
  std::vector<float> Floats(const std::vector<uint16_t>& h) const {
    std::vector<float> f(h.size());
    for (size_t i = 0; i < h.size(); ++i) f[i] = Value(h[i]);
    return f;
  }
};

TEST_P(WgmmaGpuTest, QueryTimesKeysFromSwizzledPanels) {
  const std::vector<uint16_t> q = Random(64 * 128, 1), k = Random(64 * 128, 2);
  std::vector<float> s(64 * 64);
  ASSERT_NO_FATAL_FAILURE(CheckRun(gpu_test::WgmmaQkT(q.data(), k.data(), s.data(), bf16())));
  if (IsSkipped()) return;
  ExpectProduct(Floats(q), 64, 128, Floats(k), /*b_by_col=*/true, 64, s, "s");
}

TEST_P(WgmmaGpuTest, RegisterFragmentsTimesMnMajorValues) {
  const std::vector<uint16_t> p = Random(64 * 64, 3), v = Random(64 * 128, 4);
  std::vector<float> o(64 * 128);
  ASSERT_NO_FATAL_FAILURE(CheckRun(gpu_test::WgmmaPv(p.data(), v.data(), o.data(), bf16())));
  if (IsSkipped()) return;
  ExpectProduct(Floats(p), 64, 64, Floats(v), /*b_by_col=*/false, 128, o, "o");
}

TEST_P(WgmmaGpuTest, AccumulatorsFeedTheNextProduct) {
  const std::vector<uint16_t> q = Random(64 * 128, 5), k = Random(64 * 128, 6),
                              v = Random(64 * 128, 7);
  std::vector<float> s(64 * 64), o(64 * 128);
  ASSERT_NO_FATAL_FAILURE(CheckRun(
      gpu_test::WgmmaQkPv(q.data(), k.data(), v.data(), s.data(), o.data(), bf16())));
  if (IsSkipped()) return;
  ExpectProduct(Floats(q), 64, 128, Floats(k), true, 64, s, "s");
  // The second product's A is s rounded to 16 bits (round to nearest even, as the host's).
  std::vector<float> p(s.size());
  for (size_t i = 0; i < s.size(); ++i) p[i] = Value(Round(s[i]));
  ExpectProduct(p, 64, 64, Floats(v), false, 128, o, "o");
}

INSTANTIATE_TEST_SUITE_P(Types, WgmmaGpuTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& param) {
                           return std::string(param.param ? "BFloat16" : "Float16");
                         });

}  // namespace
}  // namespace kvstream
