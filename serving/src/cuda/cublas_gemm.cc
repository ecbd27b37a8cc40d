// CublasGemm (cublas_gemm.h) over cuBLAS's cublasGemmEx.
#include "cuda/cublas_gemm.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {
namespace {

// CublasErrorToStatus maps cuBLAS's codes by value; these are the ones it names.
static_assert(CUBLAS_STATUS_SUCCESS == 0 && CUBLAS_STATUS_NOT_INITIALIZED == 1 &&
                  CUBLAS_STATUS_ALLOC_FAILED == 3 && CUBLAS_STATUS_INVALID_VALUE == 7 &&
                  CUBLAS_STATUS_ARCH_MISMATCH == 8 && CUBLAS_STATUS_MAPPING_ERROR == 11 &&
                  CUBLAS_STATUS_EXECUTION_FAILED == 13 && CUBLAS_STATUS_INTERNAL_ERROR == 14 &&
                  CUBLAS_STATUS_NOT_SUPPORTED == 15 && CUBLAS_STATUS_LICENSE_ERROR == 16,
              "cuBLAS status codes changed: update common/src/cublas_status.cc");

absl::Status Check(cublasStatus_t status, const char* what) {
  return CublasErrorToStatus(static_cast<int>(status), what);
}

// cuBLAS's recommended workspace for Hopper (32 MiB); the handle's own, so that no other
// handle or stream shares it.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;

}  // namespace

struct CublasGemm::Handle {
  cublasHandle_t handle = nullptr;
  DeviceBuffer workspace;
  ~Handle() {
    if (handle != nullptr) cublasDestroy(handle);
  }
};

absl::StatusOr<CublasGemm> CublasGemm::Create(void* stream) {
  RETURN_IF_ERROR(CudaAvailability());
  auto h = std::make_unique<Handle>();
  RETURN_IF_ERROR(Check(cublasCreate(&h->handle), "cublasCreate"));
  ASSIGN_OR_RETURN(h->workspace, DeviceBuffer::Create(kWorkspaceBytes, MemoryKind::kDevice));
  RETURN_IF_ERROR(
      Check(cublasSetStream(h->handle, static_cast<cudaStream_t>(stream)), "cublasSetStream"));
  RETURN_IF_ERROR(Check(cublasSetWorkspace(h->handle, h->workspace.data(), kWorkspaceBytes),
                        "cublasSetWorkspace"));
  RETURN_IF_ERROR(Check(cublasSetAtomicsMode(h->handle, CUBLAS_ATOMICS_NOT_ALLOWED),
                        "cublasSetAtomicsMode"));
  RETURN_IF_ERROR(Check(cublasSetMathMode(h->handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode"));
  RETURN_IF_ERROR(Check(cublasSetPointerMode(h->handle, CUBLAS_POINTER_MODE_HOST),
                        "cublasSetPointerMode"));
  return CublasGemm(std::move(h));
}

CublasGemm::CublasGemm(std::unique_ptr<Handle> handle) : handle_(std::move(handle)) {}
CublasGemm::CublasGemm(CublasGemm&&) noexcept = default;
CublasGemm& CublasGemm::operator=(CublasGemm&&) noexcept = default;
CublasGemm::~CublasGemm() = default;

absl::Status CublasGemm::MatMulBf16(const uint16_t* a, const uint16_t* b, uint16_t* c, int64_t m,
                                    int64_t n, int64_t k, float beta) {
  return Gemm(a, b, c, /*f32_out=*/false, m, n, k, beta);
}

absl::Status CublasGemm::MatMulBf16ToF32(const uint16_t* a, const uint16_t* b, float* c,
                                         int64_t m, int64_t n, int64_t k) {
  return Gemm(a, b, c, /*f32_out=*/true, m, n, k, 0.0f);
}

absl::Status CublasGemm::Gemm(const uint16_t* a, const uint16_t* b, void* c, bool f32_out,
                              int64_t m, int64_t n, int64_t k, float beta) {
  if (handle_ == nullptr) return absl::FailedPreconditionError("CublasGemm: moved from");
  constexpr int64_t kMax = 1 << 30;  // cuBLAS takes int dimensions and leading dimensions
  if (m <= 0 || n <= 0 || k <= 0 || m > kMax || n > kMax || k > kMax) {
    return absl::InvalidArgumentError(
        absl::StrCat("CublasGemm: shape ", m, " x ", k, " * ", k, " x ", n, " out of range"));
  }
  const float alpha = 1.0f;
  // Row-major C = A * B is column-major C^T = B^T * A^T: cuBLAS sees B (n x k, ld n) times
  // A (k x m, ld k) into C (n x m, ld n).
  return Check(cublasGemmEx(handle_->handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n),
                            static_cast<int>(m), static_cast<int>(k), &alpha, b, CUDA_R_16BF,
                            static_cast<int>(n), a, CUDA_R_16BF, static_cast<int>(k), &beta, c,
                            f32_out ? CUDA_R_32F : CUDA_R_16BF, static_cast<int>(n),
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx");
}

}  // namespace internal
}  // namespace kvstream
