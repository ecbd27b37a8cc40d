// cuBLAS status codes as absl::Status (cuda_status.h). Built in every configuration: the
// codes are cuBLAS's documented enumerators, so no cuBLAS header is needed here.
#include "absl/strings/str_cat.h"
#include "kvstream/common/cuda_status.h"

namespace kvstream {

absl::Status CublasErrorToStatus(int cublas_status, absl::string_view operation) {
  const char* name = "unknown cuBLAS status";
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (cublas_status) {
    case 0: return absl::OkStatus();
    case 1: name = "CUBLAS_STATUS_NOT_INITIALIZED"; code = absl::StatusCode::kFailedPrecondition; break;
    case 3: name = "CUBLAS_STATUS_ALLOC_FAILED"; code = absl::StatusCode::kResourceExhausted; break;
    case 7: name = "CUBLAS_STATUS_INVALID_VALUE"; code = absl::StatusCode::kInvalidArgument; break;
    case 8: name = "CUBLAS_STATUS_ARCH_MISMATCH"; code = absl::StatusCode::kFailedPrecondition; break;
    case 11: name = "CUBLAS_STATUS_MAPPING_ERROR"; break;
    case 13: name = "CUBLAS_STATUS_EXECUTION_FAILED"; break;
    case 14: name = "CUBLAS_STATUS_INTERNAL_ERROR"; break;
    case 15: name = "CUBLAS_STATUS_NOT_SUPPORTED"; code = absl::StatusCode::kFailedPrecondition; break;
    case 16: name = "CUBLAS_STATUS_LICENSE_ERROR"; code = absl::StatusCode::kFailedPrecondition; break;
    default: break;
  }
  return absl::Status(code, absl::StrCat(operation, ": ", name, " (", cublas_status, ")"));
}

}  // namespace kvstream
