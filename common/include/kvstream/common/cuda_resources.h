// Move-only RAII owners of CUDA handles: CudaStream, CudaEvent and DeviceBuffer (device,
// pinned-host or stream-ordered device memory). Every CUDA error becomes a Status through
// CudaErrorToStatus with the operation named; destructors release quietly.
//
//   ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
//   ASSIGN_OR_RETURN(DeviceBuffer buf, DeviceBuffer::CreateZeroed(bytes, MemoryKind::kDevice));
//   ... enqueue work on stream.get() ...
//   RETURN_IF_ERROR(stream.Synchronize(absl::Seconds(10)));
//
// The header needs no CUDA include: handles are carried as void* (cudaStream_t and
// cudaEvent_t are pointers), so CPU-only builds and users of the installed package compile
// it unchanged. In builds without CUDA every Create() returns FailedPrecondition ("built
// without CUDA") and nothing else can be reached, since no owner is ever non-empty.
//
// Waiting never blocks without a deadline: Query() says "done or not yet" as a value, and
// Synchronize() polls until a timeout.
//
// Thread safety: each owner is thread-compatible (const methods may be called concurrently;
// moving or destroying needs exclusive access). The CUDA objects themselves may be used
// from any thread.
#ifndef KVSTREAM_COMMON_CUDA_RESOURCES_H_
#define KVSTREAM_COMMON_CUDA_RESOURCES_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvstream/common/dtype.h"

namespace kvstream {

// "The calling thread's current CUDA device."
inline constexpr int kCurrentCudaDevice = -1;

// Makes `device` the calling thread's current CUDA device for a scope (kCurrentCudaDevice:
// changes nothing), then puts back the device the thread had been using. A thread that had
// not used CUDA yet is left on `device`: its nominal current device is 0, and switching it
// back would create a context on GPU 0 (memory on that GPU in every process of a multi-GPU
// job that touched kvstream from such a thread). status() is the cudaSetDevice error, if any
// (FailedPrecondition in builds without CUDA).
class CudaDeviceScope {
 public:
  explicit CudaDeviceScope(int device);
  ~CudaDeviceScope();
  CudaDeviceScope(const CudaDeviceScope&) = delete;
  CudaDeviceScope& operator=(const CudaDeviceScope&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  // Unused in builds without CUDA (cuda_resources_none.cc).
  [[maybe_unused]] int previous_ = 0;
  [[maybe_unused]] bool restore_ = false;
  absl::Status status_;
};

// Owns a cudaStream_t.
class CudaStream {
 public:
  // Creates a stream on `device` (kCurrentCudaDevice: the calling thread's current device).
  // Like cudaStreamCreate's, it synchronises with the legacy default stream, so a plain
  // cudaMemcpy before a launch on this stream is ordered before it. The calling thread's
  // current device is left as it was (see CudaDeviceScope: a thread that had not used CUDA
  // is left on `device`). FailedPrecondition without CUDA or without a usable
  // device; InvalidArgument for a device index out of range; other CUDA errors mapped by
  // CudaErrorToStatus.
  static absl::StatusOr<CudaStream> Create(int device = kCurrentCudaDevice);

  CudaStream() = default;  // empty: get() is null
  CudaStream(CudaStream&& other) noexcept;
  CudaStream& operator=(CudaStream&& other) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  // Destroys the stream. Work already enqueued still runs (CUDA's semantics); the
  // destructor does not wait for it.
  ~CudaStream();

  // The cudaStream_t, as void*; null when empty. Ownership stays here.
  void* get() const { return stream_; }
  // The device the stream belongs to; -1 when empty.
  int device() const { return device_; }
  bool empty() const { return stream_ == nullptr; }

  // true when all work enqueued so far has finished, false while some is pending; an
  // error from that work (or FailedPrecondition when empty) otherwise. Never blocks.
  absl::StatusOr<bool> Query() const;
  // Waits until all work enqueued so far has finished: OK, DeadlineExceeded after
  // `timeout` (the work keeps running), or the error that work raised. Polls with backoff.
  absl::Status Synchronize(absl::Duration timeout) const;

