// CudaEventClock: when the GPU reached a point of a stream, on the host's monotonic clock
// (monotonic_clock.h), so that GPU work and host events share one time axis.
//
// Record() captures a timing event on a stream; once the GPU has passed it, HostNs() gives
// the moment on the host clock. The clock maps event time to host time with an anchor: an
// event recorded on an idle stream of its own and waited for, whose host time is read right
// after (error: the wait's return latency, a few microseconds). Event differences are
// floats of milliseconds, so their resolution coarsens away from the anchor; Record()
// re-anchors once the anchor is older than `max_anchor_age` (5 s: steps under a
// microsecond), blocking for that one wait.
//
// Thread safety: thread-compatible. Stamps keep their anchor alive and outlive the clock.
#ifndef KVSTREAM_COMMON_CUDA_EVENT_CLOCK_H_
#define KVSTREAM_COMMON_CUDA_EVENT_CLOCK_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvstream/common/cuda_resources.h"

namespace kvstream {

class CudaEventClock {
 public:
  struct Anchor {
    CudaEvent event;
    uint64_t host_ns = 0;
  };
  // A point of a stream: its timing event and the anchor that dates it.
  struct Stamp {
    CudaEvent event;
    std::shared_ptr<const Anchor> anchor;
  };

  // On the calling thread's current device. Errors: no GPU, or the CUDA calls'.
  static absl::StatusOr<CudaEventClock> Create(
      absl::Duration max_anchor_age = absl::Seconds(5));

  CudaEventClock(CudaEventClock&&) = default;
  CudaEventClock& operator=(CudaEventClock&&) = default;

  // A timing event recorded on `stream` (a cudaStream_t of this clock's device). It may
  // serve as an ordering event too (CudaEvent::MakeStreamWait).
  absl::StatusOr<Stamp> Record(void* stream);

  // MonotonicNs() at which the GPU reached `stamp`. FailedPrecondition while it has not.
  static absl::StatusOr<uint64_t> HostNs(const Stamp& stamp);

 private:
  CudaEventClock(CudaStream stream, absl::Duration max_age)
      : stream_(std::move(stream)), max_age_ns_(absl::ToInt64Nanoseconds(max_age)) {}
  absl::Status Reanchor();

  CudaStream stream_;  // idle but for the anchors
  int64_t max_age_ns_;
  std::shared_ptr<const Anchor> anchor_;
};

}  // namespace kvstream

#endif  // KVSTREAM_COMMON_CUDA_EVENT_CLOCK_H_
