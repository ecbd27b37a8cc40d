// The one place where an NCCL ncclResult_t becomes an absl::Status (private to transfer/).
//
// ARCHITECTURE.md puts this conversion in common/, but common/ does not link NCCL; it lives
// here, beside the only code that calls NCCL (as ucx/ucx_status.h does for UCX). The codes
// are NCCL's documented enumerators, mirrored so that this file and its callers compile
// without nccl.h (and are unit-tested in every build); nccl_api.cc checks them against the
// header it is built with.
#ifndef KVSTREAM_TRANSFER_SRC_NCCL_NCCL_STATUS_H_
#define KVSTREAM_TRANSFER_SRC_NCCL_NCCL_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvstream {
namespace internal {

// ncclResult_t values.
inline constexpr int kNcclSuccess = 0;
inline constexpr int kNcclUnhandledCudaError = 1;
inline constexpr int kNcclSystemError = 2;
inline constexpr int kNcclInternalError = 3;
inline constexpr int kNcclInvalidArgument = 4;
inline constexpr int kNcclInvalidUsage = 5;
inline constexpr int kNcclRemoteError = 6;
inline constexpr int kNcclInProgress = 7;

// OK for ncclSuccess and ncclInProgress (not an error: the caller asks the communicator's
// state again later); otherwise a Status whose code follows the error's meaning (remote and
// system errors, which is how NCCL reports a peer or link that failed -> Unavailable;
// invalid argument -> InvalidArgument; invalid usage -> FailedPrecondition; CUDA and
// internal errors -> Internal) and whose message reads "NCCL <operation> (<peer>): <name>
// [<code>]: <detail>". `peer` and `detail` (ncclGetLastError's text) may be empty.
absl::Status NcclResultToStatus(int result, absl::string_view operation,
                                absl::string_view peer = {}, absl::string_view detail = {});

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_NCCL_NCCL_STATUS_H_
