// DeviceChecksummer (kvstream/cache/layer_checksum.h): validates a call, stages its span
// table in the ring (pinned host memory, copied into a device mirror at the same offset),
// and enqueues the copy, the kernel (layer_checksum.cuh) and the event that frees the
// range again. The ring hands out ranges in order and takes them back in order (FIFO), so
// that its state is one head offset and the queue of calls in flight.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cuda/layer_checksum.cuh"
#include "kvstream/cache/layer_checksum.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

namespace ks = internal::kvsum64;

constexpr size_t kMinStagingBytes = 4096;
constexpr int kMaxInFlight = 1 << 16;
constexpr uint64_t kMaxTotalBytes = uint64_t{1} << 62;
constexpr size_t kMaxSpans = std::numeric_limits<uint32_t>::max() - 1;

absl::Status Cuda(cudaError_t e, absl::string_view operation) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // a failed call also sets the last-error slot; keep it clean
  return CudaErrorToStatus(static_cast<int>(e), operation);
}

// The device address the kernel writes the result through, or why `result` cannot be used.
absl::StatusOr<uint64_t*> ResultAddress(uint64_t* result, int device) {
  if (result == nullptr) {
    return absl::InvalidArgumentError("DeviceChecksummer::Enqueue: result is null");
  }
  if (reinterpret_cast<uintptr_t>(result) % alignof(uint64_t) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceChecksummer::Enqueue: result ",
                                                   absl::Hex(reinterpret_cast<uintptr_t>(result)),
                                                   " is not 8-byte aligned"));
  }
  cudaPointerAttributes attr{};
  RETURN_IF_ERROR(
      Cuda(cudaPointerGetAttributes(&attr, result), "cudaPointerGetAttributes(result)"));
  switch (attr.type) {
    case cudaMemoryTypeDevice:
      if (attr.device != device) {
        return absl::InvalidArgumentError(
            absl::StrCat("DeviceChecksummer::Enqueue: result is memory of device ", attr.device,
                         ", the checksummer runs on device ", device));
      }
      return result;
    case cudaMemoryTypeManaged: return result;
    case cudaMemoryTypeHost:
      if (attr.devicePointer == nullptr) {
        return absl::InvalidArgumentError(
            "DeviceChecksummer::Enqueue: result is pinned host memory not mapped into the "
            "device's address space");
      }
      return static_cast<uint64_t*>(attr.devicePointer);
    default: break;
  }
  return absl::InvalidArgumentError(
      "DeviceChecksummer::Enqueue: result is pageable host memory; the GPU writes it, so it "
      "must be pinned (cudaMallocHost, cudaHostRegister) or device memory");
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceChecksummer>> DeviceChecksummer::Create(
    const Options& options) {
  if (options.max_in_flight < 1 || options.max_in_flight > kMaxInFlight) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceChecksummer: max_in_flight must be in [1, ", kMaxInFlight, "], got ",
                     options.max_in_flight));
  }
  if (options.staging_bytes < kMinStagingBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceChecksummer: staging_bytes must be at least ", kMinStagingBytes,
                     ", got ", options.staging_bytes));
  }
  if (options.table_copy != TableCopy::kInternalStream &&
      options.table_copy != TableCopy::kCallerStream) {
    return absl::InvalidArgumentError("DeviceChecksummer: unknown table_copy");
  }
  RETURN_IF_ERROR(CudaAvailability());
  int count = 0;
  RETURN_IF_ERROR(Cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount"));
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceChecksummer: device ", options.device,
                                                   " out of range (", count, " CUDA devices)"));
  }
  CudaDeviceScope scope(options.device);
  RETURN_IF_ERROR(scope.status());

  std::unique_ptr<DeviceChecksummer> c(new DeviceChecksummer(options));
  int sms = 0;
  int per_sm = 0;
  RETURN_IF_ERROR(Cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, options.device),
                       "cudaDeviceGetAttribute(multiprocessors)"));
  RETURN_IF_ERROR(Cuda(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, ks::Kvsum64Kernel, ks::kThreads, 0),
      "cudaOccupancyMaxActiveBlocksPerMultiprocessor(kvsum64)"));
  c->ctas_per_launch_ = std::max(1, sms * per_sm);
  // Staging ranges are 16-byte aligned offsets into buffers whose bases are (at least)
  // 256-byte aligned.
  const size_t ring = options.staging_bytes & ~size_t{15};
  ASSIGN_OR_RETURN(c->staging_, DeviceBuffer::Create(ring, MemoryKind::kPinned));
  ASSIGN_OR_RETURN(c->mirror_, DeviceBuffer::Create(ring, MemoryKind::kDevice));
  if (options.table_copy == TableCopy::kInternalStream) {
    ASSIGN_OR_RETURN(c->copy_stream_, CudaStream::Create(options.device));
  }
  c->done_events_.reserve(static_cast<size_t>(options.max_in_flight));
  for (int i = 0; i < options.max_in_flight; ++i) {
    ASSIGN_OR_RETURN(CudaEvent done, CudaEvent::Create());
    c->done_events_.push_back(std::move(done));
    if (options.table_copy == TableCopy::kInternalStream) {
      ASSIGN_OR_RETURN(CudaEvent copied, CudaEvent::Create());
      c->copied_events_.push_back(std::move(copied));
    }
  }
  absl::MutexLock lock(&c->mu_);
  for (int i = options.max_in_flight - 1; i >= 0; --i) c->free_slots_.push_back(i);
  return c;
}

