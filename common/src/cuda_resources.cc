// RAII owners of CUDA streams, events and buffers (cuda_resources.h), over the CUDA
// runtime API. Compiled by the host compiler; only in builds with CUDA.
#include "kvstream/common/cuda_resources.h"

#include <cuda.h>  // types only: the driver entry point is looked up at run time
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

// Whether the calling thread has a current CUDA context, i.e. has used a device: the
// driver's cuCtxGetCurrent, found through the runtime so that nothing links libcuda. True
// when that cannot be told (the caller then restores the device as before).
bool ThreadHasCudaContext() {
  static const PFN_cuCtxGetCurrent_v4000 get_current = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 4000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<PFN_cuCtxGetCurrent_v4000>(nullptr);
    }
    return reinterpret_cast<PFN_cuCtxGetCurrent_v4000>(fn);
  }();
  if (get_current == nullptr) return true;
  CUcontext context = nullptr;
  return get_current(&context) != CUDA_SUCCESS || context != nullptr;
}

// `e` as a Status naming `operation`. A failure also clears the runtime's last-error slot
// (which the failed call set), so that it does not surface again in an unrelated later
// check; success leaves the slot alone, so a pending launch error elsewhere is not lost.
absl::Status QueryError(cudaError_t e, absl::string_view operation) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return CudaErrorToStatus(static_cast<int>(e), operation);
}

// Polls `query` (true: done) until it reports done, fails, or `timeout` passes. Spins with
// yields for the first ~50 us (short kernels), then sleeps with a doubling backoff capped
// at 1 ms so that a long wait costs no CPU.
template <typename Query>
absl::Status PollUntilDone(Query query, absl::Duration timeout, absl::string_view what) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  absl::Duration sleep = absl::Microseconds(5);
  while (true) {
    absl::StatusOr<bool> done = query();
    if (!done.ok()) return done.status();
    if (*done) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          what, ": work still running after ", absl::FormatDuration(timeout)));
    }
    if (now - start < absl::Microseconds(50)) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(std::min(sleep, deadline - now));
      sleep = std::min(sleep * 2, absl::Milliseconds(1));
    }
  }
}

}  // namespace

// ---- CudaDeviceScope ----

CudaDeviceScope::CudaDeviceScope(int device) {
  if (device == kCurrentCudaDevice) return;
  int current = 0;
  const bool known = cudaGetDevice(&current) == cudaSuccess;
  if (!known) cudaGetLastError();
  if (known && current == device) return;
  const bool had_context = known && ThreadHasCudaContext();
  status_ = QueryError(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  previous_ = current;
  restore_ = status_.ok() && had_context;
}

CudaDeviceScope::~CudaDeviceScope() {
  if (restore_) cudaSetDevice(previous_);
}

// ---- CudaStream ----

absl::StatusOr<CudaStream> CudaStream::Create(int device) {
  if (device != kCurrentCudaDevice) {
    int count = 0;
    RETURN_IF_ERROR(QueryError(cudaGetDeviceCount(&count), "cudaGetDeviceCount"));
    if (device < 0 || device >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat("CudaStream::Create: device ", device, " out of range (", count,
                       " CUDA devices)"));
    }
  }
  CudaDeviceScope scope(device);
  RETURN_IF_ERROR(scope.status());
  if (device == kCurrentCudaDevice) {
    RETURN_IF_ERROR(QueryError(cudaGetDevice(&device), "cudaGetDevice"));
  }
  cudaStream_t stream = nullptr;
  RETURN_IF_ERROR(QueryError(cudaStreamCreateWithFlags(&stream, cudaStreamDefault),
                             absl::StrCat("cudaStreamCreate on device ", device)));
  return CudaStream(stream, device);
}

CudaStream::CudaStream(CudaStream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)), device_(std::exchange(other.device_, -1)) {}

CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  if (this != &other) {
    Reset();
    stream_ = std::exchange(other.stream_, nullptr);
    device_ = std::exchange(other.device_, -1);
  }
  return *this;
}

CudaStream::~CudaStream() { Reset(); }

void CudaStream::Reset() {
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  stream_ = nullptr;
  device_ = -1;
}

absl::StatusOr<bool> CudaStream::Query() const {
  if (stream_ == nullptr) return absl::FailedPreconditionError("CudaStream::Query: empty stream");
  const cudaError_t e = cudaStreamQuery(static_cast<cudaStream_t>(stream_));
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) {
    cudaGetLastError();  // not an error; keep later error checks clean
    return false;
  }
  return QueryError(e, "cudaStreamQuery");
}

absl::Status CudaStream::Synchronize(absl::Duration timeout) const {
  return PollUntilDone([this] { return Query(); }, timeout, "CudaStream::Synchronize");
}

// ---- CudaEvent ----

absl::StatusOr<CudaEvent> CudaEvent::Create(bool enable_timing) {
  cudaEvent_t event = nullptr;
  RETURN_IF_ERROR(QueryError(
      cudaEventCreateWithFlags(&event, enable_timing ? cudaEventDefault : cudaEventDisableTiming),
      "cudaEventCreate"));
  return CudaEvent(event);
}

CudaEvent::CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    Reset();
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

CudaEvent::~CudaEvent() { Reset(); }

