// The one place where a UCX ucs_status_t becomes an absl::Status (private to transfer/).
//
// ARCHITECTURE.md puts this conversion in common/, but common/ does not link UCX; it lives
// here, beside the only code that calls UCX, until common/ grows a UCX dependency.
#ifndef KVSTREAM_TRANSFER_SRC_UCX_UCX_STATUS_H_
#define KVSTREAM_TRANSFER_SRC_UCX_UCX_STATUS_H_

#include <ucs/type/status.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvstream {
namespace internal {

// OK for UCS_OK (and UCS_INPROGRESS, which is not an error); otherwise a Status whose code
// follows the UCX error's meaning (unreachable/reset/timeout -> Unavailable, cancelled ->
// Cancelled, bad parameter -> InvalidArgument, no memory -> ResourceExhausted, ...) and whose
// message reads "UCX <operation> (<peer>): <UCX's text> [<code>]". `peer` may be empty.
absl::Status UcxStatusToStatus(ucs_status_t status, absl::string_view operation,
                               absl::string_view peer = {});

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_UCX_STATUS_H_