DeviceChecksummer::~DeviceChecksummer() {
  CudaDeviceScope scope(options_.device);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  bool pending = false;
  absl::MutexLock lock(&mu_);
  for (const InFlight& call : in_flight_) {
    const absl::Status s = done_events_[static_cast<size_t>(call.slot)].Synchronize(
        std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (absl::IsDeadlineExceeded(s)) pending = true;
  }
  if (!broken_.ok()) pending = true;  // a range may be read by work no event tracks
  if (pending) {
    Log(LogLevel::kWarning,
        "DeviceChecksummer: checksum work still pending at destruction; its staging memory "
        "is leaked rather than freed under the GPU");
    new DeviceBuffer(std::move(staging_));  // intentionally leaked
    new DeviceBuffer(std::move(mirror_));
  }
}

absl::Status DeviceChecksummer::ReclaimLocked() {
  while (!in_flight_.empty()) {
    const InFlight& front = in_flight_.front();
    ASSIGN_OR_RETURN(const bool done, done_events_[static_cast<size_t>(front.slot)].Query());
    if (!done) break;
    free_slots_.push_back(front.slot);
    in_flight_.pop_front();
  }
  if (in_flight_.empty()) head_ = 0;
  return absl::OkStatus();
}

absl::StatusOr<size_t> DeviceChecksummer::AllocateLocked(size_t bytes) {
  const size_t ring = staging_.size();
  // The ranges in use lie in the circular interval [tail, head_): handed out in order and
  // taken back in order.
  if (in_flight_.empty()) return size_t{0};  // ReclaimLocked reset head_; bytes <= ring
  const size_t tail = in_flight_.front().begin;
  if (head_ > tail) {
    if (ring - head_ >= bytes) return head_;
    if (tail >= bytes) return size_t{0};  // wrap; [head_, ring) stays unused this round
  } else if (head_ < tail && tail - head_ >= bytes) {
    return head_;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("DeviceChecksummer::Enqueue: the staging ring has no room for ", bytes,
                   " bytes of span table now (", in_flight_.size(), " calls in flight over ", ring,
                   " bytes); retry once earlier checksums completed"));
}

absl::Status DeviceChecksummer::Enqueue(absl::Span<const ChecksumSpan> spans, void* stream,
                                        uint64_t* result) {
  uint64_t total = 0;
  size_t num_spans = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    const ChecksumSpan& s = spans[i];
    if (s.length == 0) continue;
    if (s.data == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("DeviceChecksummer::Enqueue: span ", i,
                                                     " has a null pointer and length ", s.length));
    }
    if (s.length > kMaxTotalBytes - total) {
      return absl::InvalidArgumentError(absl::StrCat(
          "DeviceChecksummer::Enqueue: the spans add up to more than 2^62 bytes (at span ", i,
          ")"));
    }
    total += s.length;
    ++num_spans;
  }
  if (num_spans > kMaxSpans) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceChecksummer::Enqueue: ", num_spans,
                                                   " non-empty spans; at most ", kMaxSpans));
  }
  CudaDeviceScope scope(options_.device);
  RETURN_IF_ERROR(scope.status());
  const cudaStream_t caller = static_cast<cudaStream_t>(stream);
