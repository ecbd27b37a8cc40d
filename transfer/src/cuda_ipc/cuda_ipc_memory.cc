// CUDA IPC memory (cuda_ipc_memory.h), over the runtime and driver APIs.
#include "cuda_ipc/cuda_ipc_memory.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "cuda_ipc/cuda_ipc_wire.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {

namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes, "IPC handle size");
static_assert(sizeof(cudaUUID_t) == kCudaUuidBytes, "UUID size");

// The few driver functions used, reached through the runtime (which loads the driver
// itself) rather than by linking libcuda: a binary linked with kvstream::transfer must
// start on machines without an NVIDIA driver, where libcuda.so.1 does not exist.
struct DriverApi {
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  CUresult (*pointer_get_attributes)(unsigned int, CUpointer_attribute*, void**,
                                     CUdeviceptr) = nullptr;
  CUresult (*mem_get_address_range)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  absl::Status status;
};

template <typename F>
absl::Status Load(const char* symbol, F* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t e =
      cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &found);
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("cuda_ipc: the CUDA driver has no ", symbol, " (", cudaGetErrorString(e),
                     ")"));
  }
  *fn = reinterpret_cast<F>(p);
  return absl::OkStatus();
}

const DriverApi& Driver() {
  static const DriverApi* api = [] {
    auto* d = new DriverApi;
    d->status = Load("cuGetErrorName", &d->get_error_name);
    if (d->status.ok()) d->status = Load("cuGetErrorString", &d->get_error_string);
    if (d->status.ok()) d->status = Load("cuPointerGetAttributes", &d->pointer_get_attributes);
    if (d->status.ok()) d->status = Load("cuMemGetAddressRange", &d->mem_get_address_range);
    return d;
  }();
  return *api;
}

}  // namespace

absl::Status CuResultToStatus(int result, absl::string_view operation) {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  const CUresult r = static_cast<CUresult>(result);
  const char* name = nullptr;
  const char* text = nullptr;
  const DriverApi& api = Driver();
  if (api.get_error_name == nullptr || api.get_error_name(r, &name) != CUDA_SUCCESS) {
    name = "CUresult";
  }
  if (api.get_error_string == nullptr || api.get_error_string(r, &text) != CUDA_SUCCESS) {
    text = "";
  }
  const std::string message = absl::StrCat(operation, ": ", name, " (", text, ", ", result, ")");
  switch (r) {
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
      return absl::InvalidArgumentError(message);
    case CUDA_ERROR_OUT_OF_MEMORY:
      return absl::ResourceExhaustedError(message);
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_INVALID_CONTEXT:
    case CUDA_ERROR_NOT_SUPPORTED:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::StatusOr<ExportedRange> ExportDeviceRange(void* base, size_t length, int device) {
  const DriverApi& api = Driver();
  RETURN_IF_ERROR(api.status);
  const CUdeviceptr ptr = reinterpret_cast<CUdeviceptr>(base);
  // cuPointerGetAttributes (unlike cuPointerGetAttribute) succeeds on pointers CUDA does
  // not know, leaving the attributes zero: that is how plain host memory shows. Booleans
  // may be written as one byte: the slots are zeroed ints.
  unsigned int memory_type = 0;
  int ordinal = -1;
  int managed = 0;
  int ipc_capable = 0;
  CUpointer_attribute attributes[] = {
      CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
      CU_POINTER_ATTRIBUTE_IS_MANAGED, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE};
  void* data[] = {&memory_type, &ordinal, &managed, &ipc_capable};
  RETURN_IF_ERROR(CuResultToStatus(api.pointer_get_attributes(4, attributes, data, ptr),
                                   "cuda_ipc RegisterMemory: cuPointerGetAttributes"));
  const std::string where = absl::StrCat("cuda_ipc RegisterMemory of ", length, " bytes at ",
                                         absl::Hex(ptr), ": ");
  if (memory_type == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "not CUDA memory (plain host memory?); cuda_ipc moves device memory only"));
  }
  if (managed != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "managed memory (cudaMallocManaged) cannot be shared over CUDA IPC"));
  }
  if (memory_type != CU_MEMORYTYPE_DEVICE) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "host memory (pinned or registered); cuda_ipc moves device memory only"));
  }
  if (ordinal != device) {
    return absl::InvalidArgumentError(absl::StrCat(where, "memory of device ", ordinal,
                                                   ", but this transport runs on device ",
                                                   device));
  }
  if (ipc_capable == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, "this device memory cannot be exported with cudaIpcGetMemHandle (memory from a "
               "stream-ordered pool, cudaMallocAsync, or from cuMemCreate, virtual memory "
               "management, e.g. PyTorch's expandable_segments); register memory from cudaMalloc"));
  }
  CUdeviceptr alloc_base = 0;
  size_t alloc_size = 0;
  RETURN_IF_ERROR(CuResultToStatus(api.mem_get_address_range(&alloc_base, &alloc_size, ptr),
                                   absl::StrCat(where, "cuMemGetAddressRange")));
  const uint64_t offset = static_cast<uint64_t>(ptr - alloc_base);
  if (ptr < alloc_base || offset > alloc_size || length > alloc_size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "the range runs past its allocation (", alloc_size, " bytes at ",
        absl::Hex(alloc_base), ")"));
  }
  cudaIpcMemHandle_t handle;
  RETURN_IF_ERROR(CudaErrorToStatus(
      static_cast<int>(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(alloc_base))),
      absl::StrCat(where, "cudaIpcGetMemHandle")));
  ExportedRange out;
  out.ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  out.allocation_base = static_cast<uintptr_t>(alloc_base);
  out.allocation_size = alloc_size;
  out.offset = offset;
  return out;
}

