// Starting UCX for one transport (private to transfer/): the UCX configuration kvstream
// derives from UcxTransportOptions, the context, the worker, its address and the
// notification handler, gathered into a fresh UcxCore.
#ifndef KVSTREAM_TRANSFER_SRC_UCX_UCX_SETUP_H_
#define KVSTREAM_TRANSFER_SRC_UCX_UCX_SETUP_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kvstream/transfer/ucx_transport.h"
#include "ucx/ucx_core.h"

namespace kvstream {
namespace internal {

// A core with its context, worker (UCS_THREAD_MODE_SERIALIZED), uid and local info. The
// UCX error naming the call when UCX cannot start with these options. Does not validate
// the options' other fields (the caller does).
absl::StatusOr<std::shared_ptr<UcxCore>> CreateUcxCore(const UcxTransportOptions& options);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_UCX_SETUP_H_
