// CUDA IPC memory for the cuda_ipc transport: exporting a device range (the allocation it
// lies in and that allocation's IPC handle) and the owner of an opened peer allocation.
// The only place where CUresult (driver API) values become Status.
#ifndef KVSTREAM_TRANSFER_CUDA_IPC_CUDA_IPC_MEMORY_H_
#define KVSTREAM_TRANSFER_CUDA_IPC_CUDA_IPC_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvstream {
namespace internal {

// A CUresult (as int) as a Status naming `operation`; OK for CUDA_SUCCESS.
absl::Status CuResultToStatus(int result, absl::string_view operation);

// The device allocation a registered range lies in.
struct ExportedRange {
  std::string ipc_handle;  // kCudaIpcHandleBytes, of the allocation's base
  uintptr_t allocation_base = 0;
  uint64_t allocation_size = 0;
  uint64_t offset = 0;  // of the range in the allocation
};

// Finds the cudaMalloc allocation holding [base, base + length) and exports it.
// InvalidArgument, saying what the memory is, for memory that is not device memory of
// `device` (host, pinned, managed, another GPU's) or a range running past its allocation;
// FailedPrecondition for device memory that cudaIpcGetMemHandle cannot export (stream-
// ordered pools, cuMemCreate). REQUIRES: `device` is the calling thread's current device.
absl::StatusOr<ExportedRange> ExportDeviceRange(void* base, size_t length, int device);

// The UUID (kCudaUuidBytes) of `device`.
absl::StatusOr<std::string> DeviceUuid(int device);

// A peer's allocation opened with cudaIpcOpenMemHandle on `device`; closed on destruction
// (REQUIRES: no enqueued work uses it any more by then). Move-only through unique_ptr.
class IpcMapping {
 public:
  // Opens `ipc_handle` (kCudaIpcHandleBytes) and measures what was mapped
  // (cuMemGetAddressRange). `peer` names the owner in messages. InvalidArgument when the
  // handle cannot be opened (not a live allocation of a peer on this host).
  static absl::StatusOr<std::unique_ptr<IpcMapping>> Open(absl::string_view ipc_handle,
                                                          int device, absl::string_view peer);
  ~IpcMapping();
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;

  char* base() const { return base_; }
  // The size of the allocation as mapped here.
  uint64_t size() const { return size_; }

 private:
  IpcMapping(char* base, uint64_t size, int device) : base_(base), size_(size), device_(device) {}

  char* base_;
  uint64_t size_;
  int device_;
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_CUDA_IPC_CUDA_IPC_MEMORY_H_
