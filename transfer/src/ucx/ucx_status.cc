// ucs_status_t -> absl::Status (see ucx_status.h).
#include "ucx/ucx_status.h"

#include "absl/strings/str_cat.h"

namespace kvstream {
namespace internal {
namespace {

absl::StatusCode CodeFor(ucs_status_t status) {
  switch (status) {
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
    case UCS_ERR_OUT_OF_RANGE:
    case UCS_ERR_BUSY:
      return absl::StatusCode::kResourceExhausted;
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
    case UCS_ERR_MESSAGE_TRUNCATED:
      return absl::StatusCode::kInvalidArgument;
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_REJECTED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_SHMEM_SEGMENT:
      return absl::StatusCode::kUnavailable;
    case UCS_ERR_TIMED_OUT:
      return absl::StatusCode::kDeadlineExceeded;
    case UCS_ERR_CANCELED:
      return absl::StatusCode::kCancelled;
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_NOT_IMPLEMENTED:
      return absl::StatusCode::kUnimplemented;
    case UCS_ERR_NO_ELEM:
      return absl::StatusCode::kNotFound;
    case UCS_ERR_ALREADY_EXISTS:
      return absl::StatusCode::kAlreadyExists;
    case UCS_ERR_NO_PROGRESS:
      return absl::StatusCode::kFailedPrecondition;
    default:
      // The ranges UCX reserves for link and endpoint failures: the peer is unreachable.
      if (UCS_IS_LINK_ERROR(status) || UCS_IS_ENDPOINT_ERROR(status)) {
        return absl::StatusCode::kUnavailable;
      }
      return absl::StatusCode::kInternal;
  }
}

}  // namespace

absl::Status UcxStatusToStatus(ucs_status_t status, absl::string_view operation,
                               absl::string_view peer) {
  if (status == UCS_OK || status == UCS_INPROGRESS) return absl::OkStatus();
  return absl::Status(CodeFor(status),
                      absl::StrCat("UCX ", operation, peer.empty() ? "" : " (", peer,
                                   peer.empty() ? "" : ")", ": ", ucs_status_string(status),
                                   " [", static_cast<int>(status), "]"));
}

}  // namespace internal
}  // namespace kvstream
