// A cuda_ipc write's GPU work (cuda_ipc_transport.h): the checking pass over its segments,
// the table (in the staging ring or in the kernel's parameters, CudaIpcTableMode), and what
// goes on the copy stream. The per-segment host work is one check and one table entry;
// everything else is per write.
#include <cuda_runtime.h>

#include <algorithm>
#include <tuple>

#include "absl/base/attributes.h"
#include "absl/numeric/bits.h"
#include "absl/strings/str_cat.h"
#include "cuda_ipc/copy_kernel.h"
#include "cuda_ipc/cuda_ipc_transport_impl.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {
namespace {

static_assert(kIpcParamSegments == kIpcMaxParamSegments,
              "the public bound is the kernel's parameter table");

absl::Status CudaCall(cudaError_t e, absl::string_view what) {
  return CudaErrorToStatus(static_cast<int>(e), what);
}

ABSL_ATTRIBUTE_NOINLINE absl::Status OutsideRegions(size_t i, const Segment& s,
                                                    uint64_t local_length,
                                                    uint64_t remote_length) {
  return absl::OutOfRangeError(absl::StrCat(
      "cuda_ipc PostWrite: segment ", i, " (local ", s.local_offset, ", remote ",
      s.remote_offset, ", length ", s.length, ") is outside the local region (", local_length,
      " bytes) or the remote one (", remote_length, " bytes)"));
}

// Segments at least this long go to the copy engine (no segment when the option is 0).
uint64_t EngineMin(const CudaIpcTransportOptions& options) {
  return options.copy_engine_min_bytes == 0 ? ~uint64_t{0} : options.copy_engine_min_bytes;
}

// log2 of the bytes per table entry: chunk bytes for the chunked kernel (whose entries are
// whole segments, counted in chunks), the piece size for the others.
int EntryShift(const CudaIpcTransportOptions& options) {
  const uint64_t bytes = options.kernel == CudaIpcKernel::kChunked
                             ? IpcCopyChunkBytes(options.vectors_per_thread)
                             : static_cast<uint64_t>(options.max_piece_bytes);
  return absl::countr_zero(bytes);  // both are powers of two (checked at creation)
}

void SetEntry(IpcCopySegment& e, const char* src, char* dst, uint64_t length) {
  e.src = reinterpret_cast<uint64_t>(src);
  e.dst = reinterpret_cast<uint64_t>(dst);
  e.length = length;
  e.first_chunk = 0;
}

void SetEntry(IpcParamSegment& e, const char* src, char* dst, uint64_t length) {
  e.src = reinterpret_cast<uint64_t>(src);
  e.dst = reinterpret_cast<uint64_t>(dst);
  e.length = length;
}

}  // namespace

absl::StatusOr<WritePlan> PlanWrite(absl::Span<const Segment> segments, uint64_t local_length,
                                    uint64_t remote_length,
                                    const CudaIpcTransportOptions& options) {
  const uint64_t engine_min = EngineMin(options);
  const bool pieces = options.kernel != CudaIpcKernel::kChunked;
  const int shift = EntryShift(options);
  WritePlan plan;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    // Unsigned: offset <= length - len fails for len > length only through the first test.
    if (s.length > local_length || s.local_offset > local_length - s.length ||
        s.length > remote_length || s.remote_offset > remote_length - s.length) {
      return OutsideRegions(i, s, local_length, remote_length);
    }
    if (s.length == 0) continue;
    if (s.length >= engine_min) {
      ++plan.engine;
    } else {
      plan.entries += pieces ? static_cast<size_t>(((s.length - 1) >> shift) + 1) : 1;
    }
  }
  return plan;
}

template <typename Entry>
size_t CudaIpcTransport::WriteEntries(absl::Span<const Segment> segments, const char* src_base,
                                      char* dst_base, Entry* out) {
  const uint64_t engine_min = EngineMin(options_);
  // The chunked kernel cuts segments itself: one entry per segment.
  const uint64_t piece = options_.kernel == CudaIpcKernel::kChunked
                             ? ~uint64_t{0}
                             : static_cast<uint64_t>(options_.max_piece_bytes);
  size_t k = 0;
  for (const Segment& s : segments) {
    if (s.length == 0) continue;
    const char* src = src_base + s.local_offset;
    char* dst = dst_base + s.remote_offset;
    if (s.length >= engine_min) {
      engine_copies_.push_back({src, dst, s.length});
      continue;
    }
    if (s.length <= piece) {
      SetEntry(out[k++], src, dst, s.length);
      continue;
    }
    for (uint64_t offset = 0; offset < s.length; offset += piece) {
      SetEntry(out[k++], src + offset, dst + offset, std::min(piece, s.length - offset));
    }
  }
  return k;
}

