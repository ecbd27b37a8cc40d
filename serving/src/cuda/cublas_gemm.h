// CublasGemm: the synthetic model's matrix products on the GPU through cuBLAS, in a
// configuration whose results are bit-reproducible: bf16 operands, fp32 accumulation, no
// atomics, the default (non-split-K-by-atomics) algorithm choice, and a workspace owned by
// this handle alone, so that a product's bits depend only on its operands and shape (cuBLAS
// guarantees that for one toolkit version on GPUs of one architecture and SM count). A row's
// result may still depend on the number of rows in the call (cuBLAS picks kernels by
// shape), which is why the model computes each batch-independent segment of rows in a call
// of its own (toy_model.h explains the segments).
//
// All matrices are row-major and dense, device memory; calls enqueue on the handle's stream
// and never block.
//
// Thread safety: thread-compatible (one handle per thread or external locking).
#ifndef KVSTREAM_SERVING_CUDA_CUBLAS_GEMM_H_
#define KVSTREAM_SERVING_CUDA_CUBLAS_GEMM_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvstream/common/cuda_resources.h"

namespace kvstream {
namespace internal {

class CublasGemm {
 public:
  // A handle on the current device whose work goes to `stream` (a cudaStream_t, borrowed:
  // it must outlive the handle). FailedPrecondition without CUDA or cuBLAS; cuBLAS errors
  // (CublasErrorToStatus) otherwise.
  static absl::StatusOr<CublasGemm> Create(void* stream);

  CublasGemm(CublasGemm&&) noexcept;
  CublasGemm& operator=(CublasGemm&&) noexcept;
  ~CublasGemm();

  // c[m, n] = a[m, k] * b[k, n] + beta * c, bf16 in and out (beta 0: c is not read; 1: a
  // fused residual add). InvalidArgument for non-positive or oversized shapes.
  absl::Status MatMulBf16(const uint16_t* a, const uint16_t* b, uint16_t* c, int64_t m,
                          int64_t n, int64_t k, float beta);

  // c[m, n] = a[m, k] * b[k, n], bf16 operands, fp32 result (logits).
  absl::Status MatMulBf16ToF32(const uint16_t* a, const uint16_t* b, float* c, int64_t m,
                               int64_t n, int64_t k);

 private:
  struct Handle;
  explicit CublasGemm(std::unique_ptr<Handle> handle);
  absl::Status Gemm(const uint16_t* a, const uint16_t* b, void* c, bool f32_out, int64_t m,
                    int64_t n, int64_t k, float beta);

  std::unique_ptr<Handle> handle_;
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_SERVING_CUDA_CUBLAS_GEMM_H_
