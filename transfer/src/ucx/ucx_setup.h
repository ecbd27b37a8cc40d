// Starting UCX for one transport (private to transfer/): the UCX configuration kvstream
// derives from UcxTransportOptions, the context, the worker, its address and the
// notification handler, gathered into a fresh UcxCore.
#ifndef KVSTREAM_TRANSFER_SRC_UCX_UCX_SETUP_H_
#define KVSTREAM_TRANSFER_SRC_UCX_UCX_SETUP_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kvstream/transfer/ucx_transport.h"
#include "ucx/ucx_core.h"

namespace kvstream {
namespace internal {

// UCX configuration settings (ucp_config_modify names and values), applied in order.
using UcxSettings = std::vector<std::pair<std::string, std::string>>;

// The settings kvstream gives UCX for these options: UCX_TLS, devices, keepalive, progress,
// the shared-memory and TCP fragment sizes where UCX_TLS may select those transports, and
// last the options' own ucx_config (so it wins).
UcxSettings UcxConfigFor(const UcxTransportOptions& options);

// Whether host writes travel as kvstream's active messages (ucx/am_writes.h) under these
// options: UcxWriteProtocol's kAuto resolved from options.tls.
bool UsesActiveMessageWrites(const UcxTransportOptions& options);

// A core with its context, worker (UCS_THREAD_MODE_SERIALIZED), uid and local info. The
// UCX error naming the call when UCX cannot start with these options. Does not validate
// the options' other fields (the caller does).
absl::StatusOr<std::shared_ptr<UcxCore>> CreateUcxCore(const UcxTransportOptions& options);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_UCX_SETUP_H_