#if CUDART_VERSION >= 12080
  int stream_device = -1;
  RETURN_IF_ERROR(Cuda(cudaStreamGetDevice(caller, &stream_device), "cudaStreamGetDevice"));
  if (stream_device != options_.device) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceChecksummer::Enqueue: the stream belongs to device ", stream_device,
                     ", the checksummer to device ", options_.device));
  }
#endif
  ASSIGN_OR_RETURN(uint64_t* const device_result, ResultAddress(result, options_.device));

  const uint64_t chunks = ks::NumChunks(total);
  const uint64_t grid =
      std::max<uint64_t>(1, std::min<uint64_t>(chunks, static_cast<uint64_t>(ctas_per_launch_)));
  const ks::TableLayout layout = ks::LayoutFor(num_spans, chunks);
  if (layout.bytes > staging_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DeviceChecksummer::Enqueue: the span table of ", num_spans, " spans over ", total,
        " bytes takes ", layout.bytes, " bytes of staging, more than the whole ring (",
        staging_.size(), " bytes; raise Options::staging_bytes)"));
  }

  absl::MutexLock lock(&mu_);
  if (!broken_.ok()) return broken_;
  RETURN_IF_ERROR(ReclaimLocked());
  if (free_slots_.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "DeviceChecksummer::Enqueue: ", options_.max_in_flight,
        " checksums in flight (Options::max_in_flight); retry once earlier ones completed"));
  }
  ASSIGN_OR_RETURN(const size_t begin, AllocateLocked(layout.bytes));
  const int slot = free_slots_.back();

  // The table, written into the staging range (free: the work that last read it is done).
  uint8_t* const host = staging_.data_as<uint8_t>() + begin;
  ks::WriteTable(spans, layout, total, host);

  uint8_t* const device = mirror_.data_as<uint8_t>() + begin;
  ks::KernelParams params{};
  params.spans = reinterpret_cast<const ks::SpanEntry*>(device + layout.spans_offset);
  params.chunk_first_span = reinterpret_cast<const uint32_t*>(device + layout.map_offset);
  params.header = reinterpret_cast<ks::TableHeader*>(device);
  params.result = device_result;
  params.num_spans = num_spans;
  params.total_bytes = total;
  params.num_chunks = chunks;

  const bool internal_copy = options_.table_copy == TableCopy::kInternalStream;
  const cudaStream_t copy_stream =
      internal_copy ? static_cast<cudaStream_t>(copy_stream_.get()) : caller;
  RETURN_IF_ERROR(
      Cuda(cudaMemcpyAsync(device, host, layout.bytes, cudaMemcpyHostToDevice, copy_stream),
           "cudaMemcpyAsync(checksum span table)"));
  // From here on the range may be read by enqueued work: it is released only through an
  // event recorded after that work.
  bool launched = false;
  const absl::Status status = [&]() -> absl::Status {
    if (internal_copy) {
      CudaEvent& copied = copied_events_[static_cast<size_t>(slot)];
      RETURN_IF_ERROR(copied.Record(copy_stream));
      RETURN_IF_ERROR(copied.MakeStreamWait(caller));
    }
    ks::Kvsum64Kernel<<<static_cast<unsigned>(grid), ks::kThreads, 0, caller>>>(params);
    RETURN_IF_ERROR(Cuda(cudaGetLastError(), "kvsum64 kernel launch"));
    launched = true;
    return absl::OkStatus();
  }();
  const absl::Status recorded =
      done_events_[static_cast<size_t>(slot)].Record(launched ? caller : copy_stream);
  if (!recorded.ok()) {
    broken_.Update(absl::FailedPreconditionError(
        absl::StrCat("DeviceChecksummer: an earlier call could not record its completion event (",
                     recorded.message(),
                     "); its staging range may still be in use, so this checksummer "
                     "takes no more work")));
    return status.ok() ? recorded : status;
  }
  free_slots_.pop_back();
  in_flight_.push_back(InFlight{begin, begin + layout.bytes, slot});
  head_ = begin + layout.bytes;
  return status;
}

}  // namespace kvstream
