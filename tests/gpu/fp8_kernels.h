// Device conversions through CUDA's own fp8 intrinsics (cuda_fp8.h), so tests can check
// kvstream's host conversions (common/numeric.h) against the hardware's, bit for bit.
#ifndef KVSTREAM_TESTS_GPU_FP8_KERNELS_H_
#define KVSTREAM_TESTS_GPU_FP8_KERNELS_H_

#include <cstdint>

namespace kvstream::gpu_test {

// All take host arrays of n elements, copy through the device and return cudaError_t as int.
// e5m2 selects the format (else e4m3). Encoding saturates (__NV_SATFINITE).
int DeviceFloatToFp8(const float* in, uint8_t* out, int n, bool e5m2);
int DeviceFp8ToFloat(const uint8_t* in, float* out, int n, bool e5m2);

}  // namespace kvstream::gpu_test

#endif  // KVSTREAM_TESTS_GPU_FP8_KERNELS_H_
