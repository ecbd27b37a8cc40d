// The cuda_ipc transport's copy stream: a stream created with cudaStreamNonBlocking. Not
// CudaStream (common/cuda_resources.h), whose streams synchronise with the legacy default
// stream: PyTorch runs its default stream there, and every model kernel on it would then
// wait for the transfers' copies and they for it, serialising the layer-wise overlap this
// transport exists for. Move-only; destroyed without waiting (enqueued work still runs).
#ifndef KVSTREAM_TRANSFER_CUDA_IPC_IPC_STREAM_H_
#define KVSTREAM_TRANSFER_CUDA_IPC_IPC_STREAM_H_

#include <cuda_runtime.h>

#include <utility>

#include "absl/status/statusor.h"
#include "kvstream/common/cuda_status.h"

namespace kvstream {
namespace internal {

class IpcStream {
 public:
  // On the calling thread's current device.
  static absl::StatusOr<IpcStream> Create() {
    cudaStream_t stream = nullptr;
    const cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      return CudaErrorToStatus(static_cast<int>(e), "cudaStreamCreateWithFlags");
    }
    return IpcStream(stream);
  }

  IpcStream() = default;
  IpcStream(IpcStream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  IpcStream& operator=(IpcStream&& other) noexcept {
    if (this != &other) {
      Reset();
      stream_ = std::exchange(other.stream_, nullptr);
    }
    return *this;
  }
  IpcStream(const IpcStream&) = delete;
  IpcStream& operator=(const IpcStream&) = delete;
  ~IpcStream() { Reset(); }

  cudaStream_t get() const { return stream_; }

 private:
  explicit IpcStream(cudaStream_t stream) : stream_(stream) {}
  void Reset() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

  cudaStream_t stream_ = nullptr;
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_CUDA_IPC_IPC_STREAM_H_
