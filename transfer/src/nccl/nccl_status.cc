// ncclResult_t -> absl::Status (nccl_status.h).
#include "nccl/nccl_status.h"

#include "absl/strings/str_cat.h"

namespace kvstream {
namespace internal {
namespace {

const char* ResultName(int result) {
  switch (result) {
    case kNcclUnhandledCudaError: return "unhandled CUDA error";
    case kNcclSystemError: return "system error";
    case kNcclInternalError: return "internal error";
    case kNcclInvalidArgument: return "invalid argument";
    case kNcclInvalidUsage: return "invalid usage";
    case kNcclRemoteError: return "remote error";
    default: return "unknown result";
  }
}

absl::StatusCode CodeFor(int result) {
  switch (result) {
    case kNcclSystemError:
    case kNcclRemoteError: return absl::StatusCode::kUnavailable;
    case kNcclInvalidArgument: return absl::StatusCode::kInvalidArgument;
    case kNcclInvalidUsage: return absl::StatusCode::kFailedPrecondition;
    default: return absl::StatusCode::kInternal;
  }
}

}  // namespace

absl::Status NcclResultToStatus(int result, absl::string_view operation, absl::string_view peer,
                                absl::string_view detail) {
  if (result == kNcclSuccess || result == kNcclInProgress) return absl::OkStatus();
  return absl::Status(CodeFor(result),
                      absl::StrCat("NCCL ", operation, peer.empty() ? "" : " (", peer,
                                   peer.empty() ? "" : ")", ": ", ResultName(result), " [", result,
                                   "]", detail.empty() ? "" : ": ", detail));
}

}  // namespace internal
}  // namespace kvstream
