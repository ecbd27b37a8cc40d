// The synthetic model's small CUDA kernels, as the host sees them (no CUDA header): weight
// generation, embedding, RMSNorm, rotary embedding, SwiGLU and greedy sampling (matrix
// products and their residual adds go through cuBLAS: cublas_gemm.h). Activations and weights are bf16 (passed as their 16-bit patterns), arithmetic
// in fp32, rounding to bf16 round-to-nearest-even; logits are fp32.
//
// Every launcher enqueues on `stream` (a cudaStream_t; null: the legacy default stream)
// and never blocks; pointers are device memory the caller owns and keeps alive until the
// work has run; tensors are row-major and dense. InvalidArgument for shapes the kernels
// do not take (the message names the argument); launch errors become Status.
//
// Batch invariance: every kernel computes each row (each head of a row, for the rotary
// embedding) with the same sequence of operations whatever the number of rows or where the
// row sits, so a row's result never depends on what else shares the batch, which the
// disaggregated and colocated runs rely on to agree bit for bit. Reductions (RMSNorm's sum of
// squares, argmax) use one fixed order per row length.
#ifndef KVSTREAM_SERVING_CUDA_MODEL_OPS_H_
#define KVSTREAM_SERVING_CUDA_MODEL_OPS_H_

#include <cstdint>

#include "absl/status/status.h"

namespace kvstream {
namespace internal {

// out[i] = bf16(RandomTensorElement(RandomTensorBase(seed, tensor), i, mean, stddev)) for
// i < n (random_weights.h): the CPU model's weights, rounded to bf16.
absl::Status LaunchRandomBf16(uint32_t seed, uint64_t tensor, int64_t n, float mean,
                              float stddev, uint16_t* out, void* stream);

// out[r] = table[tokens[r]] for r < rows ([rows, hidden] from [vocab, hidden]). A token
// outside [0, vocab) gives a row of zeros (callers validate tokens first; the kernel never
// reads outside the table).
absl::Status LaunchEmbed(const uint16_t* table, int64_t vocab, int64_t hidden,
                         const int32_t* tokens, int64_t rows, uint16_t* out, void* stream);

// out[r] = in[r] / sqrt(mean(in[r]^2) + eps) * weight, per row; in and out may be the same.
// REQUIRES hidden a multiple of 8.
absl::Status LaunchRmsNorm(const uint16_t* in, const uint16_t* weight, int64_t rows,
                           int64_t hidden, float eps, uint16_t* out, void* stream);

// Rotary embedding in GPT-NeoX style (element i of a head pairs with i + head_size / 2) of
// the first `heads` heads of each row of `x` ([rows, row_stride], heads of head_size from
// column 0), at positions[r], with inverse frequencies theta^(-2i / head_size); in place.
// The angles are computed in fp64 like the CPU model's, then rounded to fp32.
// REQUIRES head_size even, heads * head_size <= row_stride.
absl::Status LaunchRotary(uint16_t* x, int64_t rows, int64_t row_stride, int heads,
                          int head_size, const int32_t* positions, double theta, void* stream);

// out[r][j] = silu(gate_up[r][j]) * gate_up[r][inter + j] for j < inter ([rows, 2 * inter]
// in, [rows, inter] out).
absl::Status LaunchSiluMul(const uint16_t* gate_up, int64_t rows, int64_t inter, uint16_t* out,
                           void* stream);

// out[r] = the index of the largest of logits[r] ([rows, vocab] fp32), the first on ties;
// NaN never wins over a number.
absl::Status LaunchArgmax(const float* logits, int64_t rows, int64_t vocab, int32_t* out,
                          void* stream);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_SERVING_CUDA_MODEL_OPS_H_