absl::StatusOr<std::string> DeviceUuid(int device) {
  cudaDeviceProp prop;
  RETURN_IF_ERROR(CudaErrorToStatus(static_cast<int>(cudaGetDeviceProperties(&prop, device)),
                                    "cudaGetDeviceProperties"));
  return std::string(reinterpret_cast<const char*>(&prop.uuid), sizeof(prop.uuid));
}

absl::StatusOr<std::unique_ptr<IpcMapping>> IpcMapping::Open(absl::string_view ipc_handle,
                                                             int device, absl::string_view peer) {
  if (ipc_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError("cuda_ipc: IPC handle of the wrong size");
  }
  CudaDeviceScope scope(device);
  RETURN_IF_ERROR(scope.status());
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, ipc_handle.data(), sizeof(handle));
  void* mapped = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky, but do not leave it for the next caller to find
    const absl::Status status = CudaErrorToStatus(
        static_cast<int>(e), absl::StrCat("cudaIpcOpenMemHandle of an allocation of ", peer));
    // The handle came from the peer: a stale or foreign one is the caller's input.
    return absl::InvalidArgumentError(status.message());
  }
  CUdeviceptr alloc_base = 0;
  size_t alloc_size = 0;
  const DriverApi& api = Driver();
  absl::Status measured = !api.status.ok()
      ? api.status
      : CuResultToStatus(api.mem_get_address_range(&alloc_base, &alloc_size,
                                                    reinterpret_cast<CUdeviceptr>(mapped)),
      "cuMemGetAddressRange of an opened IPC allocation");
  if (!measured.ok()) {
    cudaIpcCloseMemHandle(mapped);
    return measured;
  }
  // What is usable from `mapped`: to the end of the range CUDA reports for it.
  const uint64_t size =
      static_cast<uint64_t>(alloc_base + alloc_size - reinterpret_cast<CUdeviceptr>(mapped));
  return std::unique_ptr<IpcMapping>(new IpcMapping(static_cast<char*>(mapped), size, device));
}

IpcMapping::~IpcMapping() {
  CudaDeviceScope scope(device_);
  const cudaError_t e = cudaIpcCloseMemHandle(base_);
  if (e != cudaSuccess) {
    cudaGetLastError();
    Log(LogLevel::kWarning, absl::StrCat("cuda_ipc: cudaIpcCloseMemHandle: ",
                                         cudaGetErrorString(e)));
  }
}

}  // namespace internal
}  // namespace kvstream