absl::StatusOr<std::pair<StagingRing*, size_t>> CudaIpcTransport::ReserveStaging(size_t n) {
  if (n > kMaxCudaIpcStagingSegments) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cuda_ipc PostWrite: ", n, " table entries in one write, more than the staging limit "
        "of ", kMaxCudaIpcStagingSegments));
  }
  if (std::optional<size_t> begin = ring_->Reserve(n)) return std::make_pair(ring_.get(), *begin);
  PollCopies();  // completed copies give their entries back
  if (std::optional<size_t> begin = ring_->Reserve(n)) return std::make_pair(ring_.get(), *begin);
  size_t capacity = ring_->capacity();
  while (capacity < 2 * n && capacity < kMaxCudaIpcStagingSegments) capacity *= 2;
  if (capacity == ring_->capacity()) capacity *= 2;
  capacity = std::min(capacity, kMaxCudaIpcStagingSegments);
  if (capacity <= ring_->capacity() || capacity < n) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cuda_ipc PostWrite: the staging ring is full (", ring_->capacity(),
        " entries of earlier writes are still being copied, the limit is ",
        kMaxCudaIpcStagingSegments, "); call Progress and post again"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<StagingRing> grown, StagingRing::Create(capacity));
  retired_rings_.push_back(std::move(ring_));
  ring_ = std::move(grown);
  std::optional<size_t> begin = ring_->Reserve(n);
  if (!begin) return absl::InternalError("cuda_ipc: a fresh staging ring refused a reservation");
  return std::make_pair(ring_.get(), *begin);
}

absl::StatusOr<CudaEvent> CudaIpcTransport::TakeEvent(bool timing) {
  std::vector<CudaEvent>& pool = timing ? free_timing_events_ : free_events_;
  if (!pool.empty()) {
    CudaEvent event = std::move(pool.back());
    pool.pop_back();
    return event;
  }
  return CudaEvent::Create(/*enable_timing=*/timing);
}

void CudaIpcTransport::ReturnEvent(CudaEvent event, bool timing) {
  if (event.empty()) return;
  (timing ? free_timing_events_ : free_events_).push_back(std::move(event));
}

