// Kernels for wgmma_gpu_test: one warpgroup's matrix products through wgmma_ptx.cuh on
// 64-row tiles, as the Hopper prefill kernel uses them, so that the descriptors, swizzled
// layouts and fragment mappings are checked against a reference on their own.
#ifndef KVSTREAM_TESTS_GPU_WGMMA_KERNELS_H_
#define KVSTREAM_TESTS_GPU_WGMMA_KERNELS_H_

#include <cstdint>

namespace kvstream::gpu_test {

// Host arrays of 16-bit values (bf16 where `bf16`, else fp16), row-major:
//   q [64][128] (query rows x head dimension), k [64][128] (keys x head dimension),
//   p [64][64] (query rows x keys), v [64][128] (keys x head dimension).
// Outputs f32, row-major: s [64][64] = q k^T, o [64][128].
// Each returns cudaError_t as int (cudaErrorNotSupported without sm_90a).

// s = q k^T: both operands K-major from shared memory.
int WgmmaQkT(const uint16_t* q, const uint16_t* k, float* s, bool bf16);
// o = p v: p from registers, v MN-major from shared memory.
int WgmmaPv(const uint16_t* p, const uint16_t* v, float* o, bool bf16);
// s = q k^T, then o = round16(s) v with the A fragments taken from s's accumulators.
int WgmmaQkPv(const uint16_t* q, const uint16_t* k, const uint16_t* v, float* s, float* o,
              bool bf16);

}  // namespace kvstream::gpu_test

#endif  // KVSTREAM_TESTS_GPU_WGMMA_KERNELS_H_
