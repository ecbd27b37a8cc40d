// The CUDA resource owners (cuda_resources.h) in builds without CUDA: every Create() says
// so, and since no owner can then hold a handle, the other methods only report that.
#include "kvstream/common/cuda_resources.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvstream {
namespace {

absl::Status NoCuda(absl::string_view what) {
  return absl::FailedPreconditionError(
      absl::StrCat(what, ": kvstream was built without CUDA (KVSTREAM_CUDA=OFF or no nvcc)"));
}

}  // namespace

CudaDeviceScope::CudaDeviceScope(int /*device*/) : status_(NoCuda("CudaDeviceScope")) {}
CudaDeviceScope::~CudaDeviceScope() = default;

absl::StatusOr<CudaStream> CudaStream::Create(int /*device*/) {
  return NoCuda("CudaStream::Create");
}
CudaStream::CudaStream(CudaStream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)), device_(std::exchange(other.device_, -1)) {}
CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  stream_ = std::exchange(other.stream_, nullptr);
  device_ = std::exchange(other.device_, -1);
  return *this;
}
CudaStream::~CudaStream() = default;
void CudaStream::Reset() {}
absl::StatusOr<bool> CudaStream::Query() const { return NoCuda("CudaStream::Query"); }
absl::Status CudaStream::Synchronize(absl::Duration /*timeout*/) const {
  return NoCuda("CudaStream::Synchronize");
}

absl::StatusOr<CudaEvent> CudaEvent::Create(bool /*enable_timing*/) {
  return NoCuda("CudaEvent::Create");
}
CudaEvent::CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  event_ = std::exchange(other.event_, nullptr);
  return *this;
}
CudaEvent::~CudaEvent() = default;
void CudaEvent::Reset() {}
absl::Status CudaEvent::Record(void* /*stream*/) { return NoCuda("CudaEvent::Record"); }
absl::Status CudaEvent::MakeStreamWait(void* /*stream*/) const {
  return NoCuda("CudaEvent::MakeStreamWait");
}
absl::StatusOr<bool> CudaEvent::Query() const { return NoCuda("CudaEvent::Query"); }
absl::Status CudaEvent::Synchronize(absl::Duration /*timeout*/) const {
  return NoCuda("CudaEvent::Synchronize");
}
absl::StatusOr<float> CudaEvent::ElapsedMilliseconds(const CudaEvent& /*start*/,
                                                     const CudaEvent& /*end*/) {
  return NoCuda("CudaEvent::ElapsedMilliseconds");
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Create(size_t /*bytes*/, MemoryKind /*memory*/) {
  return NoCuda("DeviceBuffer::Create");
}
absl::StatusOr<DeviceBuffer> DeviceBuffer::CreateZeroed(size_t /*bytes*/, MemoryKind /*memory*/) {
  return NoCuda("DeviceBuffer::CreateZeroed");
}
absl::StatusOr<DeviceBuffer> DeviceBuffer::CreateAsync(size_t /*bytes*/, void* /*stream*/) {
  return NoCuda("DeviceBuffer::CreateAsync");
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      memory_(other.memory_),
      free_stream_(std::exchange(other.free_stream_, nullptr)),
      stream_ordered_(std::exchange(other.stream_ordered_, false)) {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  data_ = std::exchange(other.data_, nullptr);
  size_ = std::exchange(other.size_, 0);
  memory_ = other.memory_;
  free_stream_ = std::exchange(other.free_stream_, nullptr);
  stream_ordered_ = std::exchange(other.stream_ordered_, false);
  return *this;
}
DeviceBuffer::~DeviceBuffer() = default;
void DeviceBuffer::Reset() {}

}  // namespace kvstream
