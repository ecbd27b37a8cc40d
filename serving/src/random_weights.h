// The synthetic model's weights: deterministic pseudo-random numbers from (seed, tensor id,
// element index), the same on the CPU and in a CUDA kernel, so that every process (and
// every pipeline stage) that builds a model from a seed gets the same weights whatever
// device it builds them on. Element i of tensor t is mean + (u0 + u1 + u2 + u3 - 4 * 32767.5)
// * stddev / 37837.23, where u0..u3 are the four 16-bit quarters of SplitMix64(base + i),
// base = SplitMix64(SplitMix64(seed) ^ SplitMix64(t + 0x5bd1e995)): a sum of four uniforms
// (Irwin-Hall), close enough to normal for synthetic weights, exact in float before the
// scaling.
#ifndef KVSTREAM_SERVING_RANDOM_WEIGHTS_H_
#define KVSTREAM_SERVING_RANDOM_WEIGHTS_H_

#include <cstdint>

#if defined(__CUDACC__)
#define KVSTREAM_SERVING_HD __host__ __device__ __forceinline__
#else
#define KVSTREAM_SERVING_HD inline
#endif

namespace kvstream {
namespace internal {

KVSTREAM_SERVING_HD uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The per-tensor base of the element stream.
KVSTREAM_SERVING_HD uint64_t RandomTensorBase(uint32_t seed, uint64_t tensor) {
  return SplitMix64(SplitMix64(seed) ^ SplitMix64(tensor + 0x5bd1e995ull));
}

// Element `i` of the tensor with base `base`.
KVSTREAM_SERVING_HD float RandomTensorElement(uint64_t base, uint64_t i, float mean,
                                              float stddev) {
  const uint64_t r = SplitMix64(base + i);
  const float sum = static_cast<float>((r & 0xffff) + ((r >> 16) & 0xffff) +
                                       ((r >> 32) & 0xffff) + (r >> 48));
  return mean + (sum - 4 * 32767.5f) * (stddev / 37837.23f);
}

// Tensor ids of the synthetic model: the embedding, the final norm and the LM head, and per
// layer 16 * (1 + layer) + which, with which = 0 attention norm, 1 MLP norm, 2 fused QKV,
// 3 output projection, 4 fused gate and up projections, 5 down projection. Matrices [rows,
// cols] have mean 0 and standard deviation 1 / sqrt(rows); norm weights mean 1 and 0.05.
inline constexpr uint64_t kEmbeddingTensor = 1;
inline constexpr uint64_t kFinalNormTensor = 2;
inline constexpr uint64_t kHeadTensor = 3;
enum LayerTensorKind : int { kAttnNorm = 0, kMlpNorm, kQkv, kOutProj, kGateUp, kDown };
KVSTREAM_SERVING_HD uint64_t LayerTensor(int layer, int which) {
  return 16 * (1 + static_cast<uint64_t>(layer)) + static_cast<uint64_t>(which);
}
inline constexpr float kNormWeightMean = 1.0f;
inline constexpr float kNormWeightStddev = 0.05f;

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_SERVING_RANDOM_WEIGHTS_H_