 private:
  CudaStream(void* stream, int device) : stream_(stream), device_(device) {}
  void Reset();

  void* stream_ = nullptr;
  int device_ = -1;
};

// Owns a cudaEvent_t, created on the calling thread's current device.
class CudaEvent {
 public:
  // A timing event (for ElapsedMilliseconds) when `enable_timing`, else a lighter one used
  // only for ordering. Errors as CudaStream::Create.
  static absl::StatusOr<CudaEvent> Create(bool enable_timing = false);

  CudaEvent() = default;  // empty
  CudaEvent(CudaEvent&& other) noexcept;
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent();

  void* get() const { return event_; }  // the cudaEvent_t; null when empty
  bool empty() const { return event_ == nullptr; }

  // Captures the work enqueued on `stream` (a cudaStream_t; null: the legacy default
  // stream) so far. Never blocks.
  absl::Status Record(void* stream);
  // Makes `stream` wait, on the device, for the work this event captured. Never blocks.
  absl::Status MakeStreamWait(void* stream) const;
  // As CudaStream::Query / Synchronize, for the captured work.
  absl::StatusOr<bool> Query() const;
  absl::Status Synchronize(absl::Duration timeout) const;

  // Milliseconds between two completed timing events. An error naming the operation when
  // either is empty, has not completed, or was created without timing.
  static absl::StatusOr<float> ElapsedMilliseconds(const CudaEvent& start, const CudaEvent& end);

 private:
  explicit CudaEvent(void* event) : event_(event) {}
  void Reset();

  void* event_ = nullptr;
};

// Owns CUDA-allocated memory: device memory (cudaMalloc), pinned host memory
// (cudaMallocHost), or stream-ordered device memory (cudaMallocAsync) freed in the order
// of its stream.
class DeviceBuffer {
 public:
  // `bytes` of uninitialised memory of kind kDevice or kPinned, on the calling thread's
  // current device. Zero bytes gives an empty buffer and OK. InvalidArgument for kHost;
  // ResourceExhausted when the memory cannot be had; FailedPrecondition without CUDA or
  // without a usable device.
  static absl::StatusOr<DeviceBuffer> Create(size_t bytes, MemoryKind memory);
  // As Create, then zero-filled. Blocks until the fill has finished (device memory: a
  // memset on a private stream, waited for with a deadline of a minute).
  static absl::StatusOr<DeviceBuffer> CreateZeroed(size_t bytes, MemoryKind memory);
  // `bytes` of uninitialised device memory usable by work enqueued on `stream` (a
  // cudaStream_t) from now on, and freed in that stream's order when the buffer is
  // destroyed, so that no wait is needed to replace it. REQUIRES: the stream outlives the
  // buffer. Errors as Create.
  static absl::StatusOr<DeviceBuffer> CreateAsync(size_t bytes, void* stream);

  DeviceBuffer() = default;  // empty
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  // Frees the memory (stream-ordered buffers: in their stream's order). Device memory
  // freed by cudaFree may still be in use by enqueued work only if the caller broke the
  // contract of not destroying a buffer that enqueued work uses.
  ~DeviceBuffer();

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const { return static_cast<T*>(data_); }
  size_t size() const { return size_; }
  MemoryKind memory() const { return memory_; }
  bool empty() const { return data_ == nullptr; }

 private:
  DeviceBuffer(void* data, size_t size, MemoryKind memory, bool stream_ordered,
               void* free_stream)
      : data_(data),
        size_(size),
        memory_(memory),
        free_stream_(free_stream),
        stream_ordered_(stream_ordered) {}
  void Reset();

  void* data_ = nullptr;
  size_t size_ = 0;
  MemoryKind memory_ = MemoryKind::kDevice;
  void* free_stream_ = nullptr;  // stream-ordered buffers: the stream to free on
  bool stream_ordered_ = false;
};

}  // namespace kvstream

#endif  // KVSTREAM_COMMON_CUDA_RESOURCES_H_
