// The argument checks the device transports (cuda_ipc, nccl) make before they touch a GPU or
// a peer, with one wording for both: which memory they register and allocate (device
// memory, a non-empty range) and which notifications they send alone. Each returns
// InvalidArgument prefixed by `transport` and the call ("nccl RegisterMemory: ..."), or OK.
// Private to transfer/.
#ifndef KVSTREAM_TRANSFER_SRC_DEVICE_ARGUMENT_CHECKS_H_
#define KVSTREAM_TRANSFER_SRC_DEVICE_ARGUMENT_CHECKS_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kvstream/common/dtype.h"

namespace kvstream {
namespace internal {

// RegisterMemory(base, length, kind): a non-empty range of device memory.
inline absl::Status CheckDeviceRegistration(absl::string_view transport, const void* base,
                                            size_t length, MemoryKind kind) {
  if (base == nullptr || length == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(transport, " RegisterMemory: null or empty range"));
  }
  if (kind != MemoryKind::kDevice) {
    return absl::InvalidArgumentError(absl::StrCat(
        transport, " RegisterMemory: ", MemoryKindName(kind), " memory is not supported (",
        transport, " moves device memory only; use the ucx transport for host memory)"));
  }
  return absl::OkStatus();
}

// AllocateMemory(length, kind): some device memory.
inline absl::Status CheckDeviceAllocation(absl::string_view transport, size_t length,
                                          MemoryKind kind) {
  if (length == 0) {
    return absl::InvalidArgumentError(absl::StrCat(transport, " AllocateMemory: zero length"));
  }
  if (kind != MemoryKind::kDevice) {
    return absl::InvalidArgumentError(absl::StrCat(transport, " AllocateMemory: cannot allocate ",
                                                   MemoryKindName(kind),
                                                   " memory (device memory only)"));
  }
  return absl::OkStatus();
}

// PostNotification(payload): not empty, at most `max_bytes` (what one frame carries).
inline absl::Status CheckNotificationPayload(absl::string_view transport,
                                             absl::string_view payload, size_t max_bytes) {
  if (payload.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(transport, " PostNotification: empty payload"));
  }
  if (payload.size() > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(transport, " PostNotification: ",
                                                   payload.size(), " bytes, more than ",
                                                   max_bytes));
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_DEVICE_ARGUMENT_CHECKS_H_
