// The "cuda" attention backend (cuda_attention.h): UpdateCache -> CacheUpdateCuda; Forward
// -> MakePagedKernelParams, then the decode kernel when max_query_len <= 1, else the varlen
// prefill kernel. The decode kernel's split workspace and its arrival counters are
// stream-ordered device buffers that grow on demand, so replacing them never waits.
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cuda/kernel_params.h"
#include "cuda/launchers.h"
#include "kvstream/attention/cuda_attention.h"
#include "kvstream/cache/cache_update.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

class CudaBackend final : public CudaAttentionBackend {
 public:
  CudaBackend(int device, int num_sms, int compute_major, CudaStream owned_stream,
              void* stream, CudaEvent done)
      : device_(device),
        num_sms_(num_sms),
        compute_major_(compute_major),
        owned_stream_(std::move(owned_stream)),
        stream_(stream),
        done_(std::move(done)) {}

  ~CudaBackend() override {
    // The workspace is freed in stream order on stream_, which must still exist: release
    // it before an owned stream goes.
    CudaDeviceScope scope(device_);
    workspace_ = DeviceBuffer();
    counters_ = DeviceBuffer();
  }

  absl::string_view name() const override { return "cuda"; }
  bool SupportsMemory(MemoryKind memory) const override { return memory == MemoryKind::kDevice; }
  void* stream() const override { return stream_; }
  int device() const override { return device_; }

  absl::Status UpdateCache(const CacheUpdateParams& params) override {
    CudaDeviceScope scope(device_);
    RETURN_IF_ERROR(scope.status());
    return CacheUpdateCuda(params, stream_);
  }

  absl::Status Forward(const PagedAttentionParams& params) override {
    ASSIGN_OR_RETURN(internal::PagedKernelParams kp, internal::MakePagedKernelParams(params));
    CudaDeviceScope scope(device_);
    RETURN_IF_ERROR(scope.status());
    const cudaStream_t stream = static_cast<cudaStream_t>(stream_);
    const DType cache_dtype = params.cache.spec.dtype;
    if (params.max_query_len <= 1) {
      internal::DecodeLaunchOptions options;
      options.num_sms = num_sms_;
      options.dependent_merge = compute_major_ >= 9;
      options.tma = compute_major_ >= 9;
      options.workspace = [this](size_t bytes) -> absl::StatusOr<void*> {
        if (bytes > workspace_.size()) {
          // Grow by half again, so that a slowly growing batch does not reallocate each
          // step. The old buffer is freed in stream order, after the kernels that used it.
          ASSIGN_OR_RETURN(workspace_, DeviceBuffer::CreateAsync(bytes + bytes / 2, stream_));
        }
        return workspace_.data();
      };
      options.arrival_counters = [this](size_t count) -> absl::StatusOr<uint32_t*> {
        // Zeroed once, in stream order (grown by half again, as the workspace); every
        // decode launch leaves the counters zero.
        return internal::ZeroedArrivalCounters(counters_, count, count + count / 2,
                                               static_cast<cudaStream_t>(stream_));
      };
      return internal::LaunchDecodeAttention(kp, params.q_dtype, params.out_dtype, cache_dtype,
                                             options, stream);
    }
    return internal::LaunchPrefillAttention(kp, params.q_dtype, params.out_dtype, cache_dtype,
                                            stream);
  }

  absl::Status Synchronize(absl::Duration timeout) override {
    CudaDeviceScope scope(device_);
    RETURN_IF_ERROR(scope.status());
    RETURN_IF_ERROR(done_.Record(stream_));
    return done_.Synchronize(timeout);
  }

 private:
  const int device_;
  const int num_sms_;
  const int compute_major_;
  CudaStream owned_stream_;  // empty when the caller supplied the stream
  void* const stream_;
  CudaEvent done_;
  // Stream-ordered on stream_; declared last, destroyed first. counters_: the decode
  // kernels' arrival counters (DecodeLaunchOptions::arrival_counters), zero between launches.
  DeviceBuffer workspace_;
  DeviceBuffer counters_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionBackend>> CreateCudaAttentionBackend(
    const CudaBackendOptions& options) {
  const absl::Status available = CudaAvailability();
  if (!available.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda attention backend: ", available.message()));
  }
  const int count = GpuCount();
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("cuda attention backend: device ",
                                                   options.device, " out of range (", count,
                                                   " CUDA devices)"));
  }
  CudaDeviceScope scope(options.device);
  RETURN_IF_ERROR(scope.status());
  int num_sms = 0;
  RETURN_IF_ERROR(CudaErrorToStatus(
      static_cast<int>(
          cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, options.device)),
      "cuda attention backend: cudaDeviceGetAttribute(multiprocessor count)"));
  int compute_major = 0;
  RETURN_IF_ERROR(CudaErrorToStatus(
      static_cast<int>(cudaDeviceGetAttribute(&compute_major, cudaDevAttrComputeCapabilityMajor,
                                              options.device)),
      "cuda attention backend: cudaDeviceGetAttribute(compute capability)"));
  CudaStream owned;
  void* stream = options.stream;
  if (stream == nullptr) {
    ASSIGN_OR_RETURN(owned, CudaStream::Create(options.device));
    stream = owned.get();
  }
  ASSIGN_OR_RETURN(CudaEvent done, CudaEvent::Create(/*enable_timing=*/false));
  return std::unique_ptr<AttentionBackend>(
      new CudaBackend(options.device, num_sms, compute_major, std::move(owned), stream,
                      std::move(done)));
}

CudaAttentionBackend* AsCudaAttentionBackend(AttentionBackend* backend) {
  return dynamic_cast<CudaAttentionBackend*>(backend);
}

}  // namespace kvstream
