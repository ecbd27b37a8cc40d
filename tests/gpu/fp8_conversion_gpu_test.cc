// kvstream's host fp8 conversions (common/numeric.h) against CUDA's, bit for bit: the CPU
// and CUDA cache updates must write identical caches.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "fp8_kernels.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/numeric.h"

namespace kvstream {
namespace {

class Fp8GpuTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    absl::Status s = CudaAvailability();
    if (!s.ok()) GTEST_SKIP() << "no GPU: " << s.message();
  }
};

TEST_P(Fp8GpuTest, DecodeOfEveryCodeMatches) {
  const bool e5m2 = GetParam();
  std::vector<uint8_t> codes(256);
  for (int i = 0; i < 256; ++i) codes[i] = static_cast<uint8_t>(i);
  std::vector<float> device(256);
  ASSERT_EQ(gpu_test::DeviceFp8ToFloat(codes.data(), device.data(), 256, e5m2), 0);
  for (int i = 0; i < 256; ++i) {
    const float host = e5m2 ? Fp8E5M2ToFloat(codes[i]) : Fp8E4M3ToFloat(codes[i]);
    if (std::isnan(host) || std::isnan(device[i])) {
      EXPECT_TRUE(std::isnan(host) && std::isnan(device[i])) << "code " << i;
    } else {
      EXPECT_EQ(host, device[i]) << "code " << i;
    }
  }
}

TEST_P(Fp8GpuTest, EncodeMatchesOnRandomAndEdgeValues) {
  const bool e5m2 = GetParam();
  std::vector<float> values = {0.0f, -0.0f, 1e-12f, -1e-9f, 448.0f, 449.0f, 464.0f, 480.0f, 1e6f,
                               -1e6f, 57344.0f, 61440.0f, INFINITY, -INFINITY};
  // Every midpoint between neighbouring codes (ties), and random values over many binades.
  for (int c = 0; c < 127; ++c) {
    const float a = e5m2 ? Fp8E5M2ToFloat(c) : Fp8E4M3ToFloat(c);
    const float b = e5m2 ? Fp8E5M2ToFloat(c + 1) : Fp8E4M3ToFloat(c + 1);
    if (std::isfinite(a) && std::isfinite(b)) values.push_back((a + b) / 2);
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-20.0f, 18.0f);
  std::uniform_real_distribution<float> sign(-1.0f, 1.0f);
  for (int i = 0; i < 100000; ++i) values.push_back(std::copysign(std::exp2(exponent(rng)), sign(rng)));
  std::vector<uint8_t> device(values.size());
  ASSERT_EQ(gpu_test::DeviceFloatToFp8(values.data(), device.data(), static_cast<int>(values.size()), e5m2), 0);
  int mismatches = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const uint8_t host = e5m2 ? FloatToFp8E5M2(values[i]) : FloatToFp8E4M3(values[i]);
    if (host != device[i] && ++mismatches <= 10) {
      ADD_FAILURE() << "value " << values[i] << ": host 0x" << std::hex << int(host) << " device 0x"
                    << int(device[i]);
    }
  }
  EXPECT_EQ(mismatches, 0);
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8GpuTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& param_info) {
                           return param_info.param ? "E5M2" : "E4M3";
                         });

}  // namespace
}  // namespace kvstream