absl::StatusOr<InFlightCopy> CudaIpcTransport::EnqueueCopy(absl::Span<const Segment> segments,
                                                           const WritePlan& plan,
                                                           const char* src_base, char* dst_base,
                                                           const WriteOrder& order) {
  const bool chunked = options_.kernel == CudaIpcKernel::kChunked;
  const size_t n = plan.entries;
  const bool in_params = !chunked && options_.table == CudaIpcTableMode::kParams &&
                         n <= kIpcParamSegments;
  // The table's copy to device memory, if the mode has one (kParams spilling over reads
  // the ring in place, as kZeroCopy).
  const bool stream_copy = options_.table == CudaIpcTableMode::kStreamCopy;
  const bool auto_side_copy = options_.table == CudaIpcTableMode::kAuto &&
                              n >= options_.auto_side_copy_min_entries;
  const bool side_copy = options_.table == CudaIpcTableMode::kSideStreamCopy || auto_side_copy;
  const bool zero_copy = !stream_copy && !side_copy && !in_params;
  const bool unit_per_entry = options_.unit_per_entry || auto_side_copy;
  StagingRing* ring = nullptr;
  size_t begin = 0;
  if (n > 0 && !in_params) {
    ASSIGN_OR_RETURN(std::tie(ring, begin), ReserveStaging(n));
  }

  // The table: the only per-segment work of a post.
  engine_copies_.clear();
  size_t written = 0;
  uint64_t chunks = 0;
  if (n > 0 && in_params) {
    if (param_table_ == nullptr) {
      param_table_ = std::make_unique<IpcParamTable<kIpcParamSegments>>();
    }
    written = WriteEntries(segments, src_base, dst_base, param_table_->segments);
    param_table_->num_segments = static_cast<uint32_t>(written);
  } else if (n > 0) {
    IpcCopySegment* table = ring->host(begin);
    written = WriteEntries(segments, src_base, dst_base, table);
    if (chunked) {
      // Prefix sums of whole chunks (shifts: the chunk is a power of two).
      const int shift = EntryShift(options_);
      for (size_t i = 0; i < written; ++i) {
        table[i].first_chunk = chunks;
        chunks += ((table[i].length - 1) >> shift) + 1;
      }
    }
  } else if (plan.engine > 0) {
    // Every segment for the copy engine: no entry is written.
    written = WriteEntries<IpcCopySegment>(segments, src_base, dst_base, nullptr);
  }
  if (written != n) {
    if (ring != nullptr) ring->ReleaseNewest();
    return absl::InternalError(absl::StrCat("cuda_ipc PostWrite: planned ", n,
                                            " table entries, wrote ", written));
  }

  cudaStream_t stream = stream_.get();
  cudaStream_t side = side_stream_.get();
  // The stream whose enqueued work reads the reserved entries last (null: none yet).
  cudaStream_t reader = nullptr;
  // After a failure: the reservation is given back at once if nothing reads it yet, else
  // when the reading stream has passed what was enqueued (or, if even that cannot be
  // tracked, kept for good: the ring grows around it).
  auto fail = [&](absl::Status status) -> absl::Status {
    if (ring == nullptr) return status;
    if (reader == nullptr) {
      ring->ReleaseNewest();
      return status;
    }
    InFlightCopy orphan;
    orphan.ring = ring;
    absl::StatusOr<CudaEvent> event = TakeEvent(/*timing=*/false);
    if (event.ok() && event->Record(reader).ok()) {
      orphan.done = std::move(event).value();
      inflight_.push_back(std::move(orphan));
    } else {
      Log(LogLevel::kError, absl::StrCat("cuda_ipc: ", n, " staging entries kept for good after ",
                                         status.message()));
    }
    return status;
  };

  InFlightCopy copy;
  const bool timing = timing_;
  if (timing) {
    absl::StatusOr<CudaEvent> start = TakeEvent(/*timing=*/true);
    if (!start.ok()) return fail(start.status());
    copy.start = std::move(start).value();
    absl::Status recorded = copy.start.Record(stream);
    if (!recorded.ok()) return fail(recorded);
  }
  const size_t table_bytes = n * sizeof(IpcCopySegment);
  if (ring != nullptr && stream_copy) {
    absl::Status status = CudaCall(cudaMemcpyAsync(ring->device(begin), ring->host(begin),
                                                   table_bytes, cudaMemcpyHostToDevice, stream),
                                   "cuda_ipc PostWrite: segment table copy");
    if (!status.ok()) return fail(status);
    reader = stream;
  } else if (ring != nullptr && side_copy) {
    absl::Status status = CudaCall(cudaMemcpyAsync(ring->device(begin), ring->host(begin),
                                                   table_bytes, cudaMemcpyHostToDevice, side),
                                   "cuda_ipc PostWrite: segment table copy (side stream)");
    if (!status.ok()) return fail(status);
    reader = side;
    status = table_ready_.Record(side);
    if (status.ok()) status = table_ready_.MakeStreamWait(stream);
    if (!status.ok()) return fail(status);
    reader = stream;  // the copy stream now waits for the table copy
  }
  // After the table copy, so that it overlaps the producer's work.
  if (order.ready_event != nullptr) {
    absl::Status status =
        CudaCall(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(order.ready_event), 0),
                 "cuda_ipc PostWrite: cudaStreamWaitEvent(ready_event)");
    if (!status.ok()) return fail(status);
  }
  if (timing) {
    absl::StatusOr<CudaEvent> kernel_start = TakeEvent(/*timing=*/true);
    if (!kernel_start.ok()) return fail(kernel_start.status());
    copy.kernel_start = std::move(kernel_start).value();
    absl::Status recorded = copy.kernel_start.Record(stream);
    if (!recorded.ok()) return fail(recorded);
  }
  for (const EngineCopy& c : engine_copies_) {
    absl::Status status =
        CudaCall(cudaMemcpyAsync(c.dst, c.src, c.length, cudaMemcpyDeviceToDevice, stream),
                 "cuda_ipc PostWrite: cudaMemcpyAsync of a long segment");
    if (!status.ok()) return fail(status);
  }
  if (n > 0) {
    const uint64_t full = static_cast<uint64_t>(grid_);
    absl::Status status;
    if (chunked) {
      IpcCopyParams params;
      params.segments = zero_copy ? ring->mapped(begin) : ring->device(begin);
      params.num_segments = static_cast<uint32_t>(n);
      params.num_chunks = chunks;
      params.zero_copy = zero_copy;
      const int grid = static_cast<int>(std::min<uint64_t>(chunks, full));
      if (zero_copy) reader = stream;  // the kernel reads the ring itself
      status = LaunchIpcCopy(params, options_.vectors_per_thread, grid, stream);
    } else {
      const IpcCopyUnit unit = IpcUnitOf(options_.kernel);
      const uint64_t per_cta = unit == IpcCopyUnit::kWarp ? kIpcWarpsPerCta : 1;
      const uint64_t units = (n + per_cta - 1) / per_cta;
      const int grid = static_cast<int>(unit_per_entry ? units : std::min(units, full));
      if (in_params) {
        status = LaunchIpcSegmentCopyParams(*param_table_, unit, options_.vectors_per_thread,
                                            grid, stream);
      } else {
        if (zero_copy) reader = stream;
        status = LaunchIpcSegmentCopy(zero_copy ? ring->mapped(begin) : ring->device(begin),
                                      static_cast<uint32_t>(n),
                                      zero_copy ? IpcTableSource::kZeroCopy
                                                : IpcTableSource::kDevice,
                                      unit, options_.vectors_per_thread, grid, stream);
      }
    }
    if (!status.ok()) return fail(status);
  }
  absl::StatusOr<CudaEvent> event = TakeEvent(timing);
  if (!event.ok()) return fail(event.status());
  absl::Status recorded = event->Record(stream);
  if (!recorded.ok()) return fail(recorded);
  copy.done = std::move(event).value();
  copy.ring = ring;
  return copy;
}

}  // namespace internal
}  // namespace kvstream