void CudaEvent::Reset() {
  if (event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
  event_ = nullptr;
}

absl::Status CudaEvent::Record(void* stream) {
  if (event_ == nullptr) return absl::FailedPreconditionError("CudaEvent::Record: empty event");
  return QueryError(
      cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream)),
      "cudaEventRecord");
}

absl::Status CudaEvent::MakeStreamWait(void* stream) const {
  if (event_ == nullptr) {
    return absl::FailedPreconditionError("CudaEvent::MakeStreamWait: empty event");
  }
  return QueryError(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream),
                                        static_cast<cudaEvent_t>(event_), 0),
                    "cudaStreamWaitEvent");
}

absl::StatusOr<bool> CudaEvent::Query() const {
  if (event_ == nullptr) return absl::FailedPreconditionError("CudaEvent::Query: empty event");
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  return QueryError(e, "cudaEventQuery");
}

absl::Status CudaEvent::Synchronize(absl::Duration timeout) const {
  return PollUntilDone([this] { return Query(); }, timeout, "CudaEvent::Synchronize");
}

absl::StatusOr<float> CudaEvent::ElapsedMilliseconds(const CudaEvent& start, const CudaEvent& end) {
  if (start.empty() || end.empty()) {
    return absl::FailedPreconditionError("CudaEvent::ElapsedMilliseconds: empty event");
  }
  float ms = 0;
  RETURN_IF_ERROR(QueryError(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.event_),
                                                  static_cast<cudaEvent_t>(end.event_)),
                             "cudaEventElapsedTime"));
  return ms;
}

// ---- DeviceBuffer ----

absl::StatusOr<DeviceBuffer> DeviceBuffer::Create(size_t bytes, MemoryKind memory) {
  if (memory == MemoryKind::kHost) {
    return absl::InvalidArgumentError(
        "DeviceBuffer::Create: host memory is not CUDA memory (use kDevice or kPinned)");
  }
  if (bytes == 0) return DeviceBuffer();
  void* p = nullptr;
  if (memory == MemoryKind::kDevice) {
    RETURN_IF_ERROR(
        QueryError(cudaMalloc(&p, bytes), absl::StrCat("cudaMalloc(", bytes, " bytes)")));
  } else {
    RETURN_IF_ERROR(QueryError(cudaMallocHost(&p, bytes),
                               absl::StrCat("cudaMallocHost(", bytes, " bytes)")));
  }
  return DeviceBuffer(p, bytes, memory, /*stream_ordered=*/false, nullptr);
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::CreateZeroed(size_t bytes, MemoryKind memory) {
  ASSIGN_OR_RETURN(DeviceBuffer buffer, Create(bytes, memory));
  if (buffer.empty()) return buffer;
  if (memory == MemoryKind::kPinned) {
    std::memset(buffer.data_, 0, bytes);
    return buffer;
  }
  // A private non-blocking stream, so that the fill waits for nothing else on the device
  // and the wait below is bounded by the fill alone.
  cudaStream_t stream = nullptr;
  RETURN_IF_ERROR(QueryError(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                             "cudaStreamCreate (zero fill)"));
  absl::Status st = QueryError(cudaMemsetAsync(buffer.data_, 0, bytes, stream),
                               absl::StrCat("cudaMemsetAsync(", bytes, " bytes)"));
  if (st.ok()) {
    st = PollUntilDone(
        [stream]() -> absl::StatusOr<bool> {
          const cudaError_t e = cudaStreamQuery(stream);
          if (e == cudaSuccess) return true;
          if (e == cudaErrorNotReady) {
            cudaGetLastError();
            return false;
          }
          return QueryError(e, "cudaStreamQuery (zero fill)");
        },
        absl::Minutes(1), "DeviceBuffer::CreateZeroed");
  }
  cudaStreamDestroy(stream);
  if (!st.ok()) return st;
  return buffer;
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::CreateAsync(size_t bytes, void* stream) {
  if (bytes == 0) return DeviceBuffer();
  void* p = nullptr;
  RETURN_IF_ERROR(QueryError(cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream)),
                             absl::StrCat("cudaMallocAsync(", bytes, " bytes)")));
  return DeviceBuffer(p, bytes, MemoryKind::kDevice, /*stream_ordered=*/true, stream);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      memory_(other.memory_),
      free_stream_(std::exchange(other.free_stream_, nullptr)),
      stream_ordered_(std::exchange(other.stream_ordered_, false)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    memory_ = other.memory_;
    free_stream_ = std::exchange(other.free_stream_, nullptr);
    stream_ordered_ = std::exchange(other.stream_ordered_, false);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() { Reset(); }

void DeviceBuffer::Reset() {
  if (data_ != nullptr) {
    cudaError_t e;
    if (stream_ordered_) {
      e = cudaFreeAsync(data_, static_cast<cudaStream_t>(free_stream_));
    } else if (memory_ == MemoryKind::kPinned) {
      e = cudaFreeHost(data_);
    } else {
      e = cudaFree(data_);
    }
    // A failed free (only possible after a fatal device error) must not surface in an
    // unrelated later check.
    if (e != cudaSuccess) cudaGetLastError();
  }
  data_ = nullptr;
  size_ = 0;
  free_stream_ = nullptr;
  stream_ordered_ = false;
}

}  // namespace kvstream
