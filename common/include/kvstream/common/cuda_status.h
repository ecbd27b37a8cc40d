// The one place where CUDA runtime and cuBLAS errors become absl::Status, and the runtime query the
// GPU tests use to skip. Available in every build: without CUDA, GpuCount() is 0 and
// CudaAvailability() says why.
#ifndef KVSTREAM_COMMON_CUDA_STATUS_H_
#define KVSTREAM_COMMON_CUDA_STATUS_H_

#include "absl/strings/string_view.h"

#include "absl/status/status.h"

namespace kvstream {

// True when this build of kvstream contains its CUDA parts.
bool BuiltWithCuda();

// OK when at least one CUDA device can be used; otherwise a FailedPrecondition saying why
// ("built without CUDA", "no CUDA device: <driver message>"). Never crashes on machines
// without a driver.
absl::Status CudaAvailability();

// Number of usable CUDA devices (0 when none, or when built without CUDA).
int GpuCount();

// Converts a cudaError_t (passed as int so this header needs no CUDA include) into a
// Status naming `operation`; OK for cudaSuccess.
absl::Status CudaErrorToStatus(int cuda_error, absl::string_view operation);

// Converts a cublasStatus_t (as int) into a Status naming `operation`: OK for
// CUBLAS_STATUS_SUCCESS, ResourceExhausted for an allocation failure, InvalidArgument for
// an invalid value, FailedPrecondition for an architecture mismatch or an unsupported
// operation, Internal otherwise. Needs no cuBLAS header or library (the codes are cuBLAS's
// documented enumerators; the serving library checks them against cublas_api.h).
absl::Status CublasErrorToStatus(int cublas_status, absl::string_view operation);

}  // namespace kvstream

#endif  // KVSTREAM_COMMON_CUDA_STATUS_H_
