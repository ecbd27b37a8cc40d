// Endpoint closing for ucx_handles.h.
#include "ucx/ucx_handles.h"

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvstream/common/logging.h"

namespace kvstream {
namespace internal {

void* UcxEndpoint::StartClose(bool force) {
  if (ep_ == nullptr) return nullptr;
  ucp_request_param_t param;
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t request = ucp_ep_close_nbx(std::exchange(ep_, nullptr), &param);
  // An error here means the endpoint is already gone; UCX has released it.
  return UCS_PTR_IS_PTR(request) ? request : nullptr;
}

void UcxEndpoint::CloseNow() {
  void* request = StartClose(/*force=*/true);
  if (request == nullptr) return;
  // A forced close completes locally; the bound only guards against a UCX bug turning the
  // destructor into a hang.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (ucp_request_check_status(request) == UCS_INPROGRESS && absl::Now() < deadline) {
    ucp_worker_progress(worker_);
  }
  if (ucp_request_check_status(request) == UCS_INPROGRESS) {
    Log(LogLevel::kError, "UCX ep_close_nbx: a forced endpoint close did not complete in 10 s");
  }
  ucp_request_free(request);
}

}  // namespace internal
}  // namespace kvstream
