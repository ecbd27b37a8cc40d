// The "cuda" attention backend (cuda_attention.h): UpdateCache -> CacheUpdateCuda; Forward
// -> MakePagedKernelParams, then the decode kernel when max_query_len <= 1, else the varlen
// prefill kernel (batch invariant: the one-row sequences through the decode kernel with a
// fixed split count, the rest through the prefill kernel). The decode kernel's split workspace and its arrival counters are
// stream-ordered device buffers that grow on demand, so replacing them never waits.
#include <cuda_runtime.h>

#include <algorithm>
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
  CudaBackend(int device, int num_sms, int compute_major, bool wgmma, bool batch_invariant,
              CudaStream owned_stream, void* stream, CudaEvent done)
      : device_(device),
        num_sms_(num_sms),
        compute_major_(compute_major),
        wgmma_(wgmma),
        batch_invariant_(batch_invariant),
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
    const DType cache_dtype = params.cache.spec.dtype;
    if (!batch_invariant_) {
      if (params.max_query_len <= 1) return Decode(kp, params, cache_dtype, 0);
      return Prefill(kp, params, cache_dtype);
    }
    // One-row sequences first, through the decode kernel with a fixed split count; the
    // rest through the prefill kernel (CudaBackendOptions::batch_invariant).
    const int32_t* qsl = params.host.query_start_loc;
    if (params.num_seqs > 0 && qsl == nullptr) {
      return absl::InvalidArgumentError(
          "cuda attention (batch invariant): the host mirror of query_start_loc is missing");
    }
    int32_t decodes = 0;
    while (decodes < params.num_seqs && qsl[decodes + 1] - qsl[decodes] <= 1) ++decodes;
    for (int32_t s = decodes; s < params.num_seqs; ++s) {
      if (qsl[s + 1] - qsl[s] <= 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cuda attention (batch invariant): sequence ", s, " has ", qsl[s + 1] - qsl[s],
            " query rows after sequence ", decodes, " with more; one-row (decode) sequences "
            "must come first"));
      }
    }
    if (decodes > 0) {
      RETURN_IF_ERROR(Decode(Subset(kp, params, 0, decodes), params, cache_dtype,
                             kBatchInvariantDecodeSplits));
    }
    if (decodes < params.num_seqs) {
      RETURN_IF_ERROR(Prefill(Subset(kp, params, decodes, params.num_seqs), params, cache_dtype));
    }
    return absl::OkStatus();
  }

  absl::Status Synchronize(absl::Duration timeout) override {
    CudaDeviceScope scope(device_);
    RETURN_IF_ERROR(scope.status());
    RETURN_IF_ERROR(done_.Record(stream_));
    return done_.Synchronize(timeout);
  }

 private:
  // Sequences [begin, end) of `kp` as a call of their own: the per-sequence arrays offset,
  // the maxima and key count from the host mirrors (query rows keep their absolute index).
  static internal::PagedKernelParams Subset(internal::PagedKernelParams kp,
                                            const PagedAttentionParams& params, int32_t begin,
                                            int32_t end) {
    const int32_t* qsl = params.host.query_start_loc;
    const int32_t* lens = params.host.seq_lens;
    kp.query_start_loc += begin;
    kp.seq_lens += begin;
    kp.block_table += static_cast<int64_t>(begin) * kp.block_table_stride;
    kp.num_seqs = end - begin;
    kp.max_query_len = 0;
    kp.max_seq_len = 0;
    kp.total_visible_keys = 0;
    for (int32_t s = begin; s < end; ++s) {
      kp.max_query_len = std::max(kp.max_query_len, qsl[s + 1] - qsl[s]);
      kp.max_seq_len = std::max(kp.max_seq_len, lens[s]);
      kp.total_visible_keys +=
          kp.sliding_window > 0 ? std::min(lens[s], kp.sliding_window) : lens[s];
    }
    return kp;
  }

  absl::Status Decode(const internal::PagedKernelParams& kp, const PagedAttentionParams& params,
                      DType cache_dtype, int num_splits) {
    internal::DecodeLaunchOptions options;
    options.num_sms = num_sms_;
    options.dependent_merge = compute_major_ >= 9;
    options.tma = compute_major_ >= 9;
    options.num_splits = num_splits;
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
                                           options, static_cast<cudaStream_t>(stream_));
  }

  absl::Status Prefill(const internal::PagedKernelParams& kp, const PagedAttentionParams& params,
                       DType cache_dtype) {
    internal::PrefillLaunchOptions options;
    options.wgmma = wgmma_;
    return internal::LaunchPrefillAttention(kp, params.q_dtype, params.out_dtype, cache_dtype,
                                            options, static_cast<cudaStream_t>(stream_));
  }

  const int device_;
  const int num_sms_;
  const int compute_major_;
  const bool wgmma_;  // PrefillLaunchOptions::wgmma for this device
  const bool batch_invariant_;
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
  int compute_minor = 0;
  RETURN_IF_ERROR(CudaErrorToStatus(
      static_cast<int>(cudaDeviceGetAttribute(&compute_minor, cudaDevAttrComputeCapabilityMinor,
                                              options.device)),
      "cuda attention backend: cudaDeviceGetAttribute(compute capability minor)"));
  // sm_90a code runs on compute capability 9.0 only.
  const bool wgmma =
      compute_major == 9 && compute_minor == 0 && internal::PrefillWgmmaCompiled();
  CudaStream owned;
  void* stream = options.stream;
  if (stream == nullptr) {
    ASSIGN_OR_RETURN(owned, CudaStream::Create(options.device));
    stream = owned.get();
  }
  ASSIGN_OR_RETURN(CudaEvent done, CudaEvent::Create(/*enable_timing=*/false));
  return std::unique_ptr<AttentionBackend>(
      new CudaBackend(options.device, num_sms, compute_major, wgmma, options.batch_invariant,
                      std::move(owned), stream, std::move(done)));
}

CudaAttentionBackend* AsCudaAttentionBackend(AttentionBackend* backend) {
  return dynamic_cast<CudaAttentionBackend*>(backend);
}

}  // namespace kvstream
